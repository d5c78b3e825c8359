"""The attention core both attention kinds share: softmax(q·kᵀ·scale)·v on [b, heads, s, d], causal.

Written once for GQA (`Attention`) and MLA: local SDPA (attention dropout on the RNG tracker's "tp" stream, an
explicit mask under document masking), or the layout's context-parallel attention; zero-padding when the q/k
and v head sizes differ; selective recompute of exactly this part. Then `attend` adds the output projection.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .context import ParallelContext
from .documents import document_mask


class AttentionCore(nn.Module):
    """The part of attention that holds no weights: what selective recompute replays (`layer_id` in the context's
    `selective` set) and what context parallelism distributes. `scale` None is 1/√(q's head size)."""

    def __init__(self, ctx: ParallelContext, layer_id: int, dropout: float, scale: float | None = None):
        super().__init__()
        self.ctx, self.layer_id, self.dropout, self.scale = ctx, layer_id, dropout, scale

    def forward(self, q, k, v, doc_ids=None):
        """`doc_ids` [b, s_global] (document masking): a token sees only earlier tokens of its own document."""
        if self.layer_id in self.ctx.selective:
            return self.ctx.checkpoint_core(self.compute, q, k, v, doc_ids)
        return self.compute(q, k, v, doc_ids)

    def compute(self, q, k, v, doc_ids=None):
        cp = self.ctx.cp
        p = self.dropout if self.training and cp is None else 0.0
        dk, dv = q.shape[-1], v.shape[-1]
        if dk != dv and (cp is not None or p == 0):
            # One head size for q, k and v: ring and Ulysses move K and V as one shape, and SDPA's fused kernels
            # (CPU flash, CUDA flash) otherwise fall back to the math path, which stores the s×s scores. Zero
            # columns keep the result exact: zero q/k columns add nothing to the scores (the scale is explicit),
            # zero v columns give output columns sliced off below.
            if dv < dk:
                v = F.pad(v, (0, dk - dv))
            else:
                q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
            if cp is not None:
                cp.record_padding("v" if dv < dk else "q/k", min(dk, dv), max(dk, dv))
        if cp is not None:
            out = cp.attend(q, k, v, scale=self.scale, doc_ids=doc_ids)
        else:
            mask = None if doc_ids is None else document_mask(doc_ids, doc_ids)
            rng = self.ctx.rng
            with rng.fork("tp") if p > 0 and rng is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                     scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
        return out if out.shape[-1] == dv else out[..., :dv]


def attend(attn: nn.Module, q, k, v, doc_ids, gate=None):
    """The attention core on [b, heads, s, d], then `wo`: the tail both attention kinds share. `gate` [b, s, heads·d]
    (gated attention, Qwen3-Next): the core's output times sigmoid(gate) before `wo`."""
    b, s = q.shape[0], q.shape[2]
    out = attn.core(q, k, v, doc_ids).transpose(1, 2).reshape(b, s, -1)
    return attn.wo(out if gate is None else out * torch.sigmoid(gate))
