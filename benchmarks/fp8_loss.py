"""FP8 against bf16 over a training run: each `--fp8` recipe's loss curve and final loss next to the bf16 run's.

For each model (tiny, tiny-moe) the CLI trains the same seed and data on one CPU process, once in bf16 and once per
recipe (`--dtype bf16 --fp8 RECIPE`: the linears' GEMMs in FP8, the rest in bf16 autocast), for --steps steps.
The bf16 run is the baseline: a recipe passes where its final loss (the mean of the last `--tail` steps, which
smooths the one batch's noise; the last step's own loss is reported too) is within `--bound` (1.5 %) of bf16's.
Beside it each run's `eval_loss` at the end, on held-out text no run trains on (the plain-text docs of a fixed list of
standard-library modules, `--eval-steps` batches): the same batches for every run, so one batch's noise cancels. An
fp32 run (`--dtype fp32`) shows how far bf16 itself moves the loss: the yardstick of a precision change.
The curves are drawn into one PNG (one panel per model, the loss smoothed over 10 steps).

    python benchmarks/fp8_loss.py                      # 300 steps, writes docs/fp8_loss.png
    python benchmarks/fp8_loss.py --smoke              # tiny, bf16 and tensorwise, 3 short steps, PNG in a temp dir

Runs go `--jobs` at a time (one thread each; default all ten at once); 4 sequences of 64 tokens per step. Last stdout line: one JSON object (final_loss, rel_to_bf16,
passed, medians_s: the median step time per run, ratios: each recipe's median step time over bf16's, wall_s: each
run's wall seconds, None where reused, config).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")


EVAL_MODULES = ("argparse", "collections", "functools", "itertools", "json", "pathlib", "re", "subprocess", "typing")


def held_out_text(path: str) -> str:
    """Held-out eval text: the plain-text docs of standard-library modules (the training corpus is pydoc's topics)."""
    import importlib
    import pydoc

    with open(path, "w") as f:
        for name in EVAL_MODULES:
            f.write(pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext))
    return path


def _rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "loss" in row or "eval_loss" in row]


def finished(out: str, steps: int) -> list[dict] | None:
    """The metrics.jsonl rows of a finished run in `out` (all its steps and its eval), else None."""
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        rows = _rows(out)
        if sum("loss" in r for r in rows) == steps and any("eval_loss" in r for r in rows):
            return rows
    return None


