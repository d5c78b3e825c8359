"""A step's global routing metrics: what the training loop reports about its MoE layers.

The metrics travel to the host in the step's one read (`shardwise.host`) beside the loss and the grad norm,
so they are gathered on the device as one float64 vector; `MoEMetrics` alone knows its layout.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import comm


@dataclasses.dataclass
class MoEMetrics:
    tokens_per_expert: list[int]  # routed tokens per expert, summed over layers and every token-holding rank
    max_over_mean_load: float  # the busiest expert's load over the mean load, averaged over layers
    dropped: int  # rows dropped by expert capacity
    aux_loss: float  # the load-balancing loss's value (scale-weighted, summed over layers)

    @staticmethod
    def width(n_experts: int) -> int:
        """Length of the device vector `gather` returns."""
        return n_experts + 4

    @classmethod
    def from_values(cls, values: list[float], n_experts: int) -> "MoEMetrics":
        """The metrics from the host copy of `gather`'s vector."""
        n = n_experts
        return cls([int(c) for c in values[:n]], values[n] / max(1.0, values[n + 1]), int(values[n + 2]),
                   values[n + 3])

    def record(self) -> dict:
        """The `moe_*` fields of a step's metrics record."""
        return {"moe_tokens_per_expert": self.tokens_per_expert, "moe_max_over_mean_load": self.max_over_mean_load,
                "moe_dropped": self.dropped, "moe_aux_loss": self.aux_loss}


def gather(layers, n_experts: int, token_axes, pp, device) -> torch.Tensor:
    """The loss-free bias update of every MoE layer (the bias is no optimizer input: before or after the
    optimizer step alike) and the step's metrics over all token-holding ranks and all stages, left on the
    device as one float64 vector (`MoEMetrics.from_values` reads it). Collective over `token_axes` and pp."""
    n = n_experts
    vec = torch.zeros(MoEMetrics.width(n), dtype=torch.float64, device=device)  # NCCL: on the device
    for m in layers:
        counts = m.update_bias(token_axes).double()  # all-reduced over the token axes; bias step
        vec[:n] += counts
        vec[n] += torch.where(counts.sum() > 0, counts.max() / counts.mean().clamp_min(1e-30), 0.0)
        vec[n + 1] += 1
        vec[n + 2] += m.step_dropped
        vec[n + 3] += m.step_aux
        m.step_dropped, m.step_aux = 0, 0.0
    tail = vec[n + 2:]  # dropped rows and aux parts are per rank: sum them over every token axis
    for ax in token_axes:
        comm.all_reduce(tail, ax, tag="metrics")
    comm.all_reduce(vec, pp, tag="metrics")
    return vec
