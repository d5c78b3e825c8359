"""`shardwise plan`: rank parallel layouts for a model on a cluster, or explain one layout in full.

`add_parser(subparsers)` registers the subcommand on an argparse subparsers object; `run(args)` executes
it and returns the exit status (0 ok, 1 nothing fits in memory, 2 bad input — including a GPU count or global
batch no layout divides — reported on one stderr line).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from shardwise.config import ConfigError
from shardwise.config.flags import plan_argument
from shardwise.hf.config import config_from_hf
from shardwise.hf.shapes import LENIENT_TYPES
from shardwise.planner.goodput import LLAMA3_MTBF_GPU_HOURS, FailureModel, goodput, goodput_lines
from shardwise.planner.errors import PlanError
from shardwise.planner.estimate import Assumptions, estimate
from shardwise.planner.hardware import GPU_PRESETS, Cluster, get_gpu
from shardwise.planner.layout import (
    DEFAULT_GLOBAL_BATCH, PRECISIONS, SCHEDULES, Layout, Workload, layout_problems, parse_layout,
)
from shardwise.commands.train_command import parse_train_flags, row_command
from shardwise.planner.activations import ACTIVATION_MODELS
from shardwise.planner.models import PRESETS, get_model, load_hf_config
from shardwise.planner.moe_skew import balanced_skew, check_skew, read_routing, skew_help
from shardwise.planner.peak import PEAK_TERMS
from shardwise.planner.search import SearchSpace, candidates, no_layout_reason, search
from shardwise.rules.hf_types import model_types

GB = 1e9
TABLE_AXES = ("tp", "cp", "pp", "emb", "dp_cp", "dp_shard", "dp_replicate", "ep", "edp")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="predict and rank parallel layouts for a model on a cluster (no GPUs needed)",
        description="Predict memory, FLOPs, communication, bubble and step time of parallel layouts; rank them. "
                    "The table's layout names and columns are explained under it (docs/planner.md).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    train_flag(src, "--model", presets=", ".join(PRESETS))
    train_flag(src, "--model-config", model_types=", ".join(LENIENT_TYPES),
               shapes_only=", ".join(t for t in LENIENT_TYPES if t not in model_types()))
    train_flag(p, "--mtp-layers")
    p.add_argument("--gpus", type=int, default=8, help="total GPUs (default 8)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the GPU preset's)")
    p.add_argument("--gpu", default="h100-80gb", help=f"GPU preset: {', '.join(GPU_PRESETS)} (default h100-80gb)")
    train_flag(p, "--seq-len")
    train_flag(p, "--global-batch", global_batch=DEFAULT_GLOBAL_BATCH)
    train_flag(p, "--micro-batch")
    train_flag(p, "--dtype", choices=list(PRECISIONS))
    train_flag(p, "--fp32-residual")
    train_flag(p, "--grad-reduce-dtype", choices=list(PRECISIONS))
    train_flag(p, "--optimizer")
    train_flag(p, "--zero")
    train_flag(p, "--dp-shard")
    train_flag(p, "--recompute")
    train_flag(p, "--sequence-parallel")
    train_flag(p, "--schedule", schedules=", ".join(SCHEDULES))
    train_flag(p, "--vp")
    p.add_argument("--max-vp", type=int, default=4, help="largest interleaved virtual-stage count to search (default 4)")
    train_flag(p, "--cp-impl")
    p.add_argument("--max-cp", type=int, help="largest context-parallel degree to search (default: all)")
    p.add_argument("--allow-tp-cross-node", action="store_true",
                   help="let TP groups span NVLink domains (off: TP stays within one)")
    p.add_argument("--uneven-pp", action="store_true", help="allow stages with unequal layer counts")
    p.add_argument("--flops-efficiency", type=float, default=0.6,
                   help="assumed achievable fraction of peak dense FLOP/s (default 0.6)")
    p.add_argument("--link-efficiency", type=float, default=0.8,
                   help="assumed achievable fraction of link bandwidth (default 0.8)")
    p.add_argument("--dp-overlap", type=float, default=0.0,
                   help="fraction of gradient-reduction time hidden behind backward (default 0)")
    train_flag(p, "--tp-overlap")
    train_flag(p, "--fp8")
    train_flag(p, "--fp8-all-gather")
    p.add_argument("--usable-memory", type=float, default=0.9, help="fraction of GPU memory to plan for (default 0.9)")
    p.add_argument("--activation-model", default="shardwise", choices=ACTIVATION_MODELS,
                   help="activation memory: what shardwise saves (default) or Korthikanti et al. 2022's formula")
    routing = p.add_mutually_exclusive_group()
    for flag, text in skew_help("plan").items():
        routing.add_argument(flag, type=float if flag == "--moe-skew" else str,
                             metavar="S" if flag == "--moe-skew" else "RUN_DIR", help=text)
    train_flag(p, "--expert-placement")
    p.add_argument("--top", type=int, default=10, help="best layouts to print, as table rows or --json objects (default 10)")
    p.add_argument("--explain", metavar="LAYOUT",
                   help="full breakdown of one layout, e.g. 'dp=8,tp=8,pp=4' (keys: dp tp pp cp ep vp mb m "
                        "schedule zero recompute sp cp_impl), or a train command's flags, e.g. "
                        "'--dp 2 --tp 2 --pp 2 --schedule 1f1b' (train's defaults for the rest)")
    p.add_argument("--trace", type=int, metavar="K",
                   help="simulate the best K rows on fake tensors (shardwise simulate, one process, one row after "
                        "another) and show each one's traced live peak; a row whose traced peak does not fit loses "
                        "its 'fits'")
    p.add_argument("--mtbf-gpu-hours", type=float, default=None, metavar="H",
                   help="GPU-hours between failures; given, the table adds goodput columns (JSON and --explain always "
                        f"carry them, at the Llama 3 report's {LLAMA3_MTBF_GPU_HOURS:,.0f} by default)")
    p.add_argument("--storage-gbps", type=float, default=100.0,
                   help="checkpoint storage bandwidth for the job, GB/s (default 100)")
    p.add_argument("--restart-s", type=float, default=180.0,
                   help="seconds from a failure to a restarted worker group, state not counted (default 180)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
    return p


def train_flag(parser, name: str, **facts) -> None:
    """A train flag on plan's parser, as the flag table declares it for plan (`config.flags.PLAN_FLAGS`)."""
    names, kw = plan_argument(name, **facts)
    parser.add_argument(*names, **kw)


