"""Every device→host read in shardwise goes through `read`: one place that counts them and one place that
answers them in a fake-tensor simulation.

On a GPU a host read (`.item()`, `float(t)`, `.tolist()`, a blocking `torch.tensor(list, device=cuda)` the
other way round) stalls the CPU until the stream drains: the host can queue no more work, so every read in
the step loop costs overlap. `summary.json`'s `host_syncs_per_step` is measured here, and tests hold it to
a budget. Under `FakeTensorMode` there is no data to read: `answered_by(fn)` makes `read` return
`fn(what, tensor)` instead, a stand-in the caller states (e.g. the planner's balanced MoE split sizes).
"""
from __future__ import annotations

import contextlib
from collections import Counter

_counts: Counter[str] = Counter()
_answer = None  # simulation: (what, tensor) -> the value a real read would have returned


def read(t, what: str):
    """`t.tolist()` (a Python scalar for a 0-d tensor), counted under `what` — a short name of the call site
    such as "loss+norm" or "moe split sizes". The one sanctioned device→host read in shardwise."""
    _counts[what] += 1
    if _answer is not None:
        return _answer(what, t)
    return t.tolist()


def count() -> int:
    """Host reads since the last `reset`."""
    return sum(_counts.values())


def counts() -> dict[str, int]:
    """Host reads since the last `reset`, by call site."""
    return dict(_counts)


def reset() -> None:
    _counts.clear()


@contextlib.contextmanager
def answered_by(fn):
    """Within the block, `read(t, what)` returns `fn(what, t)` without touching `t` (fake tensors)."""
    global _answer
    previous, _answer = _answer, fn
    try:
        yield
    finally:
        _answer = previous
