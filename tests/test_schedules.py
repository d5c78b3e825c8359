"""Schedules as data: validity, simulated bubble vs. the papers, memory, errors, CLI. No processes."""

import argparse
import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from shardwise.pipeline import cli
from shardwise.rules.schedules import Action, Schedule, StageLayout, build_schedule, stage_of
from shardwise.rules.schedule_check import (
    DeadlockError,
    ScheduleError,
    analytic_bubble,
    find_problems,
    measured_bubble,
    simulate,
    validate,
)

GRID = {
    "gpipe": [(p, m, 1) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 5, 8, 16)],
    "1f1b": [(p, m, 1) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 5, 8, 16)],
    "zb": [(p, m, 1) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 5, 8, 16)],
    "interleaved": [(p, k * p, v) for p in (2, 3, 4) for k in (1, 2, 3) for v in (2, 3, 4)],
    "dualpipev": [(p, m, 2) for p in (1, 2, 3, 4, 6) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 3)],
}
CASES = [(name, *pmv) for name, grid in GRID.items() for pmv in grid]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_schedule_is_valid_and_deadlock_free(name, p, m, v):
    s = build_schedule(name, p, m, v)
    assert find_problems(s) == []
    n_kinds = 3 if s.split_bw else 2
    assert sum(len(ops) for ops in s.actions) == n_kinds * p * v * m
    r = simulate(s, cost_f=1.0, cost_b=1.3, cost_w=0.7, comm=0.1)
    assert r.makespan > 0 and 0.0 <= r.bubble_fraction < 1.0
    assert [len(ops) for ops in r.timeline] == [len(ops) for ops in s.actions]


# The 1F1B/GPipe formula holds for any F:B ratio as long as every microbatch costs the same
# (and comm = 0); Megatron's interleaved formula also holds for any ratio here, with m a
# multiple of p. Both are checked for F == B and for B = 2F (fused B+W costs cost_b + cost_w).
@pytest.mark.parametrize("costs", [(1.0, 1.0, 0.0), (1.0, 1.0, 1.0), (1.0, 2.5, 0.5)])
@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[0] in ("gpipe", "1f1b", "interleaved")])
def test_simulated_bubble_matches_analytic(name, p, m, v, costs):
    r = simulate(build_schedule(name, p, m, v), *costs)
    assert r.bubble_fraction == pytest.approx(analytic_bubble(name, p, m, v), abs=1e-9)


def test_analytic_formulas():
    assert analytic_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert analytic_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert analytic_bubble("zb", 4, 8) is None and analytic_bubble("dualpipev", 4, 8, 2) is None


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8), (8, 16), (8, 9)])
def test_zero_bubble_beats_1f1b_and_matches_zb_h1(p, m):
    f, b, w = 1.0, 1.0, 1.0
    zb = simulate(build_schedule("zb", p, m), f, b, w)
    ofob = simulate(build_schedule("1f1b", p, m), f, b, w)  # fused backward costs b + w = 2
    assert zb.bubble_fraction < ofob.bubble_fraction
    # ZB-H1 (Qi et al. 2024, table 1): (p-1)(F+B-W) idle per rank vs 1F1B's (p-1)(F+B+W), m >= p.
    idle = (p - 1) * (f + b - w)
    assert zb.bubble_fraction == pytest.approx(idle / (m * (f + b + w) + idle), abs=1e-9)
    assert zb.makespan < ofob.makespan


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (3, 2), (4, 4), (4, 9), (8, 16)])
def test_peak_inflight(p, m):
    assert simulate(build_schedule("gpipe", p, m)).peak_inflight == [m] * p
    expected = [min(p - r, m) for r in range(p)]
    assert simulate(build_schedule("1f1b", p, m)).peak_inflight == expected
    assert simulate(build_schedule("zb", p, m), 1, 1, 1).peak_inflight == expected


def test_stage_layouts_map_both_ways():
    loop, vee = StageLayout("loop", 4, 3), StageLayout("v", 4, 2)
    assert loop.stage_of(1, 2) == 9 and stage_of("interleaved", 1, 2, 4, 3) == 9
    assert [vee.stage_of(r, 1) for r in range(4)] == [7, 6, 5, 4]
    assert stage_of("dualpipev", 0, 0, 4, 2) == 0 and stage_of("dualpipev", 0, 1, 4, 2) == 7
    for layout in (loop, vee):
        stages = {layout.stage_of(r, c) for r in range(layout.p) for c in range(layout.v)}
        assert stages == set(range(layout.num_stages))
        for st in range(layout.num_stages):
            assert layout.stage_of(*layout.owner(st)) == st
    assert vee.next_rank(3) == 3 and vee.prev_rank(4) == 3 and vee.next_rank(7) is None
    assert loop.next_rank(3) == 0 and loop.prev_rank(0) is None
    assert Action("B", 2, 1).stage(vee, 0) == 7


