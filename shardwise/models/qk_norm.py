"""MiniMax-M2's q/k norms: one RMSNorm over all heads' width of q (and one over k's), not one per head.

Under TP each rank holds its heads' columns (and their slice of the weight), so the mean square a token's norm
divides by spans ranks: each rank sums its columns' squares, one all-reduce of those sums over tp ([b, s, 1] fp32
per norm) gives every rank the whole row's, forward and backward (the gradient of the shared mean reaches every
rank's columns). With fewer K/V heads than tp ranks, each rank holds one whole K/V head and the heads repeat
equally often, so the all-reduced sum over the ranks' widths is still the mean over the distinct heads.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import comm
from ..rules.inventory import Param
from .context import ParallelContext
from .params import create


class WidthNorm(nn.Module):
    """RMSNorm over the last dimension of [b, s, width] as a whole row of `ranks` equal shards (fp32 statistics)."""

    def __init__(self, weight: Param, eps: float, ctx: ParallelContext):
        super().__init__()
        self.eps, self.ctx = eps, ctx
        self.weight = create(weight)

    def forward(self, x):
        xf = x.float()
        sq = xf.pow(2).sum(-1, keepdim=True)
        tp = self.ctx.tp_axis
        ranks = 1
        if tp is not None and tp.active:
            sq = comm.copy_to_region(comm.reduce_from_region(sq, tp), tp)
            ranks = tp.size
        return (xf * torch.rsqrt(sq / (x.shape[-1] * ranks) + self.eps) * self.weight).type_as(x)
