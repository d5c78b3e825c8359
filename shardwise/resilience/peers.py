"""Which rank holds whose memory copy: pure, so the planner, the launcher and the tests read the same rule.

Ranks are laid out node by node (rank = node × ranks_per_node + local), as torchrun and the built-in launcher
number them. Every rank keeps its own copy on its own node, and the rank at the same local position on the next
node, (node + 1) mod nodes, keeps a second one. Losing any one node n loses the copies held there — its ranks'
own copies and node n−1's peer copies — but node n's ranks' peer copies sit on node n+1 and node n−1's own
copies on node n−1, both alive: every rank's state survives, by construction (`survivors_cover`).
"""
from __future__ import annotations


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def holder_of(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank on the next node (same local position) that keeps `rank`'s peer copy; `rank` itself on one node."""
    nodes = world // ranks_per_node
    node, local = divmod(rank, ranks_per_node)
    return ((node + 1) % nodes) * ranks_per_node + local


def ward_of(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank whose peer copy `rank` keeps (the inverse of `holder_of`)."""
    nodes = world // ranks_per_node
    node, local = divmod(rank, ranks_per_node)
    return ((node - 1) % nodes) * ranks_per_node + local


def node_memory(world: int, ranks_per_node: int, holder=holder_of) -> dict[int, set[int]]:
    """{node: the ranks whose state its memory holds}: its own ranks' and those whose `holder` is on it."""
    held = {n: set(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(world // ranks_per_node)}
    for r in range(world):
        held[node_of(holder(r, world, ranks_per_node), ranks_per_node)].add(r)
    return held


def survivors_cover(lost_node: int, world: int, ranks_per_node: int, holder=holder_of) -> bool:
    """Whether every rank's state is still held in memory once `lost_node` is gone (under the rule `holder`)."""
    held = node_memory(world, ranks_per_node, holder)
    return set().union(*(h for n, h in held.items() if n != lost_node)) == set(range(world))
