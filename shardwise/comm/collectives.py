"""Raw collectives: each calls torch.distributed on an `Axis` and records what it moved in the axis' ledger.

An op on an axis of size 1 is the identity and records nothing, so the single-device model runs the very
same code.

Byte convention (shared with the planner): `bytes` is the payload this rank contributes — the input tensor
of an all-reduce, reduce-scatter or all-to-all, the local shard of an all-gather, the tensor of a send.
`wire_bytes` is what this rank puts on links under ring algorithms: all-reduce 2(t-1)/t·N, reduce-scatter
(t-1)/t·N, all-gather (t-1)·N_shard, all-to-all the part addressed to other ranks, send N.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .calls import eager, guarded, nbytes, record


@eager
def wait(work, axis, op: str) -> None:
    """Wait on an async work handle with the same error naming as the blocking ops."""
    if work is not None:
        guarded(axis, op, work.wait)


def completed(works) -> bool:
    """Whether every handle has finished, without blocking."""
    return all(w is None or w.is_completed() for w in works)


def wait_all(works, axis, op: str) -> None:
    """`wait` on each handle of a p2p batch, in order."""
    for work in works:
        wait(work, axis, op)


# torch >= 2.13 renames the flat collectives; 2.11 (our floor) has only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------- raw collectives
@eager
def all_reduce(t: torch.Tensor, axis, op: str = "sum", tag: str | None = None) -> torch.Tensor:
    """In-place all-reduce of `t` over `axis` (sum or max)."""
    if not axis.active:
        return t
    n = axis.size
    record(axis, "all_reduce", nbytes(t), 2 * (n - 1) / n * nbytes(t), tag)
    guarded(axis, "all_reduce", dist.all_reduce, t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
             group=axis.group)
    return t


@eager
def all_reduce_async(t: torch.Tensor, axis, tag: str | None = None):
    """Start an in-place sum all-reduce; returns the work handle (None on a size-1 axis) for `wait`."""
    if not axis.active:
        return None
    n = axis.size
    record(axis, "all_reduce", nbytes(t), 2 * (n - 1) / n * nbytes(t), tag)
    return guarded(axis, "all_reduce", dist.all_reduce, t, group=axis.group, async_op=True)


@eager
def reduce_scatter(t: torch.Tensor, axis, dim: int = 0, tag: str | None = None) -> torch.Tensor:
    """Sum over `axis`, keep this rank's 1/n slice of `dim`."""
    if not axis.active:
        return t
    n = axis.size
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter on {axis.name}: dim {dim} of size {t.shape[dim]} not divisible by {n}")
    src = t.movedim(dim, 0).contiguous() if dim else t.contiguous()
    out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
    record(axis, "reduce_scatter", nbytes(src), (n - 1) / n * nbytes(src), tag)
    guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, src, group=axis.group)
    return out.movedim(0, dim) if dim else out


@eager
def all_gather(t: torch.Tensor, axis, dim: int = 0, tag: str | None = None) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`, in axis-rank order."""
    if not axis.active:
        return t
    n = axis.size
    src = t.movedim(dim, 0).contiguous() if dim else t.contiguous()
    out = src.new_empty((n * src.shape[0], *src.shape[1:]))
    record(axis, "all_gather", nbytes(src), (n - 1) * nbytes(src), tag)
    guarded(axis, "all_gather", _all_gather_flat, out, src, group=axis.group)
    # Contiguous once here, so the several linears that read a gathered SP input share one tensor
    # instead of each saving its own contiguous copy for backward.
    return out.movedim(0, dim).contiguous() if dim else out


@eager
def all_gather_into(out: torch.Tensor, shard: torch.Tensor, axis, tag: str | None = None) -> torch.Tensor:
    """Flat all-gather into a preallocated buffer (ZeRO parameter gather)."""
    if not axis.active:
        out.copy_(shard)
        return out
    record(axis, "all_gather", nbytes(shard), (axis.size - 1) * nbytes(shard), tag)
    guarded(axis, "all_gather", _all_gather_flat, out, shard, group=axis.group)
    return out


@eager
def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, axis, tag: str | None = None) -> torch.Tensor:
    """Flat reduce-scatter into a preallocated shard (ZeRO gradient reduction)."""
    if not axis.active:
        out.copy_(full)
        return out
    n = axis.size
    record(axis, "reduce_scatter", nbytes(full), (n - 1) / n * nbytes(full), tag)
    guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, full, group=axis.group)
    return out


@eager
def all_gather_into_async(out: torch.Tensor, shard: torch.Tensor, axis, tag: str | None = None):
    """Start a flat all-gather into `out` (ZeRO-3 parameter prefetch); the work handle for `wait`, None
    when done already (size-1 axis). Recorded like the blocking op, when it is issued."""
    if not axis.active:
        out.copy_(shard)
        return None
    record(axis, "all_gather", nbytes(shard), (axis.size - 1) * nbytes(shard), tag)
    return guarded(axis, "all_gather", _all_gather_flat, out, shard, group=axis.group, async_op=True)


@eager
def reduce_scatter_into_async(out: torch.Tensor, full: torch.Tensor, axis, tag: str | None = None):
    """Start a flat reduce-scatter into `out` (gradient reduction overlapped with backward); the work
    handle for `wait`, None when done already (size-1 axis). Recorded like the blocking op."""
    if not axis.active:
        out.copy_(full)
        return None
    n = axis.size
    record(axis, "reduce_scatter", nbytes(full), (n - 1) / n * nbytes(full), tag)
    return guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, full, group=axis.group, async_op=True)


@eager
def broadcast(t: torch.Tensor, axis, src_rank: int = 0, tag: str | None = None) -> torch.Tensor:
    """Broadcast from axis-rank `src_rank`."""
    if not axis.active:
        return t
    record(axis, "broadcast", nbytes(t) if axis.rank == src_rank else 0,
            nbytes(t) if axis.rank == src_rank else 0, tag)
    guarded(axis, "broadcast", dist.broadcast, t, src=axis.ranks[src_rank], group=axis.group)
    return t


@eager
def all_to_all(inp: torch.Tensor, axis, in_splits: list[int] | None = None, out_splits: list[int] | None = None,
               tag: str | None = None) -> torch.Tensor:
    """`all_to_all_single` along dim 0 with optional variable splits (rows sent to / received from each rank)."""
    if not axis.active:
        return inp
    n = axis.size
    row = math.prod(inp.shape[1:]) * inp.element_size()
    if out_splits is None:
        out = torch.empty_like(inp)
        sent_to_others = nbytes(inp) * (n - 1) / n
    else:
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        sent_to_others = row * (sum(in_splits) - in_splits[axis.rank])
    record(axis, "all_to_all", nbytes(inp), sent_to_others, tag)
    guarded(axis, "all_to_all", dist.all_to_all_single, out, inp.contiguous(), out_splits, in_splits,
             group=axis.group)
    return out


@eager
def all_gather_object(obj, axis) -> list:
    """Gather small Python objects (metadata only; recorded as op 'all_gather_object')."""
    if not axis.active:
        return [obj]
    out = [None] * axis.size
    record(axis, "all_gather_object", 0, 0, None)
    return guarded(axis, "all_gather_object", axis.transport.all_gather_object, out, obj, axis.group)


@eager
def barrier(axis) -> None:
    if axis.active:
        guarded(axis, "barrier", dist.barrier, group=axis.group)
