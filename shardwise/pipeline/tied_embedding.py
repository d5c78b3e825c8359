"""Tied input embedding and LM head under pipeline parallelism, Megatron's way.

The embedding lives on the first stage and the LM head on the last, usually on different pipeline
ranks. Each of those ranks holds its own copy of the shared [vocab, dim] matrix (its TP shard):
* both copies are drawn from the embedding's name, so they start bitwise equal;
* after the last backward, GradReducer._reduce_tied sums their gradients over the two-rank "emb"
  group (first and last stage, same dp/cp/tp coordinates; `mesh._emb_axis`), so both hold the tied
  gradient and the identical AdamW updates keep them equal. This runs before the dp×cp reduction because ZeRO
  shards of the two stages' flat buffers do not line up; sums commute, so the result is the same;
* each copy counts half in the global grad norm (its ShardSpec's `replicas` doubles), so the
  matrix is counted once;
* checkpoints and HF import/export use one global name, `tok_embeddings.weight`: the head's copy
  is never written, and is read from the embedding's entry.
When one rank holds both ends (pp=1, or dualpipev's V) they are one Parameter and nothing is reduced.
"""
from __future__ import annotations

import dataclasses

import torch

from ..tensor_parallel.layers import get_spec, set_spec
from .schedules import layout_for

SHARED = "tok_embeddings.weight"
COPY = "output.weight"


def emb_stages(parallel) -> tuple[int, int] | None:
    """The pp ranks that hold the first stage (embedding) and the last (LM head) for a ParallelConfig."""
    if parallel.pp < 2:
        return None
    layout = layout_for(parallel.schedule, parallel.pp, parallel.vp)
    return layout.owner(0)[0], layout.owner(layout.num_stages - 1)[0]


def mark_tied_copies(model, mesh) -> None:
    """After PP pruning, before materialisation: tag the copy/copies of the shared matrix this rank holds.

    Raises if the two copies sit on different ranks but the mesh has no embedding group (their
    gradients would silently diverge).
    """
    if not model.cfg.tie_embeddings:
        return
    emb = model.tok_embeddings.weight if model.tok_embeddings is not None else None
    head = model.output.weight if model.output is not None else None
    if emb is head:
        return  # one rank holds both ends (or neither): one Parameter, nothing to tie
    axis = mesh["emb"]
    if not axis.active:
        raise RuntimeError("tied embeddings with the embedding and the LM head on different pipeline ranks need the "
                           "mesh's emb group: Mesh.build(..., emb_stages=tied_embedding.emb_stages(parallel))")
    for p in (emb, head):
        if p is not None:
            p._sw_tied = SHARED
            set_spec(p, dataclasses.replace(get_spec(p), replicas=get_spec(p).replicas * axis.size))


def tied_name(name: str, p: torch.Tensor) -> str:
    """The global name of parameter `name`: the LM head's copy of a tied matrix is the embedding."""
    return getattr(p, "_sw_tied", name)


def is_tied_copy(name: str, p: torch.Tensor) -> bool:
    """True for the LM head's copy of a tied matrix (not written to checkpoints: the embedding's is)."""
    return tied_name(name, p) != name


def tied_partial(p: torch.Tensor, mesh) -> bool:
    """True when `p`'s gradient is partial until summed over the emb group (its dp×cp reduction must wait)."""
    return getattr(p, "_sw_tied", None) is not None and mesh["emb"].active

