"""Hybrid sharded data parallelism (`--dp-shard S`) against the single-device model.

Two spawns (4 and 8 ranks):
* `verify` (losses, reduced gradients and parameters after AdamW steps equal one device) for
  `--dp 4 --dp-shard 2 --zero 3`, S = 1 under ZeRO-2 (pure replication through the hybrid path, without
  overlap), dp2 × cp2 with S = 1 (the shard group is then the cp pair), `--dp 4 --dp-shard 2 --zero 2
  --tp 2 --sequence-parallel`, and pp2 with the zero-bubble schedule (deferred W) under ZeRO-3;
* the groups are what docs/data-parallel.md says (consecutive dp ranks × cp shard, the strided rest replicates),
  and a step's ledger holds the reduce-scatter / all-gather on dp_shard, one all-reduce per dense bucket
  on dp_replicate and no dp_cp gradient traffic;
* checkpoints reshard between any S: a dp-shard 2 ZeRO-3 save continues identically (rel 1e-5) under no
  hybrid sharding, S = 4 and S = 1 at ZeRO 2/3 and on one device, and a ZeRO-2 save without hybrid
  sharding continues identically under S = 2.
Skipping the dp_replicate all-reduce makes every verify here fail (gradient error ~2, checked once).
"""
import json

import pytest
import torch

from shardwise.checkpoint import load_checkpoint, save_checkpoint
from shardwise.config import ParallelConfig, TrainConfig
from shardwise.config import ParallelConfig
from shardwise.mesh import axis_lines
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks, verify_all
from test_cli import main_without_ranks


def _cfg(seed, gb=8, steps=2, **par) -> TrainConfig:
    extra = {k: par.pop(k) for k in ("overlap_grad_reduce",) if k in par}
    return TrainConfig(model="tiny", parallel=ParallelConfig(**par), steps=steps, seq_len=32, micro_batch=2,
                       global_batch=gb, seed=seed, progress=False, **extra)


def _trainer(cfg) -> Trainer:
    cfg = cfg.resolved()
    return Trainer(cfg, make_mesh(cfg, torch.device("cpu")))


def _ledger_and_groups(seed):
    t = _trainer(_cfg(seed, gb=16, dp=4, dp_shard=2, zero=2))
    t.mesh.ledger.reset()
    t.train_step(0)
    return dict(axes=t.mesh.ledger.steps[-1]["axes"], buckets=sum(not b.expert for b in t.reducer.buckets),
                shard=t.mesh["dp_shard"].ranks, replicate=t.mesh["dp_replicate"].ranks)


def _checkpoints(seed, root, root2):
    out = {}
    cfg = _cfg(seed, gb=16, steps=4, dp=4, dp_shard=2, zero=3)
    t = _trainer(cfg)
    for step in range(2):
        t.train_step(step)
    save_checkpoint(root, 2, t)
    out["next"] = t.train_step(2)["loss"]
    for name, par in (("full_zero3", dict(zero=3)), ("s4_zero2", dict(dp_shard=4, zero=2)),
                      ("s1_zero3", dict(dp_shard=1, zero=3)), ("s2_zero3", dict(dp_shard=2, zero=3))):
        again = _trainer(_cfg(seed, gb=16, steps=4, dp=4, **par))
        load_checkpoint(root, again)
        out[name] = again.train_step(2)["loss"]
    plain = _trainer(_cfg(seed, gb=16, steps=4, dp=4, zero=2))
    plain.train_step(0)
    save_checkpoint(root2, 1, plain)
    out["plain_next"] = plain.train_step(1)["loss"]
    hs = _trainer(_cfg(seed, gb=16, steps=4, dp=4, dp_shard=2, zero=3))
    load_checkpoint(root2, hs)
    out["plain_into_s2"] = hs.train_step(1)["loss"]
    return out


def _four(seed, root, root2):
    cfgs = [_cfg(seed, gb=16, dp=4, dp_shard=2, zero=3),
            _cfg(seed, gb=16, dp=4, dp_shard=1, zero=2, overlap_grad_reduce=False),
            _cfg(seed, dp=2, cp=2, dp_shard=1, zero=3)]
    return dict(verify=verify_all(cfgs), ledger=_ledger_and_groups(seed), ckpt=_checkpoints(seed, root, root2))


