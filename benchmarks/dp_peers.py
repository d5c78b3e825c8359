"""A full data-parallel optimizer step at dp=2 on 2 CPU gloo ranks: shardwise vs. PyTorch's own.

Every implementation trains the same model (shardwise's `build_model` at tp=1, deep-copied, from the
same seeded global weights) on the same micro-batches, one per rank, with the same step: forward,
backward, gradient reduction, global grad-norm clipping (1.0) and AdamW.
  * shardwise ZeRO-0 (`GradReducer(zero=0)`: buckets all-reduced from backward) vs
    `torch.nn.parallel.DistributedDataParallel` with the same bucket size (`bucket_cap_mb`);
  * shardwise ZeRO-3 (`GradReducer(zero=3)`: per-layer gather / free / prefetch, per-layer
    reduce-scatter from backward) vs FSDP2 `fully_shard` on every block and the root.
The model is wide and shallow so that reducing its gradients is a large part of a step (the share
is measured: one blocking all-reduce of every gradient, bucketed the same way, against the DDP step).

Every repetition runs each implementation once, after a barrier, in the orders of a balanced Latin
square (each implementation directly follows each other one equally often over 4 repetitions: a plain
rotation put shardwise ZeRO-0 right after FSDP2, whose freed memory the next step pays for in page
faults, in 3 of 4 repetitions, and DDP after shardwise in 3 of 4); a repetition's
time is the slower rank's; ratios are medians of per-repetition ratios (paired, so both sides of a
ratio see the same machine noise), as benchmarks/tp_peers.py measures. Last stdout line: one JSON
object with `medians_s` and `ratios` (shardwise / peer).

    python benchmarks/dp_peers.py --reps 20
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardwise.comm import Ledger  # noqa: E402
from shardwise.config import ModelConfig  # noqa: E402
from shardwise.data_parallel import GradReducer  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402
from shardwise.config import ParallelConfig  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.parallelize import build_model  # noqa: E402

DP = 2
IMPLS = ("shardwise_zero0", "ddp", "shardwise_zero3", "fsdp2")
PEER = {"ddp": "shardwise_zero0", "fsdp2": "shardwise_zero3"}
SMOKE = {"dim": 64, "layers": 2, "ffn": 128, "seq": 8, "bucket_mb": 1, "reps": 1, "warmup": 0}
LR, CLIP = 1e-3, 1.0


def _loss(model, x, y, denom):
    return model.loss_fn(model(x), y).sum() / denom


class Shardwise:
    def __init__(self, model, mesh, zero, bucket_bytes, n_global):
        self.model, self.n_global = model, n_global
        self.red = GradReducer(model, mesh, zero=zero, lr=LR, bucket_bytes=bucket_bytes)

    def step(self, x, y) -> float:
        loss = _loss(self.model, x, y, self.n_global)  # summed over dp by the reduction: the global mean
        loss.backward()
        self.red.reduce_and_clip(CLIP)
        self.red.step()
        return float(loss.detach()) * DP


class TorchPeer:
    """DDP or FSDP2: both average gradients over the ranks, so the loss is this rank's token mean."""

    def __init__(self, model, params):
        self.model = model
        self.opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                     fused=True)  # shardwise's AdamW, so the ratios time the rest of the step

    def step(self, x, y) -> float:
        loss = _loss(self.model, x, y, y.numel())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)


