"""The planner's figures for one simulated rank: static, saved-activation and peak bytes of its pipeline
stage, and its per-axis communication bytes of one step."""
from __future__ import annotations

from dataclasses import replace

from ..planner import Cluster, estimate, get_gpu
from ..planner.layout import from_train_config
from ..planner.activations import recompute_transient_bytes
from ..planner.moe_skew import skew


def routing_skew(cfg, routing: dict | None) -> float:
    """S of `routing` ({"moe_skew": S} or {"moe_routing": histogram}, the planner's Workload fields) at cfg's ep."""
    spec, lay, wl = from_train_config(cfg)
    return skew(spec, lay, replace(wl, **(routing or {})))


def planned(cfg, stage: int, routing: dict | None = None) -> dict:
    """{static_bytes, activation_bytes, peak_bytes, comm_bytes: {axis: bytes}} of pipeline stage `stage`
    (`routing`: the Workload's MoE routing fields, as `routing_skew`)."""
    from ..planner.estimate import memory_by_stage

    spec, lay, wl = from_train_config(cfg)
    wl = replace(wl, **(routing or {}))
    est = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)
    mem = memory_by_stage(spec, lay, wl)[stage]
    held = mem["activation"] - recompute_transient_bytes(spec, mem["stage"], lay, wl)
    return {"static_bytes": mem["static"]["total"], "activation_bytes": round(held),
            "peak_bytes": round(mem["peak"]), "peak_terms": mem["peak_terms"],
            "comm_bytes": {a: b for a, b in est["stages"][stage]["comm_bytes_per_step"].items() if b}}
