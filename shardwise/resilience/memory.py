"""`--mem-ckpt-every N`: every N steps each rank keeps a copy of its state on its own node and sends one to its
holder on the next node (`peers`), where it lands in that node's store. The send travels on the `ckpt` gloo group
(host tensors, like a disk checkpoint's metadata), so the ledger counts it on axis 'ckpt' as `send:mem_ckpt`."""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch

from .. import comm
from .peers import holder_of, ward_of
from .snapshot import snapshot
from .store import NodeInfo, NodeStore


def exchange(ops, axis, what: str, timeout_s: float) -> None:
    """One p2p batch on the host axis, waited for at most the run's collective timeout (the `ckpt` group's own is an
    hour, for disk checkpoints): a peer that hangs mid-copy fails its partners as it would any collective."""
    timeout = timedelta(seconds=timeout_s)
    for work in comm.p2p(ops, tag=what.replace(" ", "_")):
        comm.guarded(axis, what, work.wait, timeout)


def host_axis(mesh):
    """The `ckpt` axis with host tensors (device="cpu" on purpose): memory copies live in host memory and travel on
    the gloo `ckpt` group, never on the training device's communicator."""
    return dataclasses.replace(mesh["ckpt"], device=torch.device("cpu"))


class MemoryCopies:
    """This rank's side of the copies: its own into its node store, its ward's (received) into the same store."""

    def __init__(self, trainer, info: NodeInfo):
        self.trainer, self.axis = trainer, host_axis(trainer.mesh)
        world, self.rank = self.axis.size, trainer.mesh.rank
        self.store = NodeStore(info.store, world)
        self.holder = holder_of(self.rank, world, info.ranks_per_node)
        self.ward = ward_of(self.rank, world, info.ranks_per_node)
        self.before_send = []  # fn(step) called once the local copy is kept (fault injection's `mem-ckpt` phase)
        self.timeout_s = trainer.cfg.timeout_s

    def copy(self, step: int) -> None:
        """Collective over `ckpt` (each rank sends to one and receives from one). After `step` completed steps."""
        blob = snapshot(self.trainer, step)
        self.store.write(self.rank, step, blob)
        for hook in self.before_send:
            hook(step)
        if self.holder == self.rank:  # one node: no peer to hold a second copy
            return
        # the size first (the metadata's length varies with the step and the RNG states' digits)
        size, got = torch.tensor([blob.numel()], device="cpu"), torch.zeros(1, dtype=torch.int64, device="cpu")
        exchange([("send", size, self.axis, self.holder), ("recv", got, self.axis, self.ward)], self.axis,
                 "mem ckpt", self.timeout_s)
        held = torch.empty(int(got[0]), dtype=torch.uint8, device="cpu")
        exchange([("send", blob, self.axis, self.holder), ("recv", held, self.axis, self.ward)], self.axis,
                 "mem ckpt", self.timeout_s)
        self.store.write(self.ward, step, held)
        # the holder says the copy is kept: a send that returned may still be in flight, and a rank whose node
        # dies right after it must not count on a copy its holder never finished receiving
        done, ack = torch.ones(1, dtype=torch.int64, device="cpu"), torch.zeros(1, dtype=torch.int64, device="cpu")
        exchange([("send", done, self.axis, self.ward), ("recv", ack, self.axis, self.holder)], self.axis,
                 "mem ckpt", self.timeout_s)
