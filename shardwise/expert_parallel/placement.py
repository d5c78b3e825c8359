"""The run's expert placement: one `rules.placement.ExpertLayout` per MoE layer, from `--expert-placement` and the
histogram `--expert-routing` names (the rule itself is torch-free, in rules/placement.py, so the planner reads it)."""
from __future__ import annotations

from ..config.errors import ConfigError
from ..rules.placement import ExpertLayout, layout_for, read_histogram


def expert_layouts(parallel, n_experts: int) -> dict[int, ExpertLayout] | None:
    """{layer id: layout} for a balanced placement (a layer the histogram lacks stays contiguous); None: contiguous."""
    if parallel.expert_placement == "contiguous" or parallel.ep < 2:
        return None
    try:
        hist = read_histogram(parallel.expert_routing)
    except ValueError as e:
        raise ConfigError(f"--expert-routing: {e}") from None
    widths = {len(c) for c in hist.values()}
    if widths != {n_experts}:
        raise ConfigError(f"--expert-routing {parallel.expert_routing}: recorded {sorted(widths)[0]} experts per layer, "
                          f"the model has {n_experts}")
    return {layer: layout_for(parallel.expert_placement, n_experts, parallel.ep, counts, parallel.expert_replicas)
            for layer, counts in hist.items()}
