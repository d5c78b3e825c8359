"""What a layout changes in the model's math, in one object the plan (`shardwise.parallelize`) fills.

The model calls through it and never asks which axes exist: attention under context parallelism, the
cross-entropy over a sharded vocabulary, dropout that agrees across TP ranks, the RNG streams, which attention
cores selective recompute replays, and which MoE block a layer gets. Its defaults are the one-device model, so
the model's modules run as plain PyTorch until a plan says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F


def cross_entropy(logits, targets, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token losses [b, s] with the whole vocabulary on this rank: PyTorch's fused kernel, in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index,
                           reduction="none", label_smoothing=label_smoothing).view(targets.shape)


@dataclass
class ParallelContext:
    """The model's window onto the layout: every field's default is the single-device behaviour."""

    cp: Any = None
    """Context-parallel attention (`attend`, `record_padding`) and RoPE positions (`rope_positions`); None: no cp."""
    cross_entropy: Callable = cross_entropy
    """(logits, targets, ignore_index, label_smoothing) → per-token losses, over this rank's logits shard."""
    dropout: Callable | None = None
    """(x, p) → dropout on the residual stream with one global mask under TP/SP; None: `F.dropout`."""
    rng: Any = None
    """The RNG tracker: attention dropout draws from its "tp" stream (each TP rank's heads differ)."""
    tp_axis: Any = None
    """The tensor-parallel axis the plan sharded the model over (None: not sharded)."""
    sequence_parallel: bool = False
    """The residual stream is cut over the sequence between TP regions."""
    selective: frozenset[int] = frozenset()
    """Layer ids whose attention core selective recompute replays, through `checkpoint_core(core, *inputs)`."""
    checkpoint_core: Callable | None = None
    max_logits: Any = None
    """A `MaxLogits` recorder (attention.py) the attention cores report each head's largest logit to in training
    (MuonClip); None: not measured."""
    attention: Callable | None = None
    """(q, k, v, scale, sinks, window, doc_ids, report=None) → out: one-device attention with what SDPA cannot express
    (gpt-oss's learned sinks, sliding windows) on the fused kernels, `report` (MuonClip) called with each head's
    largest logit over the pairs it attends; the plan fills it. None: a model with either cannot run."""
    moe: Callable | None = None
    """(cfg, layer_id) → the MoE feed-forward of an MoE layer: routing and experts live with expert parallelism,
    which the models do not import. Without it a model with MoE layers cannot be built."""
