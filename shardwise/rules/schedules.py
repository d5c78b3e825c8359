"""Pipeline schedules as data: one ordered list of actions per rank.

A schedule is computed, not executed, here. Keeping it as plain data lets us validate it,
simulate it and draw it without starting a single process; the executor only walks the lists.

Vocabulary (p ranks, m microbatches, v model chunks per rank, p*v stages):

* ``F``  forward of one microbatch through one chunk.
* ``B``  backward. In a split schedule (``split_bw``) it is the *input*-gradient backward only,
  the one the previous stage waits for; otherwise it is the full backward.
* ``W``  weight-gradient backward, only in split schedules. Nothing downstream waits for it,
  which is why zero-bubble schedules can move it into the bubbles.

Stage layouts (who owns which global stage):

* ``"loop"`` (Megatron interleaved): stage of (rank r, chunk c) = c*p + r, so each chunk
  sweeps through all ranks before the next chunk starts.
* ``"v"`` (DualPipeV, v=2): rank r owns stage r (chunk 0) and stage 2p-1-r (chunk 1), so the
  activations go down the ranks and come back up; the turn-around stays on the last rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("F", "B", "W")
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")


class Action(NamedTuple):
    """One unit of compute on one rank: ``kind`` of ``microbatch`` through local ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    def stage(self, layout: StageLayout, rank: int) -> int:
        """Global stage index of this action when run on ``rank``."""
        return layout.stage_of(rank, self.chunk)

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class StageLayout:
    """Maps (rank, chunk) <-> global stage, so an executor knows its neighbours' ranks."""

    style: str
    p: int
    v: int

    def __post_init__(self):
        if self.style not in ("loop", "v"):
            raise ValueError(f"unknown stage layout {self.style!r}; expected 'loop' or 'v'")
        if self.style == "v" and self.v != 2:
            raise ValueError(f"the V layout has exactly 2 chunks per rank, got v={self.v}")

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def stage_of(self, rank: int, chunk: int) -> int:
        if not (0 <= rank < self.p and 0 <= chunk < self.v):
            raise ValueError(f"(rank={rank}, chunk={chunk}) outside p={self.p}, v={self.v}")
        if self.style == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def owner(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) that holds global ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")
        if self.style == "v":
            return (stage, 0) if stage < self.p else (2 * self.p - 1 - stage, 1)
        return stage % self.p, stage // self.p

    def next_rank(self, stage: int) -> int | None:
        """Rank of the stage after ``stage`` (where F output goes); None for the last stage."""
        return None if stage == self.num_stages - 1 else self.owner(stage + 1)[0]

    def prev_rank(self, stage: int) -> int | None:
        """Rank of the stage before ``stage`` (where B output goes); None for stage 0."""
        return None if stage == 0 else self.owner(stage - 1)[0]


def layout_for(name: str, p: int, v: int) -> StageLayout:
    return StageLayout("v" if name == "dualpipev" else "loop", p, v)


def stage_of(name: str, rank: int, chunk: int, p: int, v: int) -> int:
    """Global stage of (rank, chunk) under schedule ``name``'s layout."""
    return layout_for(name, p, v).stage_of(rank, chunk)


@dataclass(frozen=True)
class Schedule:
    """A complete schedule: ``actions[r]`` is what rank r runs, strictly in order."""

    name: str
    p: int
    m: int
    v: int
    split_bw: bool
    actions: list[list[Action]]
    layout: StageLayout

    @property
    def num_stages(self) -> int:
        return self.p * self.v


