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

from dataclasses import dataclass, replace

from shardwise.rules import wire
from shardwise.rules.flops import layer_flops_per_token

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


PROGRESS_CORES = 2
"""CPU cores per rank at or below which `--tp-overlap-auto` turns the overlap off on a host (gloo): the chunks'
transfers progress on gloo's threads, which then run on the cores the GEMMs need. Measured (benchmarks/tp_overlap.py,
2 cores): the overlapped block 1.26–1.37× the plain one at tp4 (0.5 cores per rank), no gain at tp2 (1 per rank)."""


@dataclass(frozen=True)
class Host:
    """What the overlap's arithmetic needs of the machine a run is on: one rank's GEMM rate, the TP link's
    achievable rate and one small collective's latency, and the CPU cores each rank has (None on an accelerator,
    whose collectives progress without the host's cores)."""

    name: str
    flops_per_s: float
    link_bytes_per_s: float
    latency_s: float
    cores_per_rank: float | None = None


CPU_CORE = Host("cpu", flops_per_s=60e9, link_bytes_per_s=1e9, latency_s=50e-6)
"""One fp32 core (one thread per rank) and gloo over loopback: ~60 GFLOP/s on a dim-512 projection GEMM, ~1 GB/s
and ~50 µs per small collective on the 2-core box the benchmarks ran on."""


def cpu_host(cores: int, ranks_here: int) -> Host:
    """The CPU host of a local or torchrun job: `cores` available to this process's node, shared by `ranks_here`."""
    return replace(CPU_CORE, cores_per_rank=cores / max(1, ranks_here))


def choose(tp: int, sequence_parallel: bool, exposed: ExposedTP | None, host: Host) -> tuple[bool, str]:
    """`--tp-overlap-auto`: (overlap on, why) for one layout on `host`. Off where there is nothing to chunk (no SP or
    tp 1), where a CPU rank has no core to spare for the transfers' progress, or where the exposed-communication
    term (`exposed_tp`) says the chunks' extra latency costs more than the GEMMs hide."""
    if tp < 2 or not sequence_parallel:
        return False, "off: no SP collectives to chunk (needs --sequence-parallel and --tp > 1)"
    if host.cores_per_rank is not None and host.cores_per_rank <= PROGRESS_CORES:
        return False, (f"off: {host.cores_per_rank:g} CPU cores per rank (≤ {PROGRESS_CORES}): the chunks' transfers "
                       "progress on gloo threads that would take the GEMMs' cores")
    per_chunk = exposed.gemm / (COLLECTIVES_PER_LAYER * tp)
    transfer = host.latency_s + exposed.comm / (COLLECTIVES_PER_LAYER * tp)
    figures = (f"exposed TP {exposed.overlap * 1e3:.3f} ms with it vs {exposed.plain * 1e3:.3f} ms without per layer "
               f"(GEMM per chunk {per_chunk * 1e6:.0f} µs, chunk transfer {transfer * 1e6:.0f} µs)")
    if exposed.overlap < exposed.plain:
        return True, f"on: {figures}"
    return False, f"off: {figures}"


def choose_for_run(cfg, tp: int, sequence_parallel: bool, cp: int, micro_batch: int, seq_len: int, act_bytes: int,
                   host: Host) -> tuple[bool, str]:
    """`choose` for a training run of model `cfg` (a ModelConfig): its first layer's projections on this rank."""
    tokens = micro_batch * seq_len // cp
    matmul, _ = layer_flops_per_token(cfg, cfg.is_moe_layer(0), seq_len, tp, sequence_parallel)
    exposed = exposed_tp(tokens, cfg.dim, act_bytes, tp, host.link_bytes_per_s, matmul * tokens, host.flops_per_s,
                         host.latency_s)
    return choose(tp, sequence_parallel, exposed, host)