def _inputs(args):
    spec = load_hf_config(args.model_config) if args.model_config else get_model(args.model)
    if args.mtp_layers:
        try:
            spec = spec.with_overrides(mtp_layers=args.mtp_layers)
            spec.validate()
        except ConfigError as e:
            raise PlanError(str(e)) from None
    gpu = get_gpu(args.gpu)
    cluster = Cluster(gpu, args.gpus, args.gpus_per_node or gpu.gpus_per_node)
    for name in ("seq_len", "global_batch", "micro_batch", "top", "max_vp", "max_cp", "vp"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise PlanError(f"--{name.replace('_', '-')} {v} must be positive")
    for name in ("flops_efficiency", "link_efficiency", "usable_memory"):
        if not 0 < getattr(args, name) <= 1:
            raise PlanError(f"--{name.replace('_', '-')} {getattr(args, name)} must be in (0, 1]")
    if args.trace is not None and args.trace < 0:
        raise PlanError(f"--trace {args.trace} must be >= 0 (the number of best rows to simulate)")
    if args.trace and args.explain is not None:
        raise PlanError("--trace simulates ranked rows; to trace one layout run `shardwise simulate` with its flags")
    if not 0 <= args.dp_overlap <= 1:
        raise PlanError(f"--dp-overlap {args.dp_overlap} must be in [0, 1]")
    check_skew(args.moe_skew)
    if args.fp8_all_gather and not args.fp8:
        raise PlanError("--fp8-all-gather needs --fp8 RECIPE (tensorwise, rowwise, blockwise or mxfp8)")
    wl = Workload(args.seq_len, args.global_batch or DEFAULT_GLOBAL_BATCH, args.precision, args.fp32_residual,
                  args.grad_reduce_dtype, args.optimizer, moe_skew=args.moe_skew or 1.0,
                  moe_routing=read_routing(args.routing, spec.moe_experts) if args.routing else None,
                  expert_placement=args.expert_placement, fp8=args.fp8,
                  fp8_all_gather=args.fp8_all_gather)
    assume = Assumptions(args.flops_efficiency, args.link_efficiency, args.dp_overlap, args.usable_memory,
                         args.activation_model, args.tp_overlap)
    return spec, cluster, wl, assume


def run(args) -> int:
    try:
        spec, cluster, wl, assume = _inputs(args)
        if args.explain is not None:
            return _explain(args, spec, cluster, wl, assume)
        return _search(args, spec, cluster, wl, assume)
    except PlanError as e:
        print(f"shardwise plan: error: {e}", file=sys.stderr)
        return 2


def model_flags(args) -> list[str]:
    mtp = ["--mtp-layers", str(args.mtp_layers)] if args.mtp_layers else []
    return (["--model-config", args.model_config] if args.model_config else ["--model", args.model]) + mtp


def _explain(args, spec, cluster, wl, assume) -> int:
    text = args.explain.strip()
    if text.startswith("-") or text.split(" ", 1)[0] in ("shardwise", "torchrun", "train"):
        lay, wl_fields = parse_train_flags(text, cluster.gpus, args.global_batch, (args.model_config or args.model),
                                          spec.n_layers, spec.mtp_layers)
        wl = replace(wl, **wl_fields)
        uneven = args.uneven_pp or "--pp-layers" in text
    else:
        base = Layout(mb=args.micro_batch or 1, zero=args.zero, recompute=args.recompute,
                      sequence_parallel=args.sequence_parallel, cp_impl=args.cp_impl)
        lay, uneven = parse_layout(text, base, cluster.gpus, args.global_batch), args.uneven_pp
    bad = layout_problems(spec, lay, cluster.gpus, wl.seq_len, uneven, wl.fp8)
    if bad:
        raise PlanError(f"--explain {args.explain!r}: " + "; ".join(bad))
    wl = replace(wl, global_batch=lay.m * lay.mb * lay.dp)
    est = estimate(spec, cluster, lay, wl, assume, detail=True)
    if est.get("moe_skew", 1.0) != 1.0:  # the busiest ep rank beside the mean one
        est["moe_mean"] = mean_rank(estimate(spec, cluster, lay, replace(wl, moe_skew=1.0, moe_routing=None), assume))
        est["moe_balanced_placement_skew"] = balanced_skew(spec, lay, wl)
    est |= runnable(row_command(model_flags(args), spec, cluster, lay, wl))
    est["goodput"] = row_goodput(est, cluster, wl, assume, failure_model(args))
    print(json.dumps(est, indent=2) if args.json else explain_text(est))
    return 0


def mean_rank(est: dict) -> dict:
    """The figures --explain sets beside the busiest ep rank's: the same layout under balanced routing."""
    return {k: est[k] for k in ("peak_bytes_per_rank", "activation_bytes_per_rank", "step_time_s", "fits",
                                "comm_bytes_per_step_max")}


def _search(args, spec, cluster, wl, assume) -> int:
    schedules = tuple(s.strip() for s in args.schedules.split(",") if s.strip())
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise PlanError(f"--schedules: unknown {', '.join(unknown)}; valid: {', '.join(SCHEDULES)}")
    space = SearchSpace(
        zero=args.zero, recompute=args.recompute, sp=args.sequence_parallel,
        micro_batches=(args.micro_batch,) if args.micro_batch else (1, 2, 4, 8), schedules=schedules,
        max_vp=args.max_vp, max_cp=args.max_cp, allow_tp_cross_domain=args.allow_tp_cross_node,
        uneven_pp=args.uneven_pp, vp=args.vp, cp_impl=args.cp_impl, dp_shard=args.dp_shard,
    )
    results = search(spec, cluster, wl, space, assume)
    n_valid = sum(1 for _ in candidates(spec, cluster, wl, space)) if not results else None
    if n_valid == 0:
        raise PlanError(no_layout_reason(spec, cluster, wl, space))
    fm = failure_model(args)
    for r in results[: args.top]:
        r |= runnable(row_command(model_flags(args), spec, cluster, Layout.from_dict(r["layout"]), wl))
        r["goodput"] = row_goodput(r, cluster, wl, assume, fm)
    if args.trace:
        from shardwise.commands.plan_trace import trace_rows

        model = args.model if not args.model_config or spec.untrainable else config_from_hf(args.model_config)
        trace_rows(results[: args.top], args.trace, model, spec, wl, args.mtp_layers)
    if args.json:
        print(json.dumps(results[: args.top], indent=2))
    if not results:
        print(f"shardwise plan: no layout fits ({n_valid} valid layouts, none within "
              f"{cluster.gpu.memory_bytes * assume.usable_memory / GB:.0f} GB per GPU); try more GPUs, "
              f"--zero 3, --recompute full, a smaller --micro-batch or --uneven-pp", file=sys.stderr)
        return 1
    if not args.json:
        print(table(results[: args.top], spec, cluster, wl, space, assume, len(results), traced=bool(args.trace),
                    goodput=args.mtbf_gpu_hours is not None))
    return 0


def failure_model(args) -> FailureModel:
    mtbf = LLAMA3_MTBF_GPU_HOURS if args.mtbf_gpu_hours is None else args.mtbf_gpu_hours
    for name, v in (("--mtbf-gpu-hours", mtbf), ("--storage-gbps", args.storage_gbps), ("--restart-s", args.restart_s)):
        if not v > 0:
            raise PlanError(f"{name} {v} must be positive")
    return FailureModel(mtbf, args.storage_gbps * 1e9, args.restart_s)


def row_goodput(row: dict, cluster: Cluster, wl: Workload, assume: Assumptions, fm: FailureModel) -> dict:
    """The row's goodput terms (`planner.goodput`): its state per rank is its weights and optimizer state."""
    br = row["static_breakdown_per_rank"]
    return goodput(cluster.gpus, row["step_time_s"], row["params_total"], br["weights"] + br["optimizer"],
                   cluster.gpu.internode_bytes_per_s * assume.link_efficiency, wl.optimizer, fm)


def runnable(command: dict) -> dict:
    """A row's `row_command` fields plus "trainable": whether `shardwise train` runs its command as printed (False
    for a model train cannot build, "untrainable", and for flags train refuses, "command_refused")."""
    return command | {"trainable": command["command"] is not None and command["command_refused"] is None}


def _header(spec_name: str, params: int, cluster: Cluster, wl: Workload) -> str:
    fp8 = f", --fp8 {wl.fp8}{' (FP8 all-gathers)' if wl.fp8_all_gather else ''}; MFU of the FP8 peak" if wl.fp8 else ""
    skew = ("; MoE routing recorded (the busiest ep rank planned)" if wl.moe_routing else
            f"; MoE busiest ep rank at {wl.moe_skew:g}x the mean" if wl.moe_skew != 1.0 else "")
    return (f"{spec_name} ({params / 1e9:.2f}B params) on {cluster.describe()}; "
            f"seq {wl.seq_len}, global batch {wl.global_batch}, {wl.precision}{fp8}{skew}")


def sp_state(rows: list[dict], asked: bool) -> str:
    """The header's SP state, true to the rows: SP needs tp > 1, so a tp1 row runs without it whatever was asked."""
    on = [r["layout"]["sp"] for r in rows]
    if all(on):
        return "SP on"
    if not any(on):
        return "SP off" + (" (it needs tp > 1)" if asked else "")
    return "SP on where tp > 1 (rows marked sp)"


AXIS_MEANING = {
    "tp": "tensor-parallel collectives", "cp": "context-parallel K/V exchange",
    "pp": "activations and gradients between stages", "emb": "the tied embedding's gradient between first and last stage",
    "dp_cp": "gradient reduction over dp×cp", "dp_shard": "ZeRO 2/3 traffic inside a hybrid shard group",
    "dp_replicate": "gradient all-reduce across hybrid replicas", "ep": "MoE token all-to-all",
    "edp": "expert gradients over the dp×cp ranks left once ep is carved out",
}
"""What each axis's "<axis> GB" column (and --explain's comm table) counts."""


def legend(rows: list[dict], names: list[str], axes: list[str]) -> list[str]:
    """The table's key: the layout name's tokens that occur in it, then the columns."""
    tokens = ["dpN tpN ppN (cpN epN where > 1): degrees", "mbN: sequences per microbatch",
              "mN: microbatches per step per dp rank"]
    if any(Layout.from_dict(r["layout"]).pp > 1 for r in rows):
        tokens.insert(1, "1f1b/interleaved/vN: pipeline schedule, N chunks per rank")
    if any(" hs" in n for n in names):
        tokens.append("hsN: hybrid sharding, ZeRO shards over N dp ranks, dp/N replicas")
    if any(n.endswith(" sp") for n in names):
        tokens.append("sp: sequence parallelism")
    comm = "; ".join(f"{a}: {AXIS_MEANING[a]}" for a in axes)
    return ["layout: " + "; ".join(tokens) + ".",
            "GB per rank: static = weights, gradients, optimizer state; act = activations held; total = static + act; "
            "peak = the step's live peak. bubble: the pipeline's idle fraction. step s: estimated step time; MFU: model "
            "FLOP/s over peak.",
            *([f"<axis> GB: payload per step on the busiest rank of the axis; {comm}."] if axes else [])]


def table(rows: list[dict], spec, cluster: Cluster, wl: Workload, space: SearchSpace, assume: Assumptions,
          n_fit: int, traced: bool = False, goodput: bool = False) -> str:
    """Fixed-width ranking: layout, memory breakdown, bubble, per-axis traffic, step time and MFU; with
    `traced`, each simulated row's traced peak (blank for rows not simulated) and why a row no longer fits."""
    names = [Layout.from_dict(r["layout"]).short() for r in rows]
    axes = [a for a in TABLE_AXES if any(r["comm_bytes_per_step_max"].get(a) for r in rows)]
    refused = not all(r["trainable"] for r in rows)
    cols = [("#", 3), ("layout", max(map(len, names))), ("params/rank", 11), ("static GB", 9), ("act GB", 7),
            ("total GB", 8), ("peak GB", 7)] + [("traced GB", 9)] * traced + [("bubble", 6)]
    cols += [(f"{a} GB", max(8, len(a) + 3)) for a in axes] + [("step s", 7), ("MFU", 5)] + [("train", 5)] * refused
    cols += [("good disk", 9), ("save-every", 10), ("good mem", 8), ("mem-every", 9)] * goodput

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, (_, w)) in enumerate(zip(cells, cols)))

    out = [_header(spec.name, rows[0]["params_total"], cluster, wl),
           f"ZeRO-{space.zero}, recompute {space.recompute}, {sp_state(rows, space.sp)}; "
           f"{n_fit} layouts fit in {rows[0]['usable_bytes_per_rank'] / GB:.1f} GB per GPU; best {len(rows)}:"]
    if spec.untrainable:
        out.append(f"! {spec.untrainable}: the rows plan its shapes only; no row has a command (train column: no)")
    out += ["", line([c for c, _ in cols]), line(["-" * w for _, w in cols])]
    for i, (r, name) in enumerate(zip(rows, names), 1):
        comm = r["comm_bytes_per_step_max"]
        cells = [str(i), name, f"{r['params_per_rank'] / 1e9:.2f}B", f"{r['static_bytes_per_rank'] / GB:.1f}",
                 f"{r['activation_bytes_per_rank'] / GB:.1f}", f"{r['total_bytes_per_rank'] / GB:.1f}",
                 f"{r['peak_bytes_per_rank'] / GB:.1f}"]
        if traced:
            t = r.get("traced", {})
            cells.append(f"{t['peak_bytes'] / GB:.1f}" if "peak_bytes" in t else "")
        cells.append(f"{r['bubble_fraction']:.3f}")
        cells += [f"{comm[a] / GB:.1f}" if a in comm else "-" for a in axes]
        cells += [f"{r['step_time_s']:.2f}", f"{r['mfu']:.3f}"] + [("yes" if r["trainable"] else "no")] * refused
        if goodput:
            gp = r["goodput"]
            cells += [f"{gp['goodput_disk']:.3f}", str(gp["save_every"]), f"{gp['goodput_mem']:.3f}",
                      str(gp["mem_ckpt_every"])]
        out.append(line(cells))
        out += command_lines(r, "     ", spec.untrainable) + trace_lines(r, "     ")
    out += ["", *legend(rows, names, axes),
            f"Assumed {assume.flops_efficiency:.0%} of peak FLOP/s and {assume.link_efficiency:.0%} of link bandwidth.",
            "Each row's $ line is the command that runs it (torchrun: on every node, HEAD_NODE_IP = node 0's address).",
            f"Details of #1: --explain \"{rows[0]['layout_str']}\""]
    if goodput:
        out.insert(-1, "good disk / good mem: expected goodput with disk checkpoints every save-every steps (Young–Daly) "
                       "or memory copies to a peer node every mem-every steps (docs/fault-tolerance.md)")
    return "\n".join(out)


