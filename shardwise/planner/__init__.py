"""Pure-Python parallel-layout planner: memory, FLOPs, communication, bubble, step time and search.

Imports no torch and no torch.distributed, so it runs anywhere. Entry points: `estimate` (one layout),
`search` (rank all layouts) and `step_comm` (per-op communication prediction of one rank); the `shardwise plan`
subcommand that presents them lives in `shardwise.commands.plan`.
"""
from shardwise.planner.comm_model import CommLedger, step_comm
from shardwise.rules.wire import wire_bytes
from shardwise.planner.errors import PlanError
from shardwise.planner.estimate import Assumptions, estimate, memory_by_stage, model_flops
from shardwise.planner.hardware import GPU_PRESETS, Cluster, get_gpu
from shardwise.planner.layout import Layout, Workload, from_train_config, layout_problems, parse_layout, stages
from shardwise.planner.models import PRESETS, ModelSpec, get_model, load_hf_config, total_params
from shardwise.planner.schedule import bubble_fraction, in_flight
from shardwise.planner.search import SearchSpace, search

__all__ = [
    "Assumptions", "Cluster", "CommLedger", "GPU_PRESETS", "Layout", "ModelSpec", "PRESETS", "PlanError",
    "SearchSpace", "Workload", "bubble_fraction", "estimate", "from_train_config", "get_gpu", "get_model",
    "in_flight", "layout_problems", "load_hf_config", "memory_by_stage", "model_flops", "parse_layout", "search",
    "stages", "step_comm", "total_params", "wire_bytes",
]
