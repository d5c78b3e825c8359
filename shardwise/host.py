"""Every device→host read in shardwise goes through `read`: one place that counts them.

On a GPU a host read (`.item()`, `float(t)`, `.tolist()`, a blocking `torch.tensor(list, device=cuda)` the
other way round) stalls the CPU until the stream drains: the host can queue no more work, so every read in
the step loop costs overlap. `summary.json`'s `host_syncs_per_step` is measured here, and tests hold it to
a budget.

The read itself (`values`) is overridable as any torch function is: a `TorchFunctionMode` sees the call
with its call-site name and may answer without touching the tensor — how a world without data (fake
tensors) states its stand-ins, while a real run takes torch's ordinary no-override path.
"""
from __future__ import annotations

from collections import Counter

from torch.overrides import wrap_torch_function

_counts: Counter[str] = Counter()


def read(t, what: str):
    """`t.tolist()` (a Python scalar for a 0-d tensor), counted under `what` — a short name of the call site
    such as "loss+norm" or "moe split sizes". The one sanctioned device→host read in shardwise."""
    _counts[what] += 1
    return values(t, what)


@wrap_torch_function(lambda t, what: (t,))
def values(t, what: str):
    """`t`'s values on the host; `what` names the call site for whoever overrides the read."""
    return t.tolist()


def count() -> int:
    """Host reads since the last `reset`."""
    return sum(_counts.values())


def counts() -> dict[str, int]:
    """Host reads since the last `reset`, by call site."""
    return dict(_counts)


def reset() -> None:
    _counts.clear()
