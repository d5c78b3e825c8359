"""How long `shardwise plan` takes on the command issue #6 names ("prints a ranked table in well under a
second"): llama3-70b on 256 H100s, seq 4096, global batch 1024.

  * plan_cpu — `shardwise.cli.main(argv)` in this process, CPU time (this process's threads) of one call;
    the first call includes the planner's own lazy imports, later ones only the search and the table;
  * command_cpu / command_wall — `python -m shardwise.cli plan ...` as a user runs it: interpreter start,
    imports (the plan path imports no torch) and the search, CPU time of the reaped child and wall time.

CPU time is what a busy shared machine disturbs least; wall time is what the user waits. Each figure is a
median over --reps repetitions; `ratios` divide each CPU median by the 1 s budget (target: well under 1).

    python benchmarks/plan_speed.py --reps 5
Last stdout line: one JSON object {"medians_s": ..., "ratios": ..., "config": ...}.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from shardwise.cli import main  # noqa: E402

ARGV = ["plan", "--model", "llama3-70b", "--gpus", "256", "--gpus-per-node", "8", "--gpu", "h100-80gb",
        "--seq-len", "4096", "--global-batch", "1024"]
BUDGET_S = 1.0


def plan_in_process() -> float:
    out = io.StringIO()
    t0 = time.process_time()
    with contextlib.redirect_stdout(out):
        rc = main(ARGV)
    cpu = time.process_time() - t0
    assert rc == 0 and "MFU" in out.getvalue(), out.getvalue()[-2000:]
    return cpu


def plan_command() -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", *ARGV], capture_output=True, text=True, env=env,
                       timeout=300)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0 and "MFU" in r.stdout, r.stderr[-2000:]
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main_bench() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="one repetition of each (the test suite's run)")
    args = ap.parse_args()
    reps = 1 if args.smoke else args.reps
    first = plan_in_process()
    warm = [plan_in_process() for _ in range(reps)]
    command = [plan_command() for _ in range(reps)]
    medians = {"plan_cpu_first": first, "plan_cpu": statistics.median(warm),
               "command_cpu": statistics.median(c for c, _ in command),
               "command_wall": statistics.median(w for _, w in command)}
    ratios = {f"{k}_vs_budget": round(v / BUDGET_S, 3) for k, v in medians.items() if "cpu" in k}
    print(json.dumps({"medians_s": {k: round(v, 4) for k, v in medians.items()}, "ratios": ratios,
                      "config": {"argv": ARGV, "reps": reps, "budget_s": BUDGET_S}}))


if __name__ == "__main__":
    main_bench()
