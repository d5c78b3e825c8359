"""A step's global routing metrics: what the training loop reports about its MoE layers.

The metrics travel to the host in the step's one read (`shardwise.host`) beside the loss and the grad norm,
so they are gathered on the device as one float64 vector; `MoEMetrics` alone knows its layout:
[E totals | slots × E per layer | max/mean sum, layers, dropped, aux]. The per-layer rows are the counts the
loss-free bias update already all-reduces over the token axes (no extra collective over dp×ep); each stage
fills its own layers' rows and the one pp all-reduce completes them.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import comm
from ..rules.routing import busiest_share


@dataclasses.dataclass
class MoEMetrics:
    tokens_per_expert: list[int]  # routed tokens per expert, summed over layers and every token-holding rank
    max_over_mean_load: float  # the busiest expert's load over the mean load, averaged over layers
    dropped: int  # rows dropped by expert capacity
    aux_loss: float  # the load-balancing loss's value (scale-weighted, summed over layers)
    per_layer: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """Routed tokens per expert of each MoE layer (key: its layer id; MTP modules n_layers + k)."""
    ep: int = 1

    @staticmethod
    def width(n_experts: int, slots: int = 0) -> int:
        """Length of the device vector `gather` returns (`slots`: layer ids a model can have)."""
        return n_experts * (1 + slots) + 4

    @classmethod
    def from_values(cls, values: list[float], n_experts: int, ep: int = 1) -> "MoEMetrics":
        """The metrics from the host copy of `gather`'s vector."""
        n, tail = n_experts, values[-4:]
        rows = values[n:-4]
        per_layer = {i // n: [int(c) for c in rows[i:i + n]] for i in range(0, len(rows), n) if any(rows[i:i + n])}
        return cls([int(c) for c in values[:n]], tail[0] / max(1.0, tail[1]), int(tail[2]), tail[3], per_layer, ep)

    def busiest_ep_share(self) -> dict[int, float]:
        """Per layer: the share of its routed tokens the busiest ep rank's experts received (contiguous placement)."""
        return {i: busiest_share(c, self.ep) for i, c in self.per_layer.items()}

    def record(self) -> dict:
        """The `moe_*` fields of a step's metrics record; `moe_routing` (the per-layer histogram) is for
        routing.jsonl, which the run writer takes out of the record."""
        out = {"moe_tokens_per_expert": self.tokens_per_expert, "moe_max_over_mean_load": self.max_over_mean_load,
               "moe_dropped": self.dropped, "moe_aux_loss": self.aux_loss}
        if self.per_layer:
            shares = self.busiest_ep_share()
            out["moe_busiest_ep_over_mean"] = max(shares.values()) * self.ep
            out["moe_routing"] = {"ep": self.ep, "tokens_per_expert": {str(i): c for i, c in self.per_layer.items()},
                                  "busiest_ep_share": {str(i): s for i, s in shares.items()}}
        return out


def gather(layers, n_experts: int, token_axes, pp, device, slots: int = 0) -> torch.Tensor:
    """The loss-free bias update of every MoE layer (the bias is no optimizer input: before or after the
    optimizer step alike) and the step's metrics over all token-holding ranks and all stages, left on the
    device as one float64 vector (`MoEMetrics.from_values` reads it). Collective over `token_axes` and pp.
    With `slots`, each layer's counts also land in its row (`routing_slot`, set by `routing_stats.moe_blocks`)."""
    n = n_experts
    vec = torch.zeros(MoEMetrics.width(n, slots), dtype=torch.float64, device=device)  # NCCL: on the device
    for m in layers:
        counts = m.update_bias(token_axes).double()  # all-reduced over the token axes; bias step
        vec[:n] += counts
        slot = getattr(m, "routing_slot", None)
        if slots and slot is not None:
            vec[n * (1 + slot):n * (2 + slot)] += counts
        vec[-4] += torch.where(counts.sum() > 0, counts.max() / counts.mean().clamp_min(1e-30), 0.0)
        vec[-3] += 1
        vec[-2] += m.step_dropped
        vec[-1] += m.step_aux
        m.step_dropped, m.step_aux = 0, 0.0
    tail = vec[-2:]  # dropped rows and aux parts are per rank: sum them over every token axis
    for ax in token_axes:
        comm.all_reduce(tail, ax, tag="metrics")
    comm.all_reduce(vec, pp, tag="metrics")
    return vec
