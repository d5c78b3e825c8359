"""Gated DeltaNet (and Kimi Delta Attention, whose per-channel gate the same rule takes) under context
parallelism: exact, with one all-gather of per-chunk state maps per layer.

A rank holds one or two cp chunks of the sequence (contiguous or load-balanced order). The layer's state after a
chunk is affine in the state before it, S_end = M S_in + B, and so are the chunk's outputs, o = o(0) + Q S_in
(`models/gated_deltanet.chunk_gated_delta_rule` with `transition`). So every rank

1. runs its chunks from a zero state, keeping (M, B) and the effective queries Q;
2. all-gathers every chunk's [M | B] over cp (2·cp maps of d_k × (d_k + d_v) per head: independent of the
   sequence length; backward reduce-scatters their gradients, summing what every later chunk's outputs owe);
3. composes them in sequence order, S_in(c) = M_{c−1} S_in(c−1) + B_{c−1}, and adds Q S_in(c) to its outputs
   (in fp32 with autocast off, like the rule itself: this is the same recurrence, one step per chunk).

The short convolution needs the K−1 inputs before each chunk: the tails of every chunk are all-gathered once
(`conv_halo`), and chunk c reads chunk c−1's. Document masks work on the global document ids every rank holds:
a chunk's reset flags (including one at its first token, against the last token of chunk c−1) zero M, the
halo and the state where a document starts. Both all-gathers go through `comm`, so the ledger counts them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from ..models.gated_deltanet import causal_conv, chunk_gated_delta_rule, resets_from_documents
from ..rules.partition import chunk_ids


def _global_order(gathered: torch.Tensor, axis, order: str) -> list[torch.Tensor]:
    """Pieces gathered in rank order (each rank's chunks in its local order) → a list indexed by global chunk."""
    per_rank = len(chunk_ids(0, axis.size, order))
    pieces = gathered.chunk(axis.size * per_rank, dim=0)
    out: dict[int, torch.Tensor] = {}
    for r in range(axis.size):
        for j, c in enumerate(chunk_ids(r, axis.size, order)):
            out[c] = pieces[r * per_rank + j]
    return [out[c] for c in range(len(out))]


def _zero_start(gathered_piece: torch.Tensor) -> torch.Tensor:
    """The sequence's zero start, computed from a gathered tensor: every rank's output then depends on each
    all-gather, so every rank runs its backward reduce-scatter. Otherwise a rank holding only the first chunk
    (contiguous order) would skip it while the others wait in theirs."""
    return gathered_piece * 0


def _chunk_resets(doc_ids, axis, order: str, length: int, extra: int = 0) -> list[torch.Tensor] | None:
    """This rank's chunks' reset flags from the global document ids, each with the `extra` positions before it."""
    if doc_ids is None:
        return None
    r = F.pad(resets_from_documents(doc_ids), (extra, 0))
    return [r[:, c * length: (c + 1) * length + extra] for c in chunk_ids(axis.rank, axis.size, order)]


def conv_halo(x: torch.Tensor, weight: torch.Tensor, axis, order: str, doc_ids=None) -> torch.Tensor:
    """The layer's causal convolution (silu) over this rank's tokens x [b, s_local, C], each chunk reading the
    K−1 inputs before it from the chunk that precedes it in the sequence (one all-gather of every chunk's tail)."""
    kw = weight.shape[-1]
    ids = chunk_ids(axis.rank, axis.size, order)
    parts = x.chunk(len(ids), dim=1)
    length = parts[0].shape[1]
    if length < kw - 1:
        raise ValueError(f"a context-parallel chunk of {length} tokens is shorter than the convolution's "
                         f"halo of {kw - 1}: use a longer sequence or a smaller cp")
    tails = torch.cat([p[:, length - (kw - 1):] for p in parts], dim=0)  # [per_rank·b, K−1, C]
    halos = _global_order(comm.gather_from_sequence(tails, axis, 0), axis, order)
    resets = _chunk_resets(doc_ids, axis, order, length, kw - 1)
    out = []
    for j, (c, p) in enumerate(zip(ids, parts)):
        halo = halos[c - 1] if c > 0 else _zero_start(halos[0])
        out.append(causal_conv(p, weight, halo, None if resets is None else resets[j]))
    return torch.cat(out, dim=1)


def delta_rule(q, k, v, g, beta, axis, order: str, doc_ids=None) -> torch.Tensor:
    """The gated delta rule over this rank's tokens ([b, h, s_local, ·]; g, beta [b, h, s_local]) with the state
    every earlier chunk of the sequence leaves: the outputs the single-device layer gives these tokens."""
    ids = chunk_ids(axis.rank, axis.size, order)
    n = len(ids)
    length = q.shape[2] // n
    resets = _chunk_resets(doc_ids, axis, order, length)
    outs, maps, reads = [], [], []
    for j in range(n):
        piece = [t.narrow(2, j * length, length) for t in (q, k, v, g, beta)]
        o, final, (m, read) = chunk_gated_delta_rule(*piece, resets=None if resets is None else resets[j],
                                                     transition=True)
        outs.append(o)
        reads.append(read)
        maps.append(torch.cat((m, final), dim=-1))  # [b, h, d_k, d_k + d_v]
    dk = q.shape[-1]
    every = _global_order(comm.gather_from_sequence(torch.cat(maps, dim=0), axis, 0), axis, order)
    with torch.autocast(q.device.type, enabled=False):  # the composition is the recurrence's: fp32, as the rule
        state = _zero_start(every[0][..., dk:])
        states = [state]
        for c in range(max(ids)):  # the state entering chunk c + 1
            state = every[c][..., :dk] @ state + every[c][..., dk:]
            states.append(state)
        return torch.cat([outs[j] + reads[j] @ states[c] for j, c in enumerate(ids)], dim=2)
