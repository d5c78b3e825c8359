"""Strict p2p mode and the static checker agree: one boundary's ops split into two batches.

Batched NCCL p2p serialises per (rank, communicator), not per peer: splitting a boundary's fused batch
into one batch per peer can deadlock even though no pair of ranks disagrees on order. The checker
(`p2p_check.check_programs`) and SHARDWISE_STRICT_P2P on real gloo ranks must reach the same verdict
on the same programs — including the split that a per-peer model (the old strict mode) lets through.
"""
import copy
import zlib

import pytest
import torch

from shardwise.training.launch import RankError
from shardwise.pipeline.p2p_check import check_programs
from shardwise.rules.p2p_program import build_programs
from shardwise.rules.schedules import build_schedule

from _dist import run_ranks


def _split_one_boundary(deadlock: bool):
    """interleaved p=3: programs where one boundary's batch is split per peer, with the checker's verdict."""
    base = build_programs(build_schedule("interleaved", 3, 3, 2))
    for r, prog in enumerate(base):
        for i, b in enumerate(prog):
            peers = sorted({op.peer for ops in b.batches for op in ops})
            if len(peers) < 2:
                continue
            progs = copy.deepcopy(base)
            progs[r][i].batches = [tuple(op for op in b.batches[0] if op.peer == p) for p in peers]
            if check_programs(progs, streams_per="pair") is None and (check_programs(progs) is not None) == deadlock:
                return progs, (r, i)
    raise AssertionError("no such split in interleaved(3, 3, 2)")


def _value(key) -> float:
    return float(zlib.crc32(repr(key).encode()) % 1000)


def _replay(programs):
    """Inside a rank: post this rank's batches exactly as the program says, through comm.p2p (strict)."""
    from shardwise import comm
    from _dist import make_mesh

    pp = make_mesh(timeout_s=4.0, pp=3)["pp"]
    me, bufs, batch_of, got = pp.rank, {}, {}, {}
    for bnd in programs[me]:
        for ops in bnd.batches:
            items = []
            for op in ops:
                t = torch.full((4,), _value(op.key)) if op.kind == "send" else torch.empty(4)
                bufs[op.key] = t
                items.append((op.kind, t, pp, op.peer))
            works = comm.p2p(items)
            for op in ops:
                if op.kind == "recv":
                    batch_of[op.key] = works
        if bnd.wait is not None:
            comm.wait_all(batch_of[bnd.wait], pp, f"recv of {bnd.wait}")
            got[bnd.wait] = bufs[bnd.wait][0].item()
    for works in batch_of.values():
        comm.wait_all(works, pp, "final")
    return {k: bufs[k][0].item() for k in batch_of}


@pytest.fixture
def strict_p2p(monkeypatch):
    monkeypatch.setenv("SHARDWISE_STRICT_P2P", "1")  # forked ranks inherit it


def test_split_that_the_checker_accepts_runs_under_strict_mode(strict_p2p):
    programs, (rank, boundary) = _split_one_boundary(deadlock=False)
    assert check_programs(programs) is None, (rank, boundary)
    for received in run_ranks(3, _replay, programs, timeout_s=30):
        assert received and all(v == _value(k) for k, v in received.items())


def test_split_that_deadlocks_on_one_communicator_fails_under_strict_mode(strict_p2p):
    programs, (rank, boundary) = _split_one_boundary(deadlock=True)
    assert "deadlock" in check_programs(programs), (rank, boundary)
    with pytest.raises(RankError, match="p2p") as e:
        run_ranks(3, _replay, programs, timeout_s=4)
    assert "rank" in str(e.value)
