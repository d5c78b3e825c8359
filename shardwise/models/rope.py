"""RoPE in Meta's interleaved-pairs layout: frequency tables (plain or Llama-3.1 scaled) and the rotation."""
from __future__ import annotations

import math

import torch


def llama3_inv_freq(inv: torch.Tensor, factor: float, low: float, high: float, old_len: int) -> torch.Tensor:
    """Llama-3.1 long-context RoPE: divide low frequencies by `factor`, keep high ones, blend between."""
    wavelen = 2 * math.pi / inv
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv / factor + smooth * inv


def rope_tables(head_dim: int, seq_len: int, theta: float, device, positions=None, scaling=None):
    """cos/sin tables [s, head_dim/2]; `positions` lets a sequence shard use its global positions.

    Per-sequence positions [b, s] (--reset-positions: each document counts from 0) give [b, s, head_dim/2].

    `scaling` is ModelConfig.rope_scaling (Llama-3.1 frequency scaling) or None.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv = llama3_inv_freq(inv, *scaling)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32) if positions is None else positions.float()
    ang = pos.unsqueeze(-1) * inv
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