def _eight(seed):
    cfgs = [_cfg(seed, gb=16, dp=4, dp_shard=2, zero=2, tp=2, sequence_parallel=True),
            _cfg(seed, gb=16, dp=4, dp_shard=2, pp=2, schedule="zb", zero=3)]
    return verify_all(cfgs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    seed = fresh_seed()
    root = str(tmp_path_factory.mktemp("hsdp") / "ckpt")
    root2 = str(tmp_path_factory.mktemp("plain") / "ckpt")
    four = run_ranks(4, _four, seed, root, root2)
    eight = run_ranks(8, _eight, seed)
    return seed, root, four, eight


def test_verify_hsdp_layouts(runs):
    seed, _, four, eight = runs
    reports = four[0]["verify"] + eight[0]
    assert len(reports) == 5
    for rep in reports:
        assert rep["passed"] and rep["max_loss_abs_diff"] < 1e-5 and rep["first_step_grad_rel_diff"] < 1e-5, \
            (seed, rep)
        assert rep["layout"].get("dp_shard") in (1, 2), rep["layout"]


def test_groups_and_ledger_rows(runs):
    _, _, four, _ = runs
    by_rank = [r["ledger"] for r in four]
    assert [r["shard"] for r in by_rank] == [(0, 1), (0, 1), (2, 3), (2, 3)]  # consecutive dp ranks shard
    assert [r["replicate"] for r in by_rank] == [(0, 2), (1, 3), (0, 2), (1, 3)]  # the strided rest replicates
    axes = by_rank[0]["axes"]
    assert set(axes["dp_shard"]) == {"reduce_scatter", "all_gather", "all_reduce:grad_norm"}, axes
    assert axes["dp_replicate"]["all_reduce"]["count"] == by_rank[0]["buckets"], axes
    # each replicate all-reduce carries the shard: half (S=2 of 4) of what the all-gather fills
    assert axes["dp_replicate"]["all_reduce"]["bytes"] == axes["dp_shard"]["all_gather"]["bytes"]
    assert set(axes["dp_cp"]) == {"all_reduce:metrics"}, axes  # no gradient traffic over all of dp


def test_axis_lines_with_cp_and_pp():
    lines = axis_lines(ParallelConfig.build(16, dp=4, pp=2, cp=2, dp_shard=2))
    # rank = ((d·pp + p)·cp + c): the shard group is dp ranks {0,1} (or {2,3}) × both cp ranks
    assert [0, 1, 4, 5] in lines["dp_shard"] and [2, 3, 6, 7] in lines["dp_shard"]
    assert [0, 8] in lines["dp_replicate"] and [5, 13] in lines["dp_replicate"]
    assert "dp_shard" not in axis_lines(ParallelConfig.build(8, dp=4, pp=2, dp_shard=4))  # S = dp: nothing new


def test_checkpoints_reshard_between_dp_shard_degrees(runs):
    seed, root, four, _ = runs
    ck = four[0]["ckpt"]
    assert ck["s2_zero3"] == ck["next"], seed  # the same layout: bitwise
    for name in ("full_zero3", "s4_zero2", "s1_zero3"):
        assert ck[name] == pytest.approx(ck["next"], rel=1e-5), (seed, name)
    assert ck["plain_into_s2"] == pytest.approx(ck["plain_next"], rel=1e-5), seed
    single = _trainer(_cfg(seed, gb=16, steps=4))  # no process group: one device
    assert load_checkpoint(root, single)["step"] == 2
    assert single.train_step(2)["loss"] == pytest.approx(ck["next"], rel=1e-5), seed


@pytest.mark.parametrize("args, message", [
    (["--dp", "4", "--dp-shard", "3", "--zero", "3"], "--dp-shard 3 must be a divisor of dp=4; valid: 1, 2, 4"),
    (["--dp", "4", "--dp-shard", "0", "--zero", "2"], "--dp-shard 0 must be a divisor of dp=4; valid: 1, 2, 4"),
    (["--dp", "4", "--dp-shard", "2", "--zero", "1"], "--dp-shard 2 shards nothing at --zero 1"),
])
def test_bad_dp_shard_exits_2_with_one_line(args, message, capsys):
    """Refused in the CLI's own `main` before any rank starts (test_cli checks the same from the shell)."""
    code = main_without_ranks(["train", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_config_records_dp_shard_only_when_hybrid():
    assert ParallelConfig(dp=4, dp_shard=2, zero=3).as_dict()["dp_shard"] == 2
    assert "dp_shard" not in ParallelConfig(dp=4, dp_shard=4, zero=3).as_dict()
    assert not ParallelConfig(dp=4).hsdp


def test_planner_searches_dp_shard_and_prints_it():
    """llama3-70b on 1,024 H100s at ZeRO-3: the search tries hybrid sharding (shard group inside a node),
    its memory divides by S (not dp), the dp_replicate bytes are the shard's fp32 gradient, and the
    printed command carries --dp-shard, which reads back to the same layout."""
    from shardwise.planner import Cluster, Layout, SearchSpace, Workload, estimate, get_gpu, get_model, search
    from shardwise.commands.train_command import parse_train_flags, row_command

    spec, cluster = get_model("llama3-70b"), Cluster(get_gpu("h100-80gb"), 1024, 8)
    wl = Workload(seq_len=4096, global_batch=1024)
    rows = search(spec, cluster, wl, SearchSpace(zero=3))
    hybrid = [r for r in rows if r["layout"].get("dp_shard")]
    assert hybrid and rows[0] in hybrid  # replicas across nodes beat gathering every layer over the network
    for r in hybrid:  # every shard group's ranks in one node (a group of one rank rides no link), replicas across
        assert r["comm_links"].get("dp_shard") in (None, "nvlink") and r["comm_links"]["dp_replicate"] == "network"
    # the S tried beside dp: the largest whose shard group (S dp ranks × cp, stride pp·cp·tp) fits a node
    from shardwise.planner.search import _dp_shards
    assert _dp_shards(SearchSpace(zero=2), 16, 1, 1, 2, 8) == [None, 4]
    assert _dp_shards(SearchSpace(zero=3), 16, 1, 2, 1, 8) == [None, 4]
    assert _dp_shards(SearchSpace(zero=3), 16, 1, 1, 8, 8) == [None, 1]
    assert _dp_shards(SearchSpace(zero=1), 16, 1, 1, 2, 8) == [None]
    assert _dp_shards(SearchSpace(zero=3, dp_shard=2), 16, 1, 1, 8, 8) == [2]
    full = Layout(dp=64, tp=8, pp=2, mb=1, m=16, zero=3)
    hs = Layout(dp=64, tp=8, pp=2, mb=1, m=16, zero=3, dp_shard=1)
    a, b = (estimate(spec, cluster, lay, wl, detail=True) for lay in (full, hs))
    per_dp = a["static_breakdown_per_rank"]
    assert b["static_breakdown_per_rank"]["optimizer"] == pytest.approx(per_dp["optimizer"] * 64, rel=1e-3)
    for st in b["stages"]:  # S = 1: the shard is the whole stage, its fp32 gradient all-reduced once per step
        assert st["comm_bytes_per_step"]["dp_replicate"] == st["params"] * 4
    cmd = row_command(["--model", "llama3-70b"], spec, cluster, hs, wl)["command"]
    assert "--dp-shard 1" in cmd
    lay, _ = parse_train_flags(cmd, 1024, None, "llama3-70b", spec.n_layers)
    assert lay == hs
    assert "--dp-shard" not in row_command(["--model", "llama3-70b"], spec, cluster, full, wl)["command"]


def test_simulate_takes_dp_shard(capsys):
    """`simulate` shares train's flags: a dp4 × dp-shard 2 ZeRO-3 rank on fake tensors, its dp_shard and
    dp_replicate bytes equal to the planner's."""
    from shardwise.cli import main

    rc = main(["simulate", "--dp", "4", "--dp-shard", "2", "--zero", "3", "--seq-len", "32", "--micro-batch", "2",
               "--global-batch", "16", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    out = json.loads(out.strip().splitlines()[-1])
    assert out["passed"] and "dp_shard=2" in out["layout"], out
    comm = out["ranks"][0]["comm_bytes"]
    for axis in ("dp_shard", "dp_replicate"):
        assert comm[axis]["measured"] == comm[axis]["planned"] > 0, comm
