"""How gradients are cut into buckets and how many bucket reductions stay in flight, as pure arithmetic.

Torch-free on purpose: `GradReducer` builds its buckets with these rules and the planner predicts their
memory and communication with the same ones, so what `shardwise plan` counts is what `shardwise train`
allocates.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")

BUCKET_BYTES = 25 * 2**20
"""A gradient bucket closes once it holds this much (DDP's default)."""

MAX_INFLIGHT = 2
"""ZeRO ≥ 2: bucket reductions in flight at once; a further launch first waits for the oldest, which bounds
the gradient buffers held by collectives (ZeRO 0/1 reduce once per step from persistent buffers: no bound)."""


def bucket_key(zero: int, chunk: int, unit: int, expert: bool, decay: bool) -> tuple:
    """The group a parameter's gradient is bucketed with at ZeRO stage `zero`: by expert? (ZeRO-0), and decayed?
    (ZeRO-1), and pipeline chunk (ZeRO-2), and ZeRO-3 unit (ZeRO-3); a bucket never spans two groups."""
    return ((expert,) if zero == 0 else (expert, decay) if zero == 1 else (chunk, expert, decay) if zero == 2
            else (chunk, unit, expert, decay))


def cut_runs(items: Iterable[T], nbytes: Callable[[T], int], bucket_bytes: int = BUCKET_BYTES) -> Iterator[list[T]]:
    """Consecutive runs of `items`, in order, each closed as soon as it holds at least `bucket_bytes` (the last
    one may hold less)."""
    run, size = [], 0
    for item in items:
        run.append(item)
        size += nbytes(item)
        if size >= bucket_bytes:
            yield run
            run, size = [], 0
    if run:
        yield run
