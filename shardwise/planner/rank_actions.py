"""What one pipeline rank's schedule actions say about its memory moments: backwards before its last
forward, each kind of backward and the activations it holds, the split-backward states (the planner's
peak, `planner/peak.py`)."""
from __future__ import annotations

from functools import lru_cache

from shardwise.planner.layout import Layout


def backward_then_forward(lay: Layout, k: int) -> bool:
    """Whether rank k of the pipeline runs a forward after a backward within one step (without a pipeline:
    whether the step has more than one microbatch)."""
    return backwards_before_forward(lay, k) > 0


def backwards_before_forward(lay: Layout, k: int) -> int:
    """How many backwards rank k of the pipeline has run before its last forward of the step."""
    if lay.pp == 1:
        return lay.m - 1
    return _b_before_f(lay.schedule, lay.pp, lay.m, lay.vp, k)


@lru_cache(maxsize=64)
def _schedule(schedule: str, p: int, m: int, v: int):
    """The schedule, built once per (schedule, p, m, v): the search asks about every rank of every layout,
    and building one costs O(p·m·v) actions."""
    from shardwise.pipeline.schedules import build_schedule

    return build_schedule(schedule, p, m, v)


@lru_cache(maxsize=1024)
def _b_before_f(schedule: str, p: int, m: int, v: int, k: int) -> int:
    try:
        kinds = [a.kind for a in _schedule(schedule, p, m, v).actions[k]]
    except (ImportError, ValueError):
        return m
    last_f = max((i for i, kind in enumerate(kinds) if kind == "F"), default=-1)
    return kinds[:last_f].count("B")


@lru_cache(maxsize=1024)
def backward_states(schedule: str, p: int, m: int, v: int, k: int) -> tuple[tuple[int, bool], ...]:
    """Per kind of backward on rank k — (its first one, one after another backward) — the fewest
    microbatch-chunks held fewer than the rank's most at any F: the first backward of a step runs with the
    most held and nothing in flight; a later one may hold fewer (e.g. 1F1B's cool-down)."""
    try:
        actions = _schedule(schedule, p, m, v).actions[k]
    except (ImportError, ValueError):
        return ((0, False), (0, True))
    held = most = 0
    seen, states = False, {}
    for a in actions:
        if a.kind == "F":
            held += 1
            most = max(most, held)
        elif a.kind == "B":
            states.setdefault(seen, []).append(held)
            held, seen = held - 1, True
    return tuple((most - max(hs), prior) for prior, hs in sorted(states.items()))


@lru_cache(maxsize=1024)
def split_states(schedule: str, p: int, m: int, v: int, k: int) -> tuple[tuple[int, int], ...]:
    """Every (chunks with F done and B not, chunks with B done and W not) rank k passes through."""
    sched = _schedule(schedule, p, m, v)
    if not sched.split_bw:
        return ()
    held = pending = 0
    states = set()
    for a in sched.actions[k]:
        held += a.kind == "F"
        if a.kind == "B":
            held, pending = held - 1, pending + 1
        pending -= a.kind == "W"
        states.add((held, pending))
    return tuple(sorted(states))
