"""gpt-oss's attention sinks and sliding windows, as corrections to a fused kernel's (out, LSE).

A sink is one learned logit σₕ per query head that joins every row's softmax denominator but has no value:

    y = Σⱼ exp(sⱼ − L′)·vⱼ,   L′ = log(Σⱼ exp sⱼ + exp σₕ) = logaddexp(L, σₕ),   L = logsumexp over the keys.

Since the kernel returns out = Σⱼ exp(sⱼ − L)·vⱼ and L, the sink is merged afterwards, once per row:
y = out · exp(L − L′) = out · sigmoid(L − σₕ). No kernel needs a sink argument, and under ring attention the
merge happens once, after every block's (out, L) was merged, never per block.

Backward: y is the attention of the same scores with probabilities pⱼ = exp(sⱼ − L′), so a fused backward
handed (y, L′) as its global out and LSE computes dq, dk, dv exactly: it forms pⱼ from L′ and the row term
D = rowsum(dy ∘ y) from y. The sink's own gradient is dσₕ = −Σ_rows D · exp(σₕ − L′) (its probability times
the same row term), summed over the batch and this rank's rows.

A sliding window W (transformers' `sliding_window`) lets query q see key k iff q − W < k ≤ q.
"""
from __future__ import annotations

import torch


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, h, s, d], LSE fp32 [b, h, s]) of the keys → (out · σ(L − sink) in fp32, logaddexp(L, sink))."""
    sink = sinks.detach().float().view(1, -1, 1)
    return out.float() * torch.sigmoid(lse - sink).unsqueeze(-1), torch.logaddexp(lse, sink)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [h] from the merged out and LSE (`merge_sink`) of this rank's rows."""
    d = (dout.float() * out.float()).sum(-1)  # [b, h, s]: the softmax backward's row term
    return -(d * torch.exp(sinks.detach().float().view(1, -1, 1) - lse)).sum((0, 2)).to(sinks.dtype)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean [s_q, s_k] (True = attend): causal and within the window, from global positions."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window) if window else diff >= 0
