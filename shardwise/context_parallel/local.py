"""Attention over a whole local sequence with what SDPA cannot express: gpt-oss's sinks and sliding windows.

One fused kernel call that returns the LSE (the ring's block primitive, `kernels.choose_kernel` picks it), the
sink merged through the LSE (`sinks.py`), the window and any document mask as one boolean mask. The one-device
model calls it through its `ParallelContext.attention`, and Ulysses after its all-to-all (each rank then holds
the whole sequence of its heads, and the sinks of those heads).
"""
from __future__ import annotations

import math

import torch

from ..models.documents import document_mask
from .ring_attention import block_backward, block_forward
from .sinks import merge_sink, sink_grad, window_mask


def attention_mask(b: int, s: int, window: int, doc_ids: torch.Tensor | None, device) -> torch.Tensor | None:
    """[b, 1, s, s] boolean mask of a causal window and / or documents over one whole sequence; None: causal."""
    window = window if window < s else 0  # a window as long as the sequence is plain causal attention
    if not window and doc_ids is None:
        return None
    pos = torch.arange(s, device=device)
    mask = window_mask(pos, pos, window)
    return mask.expand(b, 1, s, s) if doc_ids is None else document_mask(doc_ids, doc_ids) & mask


class _LocalAttention(torch.autograd.Function):
    """forward: one fused kernel call → (out, LSE), the sink merged through the LSE /
    backward: the fused backward at the merged (out, LSE); the sinks' gradient from the row term."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, window, doc_ids, site):
        mask = attention_mask(q.shape[0], q.shape[2], window, doc_ids, q.device)
        out, lse = block_forward(q, k, v, mask is None, scale, mask=mask, site=site)
        if sinks is not None:
            out, lse = merge_sink(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.window, ctx.doc_ids, ctx.site = scale, window, doc_ids, site
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        mask = attention_mask(q.shape[0], q.shape[2], ctx.window, ctx.doc_ids, q.device)
        dout = dout.contiguous()
        dq, dk, dv = block_backward(dout, q, k, v, out, lse.contiguous(), mask is None, ctx.scale, mask=mask,
                                    site=ctx.site)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None, None


def local_attention(q, k, v, scale: float | None = None, sinks: torch.Tensor | None = None, window: int = 0,
                    doc_ids: torch.Tensor | None = None, site: str = "attention") -> torch.Tensor:
    """Causal attention of q [b, hq, s, d] over k, v [b, hkv, s, d] (the same s tokens), with `sinks` [hq] in
    every softmax denominator, a sliding `window` (0: none) and document masking by `doc_ids` [b, s]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"{site}: sinks {tuple(sinks.shape)} must be one per query head ({q.shape[1]})")
    return _LocalAttention.apply(q, k.contiguous(), v.contiguous(), sinks, scale, window, doc_ids, site)
