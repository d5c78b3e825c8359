"""`shardwise plan … --trace K`: the best K rows simulated on fake tensors, their traced peaks in the JSON
rows and the table, equal to what `shardwise simulate` reports for each row's own command."""
from __future__ import annotations

import json
import shlex

import pytest

from shardwise.cli import main
from shardwise.commands import plan_trace as trace

PLAN = ["plan", "--model", "tiny", "--gpus", "2", "--seq-len", "64", "--micro-batch", "2", "--global-batch", "4",
        "--top", "3"]


def test_trace_two_rows_equals_simulate(capsys, shared_simulations):
    """`shared_simulations`: the `--trace 1` table re-traces row 1's ranks as `--trace 2` did (simulated once)."""
    assert main(PLAN + ["--trace", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and "traced" not in rows[2]
    for r in rows[:2]:
        t = r["traced"]
        assert set(t) >= {"peak_bytes", "planned_peak_bytes", "static_bytes", "activation_bytes"}
        assert t["passed"] and t["fits"] and r["fits"]
        flags = shlex.split(r["command"].split(" train ", 1)[1])
        rc = main(["simulate", *flags, "--json"])
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == 0
        for key in ("peak_bytes", "static_bytes", "activation_bytes"):
            assert t[key] == max(x[key]["measured"] for x in report["ranks"]), key
        assert t["planned_peak_bytes"] == max(x["peak_bytes"]["planned"] for x in report["ranks"])
        assert t["microbatches_run"] == max(x["microbatches_run"] for x in report["ranks"])
        assert abs(t["peak_bytes"] - t["planned_peak_bytes"]) <= 0.03 * t["planned_peak_bytes"]

    assert main(PLAN + ["--trace", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    head = next(line for line in table if line.lstrip().startswith("#"))
    assert "traced GB" in head
    col = head.index("traced GB") + len("traced GB")
    numbered = [line for line in table if line.lstrip()[:1].isdigit()]
    assert numbered[0][col - 9:col].strip() and not numbered[1][col - 9:col].strip()  # row 2 not traced: blank


def test_a_traced_peak_beyond_the_gpu_fails_the_row(capsys, monkeypatch):
    """A row whose traced peak exceeds the usable memory loses its 'fits', and the table says why."""
    monkeypatch.setattr(trace, "trace_row", lambda cfg: {"peak_bytes": 500e9, "planned_peak_bytes": 1e6,
                                                           "static_bytes": 1e6, "activation_bytes": 1e6,
                                                           "passed": False, "wall_s": 0.0})
    assert main(PLAN + ["--trace", "5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(not r["fits"] and not r["traced"]["fits"] for r in rows)  # K > rows: every row traced
    assert main(PLAN + ["--trace", "1"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT: traced peak 500.0 GB > 72.0 GB usable" in out


@pytest.mark.parametrize("argv, says", [
    (["--trace", "-1"], "--trace -1 must be >= 0"),
    (["--trace", "1", "--explain", "dp=2"], "--trace simulates ranked rows"),
])
def test_bad_trace_exits_2_with_one_line(capsys, argv, says):
    assert main(PLAN + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
