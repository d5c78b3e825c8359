"""Token dispatch + combine over ep on forked CPU gloo ranks: shardwise vs. Megatron-Core's alltoall dispatcher.

For ep = 2 and 4 (one rank per ep rank, E experts, k choices, N tokens per rank) and two routings,
  * balanced — every token picks k distinct experts uniformly at random;
  * skewed   — every token's first choice is expert 0, so ep rank 0 receives half of all rows
               (and some ranks may receive few);
we time forward (dispatch → weight → combine) and forward+backward, with identity experts so only
the dispatcher is measured. Megatron-Core's `MoEAlltoAllTokenDispatcher` (its six phases) runs on
the same tokens and routing; its outputs are checked against ours. Megatron assumes CUDA streams
for its device-to-host copies: the benchmark stubs them (no-ops on CPU) and hands split sizes over
as NumPy arrays, as its GPU path does. Megatron sends the router weights in a second all-to-all
and applies them on the expert side; we apply them after combine.

Each repetition runs every implementation once after a barrier, in a rotated order; a
repetition's time is the slower rank's; paired ratios are medians of per-repetition ratios
(same machine noise on both sides). The ledger gives our per-rank bytes. The last stdout line
is one JSON object (medians, ratios ours/megatron, bytes, config, and `absent`: a peer that could not
run, with the reason).

    python benchmarks/ep_dispatch.py --reps 20
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
import torch.distributed as dist  # noqa: E402

from shardwise import comm  # noqa: E402
from shardwise.comm import Ledger  # noqa: E402
from shardwise.expert_parallel import AllToAllDispatcher  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402
from shardwise.config import ParallelConfig  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402

ROUTINGS = ("balanced", "skewed")
SMOKE = {"tokens": 16, "dim": 16, "reps": 1, "warmup": 0}


def routing(kind: str, n: int, e: int, k: int, g: torch.Generator):
    """indices, weights [n, k]: k distinct experts per token (expert 0 first for every token if skewed)."""
    scores = torch.rand(n, e, generator=g)
    if kind == "skewed":
        scores[:, 0] += 1.0
    idx = scores.topk(k, dim=-1).indices
    w = torch.rand(n, k, generator=g).softmax(-1)
    return idx, w


# ---------------------------------------------------------------- implementations
def ours_step(disp: AllToAllDispatcher, x, idx, w, backward: bool):
    rows, handle = disp.dispatch(x, idx, w)
    out = disp.combine(rows, handle)
    if backward:
        out.backward(torch.ones_like(out))
    return out


class _NoStream:
    """Stands in for torch.cuda.Stream / Event on CPU: Megatron's side-stream copies become no-ops."""

    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    __hash__ = object.__hash__


