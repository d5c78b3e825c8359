"""How every comm op reaches torch.distributed: the device check, the launcher's hook, error naming, the ledger
record and the compile barrier. `collectives` and `p2p` both build on these."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed or timed out; names this rank, the axis, the op and the group's ranks."""


class DeviceError(RuntimeError):
    """A tensor handed to a collective is not on the mesh's device (NCCL would fail at once)."""


def check_device(axis, what: str, t: torch.Tensor) -> None:
    """Refuse a tensor off the mesh's device: gloo moves CPU tensors anywhere, NCCL accepts only tensors on the
    rank's GPU, so the check makes a CPU test run fail where a GPU run would."""
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


def guarded(axis, what: str, fn, *args, **kwargs):
    """Run one torch.distributed call; turn backend errors (peer died, timeout) into a CollectiveError.

    Every tensor argument must live on the mesh's device (`check_device`)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            check_device(axis, what, a)
    if _on_call is not None:
        _on_call(what, axis.name)
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CollectiveError(f"rank {dist.get_rank()}: {what} on axis '{axis.name}' (ranks {list(axis.ranks)}) "
                              f"failed: {first}") from e


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def record(axis, op: str, n: int, wire: float, tag: str | None) -> None:
    """Count one op in the axis' ledger, under `op:tag` when tagged."""
    if axis.ledger is not None:
        axis.ledger.record(axis.name, f"{op}:{tag}" if tag else op, n, wire)


_twins: list[list] = []  # [the op a compile calls]: the raw op until compile_barriers disables it


def eager(fn):
    """Mark a raw op as one that runs eagerly under torch.compile: traced by Dynamo, it calls its disabled twin.

    Dynamo then breaks the graph at each collective instead of tracing the ledger's dict updates (a compiled
    graph replays no Python side effects, so the ledger would count only the first trace) or torch.distributed's
    in-place c10d calls; the autograd Functions around them run whole and eagerly, exactly as without compile,
    and only the math between collectives is compiled. The op object itself never changes, so a name bound
    anywhere (`from .collectives import all_reduce`) reaches the barrier too. Outside a compile it is one
    flag check."""
    twin = [fn]

    @functools.wraps(fn)
    def op(*args, **kwargs):
        if torch.compiler.is_compiling():
            return twin[0](*args, **kwargs)
        return fn(*args, **kwargs)

    _twins.append(twin)
    return op


def compile_barriers() -> None:
    """Disable every raw op's twin for Dynamo (idempotent; called under --compile). On demand, not at import,
    because importing Dynamo costs every process seconds."""
    for twin in _twins:
        if not getattr(twin[0], "_torchdynamo_disable", False):
            twin[0] = torch.compiler.disable(twin[0])