def _check_common(name: str, p: int, m: int, v: int) -> None:
    for label, value in (("p (pipeline ranks)", p), ("m (microbatches)", m), ("v (chunks per rank)", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be an integer >= 1, got {value!r}")


def _check_single_chunk(name: str, p: int, m: int, v: int) -> None:
    _check_common(name, p, m, v)
    if v != 1:
        raise ValueError(f"{name}: runs one chunk per rank (v=1), got v={v}; use 'interleaved' for v>1")


def gpipe(p: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards in the same order (GPipe, Huang et al. 2019).

    Every rank holds all m activations at the peak: simple, and the memory reference point.
    Works for any m (m < p just leaves a larger bubble).
    """
    _check_single_chunk("gpipe", p, m, 1)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush, Narayanan et al. 2021): same bubble as GPipe, memory capped at p - r.

    Rank r runs (p - r - 1) warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards. Works for any m; with m < p warm-up is cut to m forwards.
    """
    _check_single_chunk("1f1b", p, m, 1)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [Action("F", i) for i in range(warmup)]          # warm-up
        for i in range(m - warmup):                           # steady: 1F1B
            ops += [Action("F", warmup + i), Action("B", i)]
        ops += [Action("B", i) for i in range(m - warmup, m)]  # cool-down
        order.append(ops)
    return order


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): bubble shrinks by a factor v.

    Microbatches go through each chunk in groups of p: rank r runs F for microbatches 0..p-1 on
    chunk 0, then the same group on chunk 1, ..., then the next group. Backward visits chunks
    in reverse. Like Megatron this requires m to be a multiple of p (so every group is full),
    p >= 2 and v >= 2. Warm-up on rank r is 2*(p - r - 1) + (v - 1)*p forwards, capped at m*v.
    (Megatron runs everything as warm-up when m == p; the cap gives the same bubble with fewer
    activations on the later ranks, as torch's ScheduleInterleaved1F1B does.)
    """
    _check_common("interleaved", p, m, v)
    if p < 2 or v < 2:
        raise ValueError(f"interleaved: needs p >= 2 and v >= 2, got p={p}, v={v} (use '1f1b' for v=1)")
    if m % p:
        raise ValueError(
            f"interleaved: m={m} microbatches must be a multiple of p={p} (v={v}): microbatches "
            f"run through each chunk in groups of p; try m={(m // p + 1) * p}"
        )
    total = m * v

    def action(kind: str, k: int) -> Action:
        group, pos = divmod(k, p * v)
        chunk = pos // p
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, group * p + pos % p, chunk)

    order = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        ops = [action("F", k) for k in range(warmup)]                 # warm-up
        for i in range(total - warmup):                               # steady: 1F1B
            ops += [action("F", warmup + i), action("B", i)]
        ops += [action("B", k) for k in range(total - warmup, total)]  # cool-down
        order.append(ops)
    return order


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with W split off.

    F and B keep exactly the 1F1B order, so peak in-flight activations stay at p - r. Only the
    W's move: nothing waits for them, so rank r holds back r of them (as torch's ZB1P does) and
    runs them at the end, where 1F1B would sit idle waiting for gradients. With m >= p and
    F = B = W this leaves (p-1)(F+B-W) idle per rank instead of 1F1B's (p-1)(F+B+W).
    Works for any m.
    """
    _check_single_chunk("zb", p, m, 1)
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops: list[Action] = []
        held: list[int] = []  # microbatches whose B is done and W not yet issued

        def backward(i: int) -> None:
            ops.append(Action("B", i))
            held.append(i)
            if len(held) > r:
                ops.append(Action("W", held.pop(0)))

        ops += [Action("F", i) for i in range(warmup)]  # warm-up
        for i in range(m - warmup):                     # steady: 1F1B(+W)
            ops.append(Action("F", warmup + i))
            backward(i)
        for i in range(m - warmup, m):                  # cool-down: B(+W)
            backward(i)
        ops += [Action("W", i) for i in held]           # drain the held W's
        order.append(ops)
    return order


def dualpipev(p: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3 "cut-in-half" DualPipe), in the action order of torch's ScheduleDualPipeV.

    Each rank holds two chunks laid out as a V (see module docstring). Phases per rank r:
    1. 2(p-r-1) forwards of chunk 0;  2. r+1 pairs F0,F1;  3. p-r-1 times B1,W,F1 (zero bubble);
    4. main phase: F0+B1 then F1+B0, pairs the executor may overlap (one's compute with the
       other's communication);  5. p-r-1 times B1 then F1+B0;  6. r+1 pairs B1,B0, the second
       half split as B-only;  7. p-r-1 times W then B0;  8. drain the held W's.
    A full backward is written as B immediately followed by its W; an overlapped pair as its two
    parts in order, F first. Requires m >= 2p (as torch: at least as many microbatches as stages).
    """
    _check_common("dualpipev", p, m, 2)
    if m < 2 * p:
        raise ValueError(
            f"dualpipev: needs at least as many microbatches as stages (m >= 2p = {2 * p}), got m={m}, p={p}"
        )
    order = []
    for r in range(p):
        ops: list[Action] = []
        nxt = {"F": [0, 0], "B": [0, 0]}  # next microbatch per (kind, chunk)
        held: list[tuple[int, int]] = []  # (chunk, microbatch) whose W is deferred

        def forward(chunk: int) -> None:
            ops.append(Action("F", nxt["F"][chunk], chunk))
            nxt["F"][chunk] += 1

        def full_backward(chunk: int) -> None:
            mb = nxt["B"][chunk]
            ops.extend((Action("B", mb, chunk), Action("W", mb, chunk)))
            nxt["B"][chunk] += 1

        def input_backward(chunk: int) -> None:
            held.append((chunk, nxt["B"][chunk]))
            ops.append(Action("B", nxt["B"][chunk], chunk))
            nxt["B"][chunk] += 1

        def held_weight() -> None:
            if held:
                chunk, mb = held.pop(0)
                ops.append(Action("W", mb, chunk))

        for _ in range(2 * (p - r - 1)):           # 1: F0
            forward(0)
        for _ in range(r + 1):                      # 2: F0 F1
            forward(0)
            forward(1)
        for _ in range(p - r - 1):                  # 3: B1 W F1
            input_backward(1)
            held_weight()
            forward(1)
        for _ in range(m - 2 * p + r + 1):          # 4: (F0+B1) (F1+B0)
            forward(0)
            full_backward(1)
            forward(1)
            full_backward(0)
        for _ in range(p - r - 1):                  # 5: B1 (F1+B0)
            full_backward(1)
            forward(1)
            full_backward(0)
        split = False
        for i in range(r + 1):                      # 6: B1 B0, second half split
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            (input_backward if split else full_backward)(1)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            (input_backward if split else full_backward)(0)
        for _ in range(p - r - 1):                  # 7: W B0
            held_weight()
            (input_backward if split else full_backward)(0)
        for _ in range(r + 1):                      # 8: W
            held_weight()
        order.append(ops)
    return order


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Pick a schedule by name (cf. Megatron's get_forward_backward_func).

    ``v`` is the number of chunks per rank; dualpipev always uses 2 (v=1 is taken to mean
    "default" there, anything else is an error).
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if name == "dualpipev":
        if v not in (1, 2):
            raise ValueError(f"dualpipev: uses exactly 2 chunks per rank (V layout), got v={v}")
        v = 2
    if name in ("gpipe", "1f1b", "zb"):
        _check_single_chunk(name, p, m, v)
    build = {
        "gpipe": lambda: gpipe(p, m),
        "1f1b": lambda: one_f_one_b(p, m),
        "zb": lambda: zero_bubble_h1(p, m),
        "interleaved": lambda: interleaved(p, m, v),
        "dualpipev": lambda: dualpipev(p, m),
    }[name]
    split = name in ("zb", "dualpipev")
    return Schedule(name, p, m, v, split, build(), layout_for(name, p, v))
