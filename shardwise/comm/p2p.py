"""Batched point-to-point ops (pipeline stage boundaries, ring attention), and the strict mode that makes
gloo follow NCCL's p2p ordering rules."""
from __future__ import annotations

import os

import torch.distributed as dist

from .collectives import _check_device, completed, _eager, _guarded, _nbytes, _record


class _BatchWork:
    """One handle for a whole p2p batch, as NCCL returns (gloo returns one per op).

    Waiting twice is a no-op: a second wait on a finished gloo receive would block for a new message.
    """

    def __init__(self, works: list):
        self.works, self.done = works, False

    def wait(self) -> bool:
        if not self.done:
            for w in self.works:
                w.wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or completed(self.works)


def strict_p2p() -> bool:
    """SHARDWISE_STRICT_P2P=1: comm.p2p follows NCCL's p2p rules on gloo (a debugging/test mode)."""
    return os.environ.get("SHARDWISE_STRICT_P2P", "") not in ("", "0")


_pair_tail: dict[tuple[int, int], _BatchWork] = {}  # (group id, peer global rank) -> last batch (strict mode)


@_eager
def p2p(ops, tag: str | None = None) -> list:
    """One batch of non-blocking point-to-point ops: ("send" | "recv", tensor, axis, peer_axis_rank).

    Returns the batch's work handles; callers must treat the list as one unit and wait on all of it,
    since NCCL returns ONE handle for the whole batch (gloo one per op). Sends record the tensor's
    bytes on their axis; receives record only their count (they contribute no payload).

    Under SHARDWISE_STRICT_P2P=1 the batch is issued only after the previous batch with each of its
    peers completed, and one handle is returned: NCCL's rule that p2p between two ranks runs in
    posting order on one stream, so code that would deadlock or mis-handle handles on NCCL fails here.
    """
    p2p_ops, peers = [], set()
    for kind, t, axis, peer in ops:
        if kind not in ("send", "recv"):
            raise ValueError(f"p2p op {kind!r}: expected 'send' or 'recv'")
        _check_device(axis, f"p2p {kind}", t)
        _record(axis, kind, _nbytes(t) if kind == "send" else 0, _nbytes(t) if kind == "send" else 0, tag)
        p2p_ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, axis.ranks[peer], group=axis.group))
        peers.add((id(axis.group), axis.ranks[peer]))
    if not p2p_ops:
        return []
    axis = ops[0][2]
    if not strict_p2p():
        return _guarded(axis, "p2p", dist.batch_isend_irecv, p2p_ops)
    for pair in sorted(peers):
        if pair in _pair_tail:
            _guarded(axis, "p2p (previous batch on the pair)", _pair_tail.pop(pair).wait)
    work = _BatchWork(_guarded(axis, "p2p", dist.batch_isend_irecv, p2p_ops))
    for pair in peers:
        _pair_tail[pair] = work
    return [work]
