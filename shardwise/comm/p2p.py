"""Batched point-to-point ops (pipeline stage boundaries, ring attention), and the strict mode that makes
gloo follow NCCL's p2p ordering rules."""
from __future__ import annotations

import os

import torch.distributed as dist

from ..rules import wire
from .calls import check_device, eager, guarded, nbytes, record
from .collectives import completed


class _BatchWork:
    """One handle for a whole p2p batch, as NCCL returns (gloo returns one per op).

    Waiting twice is a no-op: a second wait on a finished gloo receive would block for a new message.
    """

    def __init__(self, works: list):
        self.works, self.done = works, False

    def wait(self, *timeout) -> bool:
        if not self.done:
            for w in self.works:
                w.wait(*timeout)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or completed(self.works)


def strict_p2p() -> bool:
    """SHARDWISE_STRICT_P2P=1: comm.p2p follows NCCL's p2p rules on gloo (a debugging/test mode)."""
    return os.environ.get("SHARDWISE_STRICT_P2P", "") not in ("", "0")


_comm_tail: dict[tuple[int, int], _BatchWork] = {}  # (rank, id of the group) -> its last batch (strict mode)


@eager
def p2p(ops, tag: str | None = None) -> list:
    """One batch of non-blocking point-to-point ops: ("send" | "recv", tensor, axis, peer_axis_rank).

    Returns the batch's work handles; callers must treat the list as one unit and wait on all of it,
    since NCCL returns ONE handle for the whole batch (gloo one per op). Sends record the tensor's
    bytes on their axis; receives record only their count (they contribute no payload).

    Under SHARDWISE_STRICT_P2P=1 the batch is issued only after this rank's previous batch on the same
    communicator (the axis' group) completed, and one handle is returned. That is how NCCL serialises:
    a batch runs as one coalesced group on the group's communicator and stream, so it waits for every
    earlier batch of this rank on that communicator, whichever peers they involve (posting per-peer
    batches does not make them independent). Code that would deadlock or mis-handle handles on NCCL
    fails here; `pipeline.p2p_check` models the same rule.
    """
    p2p_ops = []
    for kind, t, axis, peer in ops:
        if kind not in ("send", "recv"):
            raise ValueError(f"p2p op {kind!r}: expected 'send' or 'recv'")
        if axis.group is not ops[0][2].group:
            raise ValueError(f"p2p batch mixes axes '{ops[0][2].name}' and '{axis.name}': one group per batch")
        check_device(axis, f"p2p {kind}", t)
        sent = wire.send(nbytes(t)) if kind == "send" else wire.recv(nbytes(t))
        record(axis, kind, sent, sent, tag)
        p2p_ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, axis.ranks[peer], group=axis.group))
    if not p2p_ops:
        return []
    axis = ops[0][2]
    if not strict_p2p():
        return guarded(axis, "p2p", axis.transport.batch_isend_irecv, p2p_ops)
    key = (dist.get_rank(), id(axis.group))
    if key in _comm_tail:
        guarded(axis, "p2p (previous batch on the communicator)", _comm_tail.pop(key).wait)
    work = _BatchWork(guarded(axis, "p2p", axis.transport.batch_isend_irecv, p2p_ops))
    _comm_tail[key] = work
    return [work]
