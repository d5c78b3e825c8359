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

from ..models.params import declare
from ..tensor_parallel.layers import VocabParallelEmbedding, get_spec, set_spec
from ..rules.schedules import layout_for

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


def mark_mtp_embedding(model, mesh, residual_dtype=None) -> None:
    """MTP under PP (models/mtp.py): the MTP modules live on the last stage and read the embedding there.

    A last stage without the embedding gets a copy (`mtp_embed`, its TP shard), tied to the first stage's matrix
    exactly as a tied LM head: drawn from the embedding's name, gradients summed over the emb group, counted half
    each in the grad norm, never written to checkpoints (it reads `tok_embeddings.weight`). With tied embeddings the
    last stage's LM head already is that copy, and the MTP embedding is it."""
    if not model.cfg.mtp_layers:
        return
    has_emb, has_mtp = model.tok_embeddings is not None, model.mtp is not None
    if has_emb and has_mtp:  # one matrix; under dualpipev's V its two uses are in different chunks' backwards, so
        model.tok_embeddings.weight._sw_multi_use = True  # it accumulates twice per microbatch: reduce it at the end
        return
    if not (has_emb or has_mtp):
        return
    if model.cfg.tie_embeddings:  # mark_tied_copies marked the copies: the MTP embedding is the head's
        if has_mtp:
            model.mtp_embed = _embedding_like(model, residual_dtype)
            model.mtp_embed.weight = model.output.weight
        return
    axis = mesh["emb"]
    if not axis.active:
        raise RuntimeError("MTP with the embedding and the MTP modules on different pipeline ranks needs the mesh's "
                           "emb group: Mesh.build(..., emb_stages=tied_embedding.emb_stages(parallel))")
    if has_mtp:
        model.mtp_embed = _embedding_like(model, residual_dtype)
    p = model.mtp_embed.weight if has_mtp else model.tok_embeddings.weight
    p._sw_tied = SHARED
    set_spec(p, dataclasses.replace(get_spec(p), replicas=get_spec(p).replicas * axis.size))


def _embedding_like(model, residual_dtype):
    emb = VocabParallelEmbedding(model.cfg.vocab_size, model.cfg.dim, model.ctx.tp_axis, model.ctx.sequence_parallel,
                                 device="meta")
    declare(emb.weight)
    emb.out_dtype = residual_dtype
    return emb


def tied_name(name: str, p: torch.Tensor) -> str:
    """The global name of parameter `name`: the LM head's copy of a tied matrix is the embedding."""
    return getattr(p, "_sw_tied", name)


def is_tied_copy(name: str, p: torch.Tensor) -> bool:
    """True for the LM head's copy of a tied matrix (not written to checkpoints: the embedding's is)."""
    return tied_name(name, p) != name


def tied_partial(p: torch.Tensor, mesh) -> bool:
    """True when `p`'s gradient is partial until summed over the emb group (its dp×cp reduction must wait)."""
    return getattr(p, "_sw_tied", None) is not None and mesh["emb"].active

