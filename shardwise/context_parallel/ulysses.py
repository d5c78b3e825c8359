"""DeepSpeed-Ulysses: trade the sequence shard for a head shard, attend over the full sequence, trade back.

Layouts: q [b, hq, s_local, d], k/v [b, hkv, s_local, d], this rank's tokens in `order`. One
all-to-all per tensor turns them into [b, hq/c, s, d] and [b, hkv/c, s, d] (cp rank g takes head
group g), SDPA runs on the full sequence, and one all-to-all brings the output back to
[b, hq, s_local, d]. The gathered sequence arrives in layout order (rank 0's chunks, rank 1's, ...);
for causal attention it is put into true token order first and back afterwards. Document masking
needs no communication: after the all-to-all each rank holds the whole sequence (in true order) for
its heads, so the window's global document ids give the mask directly.

Communication per rank and call: forward 4 all-to-alls (q, k, v, out), backward 4 (their grads).
Heads must split over cp: hq % c == 0, and hkv % c == 0 — or, with fewer KV heads than ranks,
c % hkv == 0, in which case each KV head is replicated c/hkv times so every rank gets the one its
query heads use (more traffic than the ring, which never replicates).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from .. import comm
from . import kernels
from ..models.attention import max_logits
from ..models.documents import document_mask
from ..rules.partition import check_seq_len
from .local import local_attention, window_max_logits
from .sharding import layout_positions


class _AllToAll(torch.autograd.Function):
    """forward: equal-split all-to-all along dim 0 over the axis / backward: the same all-to-all of the grad.

    Row block i goes to rank i and the block received from rank i lands at row block i, so the op is
    its own inverse (the gradient routes back the way the data came).
    """

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return comm.all_to_all(x.contiguous(), axis)

    @staticmethod
    def backward(ctx, g):
        return comm.all_to_all(g.contiguous(), ctx.axis), None


def _seq_to_heads(x: torch.Tensor, axis, gather_index: torch.Tensor | None) -> torch.Tensor:
    """[b, h, s_local, d] → [b, h/c, s, d]: send head group g to cp rank g, concatenate the sequence."""
    c = axis.size
    b, h, s_local, d = x.shape
    x = x.reshape(b, c, h // c, s_local, d).transpose(0, 1)  # [dest rank, b, h/c, s_local, d]
    x = _AllToAll.apply(x, axis)  # [source rank, b, h/c, s_local, d]
    x = x.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s_local, d)
    return x if gather_index is None else x.index_select(2, gather_index)


def _heads_to_seq(x: torch.Tensor, axis, scatter_index: torch.Tensor | None) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [b, h/c, s, d] → [b, h, s_local, d]."""
    c = axis.size
    if scatter_index is not None:
        x = x.index_select(2, scatter_index)
    b, hc, s, d = x.shape
    x = x.reshape(b, hc, c, s // c, d).permute(2, 0, 1, 3, 4)  # [dest rank, b, h/c, s_local, d]
    x = _AllToAll.apply(x, axis)  # [source head group, b, h/c, s_local, d]
    return x.transpose(0, 1).reshape(b, c * hc, s // c, d)


def _kv_replication(hq: int, hkv: int, c: int) -> int:
    if hq % c:
        raise ValueError(f"ulysses_attention: hq={hq} query heads cannot be split over cp={c} "
                         f"(need a multiple of {c}); use ring_attention instead")
    if hq % hkv:
        raise ValueError(f"ulysses_attention: hq={hq} query heads is not a multiple of hkv={hkv}")
    if hkv % c == 0:
        return 1
    if c % hkv == 0:
        return c // hkv
    raise ValueError(f"ulysses_attention: hkv={hkv} KV heads can neither be split over cp={c} nor replicated "
                     f"onto it (need hkv a multiple or a divisor of {c}); use ring_attention instead")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis, causal: bool = True,
                      order: str = "balanced", scale: float | None = None,
                      doc_ids: torch.Tensor | None = None, report=None, sinks: torch.Tensor | None = None,
                      window: int = 0) -> torch.Tensor:
    """Exact attention for this rank's tokens via head-sharded full-sequence SDPA; out [b, hq, s_local, d].

    `doc_ids` [b, s] (global, unsharded): a token attends only within its own document. `report` (MuonClip):
    called with each query head's largest logit, −inf for the heads another cp rank attends for. `sinks` [hq]
    and `window` (gpt-oss): the sinks follow the heads (rank g keeps head group g's), and the full sequence runs
    `local.local_attention`, which merges them through the LSE and masks the window; the reported maxima then come
    from the same bands (`local.window_max_logits`).
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"ulysses_attention: expected q [b, hq, s, d] and k, v [b, hkv, s, d], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    c = axis.size
    seq_len = q.shape[2] * c
    check_seq_len(seq_len, c, order)
    if doc_ids is not None and doc_ids.shape != (q.shape[0], seq_len):
        raise ValueError(f"ulysses_attention: doc_ids {tuple(doc_ids.shape)} must be the global [b, s] = "
                         f"[{q.shape[0]}, {seq_len}]")
    if (sinks is not None or window) and not causal:
        raise ValueError("ulysses_attention: sinks and sliding windows need causal attention")
    mask = None if doc_ids is None else document_mask(doc_ids, doc_ids, causal=causal)
    if (sinks is not None or window) and not axis.active:
        return local_attention(q, k, v, scale, sinks, window, doc_ids, site="ulysses", report=report)
    if not axis.active:
        if report:
            report(max_logits(q, k, q.shape[-1] ** -0.5 if scale is None else scale, causal and mask is None, mask))
        with sdpa_kernel(kernels.sdpa_backends(kernels.pick("ulysses", q, v, mask=kernels.mask_kind(causal, mask),
                                                            entry="sdpa"))):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                  scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    rep = _kv_replication(q.shape[1], k.shape[1], c)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # Non-causal attention does not care about token order; causal needs the true order, which only
    # the balanced layout scrambles; so does a document mask, built in true order.
    reorder = (causal or mask is not None) and order == "balanced"
    scatter_index = layout_positions(seq_len, c, order, q.device) if reorder else None
    gather_index = torch.argsort(scatter_index) if reorder else None
    qh, kh, vh = (_seq_to_heads(t, axis, gather_index) for t in (q, k, v))
    if report:  # this rank's head group over the whole sequence (a window: over the bands local_attention runs)
        best = torch.full(q.shape[1:2], float("-inf"), device=q.device)
        sc = q.shape[-1] ** -0.5 if scale is None else scale
        group = (window_max_logits(qh, kh, sc, window, doc_ids) if sinks is not None or window else
                 max_logits(qh, kh, sc, causal and mask is None, mask))
        best[axis.rank * group.numel():(axis.rank + 1) * group.numel()] = group
        report(best)
    if sinks is not None or window:
        per = q.shape[1] // c  # this rank's query heads are head group `rank`
        own = None if sinks is None else sinks.narrow(0, axis.rank * per, per)
        return _heads_to_seq(local_attention(qh, kh, vh, scale, own, window, doc_ids, site="ulysses"), axis,
                             scatter_index)
    choice = kernels.pick("ulysses", qh, vh, mask=kernels.mask_kind(causal, mask), entry="sdpa")
    with sdpa_kernel(kernels.sdpa_backends(choice)):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal and mask is None,
                                             scale=scale, enable_gqa=qh.shape[1] != kh.shape[1])
    return _heads_to_seq(out, axis, scatter_index)
