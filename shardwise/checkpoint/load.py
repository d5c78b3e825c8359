"""Loading: the newest intact checkpoint (ranks split the checksumming), read into any layout by DCP's
resharding, with the RNG streams restored where the layout allows."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp

from .. import comm
from ..config import ConfigError
from .boxes import BoxLoadPlanner, run_dcp, ensure_state, state_entries, SafeReader
from .files import FORMAT_VERSION, META, MANIFEST, RNG_AXES, STEP_DIR, from_b64, checkpoint_problems, log, resume_order


def newest_intact(root: str, world_axis=None) -> tuple[str | None, list[tuple[str, str]]]:
    """The intact checkpoint `latest` names under `root` (else the newest older intact one; or `root` itself)
    and the (path, reason) of each skipped one.

    Collective over `world_axis` when given (a Mesh's `ckpt` axis: gloo, long timeout): ranks split the
    checksumming and agree on the answer.
    """
    size, rank = (world_axis.size, world_axis.rank) if world_axis is not None else (1, 0)
    single = os.path.isfile(os.path.join(root, MANIFEST)) or STEP_DIR.match(os.path.basename(os.path.normpath(root)))
    cands = [root] if single else [path for _, path in resume_order(root)]
    if world_axis is not None:
        cands = comm.all_gather_object(cands, world_axis)[0]  # one listing for all ranks
    skipped = []
    for path in cands:
        probs = checkpoint_problems(path, rank, size)
        if world_axis is not None:
            probs = sorted({p for ps in comm.all_gather_object(probs, world_axis) for p in ps})
        if not probs:
            return path, skipped
        skipped.append((path, "; ".join(probs)))  # the caller reports them, once
    return None, skipped


def load_checkpoint(root: str, trainer, required: bool = False) -> dict | None:
    """Collective. Load the newest intact checkpoint under `root` into `trainer`, resharding as needed.
    `required`: with none intact, a ConfigError naming each checkpoint and why it was rejected (a resume whose
    every checkpoint failed its checksum on the ranks) instead of None.

    Restores parameters, optimizer state (AdamW's moments and step count, Muon's momentum), `trainer.step`, and — when the layout is the
    one saved — every rank's RNG streams (another layout cannot replay them, so the tracker streams
    are reseeded from (seed, step) instead; so are they when the device type differs, e.g. a CPU
    checkpoint resumed on CUDA). Returns {"step", "path", "layout", "extra_state",
    "skipped"}, or None when no intact checkpoint exists.
    """
    mesh = trainer.mesh
    path, skipped = newest_intact(root, mesh["ckpt"] if mesh["world"].active else None)
    if path is None and required:
        why = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in skipped) or "none found"
        raise ConfigError(f"--resume: no intact checkpoint under {root} ({why}); start fresh with --overwrite")
    if path is None:
        return None
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')}, this shardwise reads {FORMAT_VERSION}")
    saved_opt = meta.get("optimizer", "adamw")  # older checkpoints: AdamW, the only optimizer then
    if saved_opt != trainer.cfg.optimizer:
        raise ValueError(f"checkpoint {path} holds {saved_opt} state; resume it with --optimizer {saved_opt}, "
                         f"not {trainer.cfg.optimizer}")
    ensure_state(trainer.reducer, meta["optimizer_step"])
    run_dcp(dcp.load, mesh, storage_reader=SafeReader(path), planner=BoxLoadPlanner(state_entries(trainer, False), path))
    step = meta["step"]
    _restore_rng(trainer, path, meta, step)
    trainer.step = step
    trainer.bad_steps = meta.get("bad_steps", 0)
    return {"step": step, "path": path, "layout": meta["layout"], "extra_state": meta["extra_state"],
            "skipped": skipped}


def _restore_rng(trainer, path: str, meta: dict, step: int) -> None:
    """Every rank's RNG streams as saved when the layout (parallel degrees) is the saved one: the host
    generator on any device, the tracker's device generators only on the device type that saved them.
    Whatever cannot be replayed is re-seeded from (seed, step), the same on every rerun, and said once."""
    mesh, tracker = trainer.mesh, trainer.model.rng_tracker
    here = mesh.device.type
    rng = None
    rank_file = os.path.join(path, f"rank{mesh.rank}.json")
    if all(meta["layout"].get(a) == getattr(mesh.dims, a) for a in RNG_AXES) and os.path.isfile(rank_file):
        with open(rank_file) as f:
            rng = json.load(f)
        torch.set_rng_state(from_b64(rng["torch_cpu_rng"]))
    saved_on = (rng or {}).get("device", meta["layout"].get("device", "cpu"))  # older checkpoints: CPU runs
    if rng is not None and saved_on == here:
        for k, g in tracker.generators.items():
            g.set_state(from_b64(rng["tracker_rng"][k]))
        return
    for g in tracker.generators.values():
        g.manual_seed((g.initial_seed() + 1_000_003 * step) % 2**63)
    if mesh.rank == 0 and rng is None:
        log.info("checkpoint %s was saved under %s: RNG streams reseeded from (seed, step)", path, meta["layout"])
    elif mesh.rank == 0:
        log.warning("checkpoint %s was saved on %s and resumes on %s: everything is restored but the %s RNG "
                    "streams, re-seeded from (seed, step %d)", path, saved_on, here, here, step)


def load_global_tensors(path: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Full-shaped tensors of every key under `prefix` (prefix stripped), read in this process alone."""
    reader = SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata
    full = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for k, md in saved.items() if k.startswith(prefix)}
    entries = {k: (tuple(t.shape), [((0,) * t.ndim, t)]) for k, t in full.items()}
    run_dcp(dcp.load, storage_reader=reader, planner=BoxLoadPlanner(entries, path))
    return {k[len(prefix):]: t for k, t in full.items()}
