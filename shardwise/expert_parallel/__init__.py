"""Expert parallelism: a top-k router, an all-to-all token dispatcher over the ep axis, grouped experts, MoE."""
from .dispatch import AllToAllDispatcher, DispatchHandle, all_to_all_rows, capacity, keep_mask
from .experts import GroupedExperts
from .moe import MoE, MoEStats
from .router import Router, Routing

__all__ = ["AllToAllDispatcher", "DispatchHandle", "GroupedExperts", "MoE", "MoEStats", "Router", "Routing",
           "all_to_all_rows", "capacity", "keep_mask"]