def megatron_dispatcher(e: int, k: int, dim: int, group, single_group):
    """Megatron-Core's alltoall dispatcher for this rank; ImportError if megatron-core is missing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.transformer.moe.token_dispatcher as td
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.transformer_config import TransformerConfig
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda *a, **kw: _NoStream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: torch.device("cpu")
    td.maybe_move_tensor_to_cpu = lambda t, as_numpy=False, record_stream=False: (
        t.numpy() if as_numpy and torch.is_tensor(t) else t)
    # Megatron's count gather uses the deprecated all_gather_into_tensor name: not our concern here.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    ep, r = group.size(), group.rank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = TransformerConfig(num_layers=1, hidden_size=dim, num_attention_heads=4, num_moe_experts=e,
                                moe_router_topk=k, moe_token_dispatcher_type="alltoall",
                                expert_model_parallel_size=ep, use_cpu_initialization=True,
                                params_dtype=torch.float32, add_bias_linear=False)
    pgc = ProcessGroupCollection(ep=group, expt_tp=single_group, tp_ep=group)
    e_l = e // ep
    return td.MoEAlltoAllTokenDispatcher(e_l, list(range(r * e_l, (r + 1) * e_l)), cfg, pgc)


def megatron_step(d, x, idx, w, backward: bool):
    n, e = x.shape[0], d.num_experts
    rmap = torch.zeros(n, e, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.zeros(n, e, dtype=w.dtype).scatter_(1, idx, w)
    h, p = d.dispatch_preprocess(x, rmap, probs)
    h, p = d.token_dispatch(h, p)
    h, _, p = d.dispatch_postprocess(h, p)
    h = d.combine_preprocess(h * p.unsqueeze(-1))  # identity experts, weighted as Megatron's experts do
    out = d.combine_postprocess(d.token_combine(h))
    if backward:
        out.backward(torch.ones_like(out))
    return out


# ---------------------------------------------------------------- one rank
def _rank(args, seed):
    world = dist.get_world_size()
    mesh = Mesh.build(ParallelConfig.build(world, ep=world), torch.device("cpu"), Ledger())
    ep_axis = mesh["ep"]
    singles = [dist.new_group([i]) for i in range(world)]  # Megatron wants an expert-TP group of size 1
    try:
        mega, absent = megatron_dispatcher(args.experts, args.topk, args.dim, ep_axis.group,
                                           singles[dist.get_rank()]), {}
    except ImportError as e:  # reported in the JSON, not fatal: shardwise still runs
        mega, absent = None, {"megatron": f"megatron-core unavailable: {type(e).__name__}: {e}"}
    ours = AllToAllDispatcher(args.experts, ep_axis)
    impls = {"shardwise": ours_step, **({"megatron": megatron_step} if mega is not None else {})}
    objs = {"shardwise": ours, "megatron": mega}
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    times, nbytes, diff = {}, {}, {}
    for kind in ROUTINGS:
        idx, w = routing(kind, args.tokens, args.experts, args.topk, g)
        x0 = torch.randn(args.tokens, args.dim, generator=g)
        mesh.ledger.reset()
        ours_step(ours, x0, idx, w, False)
        nbytes[kind] = mesh.ledger.snapshot()["ep"]
        outs = {name: impls[name](objs[name], x0, idx, w, False) for name in impls}
        diff[kind] = {name: float((o - outs["shardwise"]).abs().max()) for name, o in outs.items()}
        for phase, bwd in (("fwd", False), ("fwd_bwd", True)):
            for rep in range(args.warmup + args.reps):
                names = list(impls)
                names = names[rep % len(names):] + names[:rep % len(names)]
                for name in names:
                    x = x0.clone().requires_grad_(bwd)
                    comm.barrier(ep_axis)
                    t0 = time.perf_counter()
                    impls[name](objs[name], x, idx, w, bwd)
                    dt = time.perf_counter() - t0
                    if rep >= args.warmup:
                        times.setdefault(f"{name}/{kind}/{phase}", []).append(dt)
    return {"times": times, "bytes": nbytes, "diff": diff, "absent": absent}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=512, help="hidden size")
    ap.add_argument("--experts", type=int, default=8, help="routed experts")
    ap.add_argument("--topk", type=int, default=2, help="experts per token")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case")
    ap.add_argument("--warmup", type=int, default=3, help="untimed repetitions per case")
    ap.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="ep degrees (one rank each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    medians, ratios, paired, bytes_out, diffs, absent = {}, {}, {}, {}, {}, {}
    for ep in args.ep:
        per_rank = run_local(_rank, ep, args, args.seed, timeout_s=600)
        absent |= per_rank[0]["absent"]
        steps = {key: [max(ts) for ts in zip(*(r["times"][key] for r in per_rank))]  # the slower rank's time
                 for key in per_rank[0]["times"]}
        for key, step in steps.items():
            medians[f"{key}/ep{ep}"] = statistics.median(step)
            if key.startswith("shardwise/") and "megatron/" + key[10:] in steps:
                mega = steps["megatron/" + key[10:]]
                paired[f"{key[10:]}/ep{ep}"] = statistics.median(a / b for a, b in zip(step, mega))
        for kind in ROUTINGS:
            rows = [r["bytes"][kind] for r in per_rank]
            bytes_out[f"{kind}/ep{ep}"] = {
                op.split(":")[1]: {"max_rank_bytes": max(r[op]["bytes"] for r in rows),
                                   "sum_bytes": sum(r[op]["bytes"] for r in rows),
                                   "sum_wire_bytes": sum(r[op]["wire_bytes"] for r in rows)}
                for op in rows[0]}
            diffs[f"{kind}/ep{ep}"] = max(max(r["diff"][kind].values()) for r in per_rank)
    print(f"{'case':40s} {'median ms':>10s}")
    for key, v in medians.items():
        print(f"{key:40s} {v * 1e3:10.2f}")
    have_mega = any(k.startswith("megatron/") for k in medians)
    if have_mega:
        for key, v in medians.items():
            if key.startswith("shardwise/"):
                ratios[key.split("/", 1)[1]] = v / medians["megatron/" + key.split("/", 1)[1]]
        for case, r in ratios.items():
            print(f"shardwise / megatron  {case:28s} {r:.3f}   (paired per-rep median {paired[case]:.3f})")
    print("bytes (dispatch/combine rows, forward):", json.dumps(bytes_out))
    print("max |ours − megatron| per case:", json.dumps(diffs))
    config = {"tokens_per_rank": args.tokens, "dim": args.dim, "experts": args.experts, "topk": args.topk,
              "reps": args.reps, "warmup": args.warmup, "dtype": "float32", "threads_per_rank": 1,
              "torch": torch.__version__}
    print(json.dumps({"medians_s": medians, "ratios": {"vs_megatron": ratios if have_mega else None},
                      "paired_ratios": paired if have_mega else None, "bytes": bytes_out,
                      "max_abs_diff_vs_megatron": diffs if have_mega else None,
                      "config": config, "absent": absent}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
