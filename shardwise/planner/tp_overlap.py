"""Exposed tensor-parallel communication per layer, with and without `--tp-overlap`.

Under SP each layer has two TP regions (attention, MLP), each entered by an all-gather of the sequence and left by
a reduce-scatter, and the backward mirrors both: k = 8 collectives per layer and microbatch, together C seconds of
bytes ((t−1)/t·n·h·bytes each over the link's rate) and one latency α each. Without overlap all of it is on the
critical path: C + k·α. With `--tp-overlap` each collective is cut into t chunks (k·t messages, the same bytes), and
chunk i+1 travels while chunk i's projection GEMM runs (G seconds per layer: the forward GEMMs and the backward's
input-gradient GEMMs, so G/(k·t) per chunk). The first chunk of each collective has nothing to hide behind; every
later one shows only what its transfer takes beyond the GEMM beside it:
    k·(α + C/(k·t)) + k·(t−1)·max(0, α + C/(k·t) − G/(k·t)).
The chunks pay α t times as often: with small messages or short GEMMs the overlapped run is slower, which the
model shows rather than hides.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.rules import wire

COLLECTIVES_PER_LAYER = 8
"""SP all-gather + reduce-scatter of two regions, forward and backward."""
LATENCY_S = {"nvlink": 8e-6, "network": 20e-6}
"""Latency α of one small collective over the TP group on the link (NCCL small-message ballpark)."""


@dataclass(frozen=True)
class ExposedTP:
    """Seconds per layer and microbatch on one rank."""

    tp: int
    comm: float
    """Bandwidth time of the layer's SP collectives (C)."""
    gemm: float
    """The projection GEMMs that can hide them (G)."""
    plain: float
    """Exposed without overlap: C + k·α."""
    overlap: float
    """Exposed with --tp-overlap: each collective's first chunk, and what the GEMMs cannot hide of the others."""

    def as_dict(self) -> dict:
        return {"comm_s": self.comm, "gemm_s": self.gemm, "exposed_plain_s": self.plain,
                "exposed_overlap_s": self.overlap, "messages_plain": messages_per_layer(self.tp, False),
                "messages_overlap": messages_per_layer(self.tp, True)}


def exposed_tp(tokens: int, dim: int, act_bytes: int, tp: int, rate: float, projection_flops: float,
               flops_per_s: float, latency: float) -> ExposedTP:
    """Exposed TP time of one SP layer: `tokens` per microbatch on the tp group (before the SP cut), `rate` the TP
    link's achievable bytes/s, `projection_flops` the layer's forward projection FLOPs on this rank."""
    if tp < 2:
        return ExposedTP(tp, 0.0, 0.0, 0.0, 0.0)
    k = COLLECTIVES_PER_LAYER
    comm = k * wire.reduce_scatter(tokens * dim * act_bytes, tp) / rate  # an all-gather's shard sends as much
    gemm = 2 * projection_flops / flops_per_s  # forward GEMMs and the backward's input-gradient GEMMs
    chunk, beside = latency + comm / (k * tp), gemm / (k * tp)
    plain = comm + k * latency
    overlap = k * chunk + k * (tp - 1) * max(0.0, chunk - beside)
    return ExposedTP(tp, comm, gemm, plain, overlap)


def messages_per_layer(tp: int, overlap: bool) -> int:
    """TP messages (collective calls) per layer and microbatch under SP: t chunks each with --tp-overlap."""
    return COLLECTIVES_PER_LAYER * (tp if overlap else 1) if tp > 1 else 0


def chunks(tp: int, local_len: int, overlap: bool) -> int:
    """Messages each overlapped SP collective is cut into: tp, or fewer on a shard of fewer rows (1: not cut)."""
    return max(1, min(tp, local_len)) if overlap and tp > 1 else 1
