"""The cluster GPUs form: what each parallel axis's traffic rides on. The GPU presets themselves are
`rules.hardware`'s (the training run's MFU reads them too)."""
from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.errors import PlanError
from shardwise.rules.hardware import GPU, GPU_PRESETS


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
