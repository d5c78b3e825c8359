"""DeepSeek Sparse Attention under context parallelism: every rank sees every key, so the top-k is global.

The indexer's top-k must be taken over the whole causal sequence, exactly as one device takes it, and a query may
select any earlier key, wherever the layout put it. Rather than pass K/V blocks around a ring (or all-to-all heads,
Ulysses), each DSA layer all-gathers over cp what a key *is* — MLA's latent (kv_lora_rank + qk_rope_dim values per
token, shared by every head) and the indexer's key (index_head_dim values) — and reorders it into sequence order.
Then each rank scores its own queries against all keys, keeps each query's top-k with the one-device tie rule and
attends over the selected latents: no step depends on where a key lived. Both `--cp-impl` values take this path.

Bytes per layer and sequence: (cp−1)/cp · s · (kv_lora_rank + qk_rope_dim + index_head_dim) elements in forward
(all-gather), the latent's share again in backward (reduce-scatter of its gradient; the indexer keys carry none).
DeepSeek-V3.2: 704 values per token, against 128 heads × (192 + 128) = 40,960 that ring attention would pass.
Every byte goes through `comm` on the cp axis, so the ledger counts it.
"""
from __future__ import annotations

import torch

from .. import comm
from .sharding import layout_positions

TAG = "dsa"
"""The ledger's tag of these gathers (`all_gather:dsa`, `reduce_scatter:dsa` on the cp axis)."""


class _GatherKeys(torch.autograd.Function):
    """forward: all-gather along the sequence (dim 1) over cp / backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return comm.all_gather(x, axis, 1, tag=TAG)

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter(g.contiguous(), ctx.axis, 1, tag=TAG), None


def gather_sequence(x: torch.Tensor, axis, order: str) -> torch.Tensor:
    """[b, s_local, ...] on every cp rank → [b, s, ...] in sequence order. Forward: all-gather over cp; backward:
    reduce-scatter of the gradient (each rank gets the sum of what every rank's queries sent its keys)."""
    if not axis.active:
        return x
    gathered = _GatherKeys.apply(x.contiguous(), axis)  # rank order: each rank's chunks, in turn
    perm = torch.argsort(layout_positions(gathered.shape[1], axis.size, order, x.device))
    return gathered.index_select(1, perm)
