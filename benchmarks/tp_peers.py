"""One Llama block, forward+backward at tp=2 on 2 CPU gloo ranks: shardwise vs. its peers.

Peers, all built from the same seeded global weights and run on the same input:
  * shardwise — `build_model(cfg, mesh, seed).layers["0"]` (Megatron plan, one f/g per sub-block);
  * dtensor   — the plain `TransformerBlock` parallelised with PyTorch's
                `parallelize_module` + ColwiseParallel / RowwiseParallel on the "tp" sub-mesh;
  * megatron  — the same block assembled from Megatron-Core's ColumnParallelLinear /
                RowParallelLinear (fused QKV and fused gate/up fc1, as Megatron's own GPT layer
                does; `--megatron-unfused` uses one layer per projection instead).
Norms, RoPE and SDPA are the same code in all three, so the timings differ only in the
tensor-parallel machinery.

All three live in the same two processes; every repetition runs each implementation once, in a
rotated order, after a barrier. A repetition's time is the slower rank's; medians are reported.
The last stdout line is one JSON object (medians, ratios, config, and `absent`: a peer that could not
run, with the reason).

    python benchmarks/tp_peers.py --reps 30
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from shardwise.comm import Ledger  # noqa: E402
from shardwise.config import ModelConfig  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402
from shardwise.config import ParallelConfig  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.models.llama import apply_rope, rope_tables  # noqa: E402
from shardwise.models.params import init_of  # noqa: E402
from shardwise.parallelize import build_model, global_init, plain_model  # noqa: E402

TP = 2
IMPLS = ("shardwise", "dtensor", "megatron")
SMOKE = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn": 128, "seq": 16, "reps": 1, "warmup": 0}


# ---------------------------------------------------------------- peers
def plain_block(cfg: ModelConfig, seed: int) -> nn.Module:
    """The unsharded block with the same global weights shardwise draws (names as in the full model)."""
    model = plain_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(global_init(name, tuple(p.shape), init_of(p, name), cfg, seed))
    return model.layers["0"]


def dtensor_block(ref: nn.Module, mesh: Mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(), "feed_forward.w3": ColwiseParallel()}
    return parallelize_module(copy.deepcopy(ref), mesh.device_mesh["tp"], plan)


class MegatronBlock(nn.Module):
    """RMSNorm → GQA attention → residual → RMSNorm → SwiGLU → residual, with Megatron-Core TP linears.

    Activations stay [b, s, h] (Megatron's own layers are layout-agnostic without sequence
    parallelism), so attention is the very same code path as the other two.
    """

    def __init__(self, cfg: ModelConfig, ref: nn.Module, group, rank: int, fused: bool):
        super().__init__()
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        mcfg = ModelParallelConfig(tensor_model_parallel_size=TP, use_cpu_initialization=True,
                                   perform_initialization=False, params_dtype=torch.float32)
        init = nn.init.zeros_  # unused: weights are copied in below
        h, hd, f = cfg.dim, cfg.head_dim, cfg.ffn_dim
        self.hd, self.fused = hd, fused
        self.nq, self.nkv = cfg.n_heads * hd // TP, cfg.n_kv_heads * hd // TP  # local q / k features

        def col(n_in, n_out):
            return ColumnParallelLinear(n_in, n_out, config=mcfg, init_method=init, bias=False,
                                        gather_output=False, tp_group=group)

        def row(n_in, n_out):
            return RowParallelLinear(n_in, n_out, config=mcfg, init_method=init, bias=False,
                                     input_is_parallel=True, skip_bias_add=False, tp_group=group)

        a, m = ref.attention, ref.feed_forward

        def rows(w):  # this rank's output rows of a column-parallel weight
            return w.detach().chunk(TP, 0)[rank]

        self.attention_norm, self.ffn_norm = copy.deepcopy(ref.attention_norm), copy.deepcopy(ref.ffn_norm)
        if fused:
            self.linear_qkv = col(h, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd)
            self.linear_fc1 = col(h, 2 * f)
            with torch.no_grad():
                self.linear_qkv.weight.copy_(torch.cat([rows(a.wq.weight), rows(a.wk.weight), rows(a.wv.weight)]))
                self.linear_fc1.weight.copy_(torch.cat([rows(m.w1.weight), rows(m.w3.weight)]))
        else:
            kv = cfg.n_kv_heads * hd
            self.wq, self.wk, self.wv = col(h, cfg.n_heads * hd), col(h, kv), col(h, kv)
            self.w1, self.w3 = col(h, f), col(h, f)
            with torch.no_grad():
                for mine, theirs in ((self.wq, a.wq), (self.wk, a.wk), (self.wv, a.wv),
                                     (self.w1, m.w1), (self.w3, m.w3)):
                    mine.weight.copy_(rows(theirs.weight))
        self.linear_proj = row(cfg.n_heads * hd, h)
        self.linear_fc2 = row(f, h)
        with torch.no_grad():
            self.linear_proj.weight.copy_(a.wo.weight.detach().chunk(TP, 1)[rank])
            self.linear_fc2.weight.copy_(m.w2.weight.detach().chunk(TP, 1)[rank])

    def attention(self, x, cos, sin):
        if self.fused:
            q, k, v = self.linear_qkv(x)[0].split([self.nq, self.nkv, self.nkv], dim=-1)
        else:
            q, k, v = self.wq(x)[0], self.wk(x)[0], self.wv(x)[0]
        b, s = q.shape[:2]
        q = apply_rope(q.view(b, s, -1, self.hd), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(b, s, -1, self.hd), cos, sin).transpose(1, 2)
        v = v.view(b, s, -1, self.hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))[0]

    def feed_forward(self, x):
        if self.fused:
            gate, up = self.linear_fc1(x)[0].chunk(2, dim=-1)
        else:
            gate, up = self.w1(x)[0], self.w3(x)[0]
        return self.linear_fc2(F.silu(gate) * up)[0]

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


# ---------------------------------------------------------------- one rank
def _step(block, x, gy, cos, sin):
    out = block(x, cos, sin)
    out.backward(gy)
    return out


def rank_main(opts: dict) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    rank = dist.get_rank()
    mesh = Mesh.build(ParallelConfig.build(TP, dp=1, tp=TP), torch.device("cpu"), Ledger())
    cfg = ModelConfig(name="bench", dim=opts["dim"], n_layers=1, n_heads=opts["n_heads"],
                      n_kv_heads=opts["n_kv_heads"], ffn_dim=opts["ffn"], max_seq_len=opts["seq"])
    cfg.validate()
    seed = opts["seed"]

    ref = plain_block(cfg, seed)  # unsharded reference, run locally for the sanity check
    blocks: dict[str, nn.Module | None] = {"shardwise": build_model(cfg, mesh, seed).layers["0"],
                                           "dtensor": dtensor_block(ref, mesh)}
    absent = {}
    try:
        blocks["megatron"] = MegatronBlock(cfg, ref, mesh["tp"].group, mesh["tp"].rank, not opts["megatron_unfused"])
    except Exception as e:  # reported, not fatal: the other two still run
        blocks["megatron"] = None
        absent["megatron"] = f"megatron-core unavailable: {type(e).__name__}: {e}"
    impls = [k for k, v in blocks.items() if v is not None]

    gen = torch.Generator().manual_seed(seed + 1)  # same input and output-gradient on every rank
    x0 = torch.randn(opts["batch"], opts["seq"], cfg.dim, generator=gen)
    gy = torch.randn(opts["batch"], opts["seq"], cfg.dim, generator=gen)
    cos, sin = rope_tables(cfg.head_dim, opts["seq"], cfg.rope_theta, torch.device("cpu"))

    # Sanity: output and input-gradient of each TP block against the local unsharded block.
    x = x0.clone().requires_grad_(True)
    ref_out = _step(ref, x, gy, cos, sin).detach()
    ref_dx = x.grad.clone()
    diffs = {}
    for name in impls:
        x = x0.clone().requires_grad_(True)
        out = _step(blocks[name], x, gy, cos, sin).detach()
        diffs[name] = {"out": (out - ref_out).abs().max().item(), "dx": (x.grad - ref_dx).abs().max().item()}
        blocks[name].zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {k: [] for k in impls}
    xs = x0.clone().requires_grad_(True)
    for it in range(opts["warmup"] + opts["reps"]):
        order = impls[it % len(impls):] + impls[:it % len(impls)]  # rotate who goes first
        for name in order:
            blk = blocks[name]
            blk.zero_grad(set_to_none=True)
            xs.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            _step(blk, xs, gy, cos, sin)
            dt = time.perf_counter() - t0
            if it >= opts["warmup"]:
                times[name].append(dt)

    prof = None
    if opts["profile"]:
        from torch.profiler import ProfilerActivity, profile

        prof = {}
        for name in impls:
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(5):
                    blocks[name].zero_grad(set_to_none=True)
                    xs.grad = None
                    _step(blocks[name], xs, gy, cos, sin)
            if rank == 0:
                prof[name] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    return {"times": times, "diffs": diffs, "absent": absent, "profile": prof}


# ---------------------------------------------------------------- driver
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per implementation")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--megatron-unfused", action="store_true",
                    help="separate q/k/v and w1/w3 Megatron layers (default: fused QKV and fc1, Megatron's own layout)")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per implementation (rank 0)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.n_kv_heads % TP or args.n_heads % TP:
        ap.error(f"n_heads and n_kv_heads must be divisible by tp={TP}")
    opts = vars(args)

    per_rank = run_local(rank_main, TP, opts, timeout_s=600.0)
    absent = per_rank[0]["absent"]
    for reason in absent.values():
        print(reason)
    impls = list(per_rank[0]["times"])
    print(f"block dim={args.dim} heads={args.n_heads}/{args.n_kv_heads} ffn={args.ffn} batch={args.batch} "
          f"seq={args.seq}, tp={TP} on {TP} gloo ranks x 1 thread, {args.warmup} warm-up + {args.reps} reps, "
          f"torch {torch.__version__}")
    print("sanity (max abs diff vs unsharded block, worst rank):")
    sanity = {}
    for name in impls:
        out = max(r["diffs"][name]["out"] for r in per_rank)
        dx = max(r["diffs"][name]["dx"] for r in per_rank)
        sanity[name] = {"out": out, "dx": dx}
        flag = "" if max(out, dx) < 1e-4 else "  <-- MISMATCH: this implementation computes a different block"
        print(f"  {name:10s} out {out:.2e}  dx {dx:.2e}{flag}")
    medians = {}
    for name in impls:
        step = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]  # the slower rank's time
        medians[name] = statistics.median(step)
        q = statistics.quantiles(step, n=4) if len(step) > 1 else [step[0]] * 3
        print(f"  {name:10s} median {medians[name] * 1e3:8.2f} ms  (p25 {q[0] * 1e3:.2f}, p75 {q[2] * 1e3:.2f})")
    steps = {name: [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))] for name in impls}
    paired = {f"vs_{k}": statistics.median(a / b for a, b in zip(steps["shardwise"], steps[k]))
              for k in impls if k != "shardwise"}  # same repetition, same machine noise
    for k, r in paired.items():
        print(f"  paired per-rep ratio shardwise/{k[3:]}: median {r:.3f}")
    if per_rank[0]["profile"]:
        for name, table in per_rank[0]["profile"].items():
            print(f"\n=== profile: {name} (rank 0, 5 steps) ===\n{table}")
    for name in IMPLS:
        medians.setdefault(name, None)
    sw = medians["shardwise"]
    ratios = {f"vs_{k}": (sw / medians[k] if medians[k] else None) for k in ("dtensor", "megatron")}
    for k, r in ratios.items():
        if r is not None:
            print(f"shardwise / {k[3:]} = {r:.3f} ({'faster' if r < 1 else 'slower'})")
    config = {"dim": args.dim, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "ffn_dim": args.ffn,
              "batch": args.batch, "seq": args.seq, "tp": TP, "reps": args.reps, "warmup": args.warmup,
              "threads_per_rank": 1, "megatron_layout": "unfused" if args.megatron_unfused else "fused",
              "torch": torch.__version__}
    print(json.dumps({"medians_s": medians, "ratios": ratios, "config": config, "paired_ratios": paired,
                      "max_abs_diff": sanity, "absent": absent}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