def explain_text(est: dict) -> str:
    """Human-readable breakdown of one `estimate(..., detail=True)`."""
    lay, br = est["layout"], est["static_breakdown_per_rank"]

    def g(b: float) -> str:
        return f"{b / GB:,.2f} GB"

    out = [
        f"{est['model']}: {est['params_total'] / 1e9:.2f}B parameters on {est['cluster']}",
        "layout: " + est["layout_str"],
        "",
        "memory per rank (largest stage)",
        f"  parameters        {est['params_per_rank'] / 1e9:,.3f}B",
        f"  weights (fp32)    {g(br['weights'])}",
        f"  grads (fp32)      {g(br['grads'])}",
        f"  ZeRO-1 buffers    {g(br.get('grad_buffers', 0))}  (flat-buffer padding, shard gradient, grad-norm weights)",
        f"  Adam moments      {g(br['optimizer'])}",
        f"  static            {g(est['static_bytes_per_rank'])}",
        f"  activations       {g(est['activation_bytes_per_rank'])}  (recompute {lay['recompute']}, "
        f"SP {'on' if lay['sp'] else 'off'})",
        f"  total             {g(est['total_bytes_per_rank'])}  (static + activations)",
        f"  live peak         {g(est['peak_bytes_per_rank'])} of {g(est['usable_bytes_per_rank'])} usable: "
        f"{'fits' if est['fits'] else 'DOES NOT FIT'}  (+ the step's transient buffers)",
        "",
        "per stage (each rank of it)",
    ]
    for st in est["stages"]:
        extra = (" +embedding" if st["embedding"] else "") + (" +head" if st["head"] else "")
        out.append(f"  stage {st['stage']:>3}: {st['layers']:>3} layers{extra:17} params {st['params'] / 1e9:7.3f}B  "
                   f"static {g(st['static_bytes'])}  activations {g(st['activation_bytes'])}  "
                   f"total {g(st['total_bytes'])}  peak {g(st['peak_bytes'])}  "
                   f"{st['microbatch_time_s'] * 1e3:8.2f} ms/microbatch")
    out += peak_lines(est, g) + skew_lines(est)
    out += [
        "",
        f"compute: model {est['model_flops_per_step']:.3e} FLOP/step, hardware {est['hardware_flops_per_step']:.3e}"
        f" (with recompute); {est['compute_time_s']:.3f} s per step on the busiest stage",
        f"pipeline: schedule {lay['schedule']}, pp={lay['pp']}, vp={lay['vp']}, m={lay['m']}: bubble "
        f"{est['bubble_fraction']:.4f} ({est['bubble_source']})",
        "",
        f"communication per step, {est['comm_rank']}:",
        f"  {'axis':6} {'op':24} {'count':>8} {'payload':>10} {'wire':>10} {'link':>8} {'time s':>8}",
    ]
    for axis, ops in est["comm_ops_per_step"].items():
        for i, (op, e) in enumerate(ops.items()):
            head = (axis, est["comm_links"].get(axis, "-"), f"{est['comm_time_s'][axis]:.3f}") if i == 0 else ("", "", "")
            out.append(f"  {head[0]:6} {op:24} {e['count']:>8} {human_bytes(e['bytes']):>10} "
                       f"{human_bytes(e['wire_bytes']):>10} {head[1]:>8} {head[2]:>8}")
    a = est["assumptions"]
    out += [
        *_comm_notes(est["comm_ops_per_step"]),
        *_tp_overlap_lines(est),
        "",
        f"step time {est['step_time_s']:.3f} s, MFU {est['mfu']:.3f}{_fp8_mfu(est)}, "
        f"{est['tokens_per_s']:,.0f} tokens/s "
        f"(assumed {a['flops_efficiency']:.0%} of peak FLOP/s, {a['link_efficiency']:.0%} of link bandwidth, "
        f"{a['dp_overlap']:.0%} of grad sync overlapped)",
        "",
        "run it:",
        *command_lines(est, "  "),
    ]
    if "goodput" in est:
        out += ["", "under failures (Young–Daly; --mtbf-gpu-hours, --storage-gbps, --restart-s)",
                *(f"  {x}" for x in goodput_lines(est["goodput"]))]
    return "\n".join(out)


