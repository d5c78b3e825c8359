"""Faults never hang: a crashed or hung rank brings the job down in bounded time, naming the rank."""
import json
import subprocess
import sys
import time


def shardwise(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_crashed_rank_is_named(tmp_path):
    t0 = time.monotonic()
    r = shardwise("train", "--steps", "6", "--no-progress", "--out", str(tmp_path), "--fault-inject", "1:3:crash")
    assert r.returncode != 0
    assert "rank 1 died with exit code 13" in r.stderr
    assert "on axis 'tp'" in r.stderr or "on axis 'dp_cp'" in r.stderr  # peers name the axis and op they were in
    assert time.monotonic() - t0 < 60


def test_hung_rank_exits_within_timeout(tmp_path):
    timeout = 4
    t0 = time.monotonic()
    r = shardwise("train", "--steps", "6", "--no-progress", "--out", str(tmp_path), "--fault-inject", "2:2:hang",
                  "--collective-timeout", str(timeout))
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "rank 2 hung" in r.stderr and "Timed out" in r.stderr
    assert elapsed < timeout + 30, elapsed  # start-up + timeout + the launcher's grace period


def test_nan_step_skipped_or_aborted(tmp_path):
    r = shardwise("train", "--steps", "4", "--no-progress", "--out", str(tmp_path / "skip"), "--fault-inject",
                  "3:2:nan")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [row.get("skipped", False) for row in rows] == [False, True, False, False]
    r = shardwise("train", "--steps", "4", "--no-progress", "--out", str(tmp_path / "abort"), "--fault-inject",
                  "3:2:nan", "--bad-step", "abort")
    assert r.returncode != 0 and "non-finite" in r.stderr and "--bad-step abort" in r.stderr
