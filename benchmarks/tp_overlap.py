"""Llama blocks, forward+backward under TP with sequence parallelism: --tp-overlap on/off × fused/unfused projections.

For each tp (2 and 4 by default) the same gloo ranks build four variants of the same seeded blocks
(`ParallelConfig(tp_overlap=..., fused_projections=...)`) and time one forward+backward of the blocks on
the same sequence shard, variants rotated per repetition after a barrier; a repetition's time is the slower rank's.
Beside the step time, each rank measures its *exposed* TP communication: the time spent inside a TP collective call
or waiting on one's handle (the guard in `comm` through which every collective and wait passes). The
overlap can only pay off where each rank has a core for its GEMMs and its collectives' progress threads; with fewer
free cores than that the output says so, and the exposed-communication fraction is the number to read, not the
speed-up. Megatron-Core's TP is timed in `tp_peers.py` (tp=2, no SP), not here.

The last stdout line is one JSON object: medians, exposed fractions, "ratios" (overlap on/off, fused/unfused), config.

    python benchmarks/tp_overlap.py            # tp 2 and 4, dim 512, seq 512
    python benchmarks/tp_overlap.py --smoke    # a few seconds: tiny shapes, tp 2, 2 reps
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardwise.comm import Ledger  # noqa: E402
from shardwise.comm import collectives  # noqa: E402
from shardwise.config import ModelConfig, ParallelConfig  # noqa: E402
from shardwise.launch import run_local  # noqa: E402
from shardwise.config import ParallelConfig  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.models.rope import rope_tables  # noqa: E402
from shardwise.parallelize import build_model  # noqa: E402

VARIANTS = {"overlap_fused": (True, True), "overlap_unfused": (True, False),
            "plain_fused": (False, True), "plain_unfused": (False, False)}  # name: (tp_overlap, fused)


_GUARD = "guarded" if hasattr(collectives, "guarded") else "_guarded"  # its name before and after comm's split


class ExposedComm:
    """Seconds this rank spends inside TP collective calls and waits (wraps the one function they all go through,
    as `collectives` sees it)."""

    def __init__(self):
        self.seconds = 0.0
        self._inner = getattr(collectives, _GUARD)

    def __enter__(self):
        def timed(axis, what, fn, *args, **kwargs):
            if axis.name != "tp":
                return self._inner(axis, what, fn, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return self._inner(axis, what, fn, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(collectives, _GUARD, timed)
        return self

    def __exit__(self, *exc):
        setattr(collectives, _GUARD, self._inner)


def rank_main(opts: dict) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    mesh = Mesh.build(ParallelConfig.build(tp, dp=1, tp=tp), torch.device("cpu"), Ledger(enabled=False))
    cfg = ModelConfig(name="bench", dim=opts["dim"], n_layers=opts["layers"], n_heads=opts["n_heads"],
                      n_kv_heads=opts["n_kv_heads"], ffn_dim=opts["ffn"], max_seq_len=opts["seq"])
    cfg.validate()
    blocks = {}
    for name, (overlap, fused) in VARIANTS.items():
        model = build_model(cfg, mesh, opts["seed"], ParallelConfig(tp=tp, sequence_parallel=True, tp_overlap=overlap,
                                                                    fused_projections=fused))
        blocks[name] = list(model.layers.values())
    gen = torch.Generator().manual_seed(opts["seed"] + 1)
    local = opts["seq"] // tp
    x0 = torch.randn(opts["batch"], opts["seq"], cfg.dim, generator=gen)[:, mesh["tp"].rank * local:][:, :local]
    gy = torch.randn_like(x0)
    cos, sin = rope_tables(cfg.head_dim, opts["seq"], cfg.rope_theta, torch.device("cpu"))

    def step(layers, x):
        for layer in layers:
            x = layer(x, cos, sin)
        x.backward(gy)
        return x

    outs = {}
    for name, layers in blocks.items():  # sanity: every variant computes the same block
        x = x0.clone().requires_grad_(True)
        outs[name] = (step(layers, x).detach(), x.grad.clone())
    base = outs["plain_unfused"]
    diffs = {n: max((o - base[0]).abs().max().item(), (g - base[1]).abs().max().item()) for n, (o, g) in outs.items()}

    times = {n: [] for n in blocks}
    exposed = {n: [] for n in blocks}
    names = list(blocks)
    xs = x0.clone().requires_grad_(True)
    for it in range(opts["warmup"] + opts["reps"]):
        for name in names[it % len(names):] + names[:it % len(names)]:
            for layer in blocks[name]:
                layer.zero_grad(set_to_none=True)
            xs.grad = None
            dist.barrier()
            with ExposedComm() as comm_time:
                t0 = time.perf_counter()
                step(blocks[name], xs)
                dt = time.perf_counter() - t0
            if it >= opts["warmup"]:
                times[name].append(dt)
                exposed[name].append(comm_time.seconds)
    return {"times": times, "exposed": exposed, "diffs": diffs}


def free_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run(tp: int, opts: dict) -> dict:
    per_rank = run_local(rank_main, tp, opts, timeout_s=600.0)
    out = {"medians_s": {}, "exposed_fraction": {}, "max_abs_diff": {}}
    for name in VARIANTS:
        steps = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
        frac = [e / t for r in per_rank for e, t in zip(r["exposed"][name], r["times"][name])]
        out["medians_s"][name] = statistics.median(steps)
        out["exposed_fraction"][name] = statistics.median(frac)
        out["max_abs_diff"][name] = max(r["diffs"][name] for r in per_rank)
    m = out["medians_s"]
    e = out["exposed_fraction"]
    out["ratios"] = {"overlap_vs_plain": m["overlap_fused"] / m["plain_fused"],
                     "fused_vs_unfused": m["plain_fused"] / m["plain_unfused"],
                     "overlap_fused_vs_plain_unfused": m["overlap_fused"] / m["plain_unfused"],
                     "exposed_overlap_vs_plain": (e["overlap_fused"] / e["plain_fused"]) if e["plain_fused"] else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, tp 2, 2 reps: checks the benchmark runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tp, args.dim, args.n_heads, args.n_kv_heads, args.ffn = [2], 64, 4, 2, 96
        args.layers, args.seq, args.reps, args.warmup = 1, 32, 2, 1
    opts = vars(args)
    cores = free_cores()
    results, notes = {}, []
    for tp in args.tp:
        results[f"tp{tp}"] = r = run(tp, opts)
        # each rank needs a core for its GEMMs and one for gloo's progress to hide anything
        if cores < 2 * tp:
            notes.append(f"tp{tp}: {cores} free cores for {tp} ranks plus their communication threads: the overlap "
                         "cannot run beside the GEMMs here; read the exposed-communication fraction, not the speed-up")
        print(f"tp={tp} (SP) dim={args.dim} seq={args.seq} layers={args.layers}, {cores} free cores")
        for name in VARIANTS:
            print(f"  {name:16s} median {r['medians_s'][name] * 1e3:8.2f} ms  exposed TP comm "
                  f"{r['exposed_fraction'][name] * 100:5.1f}%  max diff {r['max_abs_diff'][name]:.1e}")
        for k, v in r["ratios"].items():
            if v is not None:
                print(f"  {k}: {v:.3f}")
    ratios = {f"tp{tp}_{k}": v for tp in args.tp for k, v in results[f"tp{tp}"]["ratios"].items()}
    ratios["vs_megatron"] = None  # Megatron-Core's TP (no SP on CPU) is timed by benchmarks/tp_peers.py
    absent = {"megatron": "not timed here: Megatron-Core's TP runs without SP on CPU; benchmarks/tp_peers.py "
                          "times it" + ("" if importlib.util.find_spec("megatron") else " (megatron-core is not installed)")}
    if importlib.util.find_spec("megatron") is None:
        notes.append("megatron-core is not installed: no Megatron-Core timing (benchmarks/tp_peers.py has one)")
    medians = {f"tp{tp}_{name}": t for tp in args.tp for name, t in results[f"tp{tp}"]["medians_s"].items()}
    for note in notes:
        print(note)
    config = {k: opts[k] for k in ("tp", "dim", "n_heads", "n_kv_heads", "ffn", "layers", "batch", "seq", "reps",
                                   "warmup")} | {"free_cores": cores, "threads_per_rank": 1,
                                                 "torch": torch.__version__, "smoke": args.smoke}
    print(json.dumps({"medians_s": medians, "ratios": ratios, "absent": absent, "results": results, "notes": notes,
                      "config": config}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
