"""Skewed MoE routing, stated once for the planner, the simulator and the run's routing record.

An ep rank owns a block of experts (contiguous: rank r owns [r·E_l, (r+1)·E_l); a placement may permute
them). In a dropless run the rank whose experts receive the most rows sets the step's MoE memory and time,
so plans and simulations state the load of that busiest rank as a share σ of every source rank's n·k
assignments: the skew S = σ·ep (1: balanced, ep: every row to one rank).

Every source rank routes alike (the simulator's stand-in and the planner's count): it sends
h = round(σ·n·k) rows to the busiest rank — capped by what top-k allows, each token choosing at most
min(k, E_l) of that rank's experts — and the rest as evenly as integers allow to the others; the busiest
rank receives ep·h rows per MoE layer and microbatch.
"""
from __future__ import annotations


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


def received_rows(tokens: int, topk: int, n_experts: int, ep: int, skew: float) -> int:
    """Rows the busiest ep rank's experts receive per MoE layer and microbatch (tokens·k at skew 1)."""
    if skew == 1.0 or ep < 2:
        return tokens * topk
    return ep * hot_rows(tokens, topk, n_experts, ep, skew)


def skewed_send_counts(tokens: int, topk: int, n_experts: int, ep: int, skew: float, hot: int = 0) -> list[int]:
    """Rows one source rank sends each expert: `hot_rows` spread over rank `hot`'s experts, the rest over the
    other ranks' experts, each as evenly as integers allow."""
    rows, e_l = tokens * topk, n_experts // ep
    h = hot_rows(tokens, topk, n_experts, ep, skew)
    others = [e for e in range(n_experts) if e // e_l != hot]
    out = [0] * n_experts
    for block, total in (([e for e in range(n_experts) if e // e_l == hot], h), (others, rows - h)):
        if block:
            base, extra = divmod(total, len(block))
            for j, e in enumerate(block):
                out[e] = base + (j < extra)
    return out
