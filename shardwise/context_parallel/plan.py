"""What the model asks of context parallelism, through its `ParallelContext.cp`: attention over the whole
sequence from this rank's tokens, Gated DeltaNet's convolution and recurrence across chunks, and the global
positions of those tokens for RoPE."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from . import linear_attention
from . import sparse_attention
from .ring_attention import ring_attention
from .sharding import positions, shard_sequence
from .ulysses import ulysses_attention


@dataclass(frozen=True)
class ContextParallel:
    """The cp axis, the token order over it and the attention implementation ('ring' or 'ulysses')."""

    axis: object
    order: str = "balanced"
    impl: str = "ring"

    @property
    def site(self) -> str:
        return "ring_attention" if self.impl == "ring" else "ulysses"

    def attend(self, q, k, v, scale: float | None = None, doc_ids=None, sinks=None, window: int = 0,
               report=None) -> torch.Tensor:
        """Causal attention of this rank's queries over every rank's keys (equal q/k and v head sizes); `sinks` and
        `window`: gpt-oss's per-head sink logits and sliding window.

        `report` (MuonClip): called with each local query head's largest logit over the block pairs this rank
        computed, −inf for heads it computed none of; the max over cp is taken with dp's, after the step."""
        fn = ring_attention if self.impl == "ring" else ulysses_attention
        extra = {} if sinks is None and not window else dict(sinks=sinks, window=window)
        return fn(q, k, v, self.axis, causal=True, order=self.order, scale=scale, doc_ids=doc_ids, report=report,
                  **extra)

    def linear_conv(self, x, weight, doc_ids=None) -> torch.Tensor:
        """Gated DeltaNet's causal convolution over this rank's tokens, with each chunk's left halo."""
        return linear_attention.conv_halo(x, weight, self.axis, self.order, doc_ids)

    def delta_rule(self, q, k, v, g, beta, doc_ids=None) -> torch.Tensor:
        """Gated DeltaNet's recurrence over this rank's tokens, from the state the earlier chunks leave."""
        return linear_attention.delta_rule(q, k, v, g, beta, self.axis, self.order, doc_ids)

    def gather_sequence(self, x) -> torch.Tensor:
        """Every rank's tokens of x [b, s_local, ...] in sequence order (DeepSeek Sparse Attention's keys)."""
        return sparse_attention.gather_sequence(x, self.axis, self.order)

    def record_padding(self, what: str, head: int, to: int) -> None:
        """The caller zero-padded a head to one size before `attend` (summary.json reports it)."""
        kernels.record_padding(self.site, what, head, to)

    def rope_positions(self, local_len: int, device, reset: torch.Tensor | None = None):
        """(global sequence length, this rank's tokens' positions) for RoPE. `reset` [b, s_global]
        (--reset-positions) are per-token positions of the whole window: this rank takes its tokens' share."""
        axis = self.axis
        seq_len = local_len * axis.size
        if reset is not None:
            return seq_len, shard_sequence(reset, axis.rank, axis.size, self.order)
        return seq_len, positions(seq_len, axis.rank, axis.size, self.order, device)
