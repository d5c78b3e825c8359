"""Skewed MoE routing, stated once for the planner, the simulator and the run's routing record.

An ep rank owns a block of experts (contiguous: rank r owns [r·E_l, (r+1)·E_l); a placement may permute
them). In a dropless run the rank whose experts receive the most rows sets the step's MoE memory and time,
so plans and simulations state the load of that busiest rank as a share σ of every source rank's n·k
assignments: the skew S = σ·ep (1: balanced, ep: every row to one rank).

Every source rank routes alike (the simulator's stand-in and the planner's count): it sends
h = round(σ·n·k) rows to the busiest rank — capped by what top-k allows, each token choosing at most
min(k, E_l) of that rank's experts — and the rest as evenly as integers allow to the others; the busiest
rank receives ep·h rows per MoE layer and microbatch. With a capacity factor F each expert keeps at most
ceil(F·n·k/E) rows of each source (`expert_capacity`, the dispatcher's rule): the plan counts the drops.
"""
from __future__ import annotations

import math

from .placement import balanced


def busiest_share(counts: list[float], ep: int, placement: list[int] | None = None) -> float:
    """The share of `counts` (rows per expert) the busiest of `ep` ranks receives; `placement[e]` is the rank
    holding expert e (None: contiguous blocks). 0 for no rows."""
    total = sum(counts)
    if not total:
        return 0.0
    e_l = len(counts) // ep
    loads = [0.0] * ep
    for e, c in enumerate(counts):
        loads[e // e_l if placement is None else placement[e]] += c
    return max(loads) / total


def skew_of(counts: list[float], ep: int, placement: list[int] | None = None) -> float:
    """The busiest rank's load over the mean: σ·ep."""
    return busiest_share(counts, ep, placement) * ep


def max_skew(n_experts: int, ep: int, topk: int) -> float:
    """The largest skew top-k routing allows: a token sends at most min(k, E_l) of its k rows to one rank."""
    return ep * min(topk, n_experts // ep) / topk


def hot_rows(tokens: int, topk: int, n_experts: int, ep: int, skew: float) -> int:
    """Rows each source rank sends the busiest rank, of its tokens·k: round(S/ep · tokens·k), capped."""
    rows = tokens * topk
    if ep < 2:
        return rows
    return min(round(skew / ep * rows), tokens * min(topk, n_experts // ep))


def expert_capacity(capacity_factor: float, tokens: int, topk: int, n_experts: int) -> int:
    """Assignments each expert accepts from one source rank: ceil(F·N·k/E) (the dispatcher's `capacity`)."""
    return math.ceil(capacity_factor * tokens * topk / n_experts)


def send_counts(tokens: int, topk: int, n_experts: int, ep: int, skew: float = 1.0, hot: int = 0,
                capacity_factor: float | None = None) -> list[int]:
    """Rows one source rank sends each expert: balanced (S = 1), or `hot_rows` spread over rank `hot`'s experts and
    the rest over the other ranks' experts, each as evenly as integers allow; with a capacity factor, what each
    expert keeps of them (the rest are dropped at the source)."""
    rows, e_l = tokens * topk, n_experts // ep
    if skew == 1.0 or ep < 2:
        blocks = [(list(range(n_experts)), rows)]
    else:
        h = hot_rows(tokens, topk, n_experts, ep, skew)
        blocks = [([e for e in range(n_experts) if e // e_l == hot], h),
                  ([e for e in range(n_experts) if e // e_l != hot], rows - h)]
    out = [0] * n_experts
    for block, total in blocks:
        base, extra = divmod(total, len(block))
        for j, e in enumerate(block):
            out[e] = base + (j < extra)
    if capacity_factor is not None:
        cap = expert_capacity(capacity_factor, tokens, topk, n_experts)
        out = [min(c, cap) for c in out]
    return out


def received_rows(tokens: int, topk: int, n_experts: int, ep: int, skew: float,
                  capacity_factor: float | None = None) -> int:
    """Rows the busiest ep rank's experts receive per MoE layer and microbatch (tokens·k balanced and dropless)."""
    if (skew == 1.0 or ep < 2) and capacity_factor is None:
        return tokens * topk
    per = send_counts(tokens, topk, n_experts, ep, skew, 0, capacity_factor)
    return ep * sum(per[:n_experts // ep])


def sent_rows(tokens: int, topk: int, n_experts: int, ep: int, skew: float,
              capacity_factor: float | None = None) -> int:
    """Rows a source rank keeps of its tokens·k (all of them without a capacity factor) and sends."""
    if capacity_factor is None:
        return tokens * topk
    return sum(send_counts(tokens, topk, n_experts, ep, skew, 0, capacity_factor))


def balanced_placement(counts: list[float], ep: int) -> list[int]:
    """The rank of each expert for an even expected load: `rules.placement.balanced`'s rule (hottest expert first,
    each to the least-loaded rank with a free slot), as a rank per expert."""
    layout = balanced(list(counts), ep)
    return [r for e in range(len(counts)) for r, rank in enumerate(layout.slots) if e in rank]
