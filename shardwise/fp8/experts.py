"""Routed experts in FP8: per expert (no grouped FP8 kernel here), all local experts one group (`fp8_linears`), so
each cast's amax reduction over the token axes (edp, and tp under SP) is one all-reduce for every expert."""
from __future__ import annotations

import dataclasses

import torch

from .linear import fp8_linears
from .scaling import TokenTiles


def fp8_experts(experts, rows: torch.Tensor, counts: list[int], where=None) -> torch.Tensor:
    """`GroupedExperts.forward` with its three projections in FP8 (scales per expert weight and per expert's rows).
    `where`: the rows' single-device positions (`expert_parallel.positions.ExpertRows`), carried in the config; where
    the experts' token tiles span ranks (`experts.fp8_tiles`: the axes holding rows of the same experts) the
    weight-gradient casts tile by them (`scaling.TokenTiles`)."""
    cfg, n = experts.fp8, experts.n_local
    if where is not None:
        tiles = None
        if experts.fp8_tiles is not None:  # token tiles at the rows' single-device positions (`TokenTiles`)
            index = getattr(experts, "_fp8_rows_index", None)  # the local slots' logical experts, once per device
            if index is None or index.device != where.totals.device:
                index = experts._fp8_rows_index = torch.tensor(experts.rows, device=where.totals.device)
            totals = where.totals[index]
            tiles = TokenTiles(where.position, counts, totals, where.tokens, where.topk, experts.fp8_tiles)
        cfg = dataclasses.replace(cfg, rows=where, tiles=tiles)
    parts = list(rows.split(counts))
    none = [None] * n
    b1, b3, b2 = (none if b is None else list(b.unbind(0)) for b in (experts.b1, experts.b3, experts.b2))
    gate = fp8_linears(cfg, parts, list(experts.w1.unbind(0)), b1)
    up = fp8_linears(cfg, parts, list(experts.w3.unbind(0)), b3)
    h = [experts.glu(a, c) for a, c in zip(gate, up)]
    return torch.cat(fp8_linears(cfg, h, list(experts.w2.unbind(0)), b2))
