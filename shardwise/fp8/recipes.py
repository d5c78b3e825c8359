"""The FP8 recipes (`--fp8`): for each of a linear layer's three GEMMs, how each operand is cast.

A linear y = x Wᵀ has three GEMMs: the forward (x, W), the input gradient dx = g W (g, W) and the weight gradient
dW = gᵀ x (g, x). Each operand is cast to FP8 with scales taken from the current tensor (dynamic scaling) over
blocks of its 2-D matrix — x [tokens, in], W [out, in], g [tokens, out] — always along the GEMM's contraction
dimension, so that a scale factors out of every dot product:

* `tensorwise` (torchao's default): one scale per tensor; e4m3 forward, e5m2 gradients.
* `rowwise` (torchao's ROWWISE): one scale per row of the contraction (axiswise), e4m3 everywhere, scales rounded
  down to powers of two.
* `blockwise` (DeepSeek-V3): activations and gradients in 1×128 tiles along the features (128×1 along the tokens for
  the weight gradient), weights in 128×128 blocks; e4m3 everywhere, fp32 scales.
* `mxfp8` (OCP MX): 32-element blocks along the contraction, e4m3 data, e8m0 (power-of-two) scales rounded up
  from amax/448 (torchao's and cuBLAS's RCEIL; OCP's FLOOR rule would saturate a block's top).

A block is (rows, cols) of the operand's matrix: None spans the whole dimension, 1 one line.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rules.fp8 import FP8_BLOCKS
from ..rules.validation import FP8_RECIPES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class Cast:
    """How one operand of one GEMM is cast: target dtype, scale block (rows, cols), scale rounding."""

    dtype: torch.dtype
    block: tuple[int | None, int | None]
    pow2: bool = False
    """torchao's round_scales_to_power_of_2: the scale rounded down to a power of two."""
    e8m0: bool = False
    """MX scales: e8m0 powers of two, the dequantising factor 2^ceil(log2(amax / max)) (torchao's RCEIL)."""


@dataclass(frozen=True)
class Recipe:
    name: str
    x: Cast
    """x for the forward (blocks along `in`)."""
    w: Cast
    """W for the forward (blocks along `in`)."""
    g_dgrad: Cast
    """g for dx = g W (blocks along `out`)."""
    w_dgrad: Cast
    """W for dx (blocks along `out`)."""
    g_wgrad: Cast
    """g for dW = gᵀ x (blocks along the tokens)."""
    x_wgrad: Cast
    """x for dW (blocks along the tokens)."""

    @property
    def casts(self) -> tuple[Cast, ...]:
        return self.x, self.w, self.g_dgrad, self.w_dgrad, self.g_wgrad, self.x_wgrad


def _recipe(name: str) -> Recipe:
    """The six casts from `rules.fp8.FP8_BLOCKS` (the planner counts the same blocks): e4m3 everywhere but
    tensorwise's gradients (e5m2, torchao's); rowwise scales rounded to powers of two (torchao), MX scales e8m0."""
    if name not in FP8_BLOCKS:
        raise ValueError(f"unknown FP8 recipe {name!r}; valid: {', '.join(RECIPES)}")
    dtypes = (E4M3, E4M3, E5M2, E4M3, E5M2, E4M3) if name == "tensorwise" else (E4M3,) * 6
    return Recipe(name, *(Cast(d, b, pow2=name == "rowwise", e8m0=name == "mxfp8")
                          for d, b in zip(dtypes, FP8_BLOCKS[name])))


RECIPES = FP8_RECIPES


def recipe(name: str) -> Recipe:
    return _recipe(name)


def scaled_mm_kind(a: Cast, b: Cast, ta: bool = False, tb: bool = False) -> str | None:
    """Which `torch._scaled_mm` form runs A Bᵀ, A and B cast as `a` and `b` on their stored matrices and used
    transposed where `ta`/`tb`: 'tensor' (one scale each), 'row' (one per row of A and of B, i.e. per line along the
    contraction); None: the GEMM is emulated."""
    if a.e8m0 or b.e8m0:
        return None
    ba, bb = a.block[::-1] if ta else a.block, b.block[::-1] if tb else b.block
    if ba == bb == (None, None):
        return "tensor"
    if ba == bb == (1, None):
        return "row"
    return None
