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
import sys

import torch
import torch.distributed as dist


_RAW_OPS: list[tuple[str, str]] = []  # (module, name) of every raw op, for compile_barriers


def _eager(fn):
    """Mark a raw op as one that must run eagerly under torch.compile (see compile_barriers)."""
    _RAW_OPS.append((fn.__module__, fn.__name__))
    return fn


def compile_barriers() -> None:
    """Make every raw op a torch.compiler.disable'd function (idempotent; called under --compile).

    Dynamo then breaks the graph at each collective instead of tracing the ledger's dict updates (a
    compiled graph replays no Python side effects, so the ledger would count only the first trace)
    or torch.distributed's in-place c10d calls; the autograd Functions around them run whole and
    eagerly, exactly as without compile, and only the math between collectives is compiled. Done on
    demand, not at import, because importing Dynamo costs every process seconds. Callers reach the
    ops as `comm.<op>`, and comm's own modules through their defining module's globals, so rebinding
    the name in both places suffices.
    """
    package = vars(sys.modules[__package__])
    for module, name in _RAW_OPS:
        names = vars(sys.modules[module])
        if not getattr(names[name], "_sw_eager", False):
            names[name] = torch.compiler.disable(names[name])
            names[name]._sw_eager = True
        package[name] = names[name]


class CollectiveError(RuntimeError):
    """A collective failed or timed out; names this rank, the axis, the op and the group's ranks."""


class DeviceError(RuntimeError):
    """A tensor handed to a collective is not on the mesh's device (NCCL would fail at once)."""


def _check_device(axis, what: str, t: torch.Tensor) -> None:
    device = getattr(axis, "device", None)
    if device is not None and (t.device.type != device.type or
                               (device.index is not None and t.device.index != device.index)):
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise DeviceError(f"rank {rank}: {what} on axis '{axis.name}' got a tensor on {t.device}, "
                          f"but the mesh's device is {device}: create it with device=mesh.device")


_on_call = None  # fn(op, axis name) run before every torch.distributed call; launch's last-op record


def set_call_hook(fn) -> None:
    """Install `fn(op, axis_name)` (or None): an NCCL hang aborts the process, so the launcher keeps its own trace."""
    global _on_call
    _on_call = fn


def _guarded(axis, what: str, fn, *args, **kwargs):
    """Run one torch.distributed call; turn backend errors (peer died, timeout) into a CollectiveError.

    Every tensor argument must live on the mesh's device: gloo moves CPU tensors anywhere, NCCL
    accepts only tensors on the rank's GPU, so the check makes a CPU test run fail where a GPU run would.
    """
    for a in args:
        if isinstance(a, torch.Tensor):
            _check_device(axis, what, a)
    if _on_call is not None:
        _on_call(what, axis.name)
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CollectiveError(f"rank {dist.get_rank()}: {what} on axis '{axis.name}' (ranks {list(axis.ranks)}) "
                              f"failed: {first}") from e


@_eager
def wait(work, axis, op: str) -> None:
    """Wait on an async work handle with the same error naming as the blocking ops."""
    if work is not None:
        _guarded(axis, op, work.wait)


_FakeWork = getattr(torch._C._distributed_c10d, "FakeWork", None)


def completed(works) -> bool:
    """Whether every handle has finished, without blocking. A fake backend's handle (simulation) did
    nothing and is done at once, though its `is_completed()` always answers False."""
    return all(w is None or (_FakeWork is not None and isinstance(w, _FakeWork)) or w.is_completed()
               for w in works)


def wait_all(works, axis, op: str) -> None:
    """`wait` on each handle of a p2p batch, in order."""
    for work in works:
        wait(work, axis, op)


# torch >= 2.13 renames the flat collectives; 2.11 (our floor) has only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(axis, op: str, nbytes: int, wire: float, tag: str | None) -> None:
    if axis.ledger is not None:
        axis.ledger.record(axis.name, f"{op}:{tag}" if tag else op, nbytes, wire)


# ---------------------------------------------------------------- raw collectives
@_eager
def all_reduce(t: torch.Tensor, axis, op: str = "sum", tag: str | None = None) -> torch.Tensor:
    """In-place all-reduce of `t` over `axis` (sum or max)."""
    if not axis.active:
        return t
    n = axis.size
    _record(axis, "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t), tag)
    _guarded(axis, "all_reduce", dist.all_reduce, t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
             group=axis.group)
    return t


@_eager
def all_reduce_async(t: torch.Tensor, axis, tag: str | None = None):
    """Start an in-place sum all-reduce; returns the work handle (None on a size-1 axis) for `wait`."""
    if not axis.active:
        return None
    n = axis.size
    _record(axis, "all_reduce", _nbytes(t), 2 * (n - 1) / n * _nbytes(t), tag)
    return _guarded(axis, "all_reduce", dist.all_reduce, t, group=axis.group, async_op=True)


@_eager
def reduce_scatter(t: torch.Tensor, axis, dim: int = 0, tag: str | None = None) -> torch.Tensor:
    """Sum over `axis`, keep this rank's 1/n slice of `dim`."""
    if not axis.active:
        return t
    n = axis.size
    if t.shape[dim] % n:
        raise ValueError(f"reduce_scatter on {axis.name}: dim {dim} of size {t.shape[dim]} not divisible by {n}")
    src = t.movedim(dim, 0).contiguous() if dim else t.contiguous()
    out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
    _record(axis, "reduce_scatter", _nbytes(src), (n - 1) / n * _nbytes(src), tag)
    _guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, src, group=axis.group)
    return out.movedim(0, dim) if dim else out


