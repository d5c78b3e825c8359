"""The fewest microbatches that show every moment of one rank's step, and how the rest of the step scales.

A rank's action list (`rules.schedules`; without a pipeline F0 B0 F1 B1 …) is a warm-up, a steady state
that repeats one period — the same actions with the microbatch indices moved on by q (1, or p for
interleaved groups) — and a cool-down. A steady period leaves the rank holding what it held before it (one
microbatch's activations in, one out), so its memory moments repeat; its communication repeats too.

`shorten` finds, from the schedule data alone, the smallest count m (≡ M mod q, valid for the schedule) whose
action list, with one of its steady periods repeated (M − m)/q more times, *is* the action list of the full
count M — checked action by action, not assumed — and whose repeated period touches neither the first nor
the last microbatch (the backward passes that open and close gradient accumulation, and so the reducer's
first and last rounds). Running m microbatches then shows every distinct moment of the M-microbatch step,
and the full step's traffic is the short step's plus (M − m)/q times the traffic of that period.

A schedule with no such period (GPipe: all forwards are its warm-up, so its peak holds every microbatch) is
run in full.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from ..comm.ledger import Ledger
from ..rules.p2p_program import build_programs
from ..rules.schedules import Action, build_schedule


@dataclass(frozen=True)
class Shortening:
    """Run `run` of the step's `full` microbatches; actions [start, stop) of the shortened list are the period
    the full list repeats `copies` more times."""

    full: int
    run: int
    start: int = 0
    stop: int = 0
    copies: int = 0

    @property
    def scaled(self) -> int:
        """Microbatches not run, whose per-microbatch traffic is counted from the repeated period."""
        return self.full - self.run


def period_microbatches(name: str, p: int) -> int:
    """q: how far the microbatch indices move from one steady period to the next."""
    return p if p > 1 and name == "interleaved" else 1


def fewest_microbatches(name: str, p: int) -> int:
    """The smallest count the schedule accepts (`rules.schedules`)."""
    if p == 1:
        return 1
    return {"interleaved": p, "dualpipev": 2 * p}.get(name, 1)


Step = tuple
"""One position of a rank's step: (the p2p batch posted before the action, what it waits for, the action);
the last position holds the batch posted after the last action, and no action."""


def rank_steps(name: str, p: int, v: int, m: int, rank: int) -> list[Step]:
    """Rank `rank`'s positions for m microbatches: each action with the p2p the executor posts before it
    (`rules.p2p_program`, whose receives run ahead of the actions); without a pipeline (p = 1) the
    trainer's F0 B0 F1 B1 …"""
    if p == 1:
        return [((), None, Action(kind, i)) for i in range(m) for kind in "FB"] + [((), None, None)]
    schedule = build_schedule(name, p, m, v)
    program = build_programs(schedule)[rank]
    actions = schedule.actions[rank] + [None]
    return [(tuple(op for batch in b.batches for op in batch), b.wait, a) for b, a in zip(program, actions)]


def _key(key: tuple | None, d: int) -> tuple | None:
    return None if key is None else (key[0], key[1] + d, *key[2:])


def _shift(steps: list[Step], d: int) -> list[Step]:
    return [(tuple(op._replace(key=_key(op.key, d)) for op in ops), _key(wait, d),
             a and a._replace(microbatch=a.microbatch + d)) for ops, wait, a in steps]


def expand(steps: list[Step], start: int, stop: int, copies: int, q: int) -> list[Step]:
    """`steps` with its period [start, stop) repeated `copies` more times, each copy and everything after it
    moved on by q microbatches."""
    period = steps[start:stop]
    out = steps[:stop]
    for k in range(1, copies + 1):
        out += _shift(period, k * q)
    return out + _shift(steps[stop:], copies * q)


def _period(short: list[Step], longer: list[Step], q: int, m: int) -> tuple[int, int] | None:
    """[start, stop) of a period of `short` (m microbatches) whose single repetition gives `longer` (m + q) and
    which runs no backward (B or W) of microbatch 0 or m − 1; the latest such period (closest to the cool-down)."""
    n = len(longer) - len(short)
    if n <= 0:
        return None
    for stop in range(len(short), n - 1, -1):
        start = stop - n
        if any(a is None or a.kind != "F" and a.microbatch in (0, m - 1) for _, _, a in short[start:stop]):
            continue
        if expand(short, start, stop, 1, q) == longer:
            return start, stop
    return None


def shorten(name: str, p: int, v: int, full: int, rank: int) -> Shortening:
    """The shortened run of pipeline rank `rank` (p = 1: no pipeline) for a step of `full` microbatches."""
    q = period_microbatches(name, p)
    target = rank_steps(name, p, v, full, rank)
    m = fewest_microbatches(name, p)
    m += (full - m) % q
    while m + q <= full:
        short = rank_steps(name, p, v, m, rank)
        found = _period(short, rank_steps(name, p, v, m + q, rank), q, m)
        if found is not None:
            copies = (full - m) // q
            if expand(short, *found, copies, q) == target:
                return Shortening(full, m, *found, copies)
        m += q
    return Shortening(full, full)


class ScaledLedger(Ledger):
    """The comm ledger of a shortened step: an op recorded while the rank is inside the repeated period
    (`position()`, the index of the action under way) counts 1 + `copies` times, so each step's entry is the
    full step's — count, bytes and wire bytes per (axis, op). Ops outside the period (warm-up, cool-down,
    and every per-step op: gradient reduction, grad norm, optimizer, metrics) count once, as they happen."""

    def __init__(self):
        super().__init__()
        self.shortening = Shortening(1, 1)
        self.position: Callable[[], int] = lambda: -1
        self.period: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0])

    def record(self, axis: str, op: str, nbytes: int, wire_bytes: float) -> None:
        super().record(axis, op, nbytes, wire_bytes)
        s = self.shortening
        if self.enabled and s.copies and s.start <= self.position() < s.stop:
            entry = self.period[(axis, op)]
            entry[0] += 1
            entry[1] += nbytes
            entry[2] += wire_bytes

    def end_step(self, step: int) -> dict:
        for key, (count, nbytes, wire) in self.period.items():
            entry = self.current[key]
            entry[0] += self.shortening.copies * count
            entry[1] += self.shortening.copies * nbytes
            entry[2] += self.shortening.copies * wire
        self.period = defaultdict(lambda: [0, 0, 0])
        return super().end_step(step)