def _fp8_mfu(est: dict) -> str:
    """Under --fp8: whose peak the MFU is of, and the MFU against the bf16 peak beside it."""
    if not est.get("fp8"):
        return ""
    return (f" of the FP8 peak ({est['peak_flops_per_gpu'] / 1e12:,.0f} TFLOP/s; --fp8 {est['fp8']}), "
            f"{est['mfu_bf16_equivalent']:.3f} bf16-equivalent")


def _comm_notes(axes) -> list[str]:
    """When each axis's time is paid; the expert axes only where the step has them (a dense model has none)."""
    path = "tp, pp and ep" if "ep" in axes else "tp and pp"
    after = "dp_cp and edp" if "edp" in axes else "dp_cp"
    out = [f"  ({path} time is on every microbatch's critical path; the cp ring hides behind attention;",
           f"   {after} reductions run after the last backward)"]
    return out + [f"  (edp: {AXIS_MEANING['edp']})"] * ("edp" in axes)


def _tp_overlap_lines(est: dict) -> list[str]:
    """Exposed TP time per layer with and without --tp-overlap (planner/tp_overlap.py), under SP."""
    t = est.get("tp_exposed_per_layer")
    if t is None:
        return []
    used = "on" if est["assumptions"]["tp_overlap"] or est.get("tp_overlap") else "off"
    return [f"  exposed TP time per layer and microbatch: {t['exposed_plain_s'] * 1e3:.3f} ms without --tp-overlap "
            f"({t['messages_plain']} messages), {t['exposed_overlap_s'] * 1e3:.3f} ms with it ({t['messages_overlap']} "
            f"messages; {t['comm_s'] * 1e3:.3f} ms of bytes, {t['gemm_s'] * 1e3:.3f} ms of GEMMs to hide them); "
            f"--tp-overlap {used} in the step time",
            f"  --tp-overlap-auto: {est['tp_overlap_auto']['why']}"]