@_eager
def all_gather(t: torch.Tensor, axis, dim: int = 0, tag: str | None = None) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim`, in axis-rank order."""
    if not axis.active:
        return t
    n = axis.size
    src = t.movedim(dim, 0).contiguous() if dim else t.contiguous()
    out = src.new_empty((n * src.shape[0], *src.shape[1:]))
    _record(axis, "all_gather", _nbytes(src), (n - 1) * _nbytes(src), tag)
    _guarded(axis, "all_gather", _all_gather_flat, out, src, group=axis.group)
    # Contiguous once here, so the several linears that read a gathered SP input share one tensor
    # instead of each saving its own contiguous copy for backward.
    return out.movedim(0, dim).contiguous() if dim else out


@_eager
def all_gather_into(out: torch.Tensor, shard: torch.Tensor, axis, tag: str | None = None) -> torch.Tensor:
    """Flat all-gather into a preallocated buffer (ZeRO parameter gather)."""
    if not axis.active:
        out.copy_(shard)
        return out
    _record(axis, "all_gather", _nbytes(shard), (axis.size - 1) * _nbytes(shard), tag)
    _guarded(axis, "all_gather", _all_gather_flat, out, shard, group=axis.group)
    return out


@_eager
def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, axis, tag: str | None = None) -> torch.Tensor:
    """Flat reduce-scatter into a preallocated shard (ZeRO gradient reduction)."""
    if not axis.active:
        out.copy_(full)
        return out
    n = axis.size
    _record(axis, "reduce_scatter", _nbytes(full), (n - 1) / n * _nbytes(full), tag)
    _guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, full, group=axis.group)
    return out


@_eager
def all_gather_into_async(out: torch.Tensor, shard: torch.Tensor, axis, tag: str | None = None):
    """Start a flat all-gather into `out` (ZeRO-3 parameter prefetch); the work handle for `wait`, None
    when done already (size-1 axis). Recorded like the blocking op, when it is issued."""
    if not axis.active:
        out.copy_(shard)
        return None
    _record(axis, "all_gather", _nbytes(shard), (axis.size - 1) * _nbytes(shard), tag)
    return _guarded(axis, "all_gather", _all_gather_flat, out, shard, group=axis.group, async_op=True)


@_eager
def reduce_scatter_into_async(out: torch.Tensor, full: torch.Tensor, axis, tag: str | None = None):
    """Start a flat reduce-scatter into `out` (gradient reduction overlapped with backward); the work
    handle for `wait`, None when done already (size-1 axis). Recorded like the blocking op."""
    if not axis.active:
        out.copy_(full)
        return None
    n = axis.size
    _record(axis, "reduce_scatter", _nbytes(full), (n - 1) / n * _nbytes(full), tag)
    return _guarded(axis, "reduce_scatter", _reduce_scatter_flat, out, full, group=axis.group, async_op=True)


@_eager
def broadcast(t: torch.Tensor, axis, src_rank: int = 0, tag: str | None = None) -> torch.Tensor:
    """Broadcast from axis-rank `src_rank`."""
    if not axis.active:
        return t
    _record(axis, "broadcast", _nbytes(t) if axis.rank == src_rank else 0,
            _nbytes(t) if axis.rank == src_rank else 0, tag)
    _guarded(axis, "broadcast", dist.broadcast, t, src=axis.ranks[src_rank], group=axis.group)
    return t


@_eager
def all_to_all(inp: torch.Tensor, axis, in_splits: list[int] | None = None, out_splits: list[int] | None = None,
               tag: str | None = None) -> torch.Tensor:
    """`all_to_all_single` along dim 0 with optional variable splits (rows sent to / received from each rank)."""
    if not axis.active:
        return inp
    n = axis.size
    row = math.prod(inp.shape[1:]) * inp.element_size()
    if out_splits is None:
        out = torch.empty_like(inp)
        sent_to_others = _nbytes(inp) * (n - 1) / n
    else:
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        sent_to_others = row * (sum(in_splits) - in_splits[axis.rank])
    _record(axis, "all_to_all", _nbytes(inp), sent_to_others, tag)
    _guarded(axis, "all_to_all", dist.all_to_all_single, out, inp.contiguous(), out_splits, in_splits,
             group=axis.group)
    return out


@_eager
def all_gather_object(obj, axis) -> list:
    """Gather small Python objects (metadata only; recorded as op 'all_gather_object')."""
    if not axis.active:
        return [obj]
    out = [None] * axis.size
    _record(axis, "all_gather_object", 0, 0, None)
    if dist.get_backend(axis.group) == "fake":  # a simulated world: every peer is taken to hold what this rank holds
        return [obj] * axis.size
    _guarded(axis, "all_gather_object", dist.all_gather_object, out, obj, group=axis.group)
    return out


@_eager
def barrier(axis) -> None:
    if axis.active:
        _guarded(axis, "barrier", dist.barrier, group=axis.group)
