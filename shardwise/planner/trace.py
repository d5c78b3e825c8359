"""`shardwise plan … --trace K`: run the top K rows' own train commands through `shardwise simulate` (one
process, one row after another) and set each row's traced live peak beside its planned one.

A row's "traced" figures are the largest over its simulated ranks (`--ranks stages`: the first rank of
every pipeline stage), exactly what `shardwise simulate` prints for the row's command; a row whose traced
peak exceeds the usable memory no longer fits.
"""
from __future__ import annotations

from shardwise.planner.command import train_flags
from shardwise.planner.layout import Layout


def simulate_flags(model_flags: list[str], spec, row: dict, wl) -> list[str]:
    """The `shardwise simulate` flags of a plan row: its train command's flags, every stage's first rank."""
    return train_flags(model_flags, spec, Layout.from_dict(row["layout"]), wl) + ["--ranks", "stages"]


def trace_row(flags: list[str]) -> dict:
    """{peak_bytes, planned_peak_bytes, static_bytes, activation_bytes, passed, wall_s} of one simulated row
    (each the maximum over its simulated ranks), or {"error": why} when the trainer refuses the command."""
    from shardwise.cli import build_parser, config_from_args
    from shardwise.config import ConfigError
    from shardwise.simulate.cli import check_simulable, choose_ranks, run

    args = build_parser().parse_args(["simulate", *flags])
    try:
        cfg = config_from_args(args, None)
        check_simulable(cfg)
        p = cfg.parallel
        ranks = choose_ranks(args.ranks, p.world_size, p.pp, p.cp, p.tp)
        report = run(cfg, ranks, cfg.steps)
    except ConfigError as e:
        return {"error": str(e)}
    rows = report["ranks"]
    out = {"peak_bytes": max(r["peak_bytes"]["measured"] for r in rows),
           "planned_peak_bytes": max(r["peak_bytes"]["planned"] for r in rows),
           "static_bytes": max(r["static_bytes"]["measured"] for r in rows),
           "activation_bytes": max(r["activation_bytes"]["measured"] for r in rows)}
    return out | {"passed": report["passed"], "wall_s": report["wall_s"]}


def trace_rows(rows: list[dict], k: int, model_flags: list[str], spec, wl) -> None:
    """Add "traced" to the first `k` rows (all when k exceeds them) and refit each by its traced peak."""
    for r in rows[:k]:
        if r.get("command") is None or r.get("command_refused"):
            r["traced"] = {"error": r.get("untrainable") or r.get("command_refused")}
            continue
        r["traced"] = trace_row(simulate_flags(model_flags, spec, r, wl))
        if "peak_bytes" in r["traced"]:
            r["traced"]["fits"] = r["traced"]["peak_bytes"] <= r["usable_bytes_per_rank"]
            r["fits"] = r["fits"] and r["traced"]["fits"]
