"""The attention core both attention kinds share: softmax(q·kᵀ·scale)·v on [b, heads, s, d], causal.

Written once for GQA (`Attention`) and MLA: local SDPA (attention dropout on the RNG tracker's "tp" stream, an
explicit mask under document masking), or the layout's context-parallel attention; zero-padding when the q/k
and v head sizes differ; selective recompute of exactly this part. Then `attend` adds the output projection.

With a `MaxLogits` recorder in the context (MuonClip), training forwards also report each local query head's
largest logit, q·k·scale over the keys it sees: the fused kernels return only the log-sum-exp, so the scores'
maximum costs one extra no-grad QKᵀ, in query-row chunks (never the whole s×s at once). Under a sliding window
"the keys it sees" are the window's: the attention path reports over the bands / block pairs it computes, masked
as it masks them. gpt-oss's sink logit is not among them: it is a learned per-head scalar, no q·k.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from .context import ParallelContext
from .documents import document_mask


SCORE_CHUNK = 1 << 22
"""Score elements per chunk of `max_logits` (16 MB in fp32): its transient, whatever the sequence length."""


class MaxLogits:
    """Per attention layer id, the largest logit each of this rank's query heads reached in the training
    forwards since the last `take` (a [heads] fp32 tensor; −inf for a head this rank computed nothing of)."""

    def __init__(self):
        self.by_layer: dict[int, torch.Tensor] = {}

    def record(self, layer_id: int, per_head: torch.Tensor) -> None:
        old = self.by_layer.get(layer_id)
        self.by_layer[layer_id] = per_head if old is None else torch.maximum(old, per_head)

    def take(self) -> dict[int, torch.Tensor]:
        out, self.by_layer = self.by_layer, {}
        return out


@torch.no_grad()
def max_logits(q, k, scale: float, causal: bool, mask=None) -> torch.Tensor:
    """Per query head, max of q·kᵀ·scale over the visible (query, key) pairs, fp32 [hq].

    q [b, hq, s_q, d], k [b, hkv, s_k, d] (GQA: query head h uses K head h // (hq/hkv)); `causal` needs
    s_q == s_k (query i sees keys ≤ i); `mask` boolean [b, 1, s_q, s_k] (True = attend)."""
    b, hq, s_q, _ = q.shape
    hkv, s_k = k.shape[1], k.shape[2]
    qg = q.float().unflatten(1, (hkv, hq // hkv))  # [b, hkv, g, s_q, d]: K broadcasts over its group
    kt = k.float().transpose(-1, -2).unsqueeze(2)  # [b, hkv, 1, d, s_k]
    best = torch.full((hq,), float("-inf"), device=q.device)
    rows = max(1, SCORE_CHUNK // max(1, b * hq * s_k))
    cols = torch.arange(s_k, device=q.device)
    for i in range(0, s_q, rows):
        s = qg[:, :, :, i:i + rows] @ kt * scale
        if causal:
            s.masked_fill_(cols > torch.arange(i, i + s.shape[3], device=q.device).unsqueeze(-1), float("-inf"))
        if mask is not None:
            s.masked_fill_(~mask[:, :, i:i + rows].unsqueeze(2), float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 3, 4)).flatten())
    return best


class AttentionCore(nn.Module):
    """The part of attention that holds no weights: what selective recompute replays (`layer_id` in the context's
    `selective` set) and what context parallelism distributes. `scale` None is 1/√(q's head size)."""

    def __init__(self, ctx: ParallelContext, layer_id: int, dropout: float, scale: float | None = None,
                 window: int = 0):
        super().__init__()
        self.ctx, self.layer_id, self.dropout, self.scale = ctx, layer_id, dropout, scale
        self.window = window  # gpt-oss's sliding window: a query sees its `window` latest keys (0: all earlier ones)

    def forward(self, q, k, v, doc_ids=None, sinks=None):
        """`doc_ids` [b, s_global] (document masking): a token sees only earlier tokens of its own document.
        `sinks` [heads] (gpt-oss): one learned logit per query head added to each softmax's denominator."""
        if self.layer_id in self.ctx.selective:
            return self.ctx.checkpoint_core(self.compute, q, k, v, doc_ids, sinks)
        return self.compute(q, k, v, doc_ids, sinks)

    def compute(self, q, k, v, doc_ids=None, sinks=None):
        cp = self.ctx.cp
        rec = self.ctx.max_logits if self.training else None
        report = None if rec is None else functools.partial(rec.record, self.layer_id)
        if sinks is not None or self.window:
            # SDPA has no sink logit and no window: the plan's kernels (or the cp path) merge the sink through the
            # log-sum-exp and mask the window (context_parallel/sinks.py).
            # MuonClip's maxima come from the same bands / block pairs, over exactly the window's pairs; the sink
            # is no q·k (Wq, Wk cannot scale it) and is left out
            if cp is not None:
                return cp.attend(q, k, v, scale=self.scale, doc_ids=doc_ids, sinks=sinks, window=self.window,
                                 report=report)
            if self.ctx.attention is None:
                raise ValueError(f"layer {self.layer_id}: attention sinks or sliding windows need a ParallelContext "
                                 "whose `attention` runs them (shardwise.parallelize.build_model or plain_model)")
            return self.ctx.attention(q, k, v, self.scale, sinks, self.window, doc_ids, report=report)
        p = self.dropout if self.training and cp is None else 0.0
        dk, dv = q.shape[-1], v.shape[-1]
        scale = dk ** -0.5 if self.scale is None else self.scale
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
            out = cp.attend(q, k, v, scale=self.scale, doc_ids=doc_ids, report=report)
        else:
            mask = None if doc_ids is None else document_mask(doc_ids, doc_ids)
            if report is not None:
                report(max_logits(q, k, scale, mask is None, mask))
            rng = self.ctx.rng
            with rng.fork("tp") if p > 0 and rng is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                     scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
        return out if out.shape[-1] == dv else out[..., :dv]


def attend(attn: nn.Module, q, k, v, doc_ids, gate=None):
    """The attention core on [b, heads, s, d], then `wo`: the tail both attention kinds share. `gate` [b, s, heads·d]
    (gated attention, Qwen3-Next): the core's output times sigmoid(gate) before `wo`."""
    b, s = q.shape[0], q.shape[2]
    out = attn.core(q, k, v, doc_ids, getattr(attn, "sinks", None)).transpose(1, 2).reshape(b, s, -1)
    return attn.wo(out if gate is None else out * torch.sigmoid(gate))
