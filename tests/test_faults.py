"""Faults never hang: a crashed or hung rank brings the job down in bounded time with exit status 1,
naming the culprit rank and, for each peer, the op it was in, on which axis and with which ranks.

The fault runs are independent jobs that mostly wait (for a timeout, or a torn-down peer), so a
module fixture starts them all at once, each the CLI's `main` in a child forked from this warm process (no
interpreter start per job), and each test reads its own job's result.
"""
import json
import re
import threading
import time

import pytest

from _dist import ForkedCli, warm_parent

TIMEOUT = 15  # --collective-timeout: each hang costs this plus the launcher's 5 s grace period; it also
# bounds start-up skew between ranks (their first collectives), which a loaded 2-core machine can stretch
BOUND_S = TIMEOUT + 5 + 40  # from the fault to the job's exit: the timeout, the launcher's grace, teardown
COMMON = ["train", "--no-progress", "--no-report", "--seq-len", "32"]
JOBS = {
    "crash": ["--steps", "3", "--fault-inject", "1:2:crash"],  # default layout tp2 × dp2
    "hang": ["--steps", "3", "--fault-inject", "2:2:hang"],
    "pp_p2p_hang": ["--pp", "2", "--microbatches", "2", "--steps", "3", "--fault-inject", "1:2:hang"],
    "ring_hang": ["--cp", "2", "--steps", "3", "--fault-inject", "1:2:hang"],
    "nan_skip": ["--steps", "4", "--fault-inject", "3:2:nan"],
    "nan_abort": ["--steps", "4", "--fault-inject", "3:2:nan", "--bad-step", "abort"],
}
# a peer's line: "rank R: OP on axis 'AXIS' (ranks [a, b]) failed: <the backend's first line>"
PEER = re.compile(r"rank (\d+): ([^;]+?) on axis '(\w+)' \(ranks \[([\d, ]+)\]\) failed: ([^;]*)")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults")
    warm_parent()
    procs = {name: ForkedCli([*COMMON, *args, "--out", str(out / name), "--collective-timeout", str(TIMEOUT)])
             for name, args in JOBS.items()}
    lines = {name: [] for name in procs}  # (arrival time, line) of each job's stderr
    readers = [threading.Thread(target=lambda p=p, ls=lines[n]: ls.extend((time.monotonic(), x) for x in p.stderr))
               for n, p in procs.items()]
    for t in readers:
        t.start()
    done = {}
    for name, p in procs.items():
        code = p.wait(timeout=300)
        end = time.monotonic()
        readers[list(procs).index(name)].join(timeout=30)
        fault = next((t for t, x in lines[name] if "fault injection" in x and ("crash" in x or "hang" in x)), None)
        done[name] = dict(code=code, err="".join(x for _, x in lines[name]), dir=out / name,
                          after_fault=None if fault is None else end - fault)
    return done


def _peers(err: str) -> list[tuple[int, str, str, list[int], str]]:
    return [(int(r), op, axis, [int(x) for x in ranks.split(",")], why) for r, op, axis, ranks, why in PEER.findall(err)]


def _tp2_dp2_group(rank: int, axis: str) -> list[int]:
    """Groups of the default layout (dp, tp) with tp innermost."""
    return {"tp": [rank - rank % 2, rank - rank % 2 + 1], "dp_cp": [rank % 2, rank % 2 + 2]}[axis]


def test_crashed_rank_is_named(jobs):
    r = jobs["crash"]
    assert r["code"] == 1, r["err"]
    assert "rank 1 died with exit code 13" in r["err"]
    peers = _peers(r["err"])
    assert {p[0] for p in peers} == {0, 2, 3}, r["err"]  # every survivor says what it was doing
    for rank, op, axis, ranks, _ in peers:
        assert op == "all_reduce" and ranks == _tp2_dp2_group(rank, axis), r["err"]
    assert any(1 in ranks for _, _, _, ranks, _ in peers), r["err"]  # someone was waiting on the dead rank
    assert r["after_fault"] < BOUND_S - TIMEOUT, r["after_fault"]  # no timeout to wait for


def test_hung_rank_exits_within_timeout(jobs):
    r = jobs["hang"]
    assert r["code"] == 1, r["err"]
    assert "rank 2 hung: alive but reported nothing" in r["err"]
    peers = _peers(r["err"])
    assert {p[0] for p in peers} == {0, 1, 3}, r["err"]
    for rank, op, axis, ranks, why in peers:  # a peer not waiting on rank 2 may see a torn-down peer instead
        assert op == "all_reduce" and ranks == _tp2_dp2_group(rank, axis), r["err"]
    assert any(2 in ranks and "Timed out" in why for _, _, _, ranks, why in peers), r["err"]
    assert r["after_fault"] < BOUND_S, r["after_fault"]


def test_hang_in_pipeline_p2p_names_the_receive(jobs):
    """Stage 1 hangs: stage 0 is stuck in the p2p batch that receives its gradient, and times out naming it."""
    rank, op, axis, ranks = _one_timed_out_peer(jobs["pp_p2p_hang"])
    assert (rank, axis, ranks) == (0, "pp", [0, 1])
    assert re.fullmatch(r"recv of \w+ for microbatch \d+, stage \d+", op), op


def test_hang_in_ring_attention_names_the_ring(jobs):
    """cp rank 1 hangs: rank 0 is stuck passing K/V around the ring, and times out naming it."""
    assert _one_timed_out_peer(jobs["ring_hang"]) == (0, "ring attention K/V p2p", "cp", [0, 1])


def _one_timed_out_peer(r) -> tuple:
    """Exit 1, rank 1 named as hung within the bound, and exactly one peer line, a timeout: (rank, op, axis, ranks)."""
    assert r["code"] == 1, r["err"]
    assert "rank 1 hung" in r["err"]
    assert r["after_fault"] < BOUND_S, r["after_fault"]
    peers = _peers(r["err"])
    assert len(peers) == 1, r["err"]
    rank, op, axis, ranks, why = peers[0]
    assert "Timed out" in why, r["err"]
    return rank, op, axis, ranks


def test_nan_step_skipped_or_aborted(jobs):
    r = jobs["nan_skip"]
    assert r["code"] == 0, r["err"]
    rows = [json.loads(x) for x in (r["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [row.get("skipped", False) for row in rows] == [False, True, False, False]
    r = jobs["nan_abort"]
    assert r["code"] == 1, r["err"]
    assert "non-finite" in r["err"] and "--bad-step abort" in r["err"]
