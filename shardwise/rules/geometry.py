"""Rank geometry: where each rank sits on the (dp, pp, cp, tp) grid and which ranks form each group of each axis.

Stated once, in plain Python (no tensor, so no tensor mode — fake or meta — can touch the layout): the mesh
creates its process groups from `axis_lines`, the planner decides which links a group crosses from the same
lines. TP is innermost, so a TP group is a block of consecutive ranks (one node when tp <= GPUs per node),
then cp, pp, and dp outermost.
"""
from __future__ import annotations

import itertools

GRID = ("dp", "pp", "cp", "tp")
"""The grid's axes, outermost first: rank = ((d·pp + p)·cp + c)·tp + t."""


def rank_of(dims, coords: dict[str, int]) -> int:
    """The global rank at `coords` (one index per GRID axis) on the grid of `dims` (anything with dp, pp, cp, tp)."""
    return ((coords["dp"] * dims.pp + coords["pp"]) * dims.cp + coords["cp"]) * dims.tp + coords["tp"]


def coords_of(dims, rank: int) -> dict[str, int]:
    """The inverse of `rank_of`: each GRID axis' index of `rank`."""
    out = {}
    for axis in reversed(GRID):
        rank, out[axis] = divmod(rank, getattr(dims, axis))
    return {a: out[a] for a in GRID}


def axis_lines(dims) -> dict[str, list[list[int]]]:
    """Every group of every axis as lists of global ranks, each in increasing order.

    `dims` carries dp, pp, cp, tp, ep and the hybrid-sharding split (`shard`, `replicas`: a ParallelConfig or the
    planner's Layout). dp×cp (dense gradient reduction) lines share (pp, tp) with cp fastest; ep takes
    consecutive blocks of ep ranks of each dp×cp line and edp the strided rest. Under hybrid sharding
    (dp_shard S < dp), dp_shard takes consecutive blocks of S·cp ranks (S dp ranks × all of cp: inside a node
    when S·cp·tp·pp fits one) and dp_replicate the strided rest (one rank per block at the same offset); without
    it neither key is present (ZeRO shards over all of dp×cp, nothing replicates).
    """
    sizes = {a: getattr(dims, a) for a in GRID}
    families = {}
    for name in GRID:
        others = [a for a in GRID if a != name]
        lines = []
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            c = dict(zip(others, fixed))
            lines.append([rank_of(dims, c | {name: i}) for i in range(sizes[name])])
        families[name] = lines
    dpcp = [[rank_of(dims, {"dp": d, "pp": p, "cp": c, "tp": t}) for d in range(dims.dp) for c in range(dims.cp)]
            for p in range(dims.pp) for t in range(dims.tp)]
    ep, edp = dims.ep, dims.dp * dims.cp // dims.ep
    families["dp_cp"] = dpcp
    if dims.replicas > 1:  # hybrid sharding: S·cp consecutive entries of each dp×cp line shard, the rest replicate
        block = dims.shard * dims.cp
        families["dp_shard"] = [line[b * block:(b + 1) * block] for line in dpcp for b in range(dims.replicas)]
        families["dp_replicate"] = [line[k::block] for line in dpcp for k in range(block)]
    families["ep"] = [line[b * ep:(b + 1) * ep] for line in dpcp for b in range(edp)]
    families["edp"] = [line[k::ep] for line in dpcp for k in range(ep)]
    return families
