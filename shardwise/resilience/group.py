"""A worker group's starts under the built-in launcher's restarts: which start it is, where each node's memory copies
live, what the launcher saw of the failure, and — after an elastic change of dp — which first-start rank each rank
stands in for (`training.launch.run_local` drives it; docs/fault-tolerance.md)."""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerGroup:
    """One start of the worker group under `--max-restarts` / memory copies: which restart it is, where each node's
    memory copies live (`shardwise.resilience.store`: shared memory this launcher owns, so the copies outlive the
    ranks) and what the launcher saw of the failure that caused it. After an elastic change of dp (`--min-dp`) the
    group is the survivors: `ranks[i]` is the first start's rank that rank i stands in for (its node is that rank's),
    and `ranks_per_node` counts the survivors per node."""

    stores: str
    ranks_per_node: int
    restart: int = 0
    failure: dict | None = None
    ranks: tuple[int, ...] | None = None
    node_size: int | None = None  # ranks per node of the first start (default: ranks_per_node)

    def node_of(self, rank: int) -> int:
        return (rank if self.ranks is None else self.ranks[rank]) // (self.node_size or self.ranks_per_node)

    def node_store(self, rank: int) -> str:
        return os.path.join(self.stores, f"node{self.node_of(rank)}")

    def env(self, rank: int) -> dict[str, str]:
        return {"SHARDWISE_NODE_STORE": self.node_store(rank), "SHARDWISE_RANKS_PER_NODE": str(self.ranks_per_node),
                "SHARDWISE_RESTART_COUNT": str(self.restart), "SHARDWISE_FAILURE": json.dumps(self.failure or {})}

    def gone(self, world: int) -> list[int]:
        """Ranks whose node is lost for good (the fault injection's `gone` marks it: `node<k>.gone`)."""
        return [r for r in range(world) if os.path.exists(self.node_store(r) + ".gone")]

    def shrunk(self, keep: list[int], failure: dict) -> "WorkerGroup":
        """The next start on the ranks `keep` (of this start's numbering) only, renumbered in order."""
        from ..config import ConfigError

        orig = tuple(r if self.ranks is None else self.ranks[r] for r in keep)
        size = self.node_size or self.ranks_per_node
        per_node = {n: sum(1 for r in orig if r // size == n) for n in {r // size for r in orig}}
        if len(set(per_node.values())) != 1:
            raise ConfigError(f"elastic data parallelism: the surviving replicas fill nodes unevenly ({per_node} "
                              f"ranks per node); use --ranks-per-node that divides or is a multiple of a replica")
        forget_progress(self.stores, len(keep))  # the old numbering's records would read as the new ranks'
        return WorkerGroup(self.stores, next(iter(per_node.values())), self.restart + 1, failure, orig, size)


def forget_progress(stores: str, below: int) -> None:
    """Remove the progress records of ranks numbered `below` or more from every node's store."""
    for node in os.listdir(stores):
        where = os.path.join(stores, node)
        for name in os.listdir(where) if os.path.isdir(where) else []:
            number = name.removeprefix("progress-r")
            if number != name and number.isdigit() and int(number) >= below:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(where, name))
