"""GPU presets and the cluster they form: what each parallel axis's traffic rides on.

Figures are vendor datasheet peaks. Bandwidths are per GPU and per direction, because a ring
collective's time is the bytes one rank sends divided by the rate it can send at. Memory sizes are
the advertised decimal GB (the real binary-sized HBM is a few percent larger; that slack is part of
the planner's headroom). The planner multiplies peaks by achievable fractions (see `Assumptions`).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.errors import PlanError

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    peak_bf16_flops: float
    """Dense (no 2:4 sparsity) BF16 tensor-core FLOP/s."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """Scale-up link (NVLink / Infinity Fabric), per GPU per direction."""
    nvlink_domain: int
    """GPUs that reach each other over the scale-up link."""
    domain_spans_nodes: bool
    """True when the scale-up domain is larger than a node (NVL72 racks)."""
    internode_bytes_per_s: float
    """Scale-out NIC bandwidth per GPU per direction."""
    gpus_per_node: int


GPU_PRESETS: dict[str, GPU] = {
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e, NVLink3 600 GB/s
    # (bidirectional, so 300 GB/s each way); DGX A100: 8 GPUs, 8x 200 Gb/s HDR InfiniBand (25 GB/s/GPU).
    "a100-80gb": GPU("a100-80gb", 80 * GB, 312e12, 2.039e12, 300e9, 8, False, 25e9, 8),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 dense (1,979 with sparsity), 3.35 TB/s HBM3,
    # NVLink4 900 GB/s bidirectional (450 each way); DGX H100: 8x 400 Gb/s NDR ConnectX-7 (50 GB/s/GPU).
    "h100-80gb": GPU("h100-80gb", 80 * GB, 989e12, 3.35e12, 450e9, 8, False, 50e9, 8),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s; same Hopper die, BF16 and NVLink as H100;
    # HGX H200 systems ship 400 Gb/s per GPU.
    "h200": GPU("h200", 141 * GB, 989e12, 4.8e12, 450e9, 8, False, 50e9, 8),
    # NVIDIA HGX/DGX B200 datasheet: 180 GB HBM3e per GPU (1,440 GB per 8), 7.7 TB/s, 2.25 PFLOP/s
    # BF16 dense (4.5 sparse), NVLink5 1.8 TB/s bidirectional; DGX B200: 8x 400 Gb/s ConnectX-7.
    "b200": GPU("b200", 180 * GB, 2.25e15, 7.7e12, 900e9, 8, False, 50e9, 8),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, 1,307.4 TFLOP/s BF16 dense; Infinity
    # Fabric 7 links x 64 GB/s each way to the 7 peers of an 8-GPU OAM platform (896 GB/s aggregate
    # bidirectional); typical platforms pair each GPU with a 400 Gb/s NIC.
    "mi300x": GPU("mi300x", 192 * GB, 1307.4e12, 5.3e12, 448e9, 8, False, 50e9, 8),
    # NVIDIA GB200 NVL72 spec sheet: 72 GPUs in one NVLink domain (130 TB/s = 1.8 TB/s bidirectional
    # per GPU), 13.4 TB HBM3e (186 GB/GPU), 576 TB/s (8 TB/s/GPU), 180 PFLOP/s FP16/BF16 dense per
    # rack (2.5 PFLOP/s/GPU); compute trays hold 4 GPUs; scale-out 400 Gb/s ConnectX-7 per GPU.
    "gb200-nvl72": GPU("gb200-nvl72", 186 * GB, 2.5e15, 8e12, 900e9, 72, True, 50e9, 4),
}


def get_gpu(name: str) -> GPU:
    if name not in GPU_PRESETS:
        raise PlanError(f"unknown GPU {name!r}; valid: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[name]


@dataclass(frozen=True)
class Cluster:
    """N GPUs of one kind, numbered node by node; the mesh puts tp innermost (see layout.py)."""

    gpu: GPU
    gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.gpus <= 0 or self.gpus_per_node <= 0:
            raise PlanError(f"--gpus {self.gpus} and --gpus-per-node {self.gpus_per_node} must be positive")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanError(f"--gpus {self.gpus} is not a multiple of --gpus-per-node {self.gpus_per_node}")

    @property
    def domain(self) -> int:
        """Size of one scale-up domain: the node, unless the fabric spans nodes (NVL72)."""
        size = self.gpu.nvlink_domain if self.gpu.domain_spans_nodes else min(self.gpu.nvlink_domain, self.gpus_per_node)
        return max(1, min(size, self.gpus))

    def bandwidth(self, link: str | None) -> float:
        return self.gpu.internode_bytes_per_s if link == "network" else self.gpu.nvlink_bytes_per_s

    def describe(self) -> str:
        nodes = max(1, self.gpus // self.gpus_per_node)
        return f"{self.gpus} x {self.gpu.name} ({nodes} nodes of {self.gpus_per_node}, NVLink domain {self.domain})"


def spans_link(spans, size: int, domain: int) -> str | None:
    """'nvlink' if every group (given by its lowest and highest rank) stays in one scale-up domain,
    'network' if any crosses it, None for groups of one rank."""
    if size < 2:
        return None
    return "network" if any(lo // domain != hi // domain for lo, hi in spans) else "nvlink"
