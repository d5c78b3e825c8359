"""Ring attention: each rank keeps its queries and passes K/V blocks around the cp ring.

Layouts: q [b, hq, s_local, d], k/v [b, hkv, s_local, d] with hq a multiple of hkv (GQA). K/V travel
with their hkv heads — never expanded before communication — and the kernel broadcasts them over
the query groups.

Forward, step i of c: rank r holds the K/V of rank (r − i) mod c. It posts the non-blocking p2p
that hands this block on to r + 1 (and receives the next one from r − 1) *before* computing on it,
so the transfer overlaps the block's attention. Block results merge with the log-sum-exp rule
(out = Σ exp(lse_blk − lse)·out_blk), so no rank ever holds more than one block pair of scores.

Backward recomputes every block from the saved q, k, v, output and LSE (the flash-attention
backward takes the *global* out and LSE). K/V go round the ring again; a dK/dV accumulator for each
block follows one step behind it (it starts at the rank after the owner, the owner adds its own
share last), so it reaches its owner after c − 1 hops.

Per rank and call, in ledger rows on the cp axis (B = b·hkv·s_local·d·elem bytes):
  forward:  2(c−1) sends, 2(c−1)·B bytes (c−1 K blocks, c−1 V blocks);
  backward: 4(c−1) sends, 4(c−1)·B bytes (c−1 K, c−1 V, c−1 dK, c−1 dV; the accumulators travel in
            K/V's dtype, as the planner's comm model assumes).
Under a sliding window only the steps some window reaches run (`ring_step_list`): c − 1 becomes their count.
A step that follows a skipped one gets its block straight from the owner, and a dK/dV accumulator goes home
from the last step of each run of consecutive steps.

Causal masking comes from the layout (`sharding.chunk_ids`): a rank's own block is causal as a
whole (local positions increase), every other block pair is either fully visible or skipped, chunk
by chunk, so the kernel only ever needs `is_causal` on a square block — never an explicit mask.

Document masking (`doc_ids`, the window's global document ids, which every rank has): each block
pair the causal plan keeps gets its own mask (same document, and causal by global position); a
pair in which no query sees a key of its own document is skipped like a causally masked one, a
pair inside one document keeps the plain path, and the rest pass an explicit mask. The decisions
come from per-row document ranges (documents are contiguous, so two token sets share one iff the
ranges touch) in one host sync per microbatch: every layer's forward and backward (and a recomputation)
reuse the plan of the same `doc_ids`; masks are rebuilt per pair when it runs rather than kept.

Attention primitive (`block_forward` / `block_backward`): the fused LSE kernel `kernels.choose_kernel`
picks (flash on CPU, flash or memory-efficient on CUDA), else fp32 math with an explicit causal
triangle per block (warned once).
"""
from __future__ import annotations

import functools
import math
import weakref

import torch

from .. import comm, host
from ..models.attention import max_logits
from ..models.documents import document_mask
from . import kernels
from .kernels import expand_heads, fold_heads
from ..rules.partition import check_seq_len, chunk_intervals, ring_block_pairs, ring_step_list, window_cut
from .sharding import positions, shard_sequence
from .sinks import merge_sink, sink_grad, window_mask


# ---------------------------------------------------------------- block primitive


def _math_scores(q, k, causal, scale, mask=None):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    return s


def block_forward(q, k, v, causal: bool, scale: float, backend: str = "auto", mask=None, site: str = "ring_attention"):
    """Attention of one block pair → (out in q's dtype, lse fp32 [b, hq, s_q]). Causal needs s_q == s_k.

    `mask` boolean [b, 1, s_q, s_k] (True = attend): rows that see nothing give out 0, LSE −inf. `site` names the
    caller in the kernel record (summary.json's "attention_kernel").
    """
    choice = kernels.pick(site, q, v, backend, kernels.mask_kind(causal, mask))
    if choice.kernel != "math":
        return kernels.fused_forward(choice, q, k, v, causal, scale, mask)
    g = q.shape[1] // k.shape[1]
    s = _math_scores(q, expand_heads(k, g), causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(lse.isneginf(), 0.0, lse)  # rows with no visible key: exp(−inf − 0) = 0, not NaN
    out = torch.matmul(torch.exp(s - safe.unsqueeze(-1)), expand_heads(v, g).float())
    return out.to(q.dtype), lse


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, backend: str = "auto", mask=None,
                   site: str = "ring_attention"):
    """(dq, dk, dv) of one block pair, given the *global* out and LSE of these query rows."""
    choice = kernels.pick(site, q, v, backend, kernels.mask_kind(causal, mask))
    if choice.kernel != "math":
        return kernels.fused_backward(choice, dout, q, k, v, out, lse, causal, scale, mask)
    g = q.shape[1] // k.shape[1]
    ke, ve = expand_heads(k, g).float(), expand_heads(v, g).float()
    p = torch.exp(_math_scores(q, ke, causal, scale, mask) - lse.unsqueeze(-1))
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, ve.transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(ds, ke)
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    return dq.to(q.dtype), fold_heads(dk, g).to(k.dtype), fold_heads(dv, g).to(v.dtype)