def _grad_share(model, bucket_bytes, group, reps: int = 5) -> float:
    """Median seconds of one blocking all-reduce of every gradient in `bucket_bytes` buckets (no compute),
    on buffers allocated and reduced once beforehand (a first reduction pays the pages' first touch)."""
    sizes, cur = [], 0
    for p in model.parameters():
        cur += p.numel()
        if cur * 4 >= bucket_bytes:
            sizes, cur = sizes + [cur], 0
    bufs = [torch.ones(n) for n in sizes + ([cur] if cur else [])]
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            dist.all_reduce(b, group=group)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def rank_main(opts):
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    cfg = ModelConfig(name="wide", vocab_size=257, dim=opts["dim"], n_layers=opts["layers"], n_heads=8, n_kv_heads=8,
                      ffn_dim=opts["ffn"], max_seq_len=max(64, opts["seq"]))
    mesh = Mesh.build(ParallelConfig.build(DP, dp=DP), torch.device("cpu"), Ledger(enabled=False), 600.0)
    base = build_model(cfg, mesh, opts["seed"])
    bucket = opts["bucket_mb"] * 2**20
    n_global = DP * opts["batch"] * opts["seq"]
    impls = {}
    impls["shardwise_zero0"] = Shardwise(copy.deepcopy(base), mesh, 0, bucket, n_global)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=opts["bucket_mb"],
                                                    process_group=mesh["dp"].group)
    ddp.loss_fn = ddp.module.loss_fn
    impls["ddp"] = TorchPeer(ddp, ddp.parameters())
    impls["shardwise_zero3"] = Shardwise(copy.deepcopy(base), mesh, 3, bucket, n_global)
    fsdp = copy.deepcopy(base)
    dmesh = mesh.device_mesh["dp"] if mesh.device_mesh is not None and "dp" in (mesh.device_mesh.mesh_dim_names or ()) \
        else torch.distributed.device_mesh.init_device_mesh("cpu", (DP,))
    for block in fsdp.layers.values():
        fully_shard(block, mesh=dmesh)
    fully_shard(fsdp, mesh=dmesh)
    impls["fsdp2"] = TorchPeer(fsdp, fsdp.parameters())

    gen = torch.Generator().manual_seed(opts["seed"] * 7 + rank)
    batches = [torch.randint(0, cfg.vocab_size, (opts["batch"], opts["seq"] + 1), generator=gen) for _ in range(4)]
    losses = {k: [] for k in impls}
    for i in range(3):  # sanity: the same training, step by step
        x, y = batches[i][:, :-1], batches[i][:, 1:]
        for name, impl in impls.items():
            t = torch.tensor([impl.step(x, y)])
            dist.all_reduce(t)
            losses[name].append(float(t) / DP)
    times = {k: [] for k in impls}
    names = list(impls)
    for it in range(opts["warmup"] + opts["reps"]):
        x, y = batches[it % 4][:, :-1], batches[it % 4][:, 1:]
        i, n = it % len(names), len(names)
        order = [names[(i + (j + 1) // 2 * (1 if j % 2 else -1)) % n] for j in range(n)]  # Williams design
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            impls[name].step(x, y)
            if it >= opts["warmup"]:
                times[name].append(time.perf_counter() - t0)
    share = _grad_share(base, bucket, mesh["dp"].group)
    n_params = sum(p.numel() for p in base.parameters())
    return {"times": times, "losses": losses, "allreduce_s": share, "params": n_params}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--bucket-mb", type=int, default=8, help="gradient bucket size for shardwise and DDP")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions (a multiple of 4 balances the orders)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    opts = vars(args)
    per_rank = run_local(rank_main, DP, opts, timeout_s=900.0)
    steps = {k: [max(ts) for ts in zip(*(r["times"][k] for r in per_rank))] for k in IMPLS}
    medians = {k: statistics.median(v) for k, v in steps.items()}
    paired = {f"vs_{peer}": statistics.median(a / b for a, b in zip(steps[sw], steps[peer]))
              for peer, sw in PEER.items()}
    share = max(r["allreduce_s"] for r in per_rank) / medians["ddp"]
    losses = per_rank[0]["losses"]
    drift = {peer: max(abs(a - b) for a, b in zip(losses[peer], losses[sw])) for peer, sw in PEER.items()}
    print(f"model dim={args.dim} layers={args.layers} ffn={args.ffn} ({per_rank[0]['params'] / 1e6:.1f}M params), "
          f"batch={args.batch}x{args.seq} per rank, dp={DP} on {DP} gloo ranks x 1 thread, bucket {args.bucket_mb} MiB, "
          f"{args.warmup} warm-up + {args.reps} reps, torch {torch.__version__}")
    print(f"gradient all-reduce alone: {share:.0%} of a DDP step")
    print("losses of the first 3 steps (all ranks' mean): " +
          ", ".join(f"{k} {[round(v, 5) for v in losses[k]]}" for k in IMPLS))
    for k in IMPLS:
        q = statistics.quantiles(steps[k], n=4) if len(steps[k]) > 1 else [steps[k][0]] * 3
        print(f"  {k:16s} median {medians[k] * 1e3:8.1f} ms  (p25 {q[0] * 1e3:.1f}, p75 {q[2] * 1e3:.1f})")
    for k, r in paired.items():
        print(f"shardwise / {k[3:]} = {r:.3f} ({'faster' if r < 1 else 'slower'}), paired per repetition")
    config = {"dim": args.dim, "layers": args.layers, "ffn_dim": args.ffn, "batch": args.batch, "seq": args.seq,
              "dp": DP, "bucket_mb": args.bucket_mb, "reps": args.reps, "warmup": args.warmup,
              "threads_per_rank": 1, "grad_allreduce_share_of_ddp_step": share, "torch": torch.__version__}
    print(json.dumps({"medians_s": medians, "ratios": paired, "config": config,
                      "loss_abs_diff_vs_peer": drift}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
