"""The one place that knows the parallel degrees, builds the device mesh and hands out groups.

Which ranks form each group is `rules.geometry`'s (the planner reads the same lines); this module turns
those lines into process groups. No other module creates a process group; everything else receives a
`Mesh` and asks it for an `Axis` by name.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm.ledger import Ledger
from .comm.transport import TORCH, Transport
from .config import ConfigError, ParallelConfig
from .rules.geometry import GRID, axis_lines

CHECKPOINT_TIMEOUT_S = 3600.0


def _subgroups(lines: list[list[int]], timeout: timedelta, name: str):
    """This rank's group among `lines` (disjoint; a rank in none gets None), in ONE collective call per
    axis: ncclCommSplit when the NCCL communicator is bound to a device, else new_subgroups_by_enumeration."""
    default = dist.distributed_c10d._get_default_group()
    if getattr(default, "bound_device_id", None) is not None and dist.get_backend() == "nccl":
        return dist.split_group(split_ranks=lines, timeout=timeout, group_desc=f"shardwise_{name}")
    return dist.new_subgroups_by_enumeration(lines, timeout=timeout, group_desc=f"shardwise_{name}")[0]


def _emb_axis(pp_lines: list[list[int]], pp: "Axis", rank: int, stages: tuple[int, int] | None,
              timeout: timedelta) -> "Axis":
    """The embedding group (Megatron's): the first and last pipeline stage's ranks with the same dp/cp/tp
    coordinates, which hold the two copies of a tied embedding matrix and sum their gradients.

    No group when one rank holds both ends (pp=1, or dualpipev's V puts the last stage back on pp rank 0);
    at pp=2 the pp group itself has exactly those two ranks, so it is reused (no new communicator). Ranks
    of the middle stages belong to no line: size 1, like an inactive axis.
    """
    if stages is None or stages[0] == stages[1]:
        return Axis("emb")
    if pp.size == 2:
        return Axis("emb", 2, pp.rank, pp.group, pp.ranks)
    lines = [[ln[stages[0]], ln[stages[1]]] for ln in pp_lines]
    group = _subgroups(lines, timeout, "emb")
    line = next((ln for ln in lines if rank in ln), None)
    return Axis("emb") if line is None else Axis("emb", 2, line.index(rank), group, tuple(line))


@dataclass
class Axis:
    """One parallel axis as seen by this rank: its group, size and this rank's index in it."""

    name: str
    size: int = 1
    rank: int = 0
    group: object = None
    ranks: tuple[int, ...] = (0,)
    ledger: "Ledger | None" = None
    device: torch.device | None = None  # the mesh's device: comm refuses tensors elsewhere
    transport: Transport = TORCH  # the mesh's: how this world's object gathers and p2p batches run

    @property
    def active(self) -> bool:
        return self.size > 1


class Mesh:
    """Degrees, this rank's coordinates and every group an axis needs.

    Single-device runs use `Mesh.single()` — the same object with every degree 1 and no groups.
    """

    def __init__(self, dims: ParallelConfig, rank: int, axes: dict[str, Axis], device: torch.device,
                 device_mesh=None, ledger: "Ledger | None" = None, transport: Transport = TORCH):
        self.ledger = ledger if ledger is not None else Ledger()
        for axis in axes.values():
            axis.ledger, axis.device, axis.transport = self.ledger, device, transport
        self.dims = dims
        self.rank = rank
        self.axes = axes
        self.device = device
        self.device_mesh = device_mesh
        self.build_s = 0.0

    def __getitem__(self, name: str) -> Axis:
        return self.axes[name]

    @property
    def coords(self) -> dict[str, int]:
        return {a: self.axes[a].rank for a in GRID}

    @classmethod
    def single(cls, device: torch.device | str = "cpu", ledger: "Ledger | None" = None) -> "Mesh":
        dims = ParallelConfig()
        axes = {n: Axis(n) for n in (*GRID, "dp_cp", "dp_shard", "dp_replicate", "ep", "edp", "emb", "world", "ckpt")}
        return cls(dims, 0, axes, torch.device(device), ledger=ledger)

    @classmethod
    def build(cls, dims: ParallelConfig, device: torch.device, ledger: "Ledger | None" = None,
              timeout_s: float = 300.0, emb_stages: tuple[int, int] | None = None,
              transport: Transport = TORCH) -> "Mesh":
        """Create every group, then the DeviceMesh over them. Collective: every rank calls it, in the same order.

        One group-creating call per axis (not per line), none for size-1 axes; the time it takes is
        `build_s` (summary.json's mesh_build_s). Groups get an explicit timeout (sub-groups would otherwise
        get gloo's 30-minute default), so a rank stuck in any collective fails within `timeout_s`.
        `emb_stages` (tied embeddings under PP): the pp ranks holding the embedding and the LM head; see `_emb_axis`.
        `transport`: the world's side groups, object gathers and p2p batches (`comm.Transport`).
        """
        t0 = time.perf_counter()
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != dims.world_size:
            raise ConfigError(f"mesh {dataclasses.asdict(dims)} needs {dims.world_size} ranks, got {world}")
        timeout = timedelta(seconds=timeout_s)
        families = axis_lines(dims)
        axes: dict[str, Axis] = {}
        for name, lines in families.items():
            line = next(ln for ln in lines if rank in ln)
            group = _subgroups(lines, timeout, name) if len(line) > 1 else None  # no group for size-1 lines
            axes[name] = Axis(name, len(line), line.index(rank), group, tuple(line))
        if "dp_shard" not in axes:  # no hybrid sharding: ZeRO shards over all of dp×cp, nothing replicates
            axes["dp_shard"], axes["dp_replicate"] = Axis("dp_shard"), Axis("dp_replicate")
        axes["emb"] = _emb_axis(families["pp"], axes["pp"], rank, emb_stages, timeout)
        axes["world"] = Axis("world", world, rank, dist.group.WORLD, tuple(range(world)))
        # Checkpoint barriers and metadata gathers, with a long timeout
        ckpt = transport.side_group(timedelta(seconds=max(timeout_s, CHECKPOINT_TIMEOUT_S)))
        axes["ckpt"] = Axis("ckpt", world, rank, ckpt, tuple(range(world)))
        active = [n for n in GRID if axes[n].active]
        device_mesh = None
        if active:
            device_mesh = transport.device_mesh([axes[n].group for n in active], device.type,
                                                torch.arange(world).view(*[axes[n].size for n in active]),
                                                tuple(active))
        mesh = cls(dims, rank, axes, device, device_mesh, ledger, transport)
        mesh.build_s = time.perf_counter() - t0
        return mesh

    def describe(self) -> str:
        return " × ".join(f"{a}={self.axes[a].size}" for a in GRID)
