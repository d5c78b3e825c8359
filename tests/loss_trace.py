"""The stored loss trace: the per-step loss of three fixed `shardwise train` runs, kept in tests/data/loss_trace.json.

A change that must keep numerics bitwise (a refactor, a new layout of the code) is checked against it: on the
torch version and CPU that wrote the file every loss must be equal to the last bit; elsewhere the first
`CROSS_STEPS` losses within `RTOL` relative (other kernels, other vector widths: a rounding difference is
amplified by training — measured on an AVX2 and a second AVX512 machine, 1e-6 by step 13-17 and 1e-2 by step
50 — so only the steps before that growth can tell a changed computation from another CPU). The runs are the default layout (`shardwise train`),
tiny-moe over ep2 with the aux-loss-free bias, and a DeepSeek-V3-shaped model with one MTP module; each is one
`shardwise train` subprocess, with output flags that do not touch numerics.

    python -m tests.loss_trace --write          # regenerate every run (from the repository root)
    python -m tests.loss_trace --write moe_ep2  # one run
    python -m tests.loss_trace                  # compare against the stored trace, print the first difference
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "tests", "data", "loss_trace.json")
RTOL = 1e-5  # elsewhere: the first CROSS_STEPS losses within this (seen: under 1e-6 through step 12)
CROSS_STEPS = 8
BITWISE_KEYS = ("torch", "cpu", "cpu_capability", "machine")  # equal: every loss must be equal to the last bit
OUTPUT_FLAGS = ["--no-progress", "--no-report", "--no-checkpoint"]  # what a run writes, not what it computes

RUNS = {
    "default": ["--steps", "50"],
    "moe_ep2": ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--moe-aux-loss-coef", "0",
                "--moe-bias-update-rate", "0.01", "--steps", "50"],
    "deepseek_mtp": ["--model-config", "tests/data/deepseek_tiny_config.json", "--mtp-layers", "1",
                     "--moe-bias-update-rate", "0.01", "--seq-len", "64", "--steps", "20"],
}


def machine() -> dict:
    """What decides whether the losses can be bitwise equal: torch, the CPU and the kernels it dispatches to,
    and the embedded corpus (pydoc_data.topics, which changes with the Python version)."""
    import torch

    from shardwise.data.loader import default_corpus

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"torch": torch.__version__, "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "python": platform.python_version(),
            "corpus_sha256": hashlib.sha256(default_corpus().encode()).hexdigest()}


def command(name: str, out: str) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli", "train", *RUNS[name], *OUTPUT_FLAGS, "--out", out]


def run(name: str) -> list[float]:
    """The per-step losses of one run, in a subprocess started from the repository root."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix=f"loss-trace-{name}-") as tmp:
        out = os.path.join(tmp, "run")
        r = subprocess.run(command(name, out), cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"loss trace run {name!r} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]


def load() -> dict:
    with open(TRACE) as f:
        return json.load(f)


def first_difference(want: list[float], got: list[float], exact: bool) -> str | None:
    """None when `got` matches `want` (every step bitwise, or the first CROSS_STEPS within RTOL); else the
    first step that does not."""
    if len(want) != len(got):
        return f"{len(got)} steps, the trace has {len(want)}"
    for step, (a, b) in enumerate(zip(want, got if exact else got[:CROSS_STEPS]), start=1):
        if (a != b) if exact else abs(a - b) > RTOL * abs(a):
            return f"step {step}: loss {b!r}, the trace has {a!r} (relative {abs(a - b) / abs(a):.1e})"
    return None


def write(names: list[str]) -> None:
    trace = load() if os.path.exists(TRACE) else {}
    runs = trace.get("runs", {})
    for name in names:
        runs[name] = {"command": " ".join(["shardwise", "train", *RUNS[name]]), "loss": run(name)}
        print(f"{name}: {len(runs[name]['loss'])} steps, loss {runs[name]['loss'][0]:.4f} -> "
              f"{runs[name]['loss'][-1]:.4f}", file=sys.stderr)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    trace = {"about": __doc__.strip().splitlines()[0] + " Regenerate with `python -m tests.loss_trace --write` "
                      "(from the repository root); tests/test_loss_trace.py checks it.",
             "written_by": machine() | {"commit": commit, "date": datetime.date.today().isoformat()},
             "runs": {k: runs[k] for k in RUNS if k in runs}}
    with open(TRACE, "w") as f:
        json.dump(trace, f, indent=1)
        f.write("\n")


def bitwise_expected(trace: dict) -> bool:
    """Whether this machine is the one that wrote the trace, as far as the kernels are concerned."""
    here = machine()
    return all(here[k] == trace["written_by"].get(k) for k in BITWISE_KEYS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rerun and store the trace instead of comparing")
    ap.add_argument("runs", nargs="*", metavar="RUN", help=f"any of {', '.join(RUNS)} (default: all)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown:
        ap.error(f"unknown run(s) {', '.join(unknown)}; the runs are {', '.join(RUNS)}")
    names = args.runs or list(RUNS)
    if args.write:
        write(names)
        return 0
    trace = load()
    exact = bitwise_expected(trace)
    failed = 0
    for name in names:
        diff = first_difference(trace["runs"][name]["loss"], run(name), exact)
        print(f"{name}: {'bitwise equal' if exact else f'first {CROSS_STEPS} steps within {RTOL:g}'}" if diff is None else f"{name}: {diff}")
        failed += diff is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
