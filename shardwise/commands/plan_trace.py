"""`shardwise plan … --trace K`: run the top K rows' own train commands through `shardwise simulate` (one
process, one row after another) and set each row's traced live peak beside its planned one.

A row's "traced" figures are the largest over its simulated ranks (`--ranks stages`: the first rank of
every pipeline stage), exactly what `shardwise simulate` prints for the row's command; a row whose traced
peak exceeds the usable memory no longer fits. Like `simulate`, each rank runs only the microbatches its
schedule needs to show every moment of the step (`simulate.shorten`), so a row with 128 microbatches costs
about what one with a dozen does.
"""
from __future__ import annotations

from shardwise.commands.train_command import train_config
from shardwise.planner.layout import Layout

SIMULATED_STEPS = 2
"""`shardwise simulate`'s default: the optimizer state exists from the second step."""


def simulate_config(model, spec, row: dict, wl, mtp_layers: int = 0):
    """The TrainConfig `shardwise simulate` runs for a plan row: its train command's, for SIMULATED_STEPS."""
    return train_config(model, spec, Layout.from_dict(row["layout"]), wl, SIMULATED_STEPS, mtp_layers)


def trace_row(cfg, routing: dict | None = None) -> dict:
    """{peak_bytes, planned_peak_bytes, static_bytes, activation_bytes, microbatches_run, passed, wall_s} of one
    simulated row (each the maximum over its simulated ranks: `--ranks stages`), or {"error": why} when the
    trainer refuses it. `routing`: the plan's skewed MoE routing (Workload fields), forced on the traced ranks."""
    from shardwise.config import ConfigError
    from shardwise.training.assemble import assemble
    from shardwise.simulate.cli import check_simulable, choose_ranks, run

    try:
        cfg = assemble(cfg)
        check_simulable(cfg)
        p = cfg.parallel
        ranks = choose_ranks("stages", p.world_size, p.pp, p.cp, p.tp)
        report = run(cfg, ranks, cfg.steps, routing=routing)
    except ConfigError as e:
        return {"error": str(e)}
    rows = report["ranks"]
    out = {"peak_bytes": max(r["peak_bytes"]["measured"] for r in rows),
           "planned_peak_bytes": max(r["peak_bytes"]["planned"] for r in rows),
           "static_bytes": max(r["static_bytes"]["measured"] for r in rows),
           "activation_bytes": max(r["activation_bytes"]["measured"] for r in rows),
           "microbatches_run": max(r["microbatches_run"] for r in rows)}
    return out | {"passed": report["passed"], "wall_s": report["wall_s"]}


def trace_rows(rows: list[dict], k: int, model, spec, wl, mtp_layers: int = 0) -> None:
    """Add "traced" to the first `k` rows (all when k exceeds them) and refit each by its traced peak; `model` is
    a preset name or the ModelConfig of --model-config."""
    for r in rows[:k]:
        if r.get("command") is None or r.get("command_refused"):
            r["traced"] = {"error": r.get("untrainable") or r.get("command_refused")}
            continue
        cfg = simulate_config(model, spec, r, wl, mtp_layers)
        skewed = wl.moe_skew != 1.0 or wl.moe_routing is not None
        r["traced"] = trace_row(cfg, {"moe_skew": wl.moe_skew, "moe_routing": wl.moe_routing}) if skewed else \
            trace_row(cfg)
        if "peak_bytes" in r["traced"]:
            r["traced"]["fits"] = r["traced"]["peak_bytes"] <= r["usable_bytes_per_rank"]
            r["fits"] = r["fits"] and r["traced"]["fits"]