def test_hand_made_deadlock_is_reported():
    # Rank 1 wants F1 first, but rank 0 only sends F1 after B0, which rank 1 sends after F1.
    acts = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
    ]
    s = Schedule("custom", 2, 2, 1, False, acts, StageLayout("loop", 2, 1))
    validate(s)  # well-formed, just stuck
    with pytest.raises(DeadlockError) as info:
        simulate(s)
    assert set(info.value.blocked) == {0, 1}
    assert "rank 0 blocked on B0" in str(info.value) and "rank 1 blocked on F1" in str(info.value)


def test_validate_reports_missing_duplicate_and_order():
    s = build_schedule("1f1b", 2, 3)
    missing = [ops[:] for ops in s.actions]
    missing[1].remove(Action("B", 2))
    dup = [ops[:] for ops in s.actions]
    dup[0].append(Action("F", 0))
    swapped = [ops[:] for ops in s.actions]
    swapped[1] = [Action("B", 0)] + [a for a in swapped[1] if a != Action("B", 0)]
    unsplit_w = [ops + [Action("W", 0)] for ops in s.actions]

    def problems(acts):
        return "\n".join(find_problems(Schedule("1f1b", 2, 3, 1, False, acts, s.layout)))

    assert "B of microbatch 2 at stage 1 (rank 1, chunk 0) missing" in problems(missing)
    assert "F of microbatch 0 at stage 0 (rank 0, chunk 0) appears 2 times" in problems(dup)
    assert "runs before F0" in problems(swapped)
    assert "kind must be one of" in problems(unsplit_w)
    with pytest.raises(ScheduleError, match="missing"):
        simulate(Schedule("1f1b", 2, 3, 1, False, missing, s.layout))


@pytest.mark.parametrize(
    "name,p,m,v,message",
    [
        ("1f1b", 0, 4, 1, "p (pipeline ranks) must be an integer >= 1, got 0"),
        ("gpipe", 2, 0, 1, "m (microbatches) must be an integer >= 1, got 0"),
        ("zb", 2, 4, 2, "use 'interleaved' for v>1"),
        ("interleaved", 4, 6, 2, "m=6 microbatches must be a multiple of p=4 (v=2)"),
        ("interleaved", 4, 2, 2, "try m=4"),
        ("interleaved", 4, 8, 1, "needs p >= 2 and v >= 2, got p=4, v=1"),
        ("interleaved", 1, 4, 2, "needs p >= 2 and v >= 2, got p=1, v=2"),
        ("dualpipev", 4, 7, 2, "m >= 2p = 8), got m=7, p=4"),
        ("dualpipev", 4, 8, 3, "exactly 2 chunks per rank"),
        ("pipedream", 4, 8, 1, "unknown schedule 'pipedream'"),
    ],
)
def test_invalid_parameters_raise_helpful_errors(name, p, m, v, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_schedule(name, p, m, v)


def test_dualpipev_v_defaults_to_two():
    assert build_schedule("dualpipev", 2, 4).v == 2


def _torch_order(fn, fake, p, layout, split):
    """Our Action lists from a torch schedule's private per-rank generator."""
    order = []
    for r in range(p):
        ops = []
        for a in fn(fake, r):
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                chunk = layout.owner(sub.stage_index)[1]
                kind = {"F": "F", "I": "B", "B": "B", "W": "W"}[sub.computation_type.value]
                ops.append(Action(kind, sub.microbatch_index, chunk))
                if sub.computation_type.value == "B" and split:
                    ops.append(Action("W", sub.microbatch_index, chunk))
        order.append(ops)
    return order


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (3, 7), (4, 8), (4, 13)])
def test_dualpipev_matches_torch_action_order(p, m):
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    fn = getattr(getattr(sched, "ScheduleDualPipeV", None), "_calculate_single_rank_operations", None)
    if fn is None:
        pytest.skip("this torch has no ScheduleDualPipeV generator")
    ours = build_schedule("dualpipev", p, m)
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    assert _torch_order(fn, fake, p, ours.layout, True) == ours.actions


