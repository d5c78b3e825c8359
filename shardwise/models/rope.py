"""RoPE in Meta's interleaved-pairs layout: frequency tables (plain, Llama-3.1 scaled or YaRN) and the rotation."""
from __future__ import annotations

import math

import torch


def llama3_inv_freq(inv: torch.Tensor, factor: float, low: float, high: float, old_len: int) -> torch.Tensor:
    """Llama-3.1 long-context RoPE: divide low frequencies by `factor`, keep high ones, blend between."""
    wavelen = 2 * math.pi / inv
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv / factor + smooth * inv


def yarn_inv_freq(head_dim: int, theta: float, factor: float, old_len: int, beta_fast: float, beta_slow: float,
                  truncate: bool, device=None) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters` computes it: frequencies rotating fewer
    than beta_slow times over the original context are interpolated (divided by `factor`), those rotating more
    than beta_fast times kept, a linear ramp over the dimensions between (bounds floored / ceiled if `truncate`)."""
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_tables(head_dim: int, seq_len: int, theta: float, device, positions=None, scaling=None, yarn=None):
    """cos/sin tables [s, head_dim/2]; `positions` lets a sequence shard use its global positions.

    Per-sequence positions [b, s] (--reset-positions: each document counts from 0) give [b, s, head_dim/2].

    `scaling` is ModelConfig.rope_scaling (Llama-3.1 frequency scaling) or None; `yarn` is ModelConfig.rope_yarn
    (factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, truncate) or None — its
    attention_factor multiplies cos and sin, as transformers' rotary embeddings do.
    """
    if yarn is not None:
        factor, old_len, beta_fast, beta_slow, attention_factor, truncate = yarn
        inv = yarn_inv_freq(head_dim, theta, factor, old_len, beta_fast, beta_slow, truncate, device)
    else:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv = llama3_inv_freq(inv, *scaling)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32) if positions is None else positions.float()
    ang = pos.unsqueeze(-1) * inv
    if yarn is not None and attention_factor != 1.0:
        return ang.cos() * attention_factor, ang.sin() * attention_factor
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """x [b, s, heads, hd]; rotate interleaved pairs (Meta's Llama convention) in fp32.

    Written in real arithmetic (the complex multiply spelled out) because inductor has no code
    generation for complex tensors: under --compile this fuses into the projections' epilogue.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [s, 1, hd/2] or, per sequence, [b, s, 1, hd/2]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)
