"""Which tokens of a sequence each context-parallel rank owns.

With cp = c every rank holds s/c tokens of every sequence. Under causal attention a plain split
is unbalanced: the rank holding the last tokens attends to the whole sequence, the first rank to
almost nothing. The default "balanced" order cuts the sequence into 2c chunks and gives rank r
chunks r and 2c−1−r (Megatron-Core's and torch's `context_parallel` load balancing), so every
rank does the same work; "contiguous" keeps the plain split (for non-causal attention, or to
measure the imbalance). Within a rank the local tokens keep increasing global positions, so a
causal mask over the local block alone is the true causal mask.

With cp = 1 every function is the identity, whatever the order.
"""
from __future__ import annotations

import torch

from ..rules.partition import check_seq_len, chunk_ids


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, order: str = "balanced", dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` (dim 1 for [b, s, ...] tokens/labels, 2 for [b, h, s, d])."""
    if cp_size == 1:
        return x
    length = check_seq_len(x.shape[dim], cp_size, order)
    parts = [x.narrow(dim, c * length, length) for c in chunk_ids(cp_rank, cp_size, order)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard_sequence(parts: list[torch.Tensor], cp_size: int, order: str = "balanced", dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full sequence from every rank's local part, in cp-rank order."""
    if len(parts) != cp_size:
        raise ValueError(f"unshard_sequence: got {len(parts)} parts for cp size {cp_size}")
    if cp_size == 1:
        return parts[0]
    per_rank = len(chunk_ids(0, cp_size, order))
    chunks: dict[int, torch.Tensor] = {}
    for r, part in enumerate(parts):
        for c, piece in zip(chunk_ids(r, cp_size, order), part.chunk(per_rank, dim=dim)):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in range(len(chunks))], dim=dim)


def positions(seq_len: int, cp_rank: int, cp_size: int, order: str = "balanced", device=None) -> torch.Tensor:
    """Global positions (int64) of this rank's local tokens, in local order: RoPE angles and masks."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    length = check_seq_len(seq_len, cp_size, order)
    return torch.cat([torch.arange(c * length, (c + 1) * length, device=device)
                      for c in chunk_ids(cp_rank, cp_size, order)])


def layout_positions(seq_len: int, cp_size: int, order: str = "balanced", device=None) -> torch.Tensor:
    """Global positions of the rank-order concatenation of all local shards (what an all-gather yields)."""
    return torch.cat([positions(seq_len, r, cp_size, order, device) for r in range(cp_size)])
