"""Elastic data parallelism (`--min-dp D`): when a lost node does not come back, the run goes on with the surviving
whole DP replicas and the same global batch, and scales back when the node returns.

Only whole replicas leave: dp is the grid's outermost axis (`rules.geometry`), so replica d is the block of ranks
[d·R, (d+1)·R) with R = pp·cp·tp, and its TP/PP/CP/EP groups are untouched by the ones that stay. The global batch
is kept (`fit_world`): dp' replicas each take gb / dp' rows of it, the rows in the same order (replica d' reads
rows [d'·gb/dp', (d'+1)·gb/dp')), as more microbatches of the same size; the loss is the mean over the global
batch's tokens either way, so the step computes the planned run's sum in another association (`recut`).

The state is re-cut from the memory copies of the old layout (`recut`): every copy records each of its tensors'
global offsets, so a rank of the new layout fills each of its tensors (its ZeRO shard now covers another range)
from the old copies whose boxes intersect it, as a disk resume re-cuts a DCP checkpoint.
"""
from __future__ import annotations

import dataclasses

from ..config import ConfigError
from ..rules.geometry import coords_of, rank_of
from ..rules.validation import ep_dpcp_problem


def replica_size(dims) -> int:
    """Ranks per DP replica: one pipeline × cp × tp block."""
    return dims.pp * dims.cp * dims.tp


def survivors(dims, lost_ranks, min_dp: int) -> list[int]:
    """Pure: the old ranks that go on — every rank of each replica none of whose ranks is lost, in rank order.
    ConfigError when fewer than `min_dp` replicas are left."""
    size = replica_size(dims)
    lost = {r // size for r in lost_ranks}
    kept = [d for d in range(dims.dp) if d not in lost]
    if len(kept) < max(min_dp, 1):
        raise ConfigError(f"elastic data parallelism: ranks {sorted(lost_ranks)} took DP replica(s) "
                          f"{sorted(lost)} of {dims.dp} with them; {len(kept)} left, below --min-dp {min_dp}")
    return [d * size + i for d in kept for i in range(size)]


def survivor_rule(cfg):
    """The built-in launcher's rule (`run_local`'s `elastic`): (world, lost ranks) → the ranks that go on, checked
    to make a layout (`fit_world`) before any rank starts."""
    def rule(world: int, lost) -> list[int]:
        keep = survivors(fit_world(cfg, world).parallel, lost, cfg.min_dp)
        fit_world(cfg, len(keep))
        return keep
    return rule


def mesh_world() -> int | None:
    """The number of ranks the process group has (None outside one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def fit_world(cfg, world: int):
    """The config for `world` ranks: `cfg` itself when its layout has that many, else (with --min-dp) the same layout
    with dp = world / replica size and the global batch kept. ConfigError (one line) when the replicas left are
    fewer than --min-dp, or when the global batch does not split into dp' × whole microbatches."""
    p = cfg.parallel
    if world == p.world_size or not cfg.min_dp:
        return cfg
    size = replica_size(p)
    dp, gb = world // size, cfg.global_batch or cfg.micro_batch * p.dp
    if world % size or dp < cfg.min_dp:
        raise ConfigError(f"elastic data parallelism: {world} ranks make {world / size:g} DP replicas of {size} "
                          f"ranks (pp {p.pp} × cp {p.cp} × tp {p.tp}); --min-dp {cfg.min_dp} needs at least "
                          f"{cfg.min_dp * size}")
    ep_misfit = ep_dpcp_problem(dp, p.cp, p.ep)
    if gb % (cfg.micro_batch * dp) or ep_misfit or p.dp_shard is not None:
        why = (f"--dp-shard {p.dp_shard} (hybrid sharding) keeps no layout for another dp" if p.dp_shard is not None
               else f"ep {p.ep} does not divide dp {dp} × cp {p.cp}" if ep_misfit
               else f"global batch {gb} is not a multiple of micro-batch {cfg.micro_batch} × dp {dp}")
        raise ConfigError(f"elastic data parallelism: the run cannot go on with dp {dp} (was {p.dp}): {why}")
    # a fault strikes only in the first start (`training.faults`), whose numbering it names
    out = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp), global_batch=gb, fault_inject=None)
    out.validate(world)
    return out


# ---------------------------------------------------------------- re-cutting the state from the old layout's copies
def _intersect(a_off, a_shape, b_off, b_shape):
    """The global box both boxes cover, as (start, size) per dim; None when they are disjoint."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a_off, a_shape, b_off, b_shape)]
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, [h - l for l, h in zip(lo, hi)])


def _pieces(meta: dict) -> dict[str, list[tuple[list, list, int]]]:
    """{global key: [(offsets, shape, index in the copy)]} of one copy's tensors."""
    out: dict[str, list] = {}
    for i, ((key, shape, _), off) in enumerate(zip(meta["layout"], meta["offsets"])):
        out.setdefault(key.rsplit("@", 1)[0], []).append((off, shape, i))
    return out


