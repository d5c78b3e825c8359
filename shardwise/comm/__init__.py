"""Every collective shardwise issues, and the ledger that counts their bytes per axis.

Callers reach all of it as `comm.<name>`; each idea has its own module:
* `collectives` — the raw ops (`all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`, ...) that call
  torch.distributed on an `Axis` and record what they moved, with the byte convention the planner shares;
* `p2p` — batched point-to-point ops and the strict mode that follows NCCL's ordering rules on gloo;
* `functions` — one small autograd Function per differentiable pattern (Megatron's f/g operators and the
  sequence-parallel gathers/scatters), each with a "forward: X / backward: Y" docstring;
* `ledger` — bytes and op counts per (axis, op), per step.
"""
from .collectives import (
    CollectiveError,
    DeviceError,
    _guarded,  # noqa: F401 - tests wrap a call the way every raw op does
    all_gather,
    all_gather_into,
    all_gather_into_async,
    all_gather_object,
    all_reduce,
    all_reduce_async,
    all_to_all,
    barrier,
    broadcast,
    compile_barriers,
    completed,
    reduce_scatter,
    reduce_scatter_into,
    reduce_scatter_into_async,
    wait,
    wait_all,
)
from .functions import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)
from .ledger import Ledger
from .p2p import p2p, strict_p2p

__all__ = [
    "CollectiveError", "DeviceError", "Ledger", "all_gather", "all_gather_into", "all_gather_into_async",
    "all_gather_object", "all_reduce", "all_reduce_async", "all_to_all", "barrier", "broadcast",
    "compile_barriers", "completed", "copy_to_region", "gather_from_region", "gather_from_sequence", "p2p",
    "reduce_from_region", "reduce_scatter", "reduce_scatter_into", "reduce_scatter_into_async",
    "reduce_scatter_to_sequence", "scatter_to_region", "strict_p2p", "wait", "wait_all",
]
