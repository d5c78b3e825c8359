"""Which MoE layer is which in the step's routing record: every MoE block labelled with its model-wide layer id.

Under a pipeline each rank holds a few layers; the record needs each layer's row at the same place on every
stage, so a block's slot is its layer id (`layers.<i>`), and an MTP module's block n_layers + k (`mtp.<k>`).
The share math is `rules.routing`'s, which the planner and the simulator read too.
"""
from __future__ import annotations

from torch import nn

from .moe import MoE


def slot_count(cfg) -> int:
    """Layer ids a model's MoE blocks can have: its layers and its MTP modules."""
    return cfg.n_layers + cfg.mtp_layers


def moe_blocks(model: nn.Module, n_layers: int) -> list[MoE]:
    """This rank's MoE blocks in module order, each with `routing_slot` set from its name."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            parts = name.split(".")
            if "layers" in parts:
                m.routing_slot = int(parts[parts.index("layers") + 1])
            elif "mtp" in parts:
                m.routing_slot = n_layers + int(parts[parts.index("mtp") + 1])
            out.append(m)
    return out