def preference(new_coords: dict, old_dims) -> list[int]:
    """Pure: old ranks in the order a new rank reads them: the same pp and tp first (they hold its stage and its TP
    slices), the same cp next, then by dp."""
    def key(o):
        c = coords_of(old_dims, o)
        return (c["pp"] != new_coords["pp"], c["tp"] != new_coords["tp"], c["cp"] != new_coords["cp"], c["dp"], o)
    return sorted(range(old_dims.world_size), key=key)


def needed(new_boxes, metas: dict[int, dict], order: list[int]) -> list[int]:
    """The old copies a new rank reads, greedily in `order`: each one that covers some element of the new rank's
    tensors not covered by the ones before. ValueError when the copies together miss an element."""
    import torch

    pieces = {o: _pieces(metas[o]) for o in order}
    chosen = []
    for key, off, t in new_boxes:
        mask = torch.zeros(t.shape, dtype=torch.bool, device="cpu")  # metadata only: which elements are covered
        gkey = key.rsplit("@", 1)[0]
        for o in order:
            if bool(mask.all()):
                break
            for p_off, p_shape, _ in pieces[o].get(gkey, []):
                hit = _intersect(off, t.shape, p_off, p_shape)
                if hit is None:
                    continue
                view = mask
                for d, (lo, n) in enumerate(zip(*hit)):
                    view = view.narrow(d, lo - off[d], n)
                if not bool(view.all()):
                    view.fill_(True)
                    if o not in chosen:
                        chosen.append(o)
        if not bool(mask.all()):
            raise ValueError(f"the old layout's memory copies do not cover {key} of this rank")
    return chosen


def recut(trainer, blobs: dict[int, "object"], metas: dict[int, dict], rng_from: int) -> int:
    """Fill this rank's state (a layout with another dp) from old copies {old rank: blob}; the scalars (step,
    optimizer step, bad steps) from any, the RNG streams from `rng_from`'s. Returns the step."""
    import torch

    from ..checkpoint.boxes import ensure_state
    from .snapshot import read_meta, state_boxes

    first = metas[rng_from]
    ensure_state(trainer.reducer, first["optimizer_step"])
    tensors = {}
    for o, blob in blobs.items():
        meta, at = read_meta(blob)
        for key, shape, dtype in meta["layout"]:
            dt = getattr(torch, dtype.removeprefix("torch."))
            n = torch.Size(shape).numel() * dt.itemsize
            tensors[(o, key)] = blob[at:at + n].clone().view(dt).view(shape)  # clone: aligned for the dtype
            at += n
    with torch.no_grad():
        for key, off, t in state_boxes(trainer):
            gkey = key.rsplit("@", 1)[0]
            for o in blobs:
                for p_off, p_shape, i in _pieces(metas[o]).get(gkey, []):
                    hit = _intersect(off, t.shape, p_off, p_shape)
                    if hit is None:
                        continue
                    dst, src = t, tensors[(o, metas[o]["layout"][i][0])]
                    for d, (lo, n) in enumerate(zip(*hit)):
                        dst, src = dst.narrow(d, lo - off[d], n), src.narrow(d, lo - p_off[d], n)
                    dst.copy_(src)
    torch.set_rng_state(torch.tensor(first["torch_rng"], dtype=torch.uint8, device="cpu"))
    for k, g in trainer.model.rng_tracker.generators.items():
        g.set_state(torch.tensor(first["tracker_rng"][k], dtype=torch.uint8, device="cpu"))
    trainer.step, trainer.bad_steps = first["step"], first["bad_steps"]
    return first["step"]


def old_dims(meta: dict):
    """The grid a copy was made under (anything with dp, pp, cp, tp and world_size)."""
    d = meta["dims"]
    return Grid(d["dp"], d["pp"], d["cp"], d["tp"])


@dataclasses.dataclass(frozen=True)
class Grid:
    """The (dp, pp, cp, tp) grid of a layout, as `rules.geometry` reads it."""

    dp: int
    pp: int
    cp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp


def rng_source(new_coords: dict, dims) -> int:
    """The old rank whose RNG streams a new rank takes: the same coordinates, dp clipped to the old grid. The dropout
    streams are seeded by pp and tp only (`tensor_parallel.random`), so every dp rank's are the same."""
    return rank_of(dims, new_coords | {"dp": min(new_coords["dp"], dims.dp - 1)})
