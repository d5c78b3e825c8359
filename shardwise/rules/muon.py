"""Muon's deal of whole matrices to the ranks of a group: which rank orthogonalises each one.

`optim.sharded.Muon` steps by this deal and the planner sizes Muon's gathers and buffers by it, so both must
read the same rule.
"""
from __future__ import annotations

NOT_HIDDEN = ("tok_embeddings", "output", "router", "mtp_embed")
"""Modules whose matrices are not hidden transformations: embeddings, the LM head and MoE routers (AdamW)."""


def is_hidden_matrix(name: str, ndim: int) -> bool:
    """Muon steps this parameter (`--optimizer muon`): a hidden weight matrix (attention and MLA projections, MLP
    and expert matrices, MTP projections); AdamW the rest. `name` as `named_parameters` gives it."""
    return ndim >= 2 and not any(part in NOT_HIDDEN for part in name.split("."))


def _cost(shape: tuple[int, int]) -> int:
    """Newton–Schulz work of one matrix, up to a constant: rows·cols·min(rows, cols)."""
    r, c = shape
    return r * c * min(r, c)


def deal(shapes: list[tuple[int, int]], ranks: int) -> list[int]:
    """Owner rank of each matrix: largest Newton–Schulz cost first, to the least-loaded rank (ties: lowest rank,
    then list order). Deterministic, so every rank of a group computes the same deal without a message, and the
    largest load exceeds the mean by at most one matrix's cost."""
    load = [0] * ranks
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_cost(shapes[i]), i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += _cost(shapes[i])
    return owner


def busiest_numel(shapes: list[tuple[int, int]], ranks: int) -> int:
    """Elements of the largest per-rank result buffer under `deal`: every rank's buffer is padded to it."""
    sizes = [0] * ranks
    for s, r in zip(shapes, deal(shapes, ranks)):
        sizes[r] += s[0] * s[1]
    return max(sizes, default=0)
