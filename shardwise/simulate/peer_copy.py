"""The host memory the memory copies of `--mem-ckpt-every` hold per rank (docs/fault-tolerance.md): its own copy
and its ward's, each exactly what `resilience.snapshot` serialises — measured on the simulated rank's state, and
planned from its weights and optimizer state (`planner.goodput.peer_copy_host_bytes`)."""
from __future__ import annotations


def held(trainer) -> int:
    """Measured: two copies of this rank's state (its own, and its ward's of the same layout position)."""
    from ..resilience.snapshot import state_bytes

    return 2 * state_bytes(trainer)


def row(cfg, measured: dict) -> dict:
    """{"peer_copy_host_bytes": {measured, planned}} for a simulated rank's report when the run keeps copies."""
    if not cfg.mem_ckpt_every or "peer_copy_host_bytes" not in measured:
        return {}
    from ..planner.estimate import memory_by_stage
    from ..planner.goodput import peer_copy_host_bytes
    from .predict import from_train_config

    spec, lay, wl = from_train_config(cfg)
    static = memory_by_stage(spec, lay, wl)[measured["stage"]]["static"]
    return {"peer_copy_host_bytes": {"measured": measured["peer_copy_host_bytes"],
                                     "planned": round(peer_copy_host_bytes(static))}}
