"""Every collective shardwise issues, and the ledger that counts their bytes per axis.

Callers reach all of it as `comm.<name>`; each idea has its own module:
* `calls` — what every op shares on its way to torch.distributed: the device check, error naming, the ledger
  record, the launcher's hook and the compile barrier;
* `transport` — the calls whose meaning depends on the world (`Transport`: torch.distributed; a simulated
  world passes the mesh its own);
* `collectives` — the raw ops (`all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`, ...) that call
  torch.distributed on an `Axis` and record what they moved, in the wire bytes of `rules.wire` the planner shares;
* `p2p` — batched point-to-point ops and the strict mode that follows NCCL's ordering rules on gloo;
* `functions` — one small autograd Function per differentiable pattern (Megatron's f/g operators and the
  sequence-parallel gathers/scatters), each with a "forward: X / backward: Y" docstring;
* `ledger` — bytes and op counts per (axis, op), per step.
"""
from .calls import CollectiveError, DeviceError, compile_barriers, guarded, set_call_hook
from .collectives import (
    all_gather,
    all_gather_into,
    all_gather_into_async,
    all_gather_object,
    all_reduce,
    all_reduce_async,
    all_to_all,
    barrier,
    broadcast,
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
from .transport import Transport

__all__ = [
    "CollectiveError", "DeviceError", "Ledger", "all_gather", "all_gather_into", "all_gather_into_async",
    "all_gather_object", "all_reduce", "all_reduce_async", "all_to_all", "barrier", "broadcast",
    "compile_barriers", "completed", "copy_to_region", "gather_from_region", "gather_from_sequence", "guarded", "p2p",
    "reduce_from_region", "reduce_scatter", "reduce_scatter_into", "reduce_scatter_into_async",
    "reduce_scatter_to_sequence", "scatter_to_region", "set_call_hook", "strict_p2p", "Transport", "wait",
    "wait_all",
]
