"""`simulate.shorten`: the shortened step derived from each schedule's data, and the ledger that scales it.

Pure logic, no processes: that the shortened action list (with its p2p program), its period repeated, is the
full one, for every schedule, rank and count; the live-memory and ledger equality on fake tensors is in
tests/test_simulate.py (`test_a_shortened_step_equals_the_full_step`)."""
from __future__ import annotations

import pytest

from shardwise.rules.schedules import build_schedule
from shardwise.simulate.shorten import (ScaledLedger, Shortening, expand, period_microbatches, rank_steps,
                                        shorten)

LAYOUTS = [("1f1b", 1, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("zb", 3, 1), ("zb", 4, 1), ("interleaved", 2, 2),
           ("interleaved", 4, 2), ("interleaved", 3, 2), ("dualpipev", 2, 2), ("dualpipev", 3, 2)]


def _counts(name: str, p: int) -> list[int]:
    q = period_microbatches(name, p)
    return [m for m in range(q, 6 * q + 1, q) if name != "dualpipev" or m >= 2 * p]


@pytest.mark.parametrize("name, p, v", LAYOUTS, ids=[f"{n}-p{p}-v{v}" for n, p, v in LAYOUTS])
def test_the_shortened_list_repeated_is_the_full_list(name, p, v):
    q = period_microbatches(name, p)
    for full in _counts(name, p):
        for rank in range(p):
            cut = shorten(name, p, v, full, rank)
            assert cut.run + cut.scaled == full and cut.scaled == cut.copies * q
            if not cut.scaled:
                continue
            short = rank_steps(name, p, v, cut.run, rank)
            assert expand(short, cut.start, cut.stop, cut.copies, q) == rank_steps(name, p, v, full, rank)
            period = [a for _, _, a in short[cut.start:cut.stop]]
            assert all(a is not None and (a.kind == "F" or a.microbatch not in (0, cut.run - 1)) for a in period)
            assert sum(a.kind == "F" for a in period) == q * (v if p > 1 else 1)  # one period: q microbatches
            # the count depends on the schedule, not on the full count
            assert shorten(name, p, v, full + q, rank).run == cut.run


def test_counts_for_128_microbatches_are_small():
    """128 microbatches: interleaved pp4 vp2 (the best rows of the 70B plan) runs 12 per step; 1f1b pp8 runs
    9 on its first rank, 3 on its last."""
    assert {shorten("interleaved", 4, 2, 128, r).run for r in range(4)} == {12}
    assert [shorten("1f1b", 8, 1, 128, r).run for r in (0, 7)] == [9, 3]
    assert shorten("1f1b", 1, 1, 128, 0).run == 3  # no pipeline: first, one middle and last microbatch


def test_gpipe_has_no_steady_state_and_runs_in_full():
    """Every forward is GPipe's warm-up (its peak holds all microbatches): nothing to repeat."""
    for full in (2, 5, 16):
        assert shorten("gpipe", 4, 1, full, 0) == Shortening(full, full)
    assert len(build_schedule("gpipe", 4, 16).actions[0]) == 32


def test_the_ledger_counts_the_period_once_per_copy():
    led = ScaledLedger()
    led.shortening = Shortening(full=7, run=3, start=2, stop=4, copies=4)
    where = iter([0, 2, 3, 4, 9, 9])
    led.position = lambda: next(where)
    for _ in range(5):
        led.record("pp", "send", 10, 10.0)
    led.record("dp", "all_reduce:grad_norm", 4, 4.0)  # after the actions: a per-step op
    entry = led.end_step(1)["axes"]
    assert entry["pp"]["send"] == {"count": 3 + 2 * 5, "bytes": 130, "wire_bytes": 130}
    assert entry["dp"]["all_reduce:grad_norm"]["count"] == 1
    led.position = lambda: 2
    led.record("pp", "send", 10, 10.0)
    assert led.end_step(2)["axes"]["pp"]["send"]["count"] == 5  # the period's count starts afresh each step