@pytest.mark.parametrize("name,p,m,v", [("zb", 2, 4, 1), ("zb", 4, 8, 1), ("interleaved", 2, 4, 2),
                                        ("interleaved", 4, 8, 2), ("interleaved", 3, 9, 3)])
def test_zb_and_interleaved_match_torch_action_order(name, p, m, v):
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = sched.ScheduleInterleavedZeroBubble if name == "zb" else sched.ScheduleInterleaved1F1B
    fn = getattr(cls, "_calculate_single_rank_operations", None)
    if fn is None:
        pytest.skip("this torch has no per-rank generator")
    rounds = max(1, m // p)
    fake = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m,
                           number_of_rounds=rounds, microbatches_per_round=m // rounds)
    ours = build_schedule(name, p, m, v)
    assert _torch_order(fn, fake, p, ours.layout, ours.split_bw) == ours.actions


def test_measured_bubble():
    events = [[{"kind": "F", "microbatch": 0, "chunk": 0, "start": 10.0, "end": 11.0}],
              [{"kind": "F", "microbatch": 0, "chunk": 0, "start": 11.0, "end": 12.0}]]
    assert measured_bubble(events) == pytest.approx(0.5)
    r = simulate(build_schedule("1f1b", 4, 8))
    assert measured_bubble(r.events()) == pytest.approx(r.bubble_fraction)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="shardwise")
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["schedule", *argv])


def test_cli_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "zb.png"
    assert cli.run(_parse(["--schedule", "zb", "--pp", "4", "--microbatches", "8", "--out", str(out)])) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "analytic n/a" in text and "simulated 0.1111" in text and "4 3 2 1" in text


def test_cli_from_run_dir(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    r = simulate(build_schedule("interleaved", 2, 4, 2))
    cli.write_timeline(tmp_path / "timeline.json", "interleaved", 2, 4, 2, r.events())
    assert json.loads((tmp_path / "timeline.json").read_text())["vp"] == 2
    assert cli.run(_parse(["--from", str(tmp_path)])) == 0
    text = capsys.readouterr().out
    assert f"measured {r.bubble_fraction:.4f}" in text and "analytic 0.1111" in text
    assert (tmp_path / "timeline.png").exists()


@pytest.mark.parametrize("argv", [
    ["--schedule", "interleaved", "--pp", "4", "--microbatches", "6", "--vp", "2"],
    ["--schedule", "1f1b", "--pp", "0", "--microbatches", "4"],
    ["--schedule", "dualpipev", "--pp", "4", "--microbatches", "5"],
    ["--pp", "4"],
    ["--from", "/nonexistent/run"],
])
def test_cli_bad_input_returns_2(argv, capsys):
    assert cli.run(_parse(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise schedule: error: ")


def test_draw_without_matplotlib(monkeypatch, tmp_path):
    from shardwise.pipeline.draw import draw_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    events = [[{"kind": "F", "microbatch": 0, "chunk": 0, "start": 0.0, "end": 1.0}]]
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        draw_timeline(events, tmp_path / "x.png", "t")


def test_action_clock_resolves_device_events_once():
    """The CUDA path of the timeline clock, with fake events: no sync until read, times = host0 + GPU elapsed."""
    from shardwise.pipeline.timing import ActionClock

    class FakeEvent:
        gpu_ms, syncs = 0.0, []

        def record(self):
            FakeEvent.gpu_ms += 2.5
            self.ms = FakeEvent.gpu_ms

        def elapsed_time(self, other):
            return other.ms - self.ms

        def synchronize(self):
            FakeEvent.syncs.append(self.ms)

    clock = ActionClock(torch.device("cpu"), event_factory=FakeEvent)
    for mb in range(2):
        t0 = clock.start()
        clock.stop({"kind": "F", "microbatch": mb, "chunk": 0}, t0)
    assert FakeEvent.syncs == []
    ev = clock.events()
    assert FakeEvent.syncs == [12.5]  # one sync, on the last event
    assert [e["microbatch"] for e in ev] == [0, 1]
    assert [round(e["start"] - clock.host0, 6) for e in ev] == [0.0025, 0.0075]
    assert [round(e["end"] - e["start"], 6) for e in ev] == [0.0025, 0.0025]
    host = ActionClock(torch.device("cpu"))
    t0 = host.start()
    host.stop({"kind": "B", "microbatch": 0, "chunk": 0}, t0)
    (e,) = host.events()
    assert e["kind"] == "B" and e["start"] <= e["end"]
