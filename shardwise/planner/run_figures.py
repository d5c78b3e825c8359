"""The planner's figures for one assembled run, as the trainer's summary.json sets them beside what it measured
(`training.activation_memory.SavedActivationMeter`): the entry point computes them and hands them to the run,
so the runtime imports no planner module."""
from __future__ import annotations

from shardwise.planner.activations import recompute_transient_bytes
from shardwise.planner.estimate import memory_by_stage
from shardwise.planner.layout import from_train_config


def predicted_activation_bytes(cfg) -> dict | None:
    """The planner's figures for exactly this run (after `resolve_world`), max over pipeline stages:
    `held` (what the meter sees) and `recompute_transient` (one layer rebuilt during backward)."""
    if cfg.parallel.recompute_layers is not None:  # not modelled
        return None
    spec, lay, wl = from_train_config(cfg)
    stages = memory_by_stage(spec, lay, wl)
    transient = [recompute_transient_bytes(spec, s["stage"], lay, wl) for s in stages]
    return {"held": max(s["activation"] - t for s, t in zip(stages, transient)), "recompute_transient": max(transient)}
