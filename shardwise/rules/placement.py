"""Which ep rank holds which expert: the placement rule the runtime (`--expert-placement`) and the planner read.

A placement only relabels where an expert's rows are computed; the router, the capacity rule and the weights
stay logical (expert e is the same tensor slice, drawn from its logical id, wherever it lives), so the math is the
one device's. An `ExpertLayout` lists each rank's local slots, slot j of rank r holding logical expert
`slots[r][j]`:

* contiguous: rank r holds [r·E_l, (r+1)·E_l) — the layout without a placement;
* balanced: from a recorded histogram (tokens per expert), hottest first, each expert to the least-loaded rank
  with a free slot (longest-processing-time bin packing, E/ep slots per rank);
* balanced with R replicas: the ep hottest experts are each held by R distinct ranks, a copy expecting 1/R of the
  expert's rows; every rank then holds E/ep − 1 + R slots. A source rank sends token t's row of a replicated expert
  to copy (t + source rank) mod R (deterministic, no communication), and the copies' gradients are summed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

PLACEMENTS = ("contiguous", "balanced")


@dataclass(frozen=True)
class ExpertLayout:
    """slots[r][j]: the logical expert in local slot j of ep rank r; every rank has the same number of slots."""

    n_experts: int
    slots: tuple[tuple[int, ...], ...]

    @property
    def ep(self) -> int:
        return len(self.slots)

    @property
    def n_local(self) -> int:
        return len(self.slots[0])

    def copies(self, e: int) -> list[int]:
        """Global slot ids (rank·n_local + j) holding expert e, in rank order."""
        return [r * self.n_local + j for r, rank in enumerate(self.slots) for j, x in enumerate(rank) if x == e]

    def replicas(self) -> int:
        """The most copies any expert has (1: a permutation)."""
        return max(len(self.copies(e)) for e in range(self.n_experts))

    def primary(self, r: int) -> tuple[bool, ...]:
        """Per local slot of rank r: whether it is its expert's first copy (the one a checkpoint writes)."""
        first = {e: self.copies(e)[0] for e in range(self.n_experts)}
        return tuple(first[e] == r * self.n_local + j for j, e in enumerate(self.slots[r]))

    @property
    def identity(self) -> bool:
        return self == contiguous(self.n_experts, self.ep)

    def rank_loads(self, counts: list[float]) -> list[float]:
        """Expected rows per rank under `counts` (rows per logical expert), a replicated expert's split evenly."""
        n_copies = [len(self.copies(e)) for e in range(self.n_experts)]
        return [sum(counts[e] / n_copies[e] for e in rank) for rank in self.slots]


def contiguous(n_experts: int, ep: int) -> ExpertLayout:
    e_l = n_experts // ep
    return ExpertLayout(n_experts, tuple(tuple(range(r * e_l, (r + 1) * e_l)) for r in range(ep)))


def balanced(counts: list[float], ep: int, replicas: int = 1) -> ExpertLayout:
    """An even expected load from `counts` (rows per expert): with `replicas` R > 1 the ep hottest experts get R
    copies each (a copy weighing 1/R), then every piece, heaviest first, goes to the least-loaded rank with a free
    slot that does not hold its expert yet (ties: the expert's contiguous rank first, then the lowest)."""
    n, e_l = len(counts), len(counts) // ep
    if n % ep:
        raise ValueError(f"{n} experts do not divide over ep={ep}")
    if not 1 <= replicas <= ep:
        raise ValueError(f"expert replicas {replicas}: expected 1..ep={ep}")
    order = sorted(range(n), key=lambda e: (-counts[e], e))
    hot = set(order[:ep]) if replicas > 1 else set()
    per_rank = e_l + (replicas - 1 if hot else 0)
    pieces = sorted(((counts[e] / (replicas if e in hot else 1), e) for e in range(n)
                     for _ in range(replicas if e in hot else 1)), key=lambda x: (-x[0], x[1]))
    loads, held = [0.0] * ep, [[] for _ in range(ep)]
    for w, e in pieces:
        free = [r for r in range(ep) if len(held[r]) < per_rank and e not in held[r]]
        if not free:
            raise ValueError(f"expert placement: no rank left for a copy of expert {e}")
        r = min(free, key=lambda r: (loads[r], r != e // e_l, r))
        held[r].append(e)
        loads[r] += w
    return ExpertLayout(n, tuple(tuple(sorted(h)) for h in held))


def layout_for(placement: str, n_experts: int, ep: int, counts: list[float] | None = None,
               replicas: int = 1) -> ExpertLayout:
    """The layout `--expert-placement` names for one MoE layer (`counts`: its recorded histogram)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"expert placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    if placement == "contiguous" or counts is None:
        return contiguous(n_experts, ep)
    return balanced(list(counts), ep, replicas)


def read_histogram(path: str) -> dict[int, list[float]]:
    """{layer id: tokens per expert summed over the recorded steps} from a run directory's routing.jsonl (or that
    file itself). Raises ValueError naming the path when there is none."""
    file = os.path.join(path, "routing.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"routing histogram {path}: no routing.jsonl (a shardwise run directory of an MoE model)")
    totals: dict[int, list[float]] = {}
    with open(file) as f:
        for line in f:
            if line.strip():
                for layer, counts in json.loads(line)["tokens_per_expert"].items():
                    row = totals.setdefault(int(layer), [0.0] * len(counts))
                    for e, c in enumerate(counts):
                        row[e] += c
    if not totals:
        raise ValueError(f"routing histogram {path}: routing.jsonl holds no step")
    return totals
