"""Muon's arithmetic on one whole matrix: Nesterov momentum, Newton–Schulz orthogonalisation, the update.

Written once and used by every layout: the distributed step (`sharded.py`) only decides where each
whole matrix is assembled, so a layout can differ from the single-device run by reduction rounding
and nothing else.
"""
from __future__ import annotations

import math

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic X ← aX + b(XXᵀ)X + c(XXᵀ)²X: chosen for a steep slope at 0, so small singular
values reach ~1 in five steps (they oscillate in [0.7, 1.2] instead of converging, which Muon tolerates)."""
NORM_EPS = 1e-7
RMS_SCALE = 0.2
"""update = 0.2·√max(rows, cols)·X: an orthogonal X has RMS 1/√max(rows, cols), and AdamW's updates have RMS
≈0.2, so the same --lr works for both."""


def nesterov(momentum: torch.Tensor, grad: torch.Tensor, mu: float) -> torch.Tensor:
    """buf ← μ·buf + g (in place); returns the Nesterov gradient g + μ·buf. Elementwise: any shard of a
    matrix computes its own part."""
    momentum.mul_(mu).add_(grad)
    return grad.add(momentum, alpha=mu)


def ns_dtype(device: torch.device, force_fp32: bool) -> torch.dtype:
    """bf16 on CUDA (tensor cores; Newton–Schulz tolerates it), fp32 elsewhere or when forced."""
    return torch.bfloat16 if device.type == "cuda" and not force_fp32 else torch.float32


def orthogonalise(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """≈ U·Vᵀ of the 2-D `g` = U·S·Vᵀ: g / (‖g‖_F + 1e-7), transposed to be wide (XXᵀ is then the small Gram
    matrix), then `steps` quintic Newton–Schulz iterations. Returns fp32 in `g`'s shape."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    x = x / (x.norm() + NORM_EPS)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).float()


def muon_update(g: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix's update direction (before −lr): 0.2·√max(rows, cols)·orthogonalise(g)."""
    return orthogonalise(g, steps, dtype).mul_(RMS_SCALE * math.sqrt(max(g.shape)))


def apply_update(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> None:
    """p ← p·(1 − lr·wd) − lr·update: decoupled weight decay, as AdamW's."""
    param.mul_(1.0 - lr * weight_decay).add_(update, alpha=-lr)