# ---------------------------------------------------------------- which block pairs to compute
def block_plan(q_rank: int, kv_rank: int, cp_size: int, order: str, causal: bool, s_local: int):
    """Block pairs rank `q_rank` computes against rank `kv_rank`'s K/V: a list of (q slice, kv slice, is_causal).

    Pure layout arithmetic, stated once in `partition.ring_block_pairs` (the planner counts the same pairs).
    Non-causal: one full block. Causal: the own block is causal as a whole; another rank's block is split into
    the query chunks that see the same earlier key chunks, one call each.
    """
    whole = slice(0, s_local)
    if not causal:
        return [(whole, whole, False)]
    return [(slice(*rows), slice(*cols), q_rank == kv_rank)
            for rows, cols in ring_block_pairs(q_rank, kv_rank, cp_size, order, s_local)]


_PLANS: dict[tuple, tuple] = {}  # (id(doc_ids), its version, layout args) -> (weakref to doc_ids, plan)
_MAX_PLANS = 64  # more than the microbatches a pipeline rank holds in flight


def document_plan(q_rank: int, cp_size: int, order: str, causal: bool, s_local: int,
                  doc_ids: torch.Tensor | None, window: int = 0, batch: int = 1, device=None) -> list[list[tuple]]:
    """`_document_plan`, computed once per `doc_ids` tensor: every layer of a microbatch (forward,
    backward, recomputation) attends over the same documents, and the plan costs a host sync.
    `window` > 0 (gpt-oss's sliding window) cuts it further: `window_plan`, its masks made on `device`."""
    if doc_ids is None:
        return window_plan(_document_plan(q_rank, cp_size, order, causal, s_local, None), q_rank, cp_size, order,
                           s_local, window, batch, None, device)
    key = (id(doc_ids), doc_ids._version, q_rank, cp_size, order, causal, s_local, window)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is doc_ids:
        return hit[1]
    plan = window_plan(_document_plan(q_rank, cp_size, order, causal, s_local, doc_ids), q_rank, cp_size, order,
                       s_local, window, batch, doc_ids, doc_ids.device)
    for k in [k for k, (ref, _) in _PLANS.items() if ref() is None]:  # microbatches already gone
        del _PLANS[k]
    while len(_PLANS) >= _MAX_PLANS:  # the masks' closures hold views of doc_ids, which keep it alive
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = (weakref.ref(doc_ids), plan)
    return plan


