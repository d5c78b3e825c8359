"""FP8 against bf16 over a training run: each `--fp8` recipe's loss curve and final loss next to the bf16 run's.

For each model (tiny, tiny-moe) the CLI trains the same seed and data on one CPU process, once in bf16 and once per
recipe (`--dtype bf16 --fp8 RECIPE`: the linears' GEMMs in FP8, the rest in bf16 autocast), for --steps steps.
The bf16 run is the baseline: a recipe passes where its final loss (the mean of the last `--tail` steps, which
smooths the one batch's noise; the last step's own loss is reported too) is within `--bound` (1.5 %) of bf16's.
The curves are drawn into one PNG (one panel per model, the loss smoothed over 10 steps).

    python benchmarks/fp8_loss.py                      # 300 steps, writes benchmarks/fp8_loss.png
    python benchmarks/fp8_loss.py --smoke              # tiny, bf16 and tensorwise, 3 short steps, PNG in a temp dir

Runs go `--jobs` at a time (one thread each; default all ten at once); 4 sequences of 64 tokens per step. Last stdout line: one JSON object (final_loss, rel_to_bf16,
passed, medians_s: the median step time per run, ratios: each recipe's median step time over bf16's, config).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


def train(model: str, fp8: str | None, steps: int, out: str, seed: int, extra: list[str]) -> list[dict]:
    """One CLI run; its metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "shardwise", "train", "--model", model, "--dp", "1", "--steps", str(steps),
           "--dtype", "bf16", "--seed", str(seed), "--out", out, "--no-progress", "--no-checkpoint", "--no-report",
           "--device", "cpu", *extra] + (["--fp8", fp8] if fp8 else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "loss" in row]


def smooth(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def plot(curves: dict, path: str, bound: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for m, _ in curves})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for run in ("bf16", *RECIPES):
            rows = curves.get((model, run))
            if rows:
                ax.plot([r["step"] for r in rows], smooth([r["loss"] for r in rows]), label=run,
                        lw=2.0 if run == "bf16" else 1.0, color="black" if run == "bf16" else None)
        ax.set_title(f"{model}: bf16 vs --fp8 (loss, 10-step mean; bound {bound:.1%} of final)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", default="tiny,tiny-moe")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--tail", type=int, default=10, help="final loss: the mean of the last N steps")
    ap.add_argument("--bound", type=float, default=0.015)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--png", default=os.path.join(ROOT, "benchmarks", "fp8_loss.png"))
    ap.add_argument("--runs", default=None, help="where the run directories go (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="3 steps of short sequences, PNG in the temp dir")
    a = ap.parse_args(argv)
    extra = ["--seq-len", str(a.seq_len), "--micro-batch", str(a.micro_batch)]
    runs_dir = a.runs or tempfile.mkdtemp(prefix="fp8_loss_")
    if a.smoke:
        a.steps, a.tail, extra = 3, 1, ["--seq-len", "32", "--micro-batch", "2"]
        a.models, a.recipes = "tiny", "tensorwise"
        a.png = os.path.join(runs_dir, "fp8_loss.png")
    recipes = [r for r in a.recipes.split(",") if r]
    jobs = [(m, r) for m in a.models.split(",") for r in ("bf16", *recipes)]

    def one(job):
        model, run = job
        return job, train(model, None if run == "bf16" else run, a.steps, os.path.join(runs_dir, f"{model}_{run}"),
                          a.seed, extra)

    with ThreadPoolExecutor(a.jobs) as pool:
        curves = dict(pool.map(one, jobs))
    final, last, rel, passed, medians, ratios = {}, {}, {}, {}, {}, {}
    for (model, run), rows in curves.items():
        key = f"{model}/{run}"
        final[key] = statistics.fmean(r["loss"] for r in rows[-a.tail:])
        last[key] = rows[-1]["loss"]
        medians[key] = statistics.median(r["step_time_s"] for r in rows)
    for (model, run) in curves:
        if run != "bf16":
            key, base = f"{model}/{run}", f"{model}/bf16"
            rel[key] = final[key] / final[base] - 1
            passed[key] = abs(rel[key]) <= a.bound
            ratios[key] = medians[key] / medians[base]
    plot(curves, a.png, a.bound)
    print(f"{'run':<24}{'final (mean last ' + str(a.tail) + ')':>22}{'last step':>11}{'vs bf16':>9}{'step s':>8}")
    for key in final:
        print(f"{key:<24}{final[key]:>22.4f}{last[key]:>11.4f}"
              f"{(f'{rel[key]:+.2%}' if key in rel else ''):>9}{medians[key]:>8.3f}")
    out = {"final_loss": final, "last_step_loss": last, "rel_to_bf16": rel, "passed": passed, "medians_s": medians,
           "ratios": ratios, "png": a.png,
           "config": {"steps": a.steps, "tail": a.tail, "bound": a.bound, "seed": a.seed, "dtype": "bf16",
                      "extra": extra, "runs": runs_dir}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
