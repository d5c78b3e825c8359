"""`--fp8` on one CPU process: shardwise's FP8 linears against torchao's `Float8Linear` in the same model.

Both sides are the same shardwise model (`tiny` / `small`, same seed, same weights, same tokens), with the same
linears in FP8 (`apply_fp8`: every attention and MLP projection; embedding, head and norms in high precision). The
shardwise side runs its own GEMMs (`shardwise/fp8/linear.py`); the peer routes every one of those layers' GEMMs
through a torchao 0.18 `Float8Linear` (`Float8Linear.from_float` of an nn.Linear sharing the layer's weight, config
`Float8LinearConfig.from_recipe_name(recipe)`), which is what `convert_to_float8_training` swaps in — so only the FP8
GEMM implementation differs. One step is forward, mean cross-entropy, backward; gradients zeroed outside the timing.

Before timing, one step of each is compared (loss and every gradient, max abs difference): tensorwise and rowwise
follow torchao's formulas, so they agree to fp32 rounding. Timing: per repetition both run once, alternating who
goes first, timed in process CPU seconds (`--clock wall`: wall time); reported are medians and the paired ratio
(median over repetitions of shardwise / torchao), robust to a shared machine's load.

    python benchmarks/fp8_torchao.py                       # tiny and small, tensorwise and rowwise, fp32
    python benchmarks/fp8_torchao.py --dtype bf16          # under bf16 autocast
    python benchmarks/fp8_torchao.py --profile             # + a torch.profiler table per side
    python benchmarks/fp8_torchao.py --smoke               # tiny sizes, one repetition

Last stdout line: one JSON object (medians_s, ratios, max_abs_diff, config).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from shardwise.config import ParallelConfig, get_model_config  # noqa: E402
from shardwise.fp8.apply import apply_fp8  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.parallelize import all_blocks, build_model  # noqa: E402
from shardwise.tensor_parallel import layers  # noqa: E402


def torchao_linears(model, recipe: str) -> dict:
    """id(layer) → a torchao Float8Linear sharing the layer's weight and bias, for every FP8 layer of `model`."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe)
    out = {}
    for m in model.modules():
        if getattr(m, "fp8", None) is not None and not hasattr(m, "n_local"):
            lin = nn.Linear(m.weight.shape[1], m.weight.shape[0], bias=False, device="meta")
            lin.weight = m.weight
            out[id(m)] = Float8Linear.from_float(lin, config=config)
    return out


@contextlib.contextmanager
def through_torchao(tao: dict):
    """Every FP8 layer's GEMM (`layers._linear`, which the column regions and the TP layers call) in torchao."""
    ours = layers._linear

    def linear(layer, x, bias):
        if id(layer) not in tao:  # a high-precision layer (the LM head)
            return ours(layer, x, bias)
        y = tao[id(layer)](x)
        return y if bias is None else y + bias

    layers._linear = linear
    try:
        yield
    finally:
        layers._linear = ours


def step(model, tokens, targets, dtype) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = model.loss_fn(model(tokens), targets).mean()
    loss.backward()
    return loss


CLOCK = time.process_time
"""CPU seconds of this process (`--clock cpu`, the default): on a shared machine wall time swings with the load."""


def run(side: str, model, tao, tokens, targets, dtype) -> float:
    model.zero_grad(set_to_none=True)
    ctx = through_torchao(tao) if side == "torchao" else contextlib.nullcontext()
    with ctx:
        t0 = CLOCK()
        step(model, tokens, targets, dtype)
        return CLOCK() - t0


def compare(model, tao, tokens, targets, dtype) -> float:
    """Max abs difference of the loss and every gradient between the two sides on one step."""
    out = []
    for side in ("shardwise", "torchao"):
        model.zero_grad(set_to_none=True)
        with through_torchao(tao) if side == "torchao" else contextlib.nullcontext():
            loss = step(model, tokens, targets, dtype)
        out.append([loss.detach().float()] + [p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(*out))


def profile(side, model, tao, tokens, targets, dtype, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run(side, model, tao, tokens, targets, dtype)
    print(f"\n=== profile: {side} ({steps} steps) ===", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--recipes", default="tensorwise,rowwise")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", default="cpu", choices=("cpu", "wall"),
                    help="cpu: process CPU time (robust to a shared machine's load); wall: perf_counter")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.models, a.batch, a.seq, a.reps, a.warmup, a.threads = "tiny", 1, 32, 1, 0, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    medians, ratios, diffs = {}, {}, {}
    for name in a.models.split(","):
        cfg = get_model_config(name)
        gen = torch.Generator().manual_seed(a.seed)
        tokens = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen)
        targets = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen)
        for recipe in a.recipes.split(","):
            mesh = Mesh.single()
            model = build_model(cfg, mesh, seed=a.seed)
            apply_fp8(all_blocks(model), mesh, ParallelConfig(), recipe)
            tao = torchao_linears(model, recipe)
            key = f"{name}/{recipe}"
            diffs[key] = compare(model, tao, tokens, targets, a.dtype)
            times = {"shardwise": [], "torchao": []}
            paired = []
            for rep in range(a.warmup + a.reps):
                order = ("shardwise", "torchao") if rep % 2 == 0 else ("torchao", "shardwise")
                t = {side: run(side, model, tao, tokens, targets, a.dtype) for side in order}
                if rep >= a.warmup:
                    for side in t:
                        times[side].append(t[side])
                    paired.append(t["shardwise"] / t["torchao"])
            medians[f"{key}/shardwise"] = statistics.median(times["shardwise"])
            medians[f"{key}/torchao"] = statistics.median(times["torchao"])
            ratios[key] = statistics.median(paired)
            print(f"{key:<20} shardwise {medians[f'{key}/shardwise'] * 1e3:8.1f} ms  torchao "
                  f"{medians[f'{key}/torchao'] * 1e3:8.1f} ms  ratio {ratios[key]:.3f}  max|Δ| {diffs[key]:.2e}")
            if a.profile:
                for side in ("shardwise", "torchao"):
                    profile(side, model, tao, tokens, targets, a.dtype)
    out = {"medians_s": medians, "ratios": ratios, "max_abs_diff": diffs,
           "config": {"models": a.models, "recipes": a.recipes, "dtype": a.dtype, "batch": a.batch, "seq": a.seq,
                      "reps": a.reps, "warmup": a.warmup, "clock": a.clock, "threads": torch.get_num_threads(),
                      "seed": a.seed, "torch": torch.__version__}}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