def train(model: str, run: str, steps: int, out: str, seed: int, extra: list[str], reuse: bool = False,
          dtype: str | None = None, launcher: list[str] | None = None) -> list[dict]:
    """One CLI run (`run`: bf16, fp32 or an FP8 recipe, under `dtype`: fp32 for the fp32 run, else bf16); its
    metrics.jsonl rows. `reuse`: a finished run already in `out` is read back instead of trained again. `launcher`:
    the command before `train` (default `python -m shardwise`; fp8_ablate.py's patches a recipe first)."""
    rows = finished(out, steps) if reuse else None
    if rows is not None:
        return rows
    dtype = dtype or ("fp32" if run == "fp32" else "bf16")
    cmd = [*(launcher or [sys.executable, "-m", "shardwise"]), "train", "--model", model, "--dp", "1",
           "--steps", str(steps), "--dtype", dtype, "--seed", str(seed), "--out", out, "--no-progress",
           "--no-checkpoint", "--no-report", "--device", "cpu", *extra] + (["--fp8", run] if run in RECIPES else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return _rows(out)


def smooth(xs: list[float], k: int = 10) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def plot(curves: dict, path: str, bound: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for m, _ in curves})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for run in ("fp32", "bf16", *RECIPES):
            rows = [r for r in curves.get((model, run), []) if "loss" in r]
            if rows:
                ax.plot([r["step"] for r in rows], smooth([r["loss"] for r in rows]), label=run,
                        lw=2.0 if run in ("bf16", "fp32") else 1.0,
                        color={"bf16": "black", "fp32": "grey"}.get(run), ls="--" if run == "fp32" else "-")
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
    ap.add_argument("--eval-steps", type=int, default=40, help="held-out batches evaluated at the end (0: none)")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 yardstick runs")
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "fp8_loss.png"))
    ap.add_argument("--runs", default=None, help="where the run directories go (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true", help="read back the finished runs already under --runs")
    ap.add_argument("--smoke", action="store_true", help="3 steps of short sequences, PNG in the temp dir")
    a = ap.parse_args(argv)
    extra = ["--seq-len", str(a.seq_len), "--micro-batch", str(a.micro_batch)]
    runs_dir = a.runs or tempfile.mkdtemp(prefix="fp8_loss_")
    os.makedirs(runs_dir, exist_ok=True)
    if a.smoke:
        a.steps, a.tail, extra = 3, 1, ["--seq-len", "32", "--micro-batch", "2"]
        a.models, a.recipes, a.eval_steps, a.no_fp32 = "tiny", "tensorwise", 2, True
        a.png = os.path.join(runs_dir, "fp8_loss.png")
    if a.eval_steps:
        extra += ["--eval-data", held_out_text(os.path.join(runs_dir, "held_out.txt")), "--eval-steps", str(a.eval_steps)]
    recipes = [r for r in a.recipes.split(",") if r]
    jobs = [(m, r) for m in a.models.split(",") for r in ((() if a.no_fp32 else ("fp32",)) + ("bf16", *recipes))]

    walls = {}

    def one(job):
        model, run = job
        out, t0 = os.path.join(runs_dir, f"{model}_{run}"), time.perf_counter()
        reused = a.reuse and finished(out, a.steps) is not None
        rows = train(model, None if run == "bf16" else run, a.steps, out, a.seed, extra, a.reuse)
        walls[f"{model}/{run}"] = None if reused else time.perf_counter() - t0
        return job, rows

    with ThreadPoolExecutor(a.jobs) as pool:
        curves = dict(pool.map(one, jobs))
    final, last, rel, passed, medians, ratios, evals, eval_rel = {}, {}, {}, {}, {}, {}, {}, {}
    for (model, run), rows in curves.items():
        key, train_rows = f"{model}/{run}", [r for r in rows if "loss" in r]
        final[key] = statistics.fmean(r["loss"] for r in train_rows[-a.tail:])
        last[key] = train_rows[-1]["loss"]
        medians[key] = statistics.median(r["step_time_s"] for r in train_rows)
        evals[key] = next((r["eval_loss"] for r in reversed(rows) if "eval_loss" in r), None)
    for (model, run) in curves:
        if run != "bf16":
            key, base = f"{model}/{run}", f"{model}/bf16"
            rel[key] = final[key] / final[base] - 1
            if evals[key] is not None:
                eval_rel[key] = evals[key] / evals[base] - 1
            if run in RECIPES:
                passed[key] = abs(eval_rel.get(key, rel[key])) <= a.bound
            ratios[key] = medians[key] / medians[base]
    plot(curves, a.png, a.bound)
    print(f"{'run':<24}{'final (mean last ' + str(a.tail) + ')':>22}{'last step':>11}{'vs bf16':>9}"
          f"{'eval':>8}{'vs bf16':>9}{'step s':>8}")
    for key in final:
        ev = f"{evals[key]:.4f}" if evals[key] is not None else "-"
        print(f"{key:<24}{final[key]:>22.4f}{last[key]:>11.4f}{(f'{rel[key]:+.2%}' if key in rel else ''):>9}"
              f"{ev:>8}{(f'{eval_rel[key]:+.2%}' if key in eval_rel else ''):>9}{medians[key]:>8.3f}")
    out = {"final_loss": final, "last_step_loss": last, "rel_to_bf16": rel, "eval_loss": evals,
           "eval_rel_to_bf16": eval_rel, "passed": passed, "medians_s": medians,
           "ratios": ratios, "wall_s": walls, "png": a.png,
           "config": {"steps": a.steps, "tail": a.tail, "bound": a.bound, "seed": a.seed, "dtype": "bf16",
                      "judged_on": "eval_loss" if eval_rel else "final_loss",
                      "extra": extra, "runs": runs_dir}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
