"""The newest consistent state of a restarted worker group: the memory copies when every rank's copy of one step
survives somewhere (its own node's store, or its holder's), else the newest intact disk checkpoint, whichever is
newer; the event (what was lost, where, how long recovery took, how many steps were lost) goes to the run
directory's `recoveries.jsonl`."""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from .. import comm
from ..checkpoint import META, newest_intact
from .memory import exchange, host_axis
from .snapshot import read_meta, restore
from .store import NodeInfo, NodeStore, Progress

DETECTED = "lost a peer"
"""How a survivor's progress record says it saw the failure (the loop writes it)."""


def newest_memory_step(held: list[dict], world: int) -> int | None:
    """Pure: the newest step every rank 0..world-1 has a copy of, over each rank's {(owner, step): bytes}."""
    have = {key for inv in held for key in inv}
    steps = sorted({s for _, s in have}, reverse=True)
    return next((s for s in steps if all((o, s) in have for o in range(world))), None)


def suppliers(held: list[dict], step: int, world: int) -> dict[int, int]:
    """Pure: {owner: the rank that hands owner its copy}: the owner itself when its node kept one, else the lowest
    rank whose node holds it."""
    return {o: o if (o, step) in held[o] else min(r for r, inv in enumerate(held) if (o, step) in inv)
            for o in range(world)}


def recover(trainer, ckpt_dir: str, info: NodeInfo, out: str | None) -> dict | None:
    """Collective over `ckpt`. None on a first start; on a restart, the state restored and from where:
    {"source": "memory" | "disk" | "scratch", "step", ...}. A memory copy is loaded here — re-cut by `elastic` when it
    was made under another dp (a world of another size); a disk checkpoint is the caller's to load (its resume
    handles LR plans, messages and another layout)."""
    axis = host_axis(trainer.mesh)
    world, rank = axis.size, trainer.mesh.rank
    store = NodeStore(info.store, world)
    mine = (info.restart, {w: store.under(w).inventory() for w in store.worlds()}, Progress.read_all(info.store))
    gathered = comm.all_gather_object(mine, axis)
    if not any(g[0] for g in gathered):
        return None
    t0 = time.time()
    progress = {r: rec for g in gathered for r, rec in g[2].items()}
    newest = {w: s for w in sorted({w for g in gathered for w in g[1]})
              if (s := newest_memory_step([g[1].get(w, {}) for g in gathered], w)) is not None}
    mem_world = max(newest, key=lambda w: (newest[w], w == world), default=None)  # a tie: no re-cut
    mem_step = newest.get(mem_world)
    path, _ = newest_intact(ckpt_dir, axis) if os.path.isdir(ckpt_dir) else (None, [])
    disk_step = None
    if path is not None:
        with open(os.path.join(path, META)) as f:
            disk_step = json.load(f)["step"]
    event = {"restart": max(g[0] for g in gathered), "memory_step": mem_step, "disk_step": disk_step}
    if mem_step is not None and (disk_step is None or mem_step >= disk_step):
        held = [g[1].get(mem_world, {}) for g in gathered]
        if mem_world == world:
            who = suppliers(held, mem_step, world)
            ops = [("send", store.read(o, mem_step), axis, o) for o, s in who.items() if s == rank and o != rank]
            got = None
            if who[rank] != rank:
                got = torch.empty(held[who[rank]][(rank, mem_step)], dtype=torch.uint8, device="cpu")
                ops.append(("recv", got, axis, who[rank]))
            exchange(ops, axis, "mem restore", trainer.cfg.timeout_s)
            blob = store.read(rank, mem_step) if got is None else got
            step = restore(trainer, blob)
            event |= {"source": "memory", "step": step, "from_peer": sorted(o for o, s in who.items() if s != o),
                      "lr_decay_steps": read_meta(blob)[0].get("lr_decay_steps")}
        else:
            event |= _recut(trainer, store.under(mem_world), held, mem_step, axis)
    elif disk_step is not None:
        event |= {"source": "disk", "step": disk_step}
    else:
        event |= {"source": "scratch", "step": 0}
    event["start"] = event["step"]
    event["restore_s"] = round(time.time() - t0, 3)
    if rank == 0:
        _log(event, progress, world, out)
    return event


