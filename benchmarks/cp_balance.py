"""Context parallelism on forked CPU gloo ranks: load balance of the causal chunk orders, ring vs Ulysses.

Three measurements, each at cp = 2 and 4 (one fork per cp degree):
  * balance — each rank's attention compute for one causal forward+backward (exactly the block pairs
    `block_plan` gives it, through the same `block_forward` / `block_backward` the ring calls), timed
    one rank at a time while the others wait at a barrier, so ranks do not share the two cores;
    repetitions interleave ranks and orders, and each rank reports its median.
    Reported: max/min across ranks, for the contiguous and the load-balanced order (target ≤ 1.1);
  * step — `ring_attention` and `ulysses_attention` forward+backward on all ranks at once (causal,
    balanced); a repetition's time is the slower rank's. At cp=4 four ranks share two cores, so the
    cp=4 step times are only comparable with each other;
  * peer — `torch.distributed.tensor.experimental.context_parallel` at cp=2, timed like the step, or
    recorded as null with the reason (on CPU it has no sharding strategy for the CPU flash op).

    python benchmarks/cp_balance.py --seq 2048 --reps 9
Last stdout line: one JSON object {"medians_s": ..., "ratios": ..., "config": ..., "peers": ..., "absent": ...}
(`absent`: a peer that could not run, with the reason).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shardwise import comm  # noqa: E402
from shardwise.comm import Ledger  # noqa: E402
from shardwise.context_parallel import block_plan, ring_attention, shard_sequence, ulysses_attention  # noqa: E402
from shardwise.context_parallel.ring_attention import block_backward, block_forward  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402
from shardwise.config import ParallelConfig  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402

ORDERS = ("contiguous", "balanced")
SMOKE = {"seq": 64, "heads": 4, "kv_heads": 2, "head_dim": 8, "reps": 1}


def _inputs(args, s_len, gen, grad=False):
    shapes = ((args.heads, s_len), (args.kv_heads, s_len), (args.kv_heads, s_len))
    ts = [torch.randn(args.batch, h, n, args.head_dim, generator=gen) for h, n in shapes]
    return [t.requires_grad_() for t in ts] if grad else ts


def _rank_compute(q, k, v, dout, r, c, order):
    """This rank's attention compute for one causal ring forward+backward, without the communication."""
    scale = q.shape[-1] ** -0.5
    s_local = q.shape[2]
    for src in range(c):
        for qs, ks, causal in block_plan(r, src, c, order, True, s_local):
            qb, kb, vb = q[:, :, qs], k[:, :, ks], v[:, :, ks]
            out, lse = block_forward(qb, kb, vb, causal, scale)
            block_backward(dout[:, :, qs].contiguous(), qb, kb, vb, out, lse, causal, scale)


def _timed(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _slowest_rank(fn, axis, reps):
    """Median over repetitions of the slowest rank's time (a barrier starts each repetition)."""
    times = []
    for _ in range(reps + 1):  # the first repetition warms up
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        times.append(comm.all_reduce(elapsed, axis, op="max").item())
    return statistics.median(times[1:])


def _torch_peer(mesh, args, gen, reps):
    """(slowest-rank step time, None), or (None, why it cannot run here)."""
    try:
        from torch.distributed.tensor.experimental import context_parallel
        q, k, v = _inputs(args, args.seq, gen)
        gqa = args.heads != args.kv_heads
        with context_parallel(mesh.device_mesh["cp"], buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            # it shards the buffers in place (and restores them on exit), which leaves requiring grad refuse
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            t = _slowest_rank(lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=gqa)
                              .sum().backward(), mesh["world"], reps)
        return t, None
    except Exception as e:  # record why the peer cannot run here rather than fail the benchmark
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _rank(c, args):
    torch.manual_seed(0)
    mesh = Mesh.build(ParallelConfig.build(dist.get_world_size(), cp=c), torch.device("cpu"), Ledger(enabled=False))
    axis, world = mesh["cp"], mesh["world"]
    gen = torch.Generator().manual_seed(1)
    q, k, v = _inputs(args, args.seq, gen)
    dout = torch.randn(q.shape, generator=gen)
    res = {"balance": {}, "step": {}}
    shards = {o: [shard_sequence(t, axis.rank, c, o, dim=2) for t in (q, k, v, dout)] for o in ORDERS}
    samples: dict[str, list[float]] = {o: [] for o in ORDERS}
    for _ in range(args.reps + 1):  # interleaved, so load from outside hits every rank and order alike
        for order in ORDERS:
            for turn in range(c):
                dist.barrier()
                if turn == axis.rank:
                    t0 = time.perf_counter()
                    _rank_compute(*shards[order], axis.rank, c, order)
                    samples[order].append(time.perf_counter() - t0)
    for order in ORDERS:
        res["balance"][order] = comm.all_gather_object(statistics.median(samples[order][1:]), world)
    lq, lk, lv = (shard_sequence(t, axis.rank, c, "balanced", dim=2).requires_grad_() for t in (q, k, v))
    ldout = shard_sequence(dout, axis.rank, c, "balanced", dim=2)
    for name, attn in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        res["step"][name] = _slowest_rank(lambda: attn(lq, lk, lv, axis, causal=True).backward(ldout), world,
                                          args.reps)
    if axis.rank == 0:
        qf, kf, vf = (t.detach().clone().requires_grad_() for t in (q, k, v))
        gqa = args.heads != args.kv_heads
        res["step"]["sdpa_one_rank"] = _timed(
            lambda: F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=gqa).backward(dout), 2)
    if c == 2:
        res["step"]["torch_context_parallel"], res["peer_reason"] = _torch_peer(mesh, args, gen, args.reps)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048, help="global sequence length (a multiple of 8)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per batch")
    ap.add_argument("--heads", type=int, default=8, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dimension")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions per measurement (median)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    medians, ratios, peers = {}, {}, {}
    for c in (2, 4):
        r0 = run_local(_rank, c, c, args, timeout_s=600, wall_timeout_s=1800)[0]
        for order, per_rank in r0["balance"].items():
            ratio = max(per_rank) / min(per_rank)
            print(f"cp={c} {order:>10}: per-rank compute {', '.join(f'{t * 1e3:.1f}' for t in per_rank)} ms, "
                  f"max/min {ratio:.2f}")
            medians[f"compute_c{c}_{order}_max"] = max(per_rank)
            ratios[f"balance_max_over_min_c{c}_{order}"] = round(ratio, 3)
        for name, t in r0["step"].items():
            print(f"cp={c} step {name}: " + (f"{t * 1e3:.1f} ms" if t is not None else f"null ({r0['peer_reason']})"))
            medians[f"step_c{c}_{name}"] = t
        ratios[f"vs_ulysses_c{c}"] = round(r0["step"]["ring"] / r0["step"]["ulysses"], 3)
        if "peer_reason" in r0:
            peers["torch_context_parallel"] = {"step_s": r0["step"]["torch_context_parallel"],
                                               "reason": r0["peer_reason"]}
    ratios["vs_ulysses"] = ratios["vs_ulysses_c2"]
    config = {k: getattr(args, k) for k in ("seq", "batch", "heads", "kv_heads", "head_dim", "reps")}
    config.update(torch=torch.__version__, cores=os.cpu_count(), dtype="float32")
    print(json.dumps({"medians_s": {k: None if v is None else round(v, 5) for k, v in medians.items()},
                      "ratios": ratios,
                      "config": config, "peers": peers,
                      "absent": {k: p["reason"] for k, p in peers.items() if p["step_s"] is None}}))


if __name__ == "__main__":
    main()
