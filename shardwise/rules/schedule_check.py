"""Check and time a schedule without processes.

``validate`` catches malformed action lists (missing, duplicate, out of order) before anything
runs; ``simulate`` plays the lists against each other with per-kind costs, which both proves a
schedule is deadlock-free and measures its bubble and activation memory.

Dependencies between actions (stage k of S, same microbatch):
  F(k)  needs F(k-1)                       activations from the previous stage
  B(k)  needs F(k) and B(k+1) (k < S-1)    the last stage starts backward from its own output
  W(k)  needs B(k)
Crossing ranks costs ``comm`` extra; each rank runs its own list strictly in order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .schedules import KINDS, Action, Schedule


class ScheduleError(ValueError):
    """The action lists are malformed (see ``find_problems``)."""


class DeadlockError(RuntimeError):
    """Every unfinished rank waits on an action that can never run; ``blocked`` maps rank -> action."""

    def __init__(self, message: str, blocked: dict[int, Action]):
        super().__init__(message)
        self.blocked = blocked


def find_problems(schedule: Schedule) -> list[str]:
    """Every way the schedule breaks the F/B/W bookkeeping, as readable strings (empty = valid)."""
    s = schedule
    problems: list[str] = []
    if len(s.actions) != s.p:
        return [f"expected {s.p} per-rank action lists, got {len(s.actions)}"]
    kinds = KINDS if s.split_bw else ("F", "B")
    seen: Counter = Counter()
    for r, ops in enumerate(s.actions):
        done: set[tuple[str, int, int]] = set()
        stages = [s.layout.stage_of(r, c) for c in range(s.v)]
        for i, a in enumerate(ops):
            where = f"rank {r} action #{i} {a!r}"
            if a.kind not in kinds:
                problems.append(f"{where}: kind must be one of {kinds} (split_bw={s.split_bw})")
                continue
            if not (0 <= a.microbatch < s.m and 0 <= a.chunk < s.v):
                problems.append(f"{where}: microbatch/chunk outside m={s.m}, v={s.v}")
                continue
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.microbatch, a.chunk) not in done:
                problems.append(f"{where}: runs before {before}{a.microbatch} of chunk {a.chunk} here")
            done.add((a.kind, a.microbatch, a.chunk))
            seen[(a.kind, stages[a.chunk], a.microbatch)] += 1
    for stage in range(s.num_stages):
        for mb in range(s.m):
            for kind in kinds:
                n = seen[(kind, stage, mb)]
                if n != 1:
                    what = "missing" if n == 0 else f"appears {n} times"
                    rank, chunk = s.layout.owner(stage)
                    problems.append(
                        f"{kind} of microbatch {mb} at stage {stage} (rank {rank}, chunk {chunk}) {what}"
                    )
    return problems


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError listing the problems (the first 10) if the schedule is malformed."""
    problems = find_problems(schedule)
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ScheduleError(f"invalid {schedule.name} schedule:\n  " + "\n  ".join(problems[:10]) + more)