def _recut(trainer, store: NodeStore, held: list[dict], step: int, axis) -> dict:
    """Collective over `ckpt`: this rank's state re-cut from the copies of `step` made under another dp (`elastic`).
    Every rank names the old copies its tensors intersect; each copy travels from the rank's own node when it is
    there, else from the lowest rank whose node holds it."""
    from ..checkpoint.boxes import ensure_state
    from .elastic import needed, old_dims, preference, recut, rng_source
    from .snapshot import state_boxes

    rank = trainer.mesh.rank
    here = sorted({o for o, s in held[rank] if s == step})
    metas = {}
    for g in comm.all_gather_object({o: read_meta(store.read(o, step))[0] for o in here}, axis):
        metas |= g
    old = old_dims(next(iter(metas.values())))
    ensure_state(trainer.reducer)
    coords = trainer.mesh.coords
    rng_from = rng_source(coords, old)
    mine = needed(state_boxes(trainer), metas, preference(coords, old))
    mine = mine + [rng_from] * (rng_from not in mine)
    wants = comm.all_gather_object(mine, axis)
    ops, got = [], {}
    for r, owners in enumerate(wants):  # one order on every rank: the pairs' sends and receives match in it
        for o in owners:
            supplier = r if (o, step) in held[r] else min(q for q, inv in enumerate(held) if (o, step) in inv)
            if supplier == r:
                if r == rank:
                    got[o] = store.read(o, step)
            elif supplier == rank:
                ops.append(("send", store.read(o, step), axis, r))
            elif r == rank:
                got[o] = torch.empty(held[supplier][(o, step)], dtype=torch.uint8, device="cpu")
                ops.append(("recv", got[o], axis, supplier))
    exchange(ops, axis, "mem restore", trainer.cfg.timeout_s)
    restored = recut(trainer, got, metas, rng_from)
    return {"source": "memory", "step": restored, "recut_from": sorted(got), "old_dp": old.dp,
            "new_dp": trainer.mesh.dims.dp, "from_peer": sorted({o for r, ows in enumerate(wants) for o in ows
                                                                  if (o, step) not in held[r]}),
            "lr_decay_steps": metas[rng_from].get("lr_decay_steps")}


def _log(event: dict, progress: dict, world: int, out: str | None) -> None:
    """Rank 0: one line, and the event completed with what the launcher saw, appended to recoveries.jsonl."""
    seen = json.loads(os.environ.get("SHARDWISE_FAILURE", "{}"))  # the built-in launcher's view of the failure
    completed = max((rec[0] for rec in progress.values()), default=event["step"])
    detected = [t for _, phase, t, _ in progress.values() if phase.startswith(DETECTED)]
    detected_at = seen.get("detected_at") or (min(detected) if detected else None)
    lost = seen["lost_ranks"] if "lost_ranks" in seen else sorted(   # a rejoin lost none
        set(range(world)) - {r for r, (_, p, _, _) in progress.items() if p.startswith(DETECTED)})
    rec = {k: v for k, v in seen.items() if k not in ("detected_at", "lost_ranks")} | {
        "lost_ranks": lost, "failed_after_step": max(completed, seen.get("failed_after_step") or 0),
        "restored_from": event["source"], "restored_step": event["step"],
        "memory_step": event["memory_step"], "disk_step": event["disk_step"], "restore_s": event["restore_s"],
        "from_peer": event.get("from_peer", [])} | {k: event[k] for k in ("old_dp", "new_dp") if k in event}
    rec["steps_lost"] = rec["failed_after_step"] - event["step"]
    if detected_at is not None:
        rec["recovery_s"] = round(time.time() - detected_at, 3)
    print(f"shardwise: restart {event['restart']}: resumed from {event['source']} at step {event['step']} "
          f"({rec['steps_lost']} step(s) lost" + (f", {rec['recovery_s']:.1f} s after the failure was detected"
                                                  if "recovery_s" in rec else "") + ")", file=sys.stderr, flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "recoveries.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