def peak_lines(est: dict, g) -> list[str]:
    """The largest stage's live peak: its worst moment and the terms that make it up."""
    st = max(est["stages"], key=lambda s: s["peak_bytes"])
    terms = st["peak_terms"]
    out = ["", f"live peak of stage {st['stage']}: {g(st['peak_bytes'])}, at {terms['moment']}"]
    out += [f"  {k:23} {g(terms[k]):>12}  {what}" for k, what in PEAK_TERMS.items() if terms.get(k)]
    return out


def skew_lines(est: dict) -> list[str]:
    """Under skewed MoE routing: the busiest ep rank (what the plan is for) beside the mean rank, and with a recorded
    histogram what an even placement of its experts would leave."""
    mean = est.get("moe_mean")
    if mean is None:
        return []
    ep, b = est["comm_bytes_per_step_max"].get("ep", 0), human_bytes
    out = ["", f"MoE routing: the busiest ep rank receives {est['moe_skew']:.3g}x the mean rows (planned above)",
           f"  {'':12} {'busiest':>12} {'mean':>12}",
           f"  {'peak':12} {b(est['peak_bytes_per_rank']):>12} {b(mean['peak_bytes_per_rank']):>12}",
           f"  {'activations':12} {b(est['activation_bytes_per_rank']):>12} {b(mean['activation_bytes_per_rank']):>12}",
           f"  {'ep bytes':12} {b(ep):>12} {b(mean['comm_bytes_per_step_max'].get('ep', 0)):>12}",
           f"  {'step time':12} {est['step_time_s'] * 1e3:>9.1f} ms {mean['step_time_s'] * 1e3:>9.1f} ms",
           f"  {'fits':12} {'yes' if est['fits'] else 'NO':>12} {'yes' if mean['fits'] else 'NO':>12}"]
    placed = est.get("moe_balanced_placement_skew")
    if placed is not None:
        out.append(f"  the recorded experts placed for an even load over ep (each layer its own permutation) would make "
                   f"the busiest rank {placed:.3g}x the mean")
    return out


def trace_lines(row: dict, indent: str) -> list[str]:
    """Why a traced row does not fit (its traced peak beyond the usable memory), or why it was not traced."""
    t = row.get("traced")
    if t is None:
        return []
    if "error" in t:
        return [f"{indent}! not traced: {t['error']}"]
    if not t["fits"]:
        return [f"{indent}! DOES NOT FIT: traced peak {t['peak_bytes'] / GB:.1f} GB > {row['usable_bytes_per_rank'] / GB:.1f} "
                f"GB usable (planned {t['planned_peak_bytes'] / GB:.1f} GB)"]
    return []


def command_lines(row: dict, indent: str, said: str = "") -> list[str]:
    """The row's command ($ line), or why there is none (briefly when the header `said` it), and the trainer's
    refusal if it has one."""
    if row["command"] is None:
        return [f"{indent}(no command: {'see above' if said == row['untrainable'] else row['untrainable']})"]
    refused = [f"{indent}! shardwise train refuses it today: {row['command_refused']}"] if row["command_refused"] else []
    return [f"{indent}$ {row['command']}"] + refused


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run(args)
