"""Plans for the busiest expert rank: MoE routing that is not balanced.

The planner's MoE counts assume every ep rank's experts receive the mean, n·k rows per layer and microbatch
(n the rank's routed tokens). In a dropless run the busiest rank receives S× that, and it sets the step's peak
(received rows, regroup permutations, the experts' four [rows, ffn] tensors, the rows' input gradient) and its
time (its grouped GEMMs, the combine and dispatch-gradient all-to-alls it sends back). A `Workload` states the
routing two ways, and `skew` turns either into S for a layout's ep (`rules.routing` counts the rows):

* `moe_skew` S (`plan --moe-skew`, `simulate --moe-skew`): the busiest rank's share of every source rank's
  assignments is S/ep — capped where top-k cannot send more (`rules.routing.max_skew`);
* `moe_routing`: per-layer tokens per expert recorded by a run (RUN_DIR/routing.jsonl, summed over its steps;
  `read_routing`); S is the worst layer's busiest rank at the layout's ep under contiguous placement.

What the routing does not change: what each rank sends (its own tokens' n·k rows), the combined rows, the
router's tensors, the weights and their gradients.
"""
from __future__ import annotations

import json
import os

from ..rules.placement import balanced
from ..rules.routing import balanced_placement, max_skew, received_rows, send_counts, sent_rows, skew_of
from .errors import PlanError


def skew(spec, lay, wl) -> float:
    """S for this layout: the busiest ep rank's received rows over the mean (1 without ep or MoE); under
    `expert_placement` 'balanced' the busiest rank once each layer's experts are placed for an even load."""
    if not spec.moe_experts or lay.ep < 2:
        return 1.0
    if getattr(wl, "expert_placement", "contiguous") == "balanced":
        return placed_skew(spec, lay, wl)
    if wl.moe_routing:
        return max(skew_of(list(layer), lay.ep) for layer in wl.moe_routing)
    return min(wl.moe_skew, max_skew(spec.moe_experts, lay.ep, spec.moe_topk))


def placed_skew(spec, lay, wl) -> float:
    """S after `rules.placement.balanced` placed the experts: of each recorded layer, or of the per-expert rows
    `--moe-skew S` states (`rules.routing.send_counts`: the hot rank's experts at S× the mean) — the same LPT rule the
    run's `--expert-placement balanced` applies."""
    layers = wl.moe_routing or [send_counts(_RULE_TOKENS, spec.moe_topk, spec.moe_experts, lay.ep,
                                            min(wl.moe_skew, max_skew(spec.moe_experts, lay.ep, spec.moe_topk)))]
    worst = 1.0
    for layer in layers:
        counts = [float(c) for c in layer]
        loads = balanced(counts, lay.ep).rank_loads(counts)
        worst = max(worst, max(loads) * lay.ep / sum(counts) if sum(counts) else 1.0)
    return worst


_RULE_TOKENS = 1 << 16
"""Tokens a stated skew's per-expert rows are drawn for: many, so the integer rounding of the rule is negligible."""


def balanced_skew(spec, lay, wl) -> float | None:
    """With a recorded histogram: S if each layer's experts were placed over the ep ranks for an even load
    (`rules.routing.balanced_placement`, per layer); None without one."""
    if not wl.moe_routing or not spec.moe_experts or lay.ep < 2:
        return None
    return max(skew_of(list(layer), lay.ep, balanced_placement(list(layer), lay.ep)) for layer in wl.moe_routing)


def busiest_rows(spec, lay, wl, tokens: int) -> int:
    """Rows the busiest rank's experts receive per MoE layer and microbatch from `tokens` routed per rank."""
    return received_rows(tokens, spec.moe_topk, spec.moe_experts, lay.ep, skew(spec, lay, wl),
                         spec.moe_capacity_factor)


def kept_rows(spec, lay, wl, tokens: int) -> int:
    """Rows a rank keeps of its `tokens`·k and sends (all of them dropless; a capacity factor drops the rest)."""
    return sent_rows(tokens, spec.moe_topk, spec.moe_experts, lay.ep, skew(spec, lay, wl), spec.moe_capacity_factor)


def extra_expert_flops_per_token(spec, lay, wl) -> float:
    """Forward matmul FLOPs per token of a rank's sequence the busiest rank's routed experts run beyond the k rows per
    token `rules.flops.layer_flops_per_token` counts (under SP 1/tp of them): S× the rows, less a capacity's drops."""
    if not spec.moe_experts:
        return 0.0
    n = lay.mb * wl.seq_len // lay.cp
    n_r = n // lay.tp if lay.sp else n
    extra_rows = busiest_rows(spec, lay, wl, n_r) - n_r * spec.moe_topk
    return 2.0 * spec.mlp_mats * spec.dim * spec.expert_ffn_dim * extra_rows / n


def read_routing(run_dir: str, n_experts: int | None = None) -> tuple[tuple[float, ...], ...]:
    """Per MoE layer, tokens per expert over every step of RUN_DIR/routing.jsonl (`train` writes it)."""
    path = os.path.join(run_dir, "routing.jsonl")
    if not os.path.exists(path):
        raise PlanError(f"--routing {run_dir}: no routing.jsonl (a shardwise run directory of an MoE model)")
    totals: dict[str, list[float]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                for layer, counts in json.loads(line)["tokens_per_expert"].items():
                    row = totals.setdefault(layer, [0.0] * len(counts))
                    for e, c in enumerate(counts):
                        row[e] += c
    if not totals:
        raise PlanError(f"--routing {run_dir}: routing.jsonl holds no step")
    widths = {len(r) for r in totals.values()}
    if n_experts is not None and widths != {n_experts}:
        raise PlanError(f"--routing {run_dir}: recorded {sorted(widths)[0]} experts per layer, the model has "
                        f"{n_experts}: record a run of the same expert count")
    return tuple(tuple(totals[k]) for k in sorted(totals, key=int))


def check_skew(value: float | None) -> None:
    if value is not None and value < 1.0:
        raise PlanError(f"--moe-skew {value}: the busiest rank's load over the mean must be >= 1 (1: balanced)")


def skew_help(command: str) -> dict[str, str]:
    """Help of the two routing flags, the same on plan and simulate."""
    verb = "plan for" if command == "plan" else "trace"
    return {
        "--moe-skew": f"MoE routing: {verb} the busiest ep rank's experts receiving S× the mean rows (default 1: "
                      "balanced; capped where top-k cannot send more to one rank; a capacity factor's drops counted)",
        "--routing": f"MoE routing: {verb} the worst layer of the tokens-per-expert histogram a train run recorded "
                     "(RUN_DIR/routing.jsonl), its busiest ep rank at the layout's ep",
    }
