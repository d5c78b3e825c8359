"""`shardwise simulate TRAIN-FLAGS [--ranks stages|all|R,R,...] [--steps N] [--json]`.

Runs chosen ranks of the layout's whole world, one after another in this process, on fake tensors
(`world.simulate_rank`), and sets each beside the planner's prediction for its pipeline stage. Exit 0
when every rank is within the bounds below, 1 otherwise, 2 on bad input (one line, before any rank runs).
"""
from __future__ import annotations

import json
import math
import sys
import time
from types import SimpleNamespace

from ..rules.geometry import rank_of

BOUNDS = {"static_bytes": 0.01, "activation_bytes": 0.02, "peak_bytes": 0.03}
"""Largest relative difference |measured − planned| / planned accepted per figure; comm bytes must be equal."""


def add_parser(sub) -> None:
    from ..config.args import add_run_flags

    p = sub.add_parser("simulate", help="run ranks of a full-size layout on fake tensors, against the planner")
    add_run_flags(p, "simulate")
    p.add_argument("--ranks", default="stages",
                   help="stages (first rank of every pipeline stage; default), all, or global ranks R,R,...")
    p.add_argument("--every-microbatch", action="store_true",
                   help="run every microbatch of each step (default: only those the rank's schedule needs to show "
                        "every moment of the step, its traffic scaled to the full count)")
    from ..planner.moe_skew import skew_help

    routing = p.add_mutually_exclusive_group()
    for flag, text in skew_help("simulate").items():
        routing.add_argument(flag, type=float if flag == "--moe-skew" else str,
                             metavar="S" if flag == "--moe-skew" else "RUN_DIR", help=text)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.set_defaults(func=main)


def choose_ranks(text: str, world: int, pp: int, cp: int, tp: int) -> list[int]:
    """Global ranks to simulate. `stages`: (dp, cp, tp) = 0 on every pipeline stage — with balanced routing
    and the balanced cp order every other rank of a stage holds the same shapes."""
    from ..config import ConfigError

    if text == "stages":
        grid = SimpleNamespace(pp=pp, cp=cp, tp=tp)  # rank_of reads no dp
        return [rank_of(grid, dict(dp=0, pp=s, cp=0, tp=0)) for s in range(pp)]
    if text == "all":
        return list(range(world))
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--ranks {text!r}: expected stages, all or comma-separated global ranks") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ConfigError(f"--ranks {text!r}: rank {bad[0] if bad else '(none)'} is outside the world of "
                          f"{world} ranks (0..{world - 1})")
    return ranks


def _close(measured: float, planned: float, tol: float) -> bool:
    return math.isclose(measured, planned, rel_tol=tol, abs_tol=0)


def compare(measured: dict, planned: dict) -> dict:
    """One rank's report: each figure as {measured, planned}, and whether all are within bounds."""
    row = {"rank": measured["rank"], "stage": measured["stage"]}
    ok = True
    for key, tol in BOUNDS.items():
        row[key] = {"measured": measured[key], "planned": planned[key]}
        ok &= _close(measured[key], planned[key], tol)
    axes = sorted(set(measured["comm_bytes"]) | set(planned["comm_bytes"]))
    row["comm_bytes"] = {a: {"measured": measured["comm_bytes"].get(a, 0), "planned": planned["comm_bytes"].get(a, 0)}
                         for a in axes}
    ok &= all(v["measured"] == v["planned"] for v in row["comm_bytes"].values())
    row["peak_phase"] = measured["peak_phase"]
    row["build_peak_bytes"] = measured["build_peak_bytes"]
    row["top_live"] = measured["top_live"]
    row["microbatches_run"] = measured["microbatches_run"]
    row["microbatches_scaled"] = measured["microbatches_scaled"]
    row["wall_s"] = round(measured["wall_s"], 2)
    row["passed"] = bool(ok)
    return row


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def render(report: dict) -> str:
    head = (f"simulated {report['model']} on {report['layout']} (world {report['world']}), "
            f"{report['steps']} steps per rank on fake tensors")
    lines = [head + (f"; {report['routing']}" if report["routing"] else ""),
             f"{'rank':>6} {'stage':>5}  {'static GiB':>21}  {'activations GiB':>21}  {'peak GiB':>21}  ok"]
    for r in report["ranks"]:
        cells = []
        for key in BOUNDS:
            m, p = r[key]["measured"], r[key]["planned"]
            cells.append(f"{_gib(m):>8}/{_gib(p):<8} {m / p if p else float('nan'):5.3f}")
        lines.append(f"{r['rank']:>6} {r['stage']:>5}  " + "  ".join(cells) + f"  {'yes' if r['passed'] else 'NO'}")
        comm = ", ".join(f"{a} {v['measured'] / 2**20:.2f}" + ("" if v["measured"] == v["planned"] else
                                                                f" (planned {v['planned'] / 2**20:.2f})")
                         for a, v in r["comm_bytes"].items())
        lines.append(f"{'':13}comm MiB/step: {comm or 'none'}")
        top = "; ".join(f"{t['group']} {_gib(t['bytes'])}" for t in r["top_live"])
        lines.append(f"{'':13}peak during {r['peak_phase']}: {top}")
        lines.append(f"{'':13}model build peak {_gib(r['build_peak_bytes'])} GiB (before the first step)")
        if "peer_copy_host_bytes" in r:  # --mem-ckpt-every: host memory, not the device's
            c = r["peer_copy_host_bytes"]
            lines.append(f"{'':13}memory copies (own + ward's) {_gib(c['measured'])} GiB host memory "
                         f"(planned {_gib(c['planned'])})")
        if r["microbatches_scaled"]:
            lines.append(f"{'':13}ran {r['microbatches_run']} of {r['microbatches_run'] + r['microbatches_scaled']} "
                         f"microbatches per step; the traffic of the other {r['microbatches_scaled']} is counted from "
                         f"a steady period")
    lines.append(f"{'passed' if report['passed'] else 'FAILED'} (bounds: static 1%, activations 2%, peak 3%, "
                 f"comm bytes equal) in {report['wall_s']:.1f} s")
    return "\n".join(lines)


