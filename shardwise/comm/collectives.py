"""Raw collectives: each calls torch.distributed on an `Axis` and records what it moved in the axis' ledger.

An op on an axis of size 1 is the identity and records nothing, so the single-device model runs the very
same code.

Byte convention (shared with the planner): `bytes` is the payload this rank contributes, `wire_bytes` what it
puts on links under ring algorithms, as `shardwise.rules.wire` states them per collective.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..rules import wire
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
    record(axis, "all_reduce", nbytes(t), wire.all_reduce(nbytes(t), axis.size), tag)
    guarded(axis, "all_reduce", dist.all_reduce, t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
             group=axis.group)
    return t


@eager
def all_reduce_async(t: torch.Tensor, axis, tag: str | None = None):
    """Start an in-place sum all-reduce; returns the work handle (None on a size-1 axis) for `wait`."""
    if not axis.active:
        return None
    record(axis, "all_reduce", nbytes(t), wire.all_reduce(nbytes(t), axis.size), tag)
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
    record(axis, "reduce_scatter", nbytes(src), wire.reduce_scatter(nbytes(src), n), tag)
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
    record(axis, "all_gather", nbytes(src), wire.all_gather(nbytes(src), n), tag)
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
    record(axis, "all_gather", nbytes(shard), wire.all_gather(nbytes(shard), axis.size), tag)
    guarded(axis, "all_gather", _all_gather_flat, out, shard, group=axis.group)
    return out


@eager
def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, axis, tag: str | None = None) -> torch.Tensor:
    """Flat reduce-scatter into a preallocated shard (ZeRO gradient reduction)."""
    if not axis.active:
        out.copy_(full)
        return out
    record(axis, "reduce_scatter", nbytes(full), wire.reduce_scatter(nbytes(full), axis.size), tag)
    guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, full, group=axis.group)
    return out


@eager
def all_gather_into_async(out: torch.Tensor, shard: torch.Tensor, axis, tag: str | None = None):
    """Start a flat all-gather into `out` (ZeRO-3 parameter prefetch); the work handle for `wait`, None
    when done already (size-1 axis). Recorded like the blocking op, when it is issued."""
    if not axis.active:
        out.copy_(shard)
        return None
    record(axis, "all_gather", nbytes(shard), wire.all_gather(nbytes(shard), axis.size), tag)
    return guarded(axis, "all_gather", _all_gather_flat, out, shard, group=axis.group, async_op=True)


@eager
def reduce_scatter_into_async(out: torch.Tensor, full: torch.Tensor, axis, tag: str | None = None):
    """Start a flat reduce-scatter into `out` (gradient reduction overlapped with backward); the work
    handle for `wait`, None when done already (size-1 axis). Recorded like the blocking op."""
    if not axis.active:
        out.copy_(full)
        return None
    record(axis, "reduce_scatter", nbytes(full), wire.reduce_scatter(nbytes(full), axis.size), tag)
    return guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, full, group=axis.group, async_op=True)


@eager
def broadcast(t: torch.Tensor, axis, src_rank: int = 0, tag: str | None = None) -> torch.Tensor:
    """Broadcast from axis-rank `src_rank`."""
    if not axis.active:
        return t
    sent = wire.broadcast(nbytes(t), axis.rank == src_rank)
    record(axis, "broadcast", sent, sent, tag)
    guarded(axis, "broadcast", dist.broadcast, t, src=axis.ranks[src_rank], group=axis.group)
    return t


@eager
def all_to_all(inp: torch.Tensor, axis, in_splits: list[int] | None = None, out_splits: list[int] | None = None,
               tag: str | None = None) -> torch.Tensor:
    """`all_to_all_single` along dim 0 with optional variable splits (rows sent to / received from each rank)."""
    if not axis.active:
        return inp
    if out_splits is None:
        out = torch.empty_like(inp)
        sent_to_others = wire.all_to_all(nbytes(inp), axis.size)
    else:
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        row = math.prod(inp.shape[1:]) * inp.element_size()
        sent_to_others = wire.all_to_all_v(row, in_splits, axis.rank)
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
