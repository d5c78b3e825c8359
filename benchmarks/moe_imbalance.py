"""Skewed MoE routing on forked CPU gloo ranks: the busiest ep rank's rows and the step time under contiguous vs
balanced expert placement (`--expert-placement`, rules/placement.py), and with replicas of the hottest experts.

One MoE block of tiny-moe's shape (E = 8 experts, top-2, dim 96, expert ffn 128; `--dim`/`--ffn` widen it) per
rank, ep = 4 (one rank each), N tokens per rank. The router is skewed the way trained routers drift: a selection
bias falling linearly from the first expert to the last (`--skew`), so under contiguous placement ep rank 0,
holding experts 0 and 1, receives the most rows. A first pass under contiguous placement records the histogram
(tokens per expert, summed over ranks) exactly as `train` writes routing.jsonl; the balanced layouts are built
from it (`rules.placement.balanced`, with 1 and `--replicas` copies of the ep hottest experts). Each repetition then
runs every placement's forward + backward once after a barrier, in a rotated order; a repetition's time is the
slower rank's; the busiest rank's rows are its experts' received rows. Routing is the same for every placement
(same weights, inputs and bias), and the block outputs are checked equal across placements.

The last stdout line is one JSON object: medians (seconds and rows), "ratios" (balanced / contiguous, and the
replicated layout's), "paired_ratios" (medians of per-repetition ratios) and the config.

    python benchmarks/moe_imbalance.py --reps 20
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardwise import comm  # noqa: E402
from shardwise.comm import Ledger  # noqa: E402
from shardwise.config import ParallelConfig  # noqa: E402
from shardwise.expert_parallel import MoE  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.rules.placement import balanced, contiguous  # noqa: E402
from shardwise.tensor_parallel.layers import get_spec  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402

SMOKE = {"tokens": 64, "reps": 1, "warmup": 0}


def _block(args, ep_axis, layout) -> MoE:
    """The MoE block with every parameter its slice of one seeded global draw: the same experts in every layout."""
    moe = MoE(args.dim, args.ffn, args.experts, args.topk, ep_axis, layout=layout)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            spec = get_spec(p)
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            full = torch.randn(spec.global_shape, generator=g) * spec.global_shape[-1] ** -0.5
            p.copy_(spec.local_slice(full))
        e = args.experts
        moe.router.expert_bias.copy_(torch.linspace(args.skew, -args.skew, e))
    return moe


def _step(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    x = x.clone().requires_grad_(True)
    out = moe(x)
    out.square().mean().backward()
    return out.detach(), sum(moe.dispatcher.last_rows)


def _rank(args, seed):
    world = dist.get_world_size()
    torch.set_num_threads(1)
    mesh = Mesh.build(ParallelConfig.build(world, ep=world), torch.device("cpu"), Ledger())
    ep_axis = mesh["ep"]
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    x = torch.randn(args.tokens, args.dim, generator=g)
    # the histogram a contiguous run records (routing.jsonl's tokens_per_expert, summed over the ranks)
    probe = _block(args, ep_axis, None)
    probe(x)
    counts = torch.tensor(probe.stats.tokens_per_expert, dtype=torch.float64)
    comm.all_reduce(counts, ep_axis)
    counts = counts.tolist()
    layouts = {"contiguous": contiguous(args.experts, world), "balanced": balanced(counts, world),
               f"balanced_r{args.replicas}": balanced(counts, world, args.replicas)}
    blocks = {name: _block(args, ep_axis, lay) for name, lay in layouts.items()}
    outs = {}
    for name, moe in blocks.items():
        moe.dispatcher.last_rows = []
        _wrap(moe)
        outs[name] = _step(moe, x)[0]
    diff = max(float((o - outs["contiguous"]).abs().max()) for o in outs.values())
    times, rows = {}, {}
    names = list(blocks)
    for rep in range(args.warmup + args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            for p in blocks[name].parameters():
                p.grad = None
            comm.barrier(ep_axis)
            t0 = time.perf_counter()
            _, received = _step(blocks[name], x)
            dt = time.perf_counter() - t0
            if rep >= args.warmup:
                times.setdefault(name, []).append(dt)
                rows.setdefault(name, []).append(received)
    return {"times": times, "rows": rows, "diff": diff, "counts": counts,
            "slots": {n: [list(s) for s in lay.slots] for n, lay in layouts.items()}}


def _wrap(moe: MoE) -> None:
    """Keep each forward's received rows per local expert (the dispatcher's handle) for the report."""
    disp = moe.dispatcher
    inner = disp.dispatch

    def dispatch(x, indices, weights):
        rows, handle = inner(x, indices, weights)
        disp.last_rows = handle.tokens_per_local_expert
        return rows, handle
    disp.dispatch = dispatch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=96, help="hidden size (tiny-moe: 96)")
    ap.add_argument("--ffn", type=int, default=128, help="expert inner size (tiny-moe: 128)")
    ap.add_argument("--experts", type=int, default=8, help="routed experts (tiny-moe: 8)")
    ap.add_argument("--topk", type=int, default=2, help="experts per token (tiny-moe: 2)")
    ap.add_argument("--ep", type=int, default=4, help="ep degree (one rank each)")
    ap.add_argument("--skew", type=float, default=0.2, help="selection bias, from +skew (expert 0) to -skew")
    ap.add_argument("--replicas", type=int, default=2, help="copies of the ep hottest experts in the third layout")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per placement")
    ap.add_argument("--warmup", type=int, default=3, help="untimed repetitions per placement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    per_rank = run_local(_rank, args.ep, args, args.seed, timeout_s=600)
    names = list(per_rank[0]["slots"])  # contiguous first: the base of every ratio
    step = {n: [max(ts) for ts in zip(*(r["times"][n] for r in per_rank))] for n in names}  # the slower rank
    busiest = {n: [max(rs) for rs in zip(*(r["rows"][n] for r in per_rank))] for n in names}
    medians = {f"step/{n}": statistics.median(step[n]) for n in names}
    rows = {f"busiest_rank_rows/{n}": statistics.median(busiest[n]) for n in names}
    base = "contiguous"
    ratios, paired = {}, {}
    for n in names[1:]:
        ratios[f"step/{n}"] = medians[f"step/{n}"] / medians[f"step/{base}"]
        ratios[f"busiest_rank_rows/{n}"] = rows[f"busiest_rank_rows/{n}"] / rows[f"busiest_rank_rows/{base}"]
        paired[f"step/{n}"] = statistics.median(a / b for a, b in zip(step[n], step[base]))
    mean_rows = args.tokens * args.topk
    print(f"histogram (tokens per expert, all ranks): {per_rank[0]['counts']}")
    for n in names:
        print(f"{n:14s} slots {per_rank[0]['slots'][n]}  busiest rank {rows[f'busiest_rank_rows/{n}']:.0f} rows "
              f"({rows[f'busiest_rank_rows/{n}'] / mean_rows:.2f}x the mean)  step {medians[f'step/{n}'] * 1e3:.1f} ms")
    diff = max(r["diff"] for r in per_rank)
    print(f"max |output − contiguous output| over placements: {diff:.2e}")
    config = {"tokens_per_rank": args.tokens, "dim": args.dim, "ffn": args.ffn, "experts": args.experts,
              "topk": args.topk, "ep": args.ep, "skew": args.skew, "replicas": args.replicas, "reps": args.reps,
              "warmup": args.warmup, "dtype": "float32", "threads_per_rank": 1, "torch": torch.__version__}
    print(json.dumps({"medians_s": medians, "medians_rows": rows, "ratios": ratios, "paired_ratios": paired,
                      "max_abs_diff": diff, "config": config}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
