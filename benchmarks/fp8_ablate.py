"""Which FP8 cast costs the loss: `fp8_loss.py`'s runs with some of a recipe's six casts changed.

A variant is RECIPE[:PART=KIND+...]: PART one of the casts (x, w, g_dgrad, w_dgrad, g_wgrad, x_wgrad) or a group of
them (fwd = x, w; dgrad = g_dgrad, w_dgrad; wgrad = g_wgrad, x_wgrad; g = both g casts; bwd = dgrad and wgrad); KIND
`hp` (no FP8: the operand in the run's precision, bf16 as autocast's GEMM sees it, or fp32), `e4m3` or `e5m2`
(the recipe's blocks and scale rule, that element type) or another recipe's name (that recipe's cast). E.g.
`tensorwise:bwd=hp` runs FP8 in the forward only, `blockwise:w=rowwise` casts the forward's W per row.
Each variant trains the model as `fp8_loss.py` does (same seed, data, held-out eval) in its own process, the recipe
patched in before the CLI runs; the baseline is a run of the same --dtype without FP8 (reused from --runs if there).
An ablation tool, not a recipe: nothing here is a flag of the library.

    python benchmarks/fp8_ablate.py --model tiny --variants tensorwise,tensorwise:bwd=hp,tensorwise:fwd=hp
    python benchmarks/fp8_ablate.py --smoke     # 3 fp32 steps of one variant and the baseline, in a temp dir

The last line is one JSON object: medians_s (each run's wall seconds; None where reused, named in absent),
ratios (none: no peer), eval_loss, rel_to_baseline (eval loss / the baseline's − 1), config.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
GROUPS = {"fwd": ("x", "w"), "dgrad": ("g_dgrad", "w_dgrad"), "wgrad": ("g_wgrad", "x_wgrad"),
          "g": ("g_dgrad", "g_wgrad"), "bwd": ("g_dgrad", "w_dgrad", "g_wgrad", "x_wgrad")}


def patched_recipe(spec: str):
    """The Recipe a variant names."""
    import torch

    from shardwise.fp8.recipes import RECIPES, Cast, recipe

    name, _, changes = spec.partition(":")
    r = recipe(name)
    for change in filter(None, changes.split("+")):
        part, kind = change.split("=")
        for field in GROUPS.get(part, (part,)):
            c = getattr(r, field)
            if kind == "hp":
                c = Cast(torch.bfloat16, (None, None))
            elif kind in RECIPES:
                c = getattr(recipe(kind), field)
            else:
                c = dataclasses.replace(c, dtype={"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kind])
            r = dataclasses.replace(r, **{field: c})
    return r


def child(spec: str, argv: list[str]) -> int:
    """Run the CLI with `spec`'s recipe in place of `--fp8`'s (a non-FP8 cast takes the emulated GEMM)."""
    import torch

    from shardwise import cli
    from shardwise.fp8 import apply, linear
    from shardwise.fp8.scaling import Quantized

    r = patched_recipe(spec)
    apply.recipe = lambda name: r
    cast_all, hp = linear.quantize_all, torch.float32 if argv[argv.index("--dtype") + 1] == "fp32" else torch.bfloat16

    def quantize_all(items):
        """FP8 casts as the library's; an `hp` operand in the run's precision (bf16 as autocast's GEMM), scale 1."""
        fp8 = iter(cast_all([i for i in items if i[1].dtype != torch.bfloat16]))
        return [Quantized(t.detach().to(hp), t.new_ones(1, 1, 1, dtype=torch.float32))
                if c.dtype == torch.bfloat16 else next(fp8) for t, c, _ in items]

    linear.quantize_all = quantize_all
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    kind = linear.scaled_mm_kind
    linear.scaled_mm_kind = lambda a, b, *t: kind(a, b, *t) if a.dtype in fp8 and b.dtype in fp8 else None
    return cli.main(argv)


def main(argv=None) -> dict:
    from fp8_loss import finished, held_out_text, train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--variants", help="comma-separated variants (required unless --smoke)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-steps", type=int, default=40)
    ap.add_argument("--runs", default=None, help="run directories (the baseline reused from here if finished)")
    ap.add_argument("--smoke", action="store_true", help="3 fp32 steps of tensorwise:bwd=hp and the baseline")
    a = ap.parse_args(argv)
    if a.smoke:
        a.variants, a.dtype, a.steps, a.eval_steps = "tensorwise:bwd=hp", "fp32", 3, 1
    if not a.variants:
        ap.error("--variants is required (e.g. tensorwise,tensorwise:bwd=hp)")
    runs = a.runs or tempfile.mkdtemp(prefix="fp8_ablate_")
    os.makedirs(runs, exist_ok=True)
    extra = ["--seq-len", "64", "--micro-batch", "4", "--eval-data", held_out_text(os.path.join(runs, "held_out.txt")),
             "--eval-steps", str(a.eval_steps)]
    times, absent, out = {}, {}, {}

    def run(key: str, recipe: str | None, out_dir: str, launcher: list[str] | None = None) -> float:
        """One training (fp8_loss's `train`), reused from --runs if finished there; its final eval loss."""
        reused = finished(out_dir, a.steps) is not None
        t0 = time.perf_counter()
        rows = train(a.model, recipe, a.steps, out_dir, a.seed, extra, reuse=True, dtype=a.dtype, launcher=launcher)
        times[key] = None if reused else time.perf_counter() - t0
        if reused:
            absent[key] = "reused from --runs"
        return next(r["eval_loss"] for r in reversed(rows) if "eval_loss" in r)

    out["baseline"] = run("baseline", None, os.path.join(runs, f"{a.model}_{a.dtype}"))
    for spec in a.variants.split(","):
        d = os.path.join(runs, f"{a.model}_{a.dtype}_{spec.replace(':', '_').replace(',', '_').replace('=', '-')}")
        out[spec] = run(spec, spec.partition(":")[0], d, [sys.executable, os.path.abspath(__file__), "--child", spec,
                                                          "--"])
        print(f"{spec:<40} eval {out[spec]:.4f}  vs {a.dtype} {out[spec] / out['baseline'] - 1:+.2%}", flush=True)
    result = {"medians_s": times, "ratios": {}, "absent": absent,
              "eval_loss": out, "rel_to_baseline": {k: v / out["baseline"] - 1 for k, v in out.items() if k != "baseline"},
              "config": {"model": a.model, "dtype": a.dtype, "steps": a.steps, "seed": a.seed, "runs": runs}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2], sys.argv[4:]))
    main()
