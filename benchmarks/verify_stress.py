"""`shardwise verify` on fresh seeds of every MoE layout: does it ever flake, and how often does routing flip?

Each layout runs N fresh seeds (3 steps, the test suite's warm-up schedule) on forked CPU gloo ranks; each fork
of a layout's ranks runs up to 20 of its seeds. A seed's line gives pass/fail, the tokens whose top-k choice
flipped (near-ties replayed on the reference), the first step that flipped, and the largest flip gap. Layouts:

  tiny-moe dp4×ep4 ZeRO-1, dp2×ep2×tp2×SP, dp2×ep2×pp2 with loss-free bias updates (fp32);
  DeepSeek-tiny dp4×ep4 ZeRO-1 (fp32), tp2×SP and cp2 (bf16: checked against the fp32 noise budget).

The last stdout line is one JSON object: per layout the seed count, passes, failing seeds, flipped tokens, seeds
with a flip, and the median seconds per seed; "ratios" is empty (nothing is compared against a peer).

    python benchmarks/verify_stress.py --seeds 200          # the target: 200 seeds per layout
    python benchmarks/verify_stress.py --seeds 5 --layouts moe_dp4_ep4_zero1
    python benchmarks/verify_stress.py --smoke              # 1 seed of the smallest layout
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # DeepSeek-tiny is defined once, beside its layout tests

from shardwise.config import ParallelConfig, TrainConfig  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402
from test_model_families import DEEPSEEK, DEEPSEEK_NOQ  # noqa: E402

_BIAS = dict(model_overrides={"moe_bias_update_rate": 0.01})
LAYOUTS = {  # name: (model, parallel degrees, extra TrainConfig fields)
    "moe_dp4_ep4_zero1": ("tiny-moe", dict(dp=4, ep=4, zero=1), {}),
    "moe_dp2_ep2_tp2_sp": ("tiny-moe", dict(dp=2, ep=2, tp=2, sequence_parallel=True), {}),
    "moe_dp2_ep2_pp2_bias": ("tiny-moe", dict(dp=2, ep=2, pp=2), dict(global_batch=8, **_BIAS)),
    "deepseek_dp4_ep4_zero1": (DEEPSEEK_NOQ, dict(dp=4, ep=4, zero=1), dict(seq_len=32, global_batch=8)),
    "deepseek_tp2_sp_bf16": (DEEPSEEK, dict(tp=2, sequence_parallel=True), dict(seq_len=32, dtype="bf16")),
    "deepseek_cp2_bf16": (DEEPSEEK, dict(cp=2), dict(seq_len=32, dtype="bf16")),
}
SMOKE = "deepseek_tp2_sp_bf16"  # the fewest ranks
SEEDS_PER_FORK = 20


def config(name: str, seed: int) -> TrainConfig:
    model, degrees, extra = LAYOUTS[name]
    cfg = TrainConfig(model=model, parallel=ParallelConfig(**degrees), steps=3, seq_len=64, micro_batch=2, seed=seed,
                      progress=False, warmup_steps=20, lr_decay_steps=200)
    return dataclasses.replace(cfg, **extra)


def seed_line(name: str, seed: int, r: dict, secs: float) -> str:
    routing = r.get("routing", {})
    line = (f"{name} seed {seed}: {'pass' if r['passed'] else 'FAIL'} flipped {routing.get('flipped_tokens', 0)} "
            f"first_flip_step {routing.get('first_flip_step')} max_gap {routing.get('max_flip_gap', 0.0):.3g} "
            f"{secs:.1f}s")
    if not r["passed"]:
        line += f"\n  {json.dumps({k: v for k, v in r.items() if k != 'losses'})}"
    return line


def run_seeds(name, cfgs):
    """Inside ranks: verify each config; (result, seconds) per config. Rank 0 prints each seed's line as it
    ends, so a run of hundreds of seeds can be followed (and a killed run keeps what it printed)."""
    import torch.distributed as dist

    from shardwise.training.assemble import assemble
    from shardwise.verify.main import verify_main

    out = []
    for cfg in cfgs:
        t0 = time.perf_counter()
        result = verify_main(assemble(cfg))
        secs = time.perf_counter() - t0
        out.append((result, secs))
        if dist.get_rank() == 0:
            print(seed_line(name, cfg.seed, result, secs), flush=True)
    return out


def stress(name: str, seeds: list[int]) -> dict:
    cfgs = [config(name, s) for s in seeds]
    results = []
    for i in range(0, len(cfgs), SEEDS_PER_FORK):  # fresh ranks now and then: a rank's RSS grows seed by seed
        chunk = cfgs[i:i + SEEDS_PER_FORK]
        results += run_local(run_seeds, chunk[0].resolve_world(), name, chunk, timeout_s=600,
                             wall_timeout_s=3600 * 24)[0]
    failed, flipped, with_flip, times = [], 0, 0, []
    for seed, (r, secs) in zip(seeds, results):
        flips = r.get("routing", {}).get("flipped_tokens", 0)
        if not r["passed"]:
            failed.append(seed)
        flipped += flips
        with_flip += flips > 0
        times.append(secs)
    return {"seeds": len(seeds), "passed": len(seeds) - len(failed), "failed_seeds": failed,
            "flipped_tokens": flipped, "seeds_with_flips": with_flip, "median_s_per_seed": statistics.median(times)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200, help="fresh seeds per layout")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    ap.add_argument("--smoke", action="store_true", help=f"1 seed of {SMOKE} (a quick check that the script runs)")
    args = ap.parse_args(argv)
    names = [SMOKE] if args.smoke else [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; valid: {', '.join(LAYOUTS)}")
    n = 1 if args.smoke else args.seeds
    report = {}
    for name in names:
        report[name] = stress(name, [int.from_bytes(os.urandom(4), "little") for _ in range(n)])
    print(json.dumps({"layouts": report, "seeds_per_layout": n,
                      "medians_s": {k: v["median_s_per_seed"] for k, v in report.items()}, "ratios": {}}))


if __name__ == "__main__":
    main()