def _document_plan(q_rank: int, cp_size: int, order: str, causal: bool, s_local: int,
                   doc_ids: torch.Tensor | None) -> list[list[tuple]]:
    """For every ring step, the block pairs to compute: (q slice, kv slice, is_causal, make_mask or None).

    Without `doc_ids` this is `block_plan` with no masks. With them ([b, s] global document ids,
    non-decreasing along the window), a pair is skipped when no query row shares a document with
    the keys, runs unmasked when every row of both sides lies in one document, else gets
    `make_mask()` → `document_mask` (same document, key position ≤ query position), built only when
    the pair runs: all of a call's masks at once would be b·s_local·s booleans. One host sync.
    """
    plans = [block_plan(q_rank, (q_rank - step) % cp_size, cp_size, order, causal, s_local)
             for step in range(cp_size)]
    if doc_ids is None:
        return [[(qs, ks, c, None) for qs, ks, c in plan] for plan in plans]
    seq_len = s_local * cp_size
    q_doc = shard_sequence(doc_ids, q_rank, cp_size, order)
    q_pos = positions(seq_len, q_rank, cp_size, order, doc_ids.device)
    kv = [(shard_sequence(doc_ids, (q_rank - step) % cp_size, cp_size, order),
           positions(seq_len, (q_rank - step) % cp_size, cp_size, order, doc_ids.device)) for step in range(cp_size)]
    flags = []  # per pair: (some query sees a key, one document on both sides), for every batch row
    for step, plan in enumerate(plans):
        for qs, ks, _ in plan:
            qd, kd = q_doc[:, qs], kv[step][0][:, ks]
            q_lo, q_hi, k_lo, k_hi = qd.amin(1), qd.amax(1), kd.amin(1), kd.amax(1)
            # Ids never decrease along the window, so with every key before every query (the causal
            # pairs of other ranks) the sets share a document iff the ranges touch; the own block
            # always overlaps; elsewhere (non-causal) overlapping ranges may still share nothing,
            # which the mask then handles.
            visible = ((k_hi >= q_lo) & (q_hi >= k_lo)).any()
            flags.append(torch.stack([visible, ((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all()]))
    flags = host.read(torch.stack(flags), "cp document plan") if flags else []  # the one host sync
    out, i = [], 0
    for step, plan in enumerate(plans):
        pairs = []
        for qs, ks, is_causal in plan:
            visible, uniform = flags[i]
            i += 1
            if not visible:
                continue
            if uniform:
                pairs.append((qs, ks, is_causal, None))
            else:
                pairs.append((qs, ks, False, functools.partial(
                    document_mask, q_doc[:, qs], kv[step][0][:, ks], q_pos[qs], kv[step][1][ks], causal)))
        out.append(pairs)
    return out


def _intervals(rank: int, cp_size: int, order: str, s_local: int, sl: slice) -> list[tuple[int, int]]:
    return chunk_intervals(rank, cp_size, order, s_local, sl.start, sl.stop)


def window_plan(plans: list[list[tuple]], q_rank: int, cp_size: int, order: str, s_local: int, window: int,
                batch: int, doc_ids: torch.Tensor | None, device=None) -> list[list[tuple]]:
    """The block pairs of `plans` under a sliding window: a pair no query's window reaches is skipped, one the
    window cuts gets a mask (its document mask, if any, and the window), the rest run as planned; steps past
    the last step `ring_step_list` keeps are dropped (nothing there is visible to any rank)."""
    if not window or window >= s_local * cp_size:
        return plans
    out = []
    for step, plan in enumerate(plans[:ring_step_list(cp_size, order, s_local, window)[-1] + 1]):
        kv_rank = (q_rank - step) % cp_size
        pairs = []
        for qs, ks, is_causal, make_mask in plan:
            visible, cut = window_cut(_intervals(q_rank, cp_size, order, s_local, qs),
                                      _intervals(kv_rank, cp_size, order, s_local, ks), window)
            if not visible:
                continue
            if cut:
                seq = s_local * cp_size
                q_pos = positions(seq, q_rank, cp_size, order, device)[qs]
                k_pos = positions(seq, kv_rank, cp_size, order, device)[ks]
                make_mask = functools.partial(_window_block_mask, q_pos, k_pos, window, batch, make_mask)
                is_causal = False
            pairs.append((qs, ks, is_causal, make_mask))
        out.append(pairs)
    return out


def _window_block_mask(q_pos, k_pos, window: int, batch: int, doc_mask) -> torch.Tensor:
    """[b, 1, s_q, s_k]: the block's window (causal included), on the positions' device, and its document mask
    when it has one."""
    mask = window_mask(q_pos, k_pos, window)
    return mask.expand(batch, 1, *mask.shape) if doc_mask is None else doc_mask() & mask


def _rows(t: torch.Tensor, sl: slice) -> torch.Tensor:
    return t[:, :, sl]


def _merge(out: torch.Tensor, lse: torch.Tensor, sl: slice, o_blk: torch.Tensor, l_blk: torch.Tensor) -> None:
    """Online-softmax merge of one block's (out, lse) into the fp32 accumulators' rows `sl`, in place.

    A row with LSE −inf on both sides (no key seen yet, none in this block) stays (0, −inf).
    """
    o_acc, l_acc = _rows(out, sl), _rows(lse, sl)
    new = torch.logaddexp(l_acc, l_blk)
    safe = torch.where(new.isneginf(), 0.0, new).unsqueeze(-1)
    o_acc.mul_(torch.exp(l_acc.unsqueeze(-1) - safe)).add_(o_blk.float() * torch.exp(l_blk.unsqueeze(-1) - safe))
    l_acc.copy_(new)


def _pass_on(send: tuple, recv: tuple, axis, hops: int = 1) -> list:
    """Non-blocking: send `send` to the cp rank `hops` ahead, receive `recv` from the one `hops` behind (the next
    and previous rank; a windowed ring's last dK/dV hop goes straight back to the block's owner)."""
    nxt, prv = (axis.rank + hops) % axis.size, (axis.rank - hops) % axis.size
    return comm.p2p([("send", t, axis, nxt) for t in send] + [("recv", t, axis, prv) for t in recv])


def _fetch(cur: tuple, own: tuple, nxt: tuple, axis, step: int, next_step: int) -> list:
    """Non-blocking: receive into `nxt` the K/V of the rank `next_step` behind. The next step on the ring passes
    `cur` (the block of `step` behind) one rank on; past steps no window reaches, the owner sends its own block
    straight to the rank `next_step` ahead. Either way one block per step, so the ledger counts the steps run."""
    if next_step == step + 1:
        return _pass_on(cur, nxt, axis)
    return _pass_on(own, nxt, axis, next_step)


# ---------------------------------------------------------------- the autograd Function
class _RingAttention(torch.autograd.Function):
    """forward: K/V ring over cp, LSE-merged block attention /
    backward: K/V ring again with dK/dV accumulators one step behind, block recompute."""

    @staticmethod
    def forward(ctx, q, k, v, axis, causal, order, scale, backend, doc_ids, report, sinks=None, window=0):
        c, r, s_local = axis.size, axis.rank, q.shape[2]
        plans = document_plan(r, c, order, causal, s_local, doc_ids, window, q.shape[0], q.device)
        k, v = k.contiguous(), v.contiguous()  # p2p needs contiguous buffers
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        cur = (k, v)
        best = torch.full(q.shape[1:2], float("-inf"), device=q.device) if report else None
        steps = ring_step_list(c, order, s_local, window)  # under a sliding window only the steps it reaches
        for j, step in enumerate(steps):
            works, nxt = [], None
            if j < len(steps) - 1:  # post the next transfer first: it overlaps this step's compute
                nxt = (torch.empty_like(k), torch.empty_like(v))
                works = _fetch(cur, (k, v), nxt, axis, step, steps[j + 1])
            for qs, ks, is_causal, make_mask in plans[step]:
                mask = make_mask and make_mask()
                o_blk, l_blk = block_forward(_rows(q, qs), _rows(cur[0], ks), _rows(cur[1], ks),
                                             is_causal, scale, backend, mask)
                _merge(out, lse, qs, o_blk, l_blk)
                if report:  # MuonClip: the block's largest logits (the kernels return only the LSE)
                    best = torch.maximum(best, max_logits(_rows(q, qs), _rows(cur[0], ks), scale, is_causal, mask))
            comm.wait_all(works, axis, "ring attention K/V p2p")
            cur = nxt if nxt is not None else cur
        if report:
            report(best)
        if sinks is not None:  # once, on the merged rows (sinks.py): a per-block merge would count it c times
            out, lse = merge_sink(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.axis, ctx.causal, ctx.order, ctx.scale, ctx.backend = axis, causal, order, scale, backend
        ctx.doc_ids, ctx.window = doc_ids, window  # masks are rebuilt in backward: b·s_local·s bytes are not worth keeping
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        axis, c, r, s_local = ctx.axis, ctx.axis.size, ctx.axis.rank, q.shape[2]
        dout = dout.contiguous()
        plans = document_plan(r, c, ctx.order, ctx.causal, s_local, ctx.doc_ids, ctx.window, q.shape[0], q.device)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        own = None  # this rank's share of its own dK/dV (step 0), added when the accumulators return
        acc_works, acc_in, acc_out = [], None, None  # acc_out stays referenced until its send completes
        home_works, home = [], []  # accumulators of this rank's own block, back from where their runs of steps end
        cur = (k, v)
        steps = ring_step_list(c, ctx.order, s_local, ctx.window)
        for j, step in enumerate(steps):
            kv_works, nxt = [], None
            if j < len(steps) - 1:
                nxt = (torch.empty_like(k), torch.empty_like(v))
                kv_works = _fetch(cur, (k, v), nxt, axis, step, steps[j + 1])
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for qs, ks, is_causal, make_mask in plans[step]:
                g_q, g_k, g_v = block_backward(
                    _rows(dout, qs).contiguous(), _rows(q, qs), _rows(cur[0], ks), _rows(cur[1], ks),
                    _rows(out, qs).contiguous(), _rows(lse, qs).contiguous(), is_causal, ctx.scale, ctx.backend,
                    make_mask and make_mask())
                _rows(dq, qs).add_(g_q)
                _rows(dk, ks).add_(g_k)
                _rows(dv, ks).add_(g_v)
            if step == 0:
                own = (dk, dv)
            else:  # add to the accumulator of this block (from the previous rank, if it held it a step ago) ...
                comm.wait_all(acc_works, axis, "ring attention dK/dV p2p")
                if acc_in is not None:
                    dk.add_(acc_in[0])
                    dv.add_(acc_in[1])
                acc_out = (dk.to(k.dtype), dv.to(v.dtype))
                if j < len(steps) - 1 and steps[j + 1] == step + 1:  # ... and on to its next holder, rank r + 1
                    acc_in = (torch.empty_like(k), torch.empty_like(v))
                    acc_works = _pass_on(acc_out, acc_in, axis)
                else:  # ... or home to its owner (`step` ranks back); this rank's own comes from `step` ahead
                    back = (torch.empty_like(k), torch.empty_like(v))
                    home_works += _pass_on(acc_out, back, axis, -step % c)
                    home.append(back)
                    acc_works, acc_in = [], None
            comm.wait_all(kv_works, axis, "ring attention K/V p2p")
            cur = nxt if nxt is not None else cur
        comm.wait_all(home_works, axis, "ring attention dK/dV p2p")
        dk, dv = own
        for back_k, back_v in home:  # one accumulator per run of consecutive steps, from the rank where it ended
            dk.add_(back_k)
            dv.add_(back_v)
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, dsinks, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis, causal: bool = True,
                   order: str = "balanced", scale: float | None = None, backend: str = "auto",
                   doc_ids: torch.Tensor | None = None, report=None, sinks: torch.Tensor | None = None,
                   window: int = 0) -> torch.Tensor:
    """Exact attention over the whole sequence for this rank's queries; out [b, hq, s_local, d].

    q/k/v are this rank's shard in `order` (see `sharding.shard_sequence(..., dim=2)`); `axis` is the
    cp axis. backend "auto" uses a fused kernel where one applies, "math" forces the fallback.
    `doc_ids` [b, s] (global, unsharded): document masking (see the module docstring). `report` (MuonClip):
    called with each query head's largest logit over the block pairs this rank computed, masked as the kernel
    masks them (under a window: only the pairs and steps `window_plan` keeps; never the sink). `sinks` [hq] (gpt-oss):
    merged once through the final LSE; `window` > 0: a sliding window, blocks outside every window skipped.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"ring_attention: expected q [b, hq, s, d] and k, v [b, hkv, s, d], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: hq={q.shape[1]} query heads is not a multiple of hkv={k.shape[1]}")
    check_seq_len(q.shape[2] * axis.size, axis.size, order)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if doc_ids is not None and doc_ids.shape != (q.shape[0], q.shape[2] * axis.size):
        raise ValueError(f"ring_attention: doc_ids {tuple(doc_ids.shape)} must be the global [b, s] = "
                         f"[{q.shape[0]}, {q.shape[2] * axis.size}]")
    if window and not causal:
        raise ValueError("ring_attention: a sliding window needs causal attention")
    return _RingAttention.apply(q, k, v, axis, causal, order, scale, backend, doc_ids, report, sinks, window)
