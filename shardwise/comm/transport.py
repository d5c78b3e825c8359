"""The calls whose meaning depends on the world a rank lives in, behind one object the mesh hands every axis.

`Transport` is torch.distributed itself. Another world (shardwise.simulate's fake process group, where
nothing moves and no second backend can exist) passes `Mesh.build` its own subclass; the ops, their ledger
and their error naming stay the comm layer's, so a real run carries no branch for it.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class Transport:
    """torch.distributed: groups beside the grid's, object gathers and batched p2p, as the backend does them."""

    def side_group(self, timeout: timedelta):
        """A group over the whole world for checkpoint barriers and metadata gathers: gloo (CPU objects), with
        its own timeout, since writing a large checkpoint legitimately outlasts the collective timeout."""
        return dist.new_group(backend="gloo", timeout=timeout)

    def device_mesh(self, groups: list, device_type: str, grid: torch.Tensor, names: tuple[str, ...]):
        """A DeviceMesh over the grid's groups (peers such as DTensor use it)."""
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], device_type, mesh=grid,
                                     mesh_dim_names=names)

    def all_gather_object(self, out: list, obj, group) -> list:
        dist.all_gather_object(out, obj, group=group)
        return out

    def batch_isend_irecv(self, ops: list) -> list:
        return dist.batch_isend_irecv(ops)


TORCH = Transport()
