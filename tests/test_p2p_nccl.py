"""Pipeline p2p under NCCL's rules: the replay checker on every schedule, a known-bad order, strict mode
on real gloo ranks against the single device, and comm's device discipline."""
import dataclasses

import pytest
import torch

from shardwise import comm
from shardwise.config import ParallelConfig, TrainConfig
from shardwise.mesh import Axis
from shardwise.pipeline.p2p_check import P2PMismatch, check_programs
from shardwise.rules.p2p_program import Boundary, Op, build_programs, message_in, message_out
from shardwise.rules.schedules import build_schedule

from _dist import fresh_seed, run_ranks, verify_all

VPS = {"gpipe": (1,), "1f1b": (1,), "zb": (1,), "interleaved": (1, 2, 3), "dualpipev": (2,)}


def _grid():
    for name, vps in VPS.items():
        for p in (2, 3, 4, 8):
            for m in range(1, 2 * p + 2):
                for v in vps:
                    try:
                        yield build_schedule(name, p, m, v)
                    except ValueError:  # not a legal (p, m, v) for this schedule
                        continue


def test_every_schedule_completes_under_nccl_rules():
    checked = {name: 0 for name in VPS}
    for s in _grid():
        programs = build_programs(s)
        assert check_programs(programs) is None, (s.name, s.p, s.m, s.v)
        assert check_programs(programs, streams_per="pair") is None, (s.name, s.p, s.m, s.v)
        checked[s.name] += 1
    assert all(n > 0 for n in checked.values()), checked
    assert sum(checked.values()) >= 130


def _recv_ahead_program(s, ahead=2):
    """The order the executor used before: every op its own batch, receives posted `ahead` of need."""
    progs = []
    for r, acts in enumerate(s.actions):
        needed = [(i, m) for i, a in enumerate(acts) if (m := message_in(s, r, a)) and m[0] != r]
        prog, posted, k = [Boundary() for _ in range(len(acts) + 1)], set(), 0
        for i, a in enumerate(acts):
            out = message_out(s, r, acts[i - 1]) if i else None
            if out and out[0] != r:
                prog[i].batches.append((Op("send", *out),))
            while k < len(needed) and needed[k][0] < i:
                k += 1
            for _, (src, key) in needed[k:k + ahead]:
                if key not in posted:
                    posted.add(key)
                    prog[i].batches.append((Op("recv", src, key),))
            m = message_in(s, r, a)
            prog[i].wait = m[1] if m and m[0] != r else None
        out = message_out(s, r, acts[-1])
        if out and out[0] != r:
            prog[-1].batches.append((Op("send", *out),))
        progs.append(prog)
    return progs


def test_checker_reports_the_recv_ahead_deadlock():
    report = check_programs(_recv_ahead_program(build_schedule("1f1b", 2, 4)))
    assert report is not None and "deadlock" in report and "pp rank 0" in report and "pp rank 1" in report


def test_checker_reports_swapped_messages():
    progs = build_programs(build_schedule("gpipe", 2, 2))
    b = progs[1][0]
    b.batches = [tuple(reversed(b.batches[0]))]  # rank 1 expects act1 where rank 0 sends act0
    with pytest.raises(P2PMismatch):
        check_programs(progs)


def test_sends_and_receives_share_one_batch_per_boundary():
    """1F1B's steady state fuses send-forward with recv-backward (Megatron's send_forward_recv_backward)."""
    prog = build_programs(build_schedule("1f1b", 2, 4))[0]
    fused = [ops for b in prog for ops in b.batches if {op.kind for op in ops} == {"send", "recv"}]
    assert fused and all(len(b.batches) <= 1 for b in prog)


def test_per_peer_batches_deadlock_on_one_stream_per_rank():
    """Split per peer, interleaved at p=3 serializes on NCCL's one stream: the checker must see it."""
    programs = build_programs(build_schedule("interleaved", 3, 3, 2))
    for prog in programs:
        for b in prog:
            b.batches = [tuple(op for op in b.batches[0] if op.peer == peer)
                         for peer in sorted({op.peer for op in b.batches[0]})] if b.batches else []
    assert check_programs(programs, streams_per="pair") is None
    assert "deadlock" in check_programs(programs)


def _cfg(seed, microbatches, **parallel):
    cfg = TrainConfig(parallel=ParallelConfig(**parallel), steps=2, seq_len=32, micro_batch=2, seed=seed,
                      progress=False)
    return dataclasses.replace(cfg, global_batch=microbatches * cfg.micro_batch * cfg.parallel.dp)


@pytest.fixture
def strict_p2p(monkeypatch):
    monkeypatch.setenv("SHARDWISE_STRICT_P2P", "1")  # forked ranks inherit it


def test_strict_mode_returns_one_work_per_batch(strict_p2p):
    assert comm.strict_p2p()

    def one_batch():
        import torch.distributed as dist
        from _dist import make_mesh
        pp = make_mesh(pp=2)["pp"]
        t = torch.full((4,), float(dist.get_rank()))
        buf = torch.empty(4)
        works = comm.p2p([("send", t, pp, 1 - pp.rank), ("recv", buf, pp, 1 - pp.rank)])
        for w in works:
            w.wait()
        works[0].wait()  # a second wait must not block
        return len(works), buf.tolist()

    for r, (n, got) in enumerate(run_ranks(2, one_batch)):
        assert n == 1 and got == [float(1 - r)] * 4


def test_every_schedule_under_strict_p2p(strict_p2p):
    seed = fresh_seed()
    pp2 = [_cfg(seed, 4, pp=2, schedule=s, vp=2 if s == "interleaved" else 1)
           for s in ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")]
    for cfg, result in zip(pp2, run_ranks(2, verify_all, pp2)[0]):
        assert result["passed"] and result["first_step_grad_rel_diff"] < 1e-5, (seed, cfg.parallel, result)
    pp4 = [_cfg(seed, 8, pp=4, schedule=s, vp=2 if s == "interleaved" else 1)
           for s in ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")]
    pp4.append(_cfg(seed, 2, cp=4, cp_impl="ring"))  # ring attention's p2p under the same rules
    for cfg, result in zip(pp4, run_ranks(4, verify_all, pp4)[0]):
        assert result["passed"] and result["first_step_grad_rel_diff"] < 1e-5, (seed, cfg.parallel, result)


def test_collectives_refuse_tensors_off_the_mesh_device():
    axis = Axis("tp", size=2, ranks=(0, 1), device=torch.device("cpu"))
    meta = torch.empty(4, device="meta")
    with pytest.raises(comm.DeviceError, match=r"all_reduce on axis 'tp' got a tensor on meta.*cpu"):
        comm.guarded(axis, "all_reduce", lambda t: t, meta)
    with pytest.raises(comm.DeviceError, match=r"p2p send on axis 'tp'"):
        comm.p2p([("send", meta, axis, 1)])
    comm.guarded(axis, "all_reduce", lambda t: t, torch.empty(4))  # on the device: passes through
