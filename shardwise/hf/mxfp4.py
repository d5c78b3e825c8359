"""MXFP4 (OCP Microscaling, FP4 E2M1 elements with one E8M0 scale per 32): the format of gpt-oss's released experts.

A checkpoint stores each expert matrix [rows, cols] as `*_blocks` uint8 [rows, cols/32, 16] (two 4-bit codes per
byte, the low nibble first) and `*_scales` uint8 [rows, cols/32] (a power of two, biased by 127). Element j of
block g of a row is FP4[code] · 2^(scale − 127), FP4 the sixteen E2M1 values below. Every such value is exact in
bf16 and fp32 (two mantissa bits, exponents well inside both ranges), so dequantising to the training dtype loses
nothing: a fine-tune starts from exactly the released weights.
"""
from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 by code: bit 3 the sign, bits 2–1 the exponent (bias 1), bit 0 the mantissa."""
BLOCK = 32  # elements per scale


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., G, 16] codes and [..., G] scales → [..., G·32] values in `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} must be [..., G, 16] "
                         "and [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = blocks.to(torch.uint8)
    lo, hi = lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    exp = scales.to(torch.int32) - 127
    return torch.ldexp(values, exp.unsqueeze(-1)).flatten(-2).to(dtype)