def peak_inflight(per_rank: list[list]) -> list[int]:
    """Per rank, the most microbatch-chunks with F done and B not yet done (activations held).

    Accepts Action lists or event dicts (taken in the given order).
    """
    peaks = []
    for ops in per_rank:
        live, peak = 0, 0
        for a in ops:
            kind = a["kind"] if isinstance(a, dict) else a.kind
            live += {"F": 1, "B": -1}.get(kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def measured_bubble(per_rank_events: list[list[dict]]) -> float:
    """1 - busy / (p * makespan) for recorded or simulated events; makespan = max end - min start."""
    events = [e for ops in per_rank_events for e in ops]
    if not events:
        raise ValueError("no events to measure")
    makespan = max(e["end"] for e in events) - min(e["start"] for e in events)
    busy = sum(e["end"] - e["start"] for e in events)
    return 1.0 - busy / (len(per_rank_events) * makespan) if makespan > 0 else 0.0


@dataclass
class SimResult:
    """Simulated timing: ``timeline[r]`` is rank r's (action, start, end) in execution order."""

    schedule: Schedule
    timeline: list[list[tuple[Action, float, float]]]
    makespan: float
    bubble_fraction: float
    peak_inflight: list[int]
    busy: list[float] = field(default_factory=list)

    def events(self) -> list[list[dict]]:
        """Per-rank event dicts, the format of timeline.json and ``draw_timeline``."""
        return [
            [{"kind": a.kind, "microbatch": a.microbatch, "chunk": a.chunk, "start": t0, "end": t1}
             for a, t0, t1 in ops]
            for ops in self.timeline
        ]


def _costs(split_bw: bool, cost_f: float, cost_b: float, cost_w: float, costs: dict | None) -> dict:
    c = {"F": cost_f, "B": cost_b, "W": cost_w, **(costs or {})}
    if any(value < 0 for value in c.values()):
        raise ValueError(f"costs must be >= 0, got {c}")
    if not split_bw:  # a fused backward does the weight-gradient work too
        c["B"] = c["B"] + c["W"]
    return c


def simulate(
    schedule: Schedule,
    cost_f: float = 1.0,
    cost_b: float = 1.0,
    cost_w: float = 1.0,
    comm: float = 0.0,
    costs: dict | None = None,
    rank_costs: list[dict] | None = None,
) -> SimResult:
    """Event-simulate ``schedule``; raise ScheduleError if malformed, DeadlockError if stuck.

    Costs are per action (one microbatch through one chunk). The defaults F=B=W=1 model a
    backward that costs twice the forward; a fused B costs cost_b + cost_w. ``costs`` (a dict
    keyed by "F"/"B"/"W") overrides the scalars; ``rank_costs`` (one such dict per rank) overrides
    them per rank — e.g. measured means, where the last stage also runs the LM head and loss.
    """
    validate(schedule)
    s, layout = schedule, schedule.layout
    c = _costs(s.split_bw, cost_f, cost_b, cost_w, costs)
    per_rank = [_costs(s.split_bw, cost_f, cost_b, cost_w, {**(costs or {}), **rc}) for rc in rank_costs] \
        if rank_costs is not None else [c] * s.p
    last = s.num_stages - 1
    finished: dict[tuple[str, int, int], tuple[float, int]] = {}  # (kind, stage, mb) -> (end, rank)
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(s.p)]
    clock = [0.0] * s.p
    nxt = [0] * s.p

    def deps(a: Action, stage: int) -> list[tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", stage - 1, a.microbatch)] if stage > 0 else []
        if a.kind == "B":
            own = [("F", stage, a.microbatch)]
            return own + ([("B", stage + 1, a.microbatch)] if stage < last else [])
        return [("B", stage, a.microbatch)]

    stages = [[layout.stage_of(r, c) for c in range(s.v)] for r in range(s.p)]
    remaining = sum(len(ops) for ops in s.actions)
    while remaining:
        progressed = False
        for r, ops in enumerate(s.actions):
            n, i, tab, cost = len(ops), nxt[r], stages[r], per_rank[r]
            while i < n:
                a = ops[i]
                kind, mb = a.kind, a.microbatch
                stage = tab[a.chunk]
                # deps(a, stage), unrolled: this loop is the whole cost of building a long schedule's p2p program
                if kind == "F":
                    d1, d2 = (("F", stage - 1, mb) if stage > 0 else None), None
                elif kind == "B":
                    d1, d2 = ("F", stage, mb), (("B", stage + 1, mb) if stage < last else None)
                else:
                    d1, d2 = ("B", stage, mb), None
                start = clock[r]
                if d1 is not None:
                    f = finished.get(d1)
                    if f is None:
                        break
                    start = max(start, f[0] + (comm if f[1] != r else 0.0))
                if d2 is not None:
                    f = finished.get(d2)
                    if f is None:
                        break
                    start = max(start, f[0] + (comm if f[1] != r else 0.0))
                clock[r] = start + cost[kind]
                finished[(kind, stage, mb)] = (clock[r], r)
                timeline[r].append((a, start, clock[r]))
                i += 1
                remaining -= 1
                progressed = True
            nxt[r] = i
        if not progressed:
            raise _deadlock(s, nxt, finished, deps)

    makespan = max(clock)
    busy = [sum(t1 - t0 for _, t0, t1 in ops) for ops in timeline]
    bubble = 1.0 - sum(busy) / (s.p * makespan) if makespan > 0 else 0.0
    return SimResult(s, timeline, makespan, bubble, peak_inflight(s.actions), busy)


def _deadlock(s: Schedule, nxt: list[int], finished: dict, deps) -> DeadlockError:
    blocked: dict[int, Action] = {}
    lines = []
    for r, ops in enumerate(s.actions):
        if nxt[r] >= len(ops):
            continue
        a = ops[nxt[r]]
        blocked[r] = a
        stage = a.stage(s.layout, r)
        waits = [
            f"{kind}{mb} of stage {st} (rank {s.layout.owner(st)[0]})"
            for kind, st, mb in deps(a, stage)
            if (kind, st, mb) not in finished
        ]
        lines.append(f"rank {r} blocked on {a!r} (stage {stage}, #{nxt[r]}) waiting for {', '.join(waits)}")
    return DeadlockError(f"{s.name} schedule deadlocks: " + "; ".join(lines), blocked)


def analytic_bubble(name: str, p: int, m: int, v: int = 1) -> float | None:
    """Textbook bubble fraction (idle / total), or None where it depends on the cost split.

    gpipe, 1f1b: (p-1)/(m+p-1). interleaved: (p-1)/(v*m+p-1) (Narayanan et al. 2021), exact when
    F and B cost the same per chunk. zb and dualpipev: None; their bubbles depend on the W cost
    (ZB-H1 leaves (p-1)(F+B-W) idle per rank instead of 1F1B's (p-1)(F+B+W)).
    """
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name in ("zb", "dualpipev"):
        return None
    raise ValueError(f"unknown schedule {name!r}")
