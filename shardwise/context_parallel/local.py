"""Attention over a whole local sequence with what SDPA cannot express: gpt-oss's sinks and sliding windows.

Fused kernel calls that return the LSE (the ring's block primitive, `kernels.choose_kernel` picks it), the
sink merged through the LSE (`sinks.py`), the window and any document mask as boolean masks. The one-device
model calls it through its `ParallelContext.attention`, and Ulysses after its all-to-all (each rank then holds
the whole sequence of its heads, and the sinks of those heads).

A sliding window W over a sequence longer than 2W runs banded (`bands`): the queries in blocks of W rows, each
block against the keys its windows reach (at most 2W − 1), so the blocks wholly outside every window are never
computed — s·(2W − 1) scores instead of s². Each query row lives in exactly one band, so a band's (out, LSE) is
the row's whole attention (no merge), and the backward adds each band's dK, dV into the keys it read.

MuonClip's per-head largest logit (`window_max_logits`) is taken over the same call or bands with the same masks,
so it covers exactly the pairs the softmax sees: never a key outside the window, never the sink.
"""
from __future__ import annotations

import math

import torch

from ..models.attention import max_logits
from ..models.documents import document_mask
from ..rules.partition import window_bands
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


def bands(s: int, window: int) -> list[tuple[slice, slice]] | None:
    """(query rows, key columns) per band of a windowed sequence (`partition.window_bands`, which the planner's
    FLOPs count too); None where banding saves nothing."""
    per_band = window_bands(s, window)
    return None if per_band is None else [(slice(*rows), slice(*cols)) for rows, cols in per_band]


def _band_mask(b: int, qs: slice, ks: slice, window: int, doc_ids, device) -> torch.Tensor:
    """[b, 1, rows, keys] boolean: the window (causal included) by global position, and the documents if any."""
    mask = window_mask(torch.arange(qs.start, qs.stop, device=device), torch.arange(ks.start, ks.stop, device=device),
                       window)
    return mask.expand(b, 1, *mask.shape) if doc_ids is None else document_mask(doc_ids[:, qs], doc_ids[:, ks]) & mask


def _forward(q, k, v, scale, window, doc_ids, site):
    """(out, LSE) of the window and documents over the whole sequence: one call, or one per band."""
    per_band = bands(q.shape[2], window)
    if per_band is None:
        mask = attention_mask(q.shape[0], q.shape[2], window, doc_ids, q.device)
        return block_forward(q, k, v, mask is None, scale, mask=mask, site=site)
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for qs, ks in per_band:
        mask = _band_mask(q.shape[0], qs, ks, window, doc_ids, q.device)
        out[:, :, qs], lse[:, :, qs] = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], False, scale, mask=mask,
                                                     site=site)
    return out, lse


def _backward(dout, q, k, v, out, lse, scale, window, doc_ids, site):
    """(dq, dk, dv) at the merged (out, LSE): one call, or one per band with dK, dV summed over the bands."""
    per_band = bands(q.shape[2], window)
    if per_band is None:
        mask = attention_mask(q.shape[0], q.shape[2], window, doc_ids, q.device)
        return block_backward(dout, q, k, v, out, lse, mask is None, scale, mask=mask, site=site)
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for qs, ks in per_band:
        mask = _band_mask(q.shape[0], qs, ks, window, doc_ids, q.device)
        dq[:, :, qs], dk_b, dv_b = block_backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                                  out[:, :, qs], lse[:, :, qs].contiguous(), False, scale, mask=mask,
                                                  site=site)
        dk[:, :, ks] += dk_b
        dv[:, :, ks] += dv_b
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def window_max_logits(q, k, scale: float, window: int, doc_ids) -> torch.Tensor:
    """Per query head, the largest q·k·scale over the pairs `_forward` attends (fp32 [hq]): its one causal or masked
    call, or its bands with their masks — s·(2W − 1) scores under banding, never s², in `max_logits`' chunks."""
    per_band = bands(q.shape[2], window)
    if per_band is None:
        mask = attention_mask(q.shape[0], q.shape[2], window, doc_ids, q.device)
        return max_logits(q, k, scale, mask is None, mask)
    best = torch.full(q.shape[1:2], float("-inf"), device=q.device)
    for qs, ks in per_band:
        mask = _band_mask(q.shape[0], qs, ks, window, doc_ids, q.device)
        best = torch.maximum(best, max_logits(q[:, :, qs], k[:, :, ks], scale, False, mask))
    return best


class _LocalAttention(torch.autograd.Function):
    """forward: fused kernel calls (one, or one per band) → (out, LSE), the sink merged through the LSE /
    backward: the fused backward at the merged (out, LSE); the sinks' gradient from the row term."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, window, doc_ids, site):
        out, lse = _forward(q, k, v, scale, window, doc_ids, site)
        if sinks is not None:
            out, lse = merge_sink(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.window, ctx.doc_ids, ctx.site = scale, window, doc_ids, site
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _backward(dout, q, k, v, out, lse.contiguous(), ctx.scale, ctx.window, ctx.doc_ids, ctx.site)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None, None


def local_attention(q, k, v, scale: float | None = None, sinks: torch.Tensor | None = None, window: int = 0,
                    doc_ids: torch.Tensor | None = None, site: str = "attention", report=None) -> torch.Tensor:
    """Causal attention of q [b, hq, s, d] over k, v [b, hkv, s, d] (the same s tokens), with `sinks` [hq] in
    every softmax denominator, a sliding `window` (0: none) and document masking by `doc_ids` [b, s]. `report`
    (MuonClip): called with each query head's largest logit over the pairs attended (`window_max_logits`)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"{site}: sinks {tuple(sinks.shape)} must be one per query head ({q.shape[1]})")
    if report is not None:
        report(window_max_logits(q, k, scale, window, doc_ids))
    return _LocalAttention.apply(q, k.contiguous(), v.contiguous(), sinks, scale, window, doc_ids, site)
