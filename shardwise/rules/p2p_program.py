"""Every pipeline rank's point-to-point program, derived from the schedule as data.

NCCL runs the p2p between two ranks in posting order on one stream, and a batch of sends and
receives completes only as a whole. A receive posted before the peer's matching send is posted
therefore blocks every later op on that pair — so the order of posting, not only the schedule,
decides whether a pipeline step finishes. This module fixes that order once, for all ranks:

1. Play the schedule in the simulator (unit costs) to get one global order of actions that
   respects every dependency: by end time (then rank). Each message's place in it is the place
   of the action producing it.
2. Every rank posts its ops with a peer in that global order of messages, so both sides of a pair
   agree on the order of everything between them. A send is posted at the boundary right after
   the action producing it; a receive at the boundary before the receiver's first action that
   ends after the producer in the global order — the action running while the message is made.
   Ordering by start time instead posts that receive one action later, after the message exists
   whenever the receiver is the slower rank (the last stage, with the LM head and loss, always
   is): gloo then sends the payload only after a round trip through the busy sender, and NCCL's
   sender stalls on its stream. By end time, with the last rank 15-30% slower, 1F1B and
   interleaved at p=2 post no receive late (17 of 48 were late in interleaved's step before).
3. At each boundary a rank posts one batch (sends and receives with every peer fused, in the
   agreed order per peer) and then waits only for the batch holding the input of its next action.

`p2p_check.check_programs` replays these programs under NCCL's rules; the executor runs exactly
what `build_programs` returns, so what the checker proves is what runs.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import NamedTuple

from .schedules import Schedule
from .schedule_check import simulate


class Op(NamedTuple):
    """One p2p op with a peer pp rank: ``key`` names the message (kind, microbatch, receiving stage)."""

    kind: str  # "send" | "recv"
    peer: int
    key: tuple


@dataclass
class Boundary:
    """What a rank does before its next action: post ``batches`` (one, for all peers), then wait for ``wait``."""

    batches: list[tuple[Op, ...]] = field(default_factory=list)
    wait: tuple | None = None  # key of the message the next action takes, if it comes from another rank


def message_in(schedule: Schedule, rank: int, a) -> tuple[int, tuple] | None:
    """(src rank, key) of the message action `a` on `rank` waits for: F's activation, B's gradient."""
    lay, stage = schedule.layout, schedule.layout.stage_of(rank, a.chunk)
    if a.kind == "F" and stage != 0:
        return lay.prev_rank(stage), ("act", a.microbatch, stage)
    if a.kind == "B" and stage != schedule.num_stages - 1:
        return lay.next_rank(stage), ("grad", a.microbatch, stage)
    return None


def message_out(schedule: Schedule, rank: int, a) -> tuple[int, tuple] | None:
    """(dst rank, key) of the message action `a` on `rank` produces: the mirror of `message_in`."""
    lay, stage = schedule.layout, schedule.layout.stage_of(rank, a.chunk)
    if a.kind == "F" and stage != schedule.num_stages - 1:
        return lay.next_rank(stage), ("act", a.microbatch, stage + 1)
    if a.kind == "B" and stage != 0:
        return lay.prev_rank(stage), ("grad", a.microbatch, stage - 1)
    return None


def messages(schedule: Schedule) -> tuple[list[list], list[list]]:
    """(ins, outs): `message_in` and `message_out` of every action, ins[r][i] for rank r's action i, in one pass."""
    lay, last = schedule.layout, schedule.num_stages - 1
    rank_of = [lay.owner(k)[0] for k in range(schedule.num_stages)]
    ins, outs = [], []
    for r, actions in enumerate(schedule.actions):
        stages = [lay.stage_of(r, c) for c in range(schedule.v)]
        rin, rout = [], []
        for a in actions:
            kind, mb, stage = a.kind, a.microbatch, stages[a.chunk]
            if kind == "F":
                rin.append((rank_of[stage - 1], ("act", mb, stage)) if stage != 0 else None)
                rout.append((rank_of[stage + 1], ("act", mb, stage + 1)) if stage != last else None)
            elif kind == "B":
                rin.append((rank_of[stage + 1], ("grad", mb, stage)) if stage != last else None)
                rout.append((rank_of[stage - 1], ("grad", mb, stage - 1)) if stage != 0 else None)
            else:
                rin.append(None)
                rout.append(None)
        ins.append(rin)
        outs.append(rout)
    return ins, outs


def build_programs(schedule: Schedule) -> list[list[Boundary]]:
    """programs[r][i]: what rank r posts and waits for before its action i; index len(actions) is the end."""
    plan = _Plan(schedule)
    return [plan.program(r) for r in range(schedule.p)]


def build_program(schedule: Schedule, rank: int) -> list[Boundary]:
    """`build_programs(schedule)[rank]` without building the other ranks' programs (what one executor needs)."""
    return _Plan(schedule).program(rank)


class _Plan:
    """The global order of a schedule's messages, computed once and shared by every rank's program.

    Linear in the number of actions: each action's messages are derived once, and a receive's boundary is
    a binary search in the receiver's end times (they rise strictly along a rank)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        timeline = simulate(schedule).timeline
        # Global order: (end time, rank); end times rise strictly along each rank (costs > 0) and a
        # consumer ends after its producer ends, so this order respects every dependency.
        # `simulate` runs each rank's actions in list order, so timeline[r][i] is actions[r][i].
        self.order = [[(t1, r) for _, _, t1 in ops] for r, ops in enumerate(timeline)]
        self.ins, self.outs = messages(schedule)
        self.producer: dict[tuple, tuple] = {}  # message key -> global order of the action producing it
        for r, outs in enumerate(self.outs):
            for i, out in enumerate(outs):
                if out is not None and out[0] != r:
                    self.producer[out[1]] = self.order[r][i]

    def program(self, r: int) -> list[Boundary]:
        actions, order, ins, outs = self.schedule.actions[r], self.order[r], self.ins[r], self.outs[r]
        n = len(actions)
        pending: list[list[tuple[tuple, Op]]] = [[] for _ in range(n + 1)]  # (sort key, op) per boundary
        for i in range(n):
            out = outs[i]
            if out is not None and out[0] != r:
                pending[i + 1].append((self.producer[out[1]], Op("send", out[0], out[1])))
            src = ins[i]
            if src is not None and src[0] != r:
                made = self.producer[src[1]]
                post = bisect_right(order, made)  # the first action ending after the producer
                if post > i:
                    raise AssertionError(f"rank {r}: {src[1]} is produced after it is needed")
                pending[post].append((made, Op("recv", src[0], src[1])))
        program = []
        for i in range(n + 1):
            by_peer: dict[int, list[tuple[tuple, Op]]] = {}
            for item in sorted(pending[i]):
                by_peer.setdefault(item[1].peer, []).append(item)
            # One batch for all peers: batched p2p on NCCL runs on the group's one stream, so a batch to
            # one peer posted before a batch to another would serialize them (deadlock at p >= 3).
            ops = tuple(op for peer in sorted(by_peer) for _, op in by_peer[peer])
            b = Boundary(batches=[ops] if ops else [])
            if i < n:
                src = ins[i]
                b.wait = src[1] if src is not None and src[0] != r else None
            program.append(b)
        return program