def run(cfg, ranks: list[int], steps: int, every_microbatch: bool = False, routing: dict | None = None) -> dict:
    """Simulate `ranks` of `cfg`'s world; the report `--json` prints (`every_microbatch`: no shortened steps;
    `routing`: skewed MoE routing, the planner's Workload fields `moe_skew` or `moe_routing`)."""
    from . import peer_copy
    from .predict import planned, routing_skew
    from .world import DOCUMENT_PLAN, ROUTING, SKEWED, simulate_rank, world_size

    t0 = time.perf_counter()
    p = cfg.parallel
    s = routing_skew(cfg, routing)
    rows = []
    for r in ranks:
        m = simulate_rank(cfg, r, steps, every_microbatch, moe_skew=s)
        rows.append(compare(m, planned(cfg, m["stage"], routing)) | peer_copy.row(cfg, m))
    routed = ROUTING if s == 1.0 else SKEWED.format(s=s)
    lay = ",".join(f"{k}={v}" for k, v in p.as_dict().items() if v not in (None, False))
    return {"world": world_size(cfg), "layout": lay, "model": cfg.model_config().name, "steps": steps,
            "routing": "; ".join(x for x, used in ((routed, cfg.model_config().moe_experts),
                                                   (DOCUMENT_PLAN, _document_ring(cfg))) if used) or None,
            "ranks": rows,
            "passed": all(r["passed"] for r in rows), "wall_s": round(time.perf_counter() - t0, 2)}


def _document_ring(cfg) -> bool:
    """Whether ring attention builds a document plan (its block pairs depend on the data)."""
    return cfg.attention_mask == "document" and cfg.parallel.cp > 1 and cfg.parallel.cp_impl == "ring"


def check_simulable(cfg) -> None:
    from ..config import ConfigError
    from ..planner.layout import unmodeled

    if cfg.init_from_hf:
        raise ConfigError("--init-from-hf: simulate holds no weights (fake tensors); drop it to simulate the shapes")
    if cfg.parallel.compile:
        raise ConfigError("--compile: simulate runs the eager model; drop --compile")
    if cfg.steps < 1:
        raise ConfigError(f"--steps {cfg.steps}: simulate at least 1 step (2: the optimizer state exists from the second)")
    unmodeled_flags = unmodeled(cfg)
    if unmodeled_flags:
        raise ConfigError(f"{', '.join(unmodeled_flags)}: not modelled by the planner, so there is no plan to compare "
                          "with; drop it to simulate the layout")


def routing_fields(args, n_experts: int) -> dict | None:
    """--moe-skew / --routing as the planner's Workload fields (None: balanced routing)."""
    from ..planner.moe_skew import check_skew, read_routing

    if getattr(args, "routing", None):
        return {"moe_routing": read_routing(args.routing, n_experts)}
    if getattr(args, "moe_skew", None) is not None:
        check_skew(args.moe_skew)
        return {"moe_skew": args.moe_skew}
    return None


def main(args) -> int:
    from ..training.assemble import config_from_args
    from ..config import ConfigError
    from ..planner.errors import PlanError

    try:
        cfg = config_from_args(args, None)
        check_simulable(cfg)
        p = cfg.parallel
        world = p.world_size
        ranks = choose_ranks(args.ranks, world, p.pp, p.cp, p.tp)
        routing = routing_fields(args, cfg.model_config().moe_experts)
    except (ConfigError, PlanError) as e:
        print(f"shardwise simulate: error: {e}", file=sys.stderr)
        return 2
    try:
        report = run(cfg, ranks, cfg.steps, args.every_microbatch, routing)
    except ConfigError as e:
        print(f"shardwise simulate: error: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if args.json:
        print(json.dumps({k: report[k] for k in ("world", "layout", "ranks", "passed", "wall_s")}))
    return 0 if report["passed"] else 1
