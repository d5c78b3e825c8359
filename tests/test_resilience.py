"""Resilience without processes: the peer assignment survives the loss of every node, the choice of the newest
consistent memory step, a node store's copies and progress records, the fault-injection spec, and elastic data
parallelism's rules (which ranks survive, the layout for fewer ranks, which old copies a new rank reads)."""
import dataclasses
import os
import re

import pytest
import torch

from shardwise.config import ConfigError, TrainConfig
from shardwise.resilience.peers import holder_of, node_memory, node_of, survivors_cover, ward_of
from shardwise.resilience.recover import newest_memory_step, suppliers
from shardwise.resilience.store import KEEP, NodeStore, Progress, node_info, release

LAYOUTS = [(2, 1), (4, 2), (8, 2), (8, 4), (16, 8), (12, 3), (1024, 8)]


@pytest.mark.parametrize("world, per_node", LAYOUTS)
def test_every_rank_survives_the_loss_of_any_one_node(world, per_node):
    nodes = world // per_node
    for rank in range(world):
        h = holder_of(rank, world, per_node)
        assert ward_of(h, world, per_node) == rank
        assert node_of(h, per_node) != node_of(rank, per_node)  # the peer copy sits on another node
        assert h % per_node == rank % per_node  # at the same position: one copy in and one out per rank
    assert sorted(holder_of(r, world, per_node) for r in range(world)) == list(range(world))
    for node, held in node_memory(world, per_node).items():
        assert survivors_cover(node, world, per_node), node
        assert len(held) == min(2, nodes) * per_node  # each node holds twice its own state (one node: once)


def test_a_rule_that_keeps_the_peer_copy_on_the_same_node_is_caught():
    """The check itself can fail: with the peer copy on the owner's own node, both copies go with the node."""
    def same_node(rank, world, per_node):
        return rank - rank % per_node + (rank + 1) % per_node

    assert not any(survivors_cover(n, 8, 4, same_node) for n in range(2))


def test_one_node_keeps_its_own_copies_only():
    assert [holder_of(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]


def test_newest_memory_step_needs_every_owner():
    world = 4
    held = [{(0, 3): 10, (0, 2): 10, (2, 2): 10, (2, 3): 10},  # rank 0's node: its own and its ward's (2)
            {(1, 2): 10, (3, 2): 10, (1, 3): 10},  # rank 1's node: 3's copy of step 3 never arrived
            {}, {}]  # node 1 lost
    assert newest_memory_step(held, world) == 2
    held[1][(3, 3)] = 10
    assert newest_memory_step(held, world) == 3
    assert suppliers(held, 3, world) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert newest_memory_step([{}, {}], 2) is None


def test_node_store_keeps_whole_copies_and_prunes(tmp_path):
    store = NodeStore(str(tmp_path / "node0"), 4)
    for step in range(1, 5):
        store.write(3, step, torch.arange(step, dtype=torch.uint8))
    store.write(1, 4, torch.ones(7, dtype=torch.uint8))
    (tmp_path / "node0" / "copy-r5-s9-w4.bin.tmp").write_bytes(b"half")  # a write that died: not a copy
    assert store.inventory() == {(3, 3): 3, (3, 4): 4, (1, 4): 7}
    other = store.under(2)  # the copies after an elastic change of dp share the directory, apart
    other.write(1, 4, torch.ones(3, dtype=torch.uint8))
    assert store.worlds() == [2, 4] and other.inventory() == {(1, 4): 3} and store.inventory()[(1, 4)] == 7
    assert KEEP == 2
    assert torch.equal(store.read(3, 4), torch.arange(4, dtype=torch.uint8))
    store.write(3, 2, torch.zeros(2, dtype=torch.uint8))  # the run went back to step 2: later copies are stale
    assert store.inventory() == {(3, 2): 2, (1, 4): 7}
    store.wipe()
    assert not os.path.exists(store.path)


def test_progress_record_outlives_its_writer(tmp_path):
    p = Progress(str(tmp_path), 2)
    p.note(7, "train step")
    p.note(phase="x" * 300)  # a long phase is cut, not spilled
    rec = Progress.read_all(str(tmp_path))[2]
    assert rec[0] == 7 and rec[1].startswith("xxx") and rec[3] == os.getpid()


def test_node_info_from_either_launcher(tmp_path):
    env = {"SHARDWISE_NODE_STORE": "/dev/shm/x/node1", "SHARDWISE_RANKS_PER_NODE": "2", "SHARDWISE_RESTART_COUNT": "1"}
    info = node_info(4, False, env)
    assert (info.store, info.ranks_per_node, info.restart) == ("/dev/shm/x/node1", 2, 1)
    torchrun = {"TORCHELASTIC_RUN_ID": "job7", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0"}
    assert node_info(4, False, torchrun) is None  # no restarts, no copies: nothing to keep
    info = node_info(4, True, torchrun)
    assert f"shardwise-mem-job7{os.sep}agent-" in info.store and str(os.getppid()) in info.store
    assert node_info(4, False, torchrun | {"TORCHELASTIC_MAX_RESTARTS": "3"}) is not None
    store = tmp_path / "shardwise-mem-j" / "agent-a"
    store.mkdir(parents=True)
    release(type(info)(str(store), 2, 0), {"LOCAL_RANK": "0"})
    assert not (tmp_path / "shardwise-mem-j").exists()


@pytest.mark.parametrize("spec, parsed", [
    ("1:3:crash", (1, 3, "crash", "start")),
    ("0:2:kill:backward", (0, 2, "kill", "backward")),
    ("3:5:node:forward", (3, 5, "node", "forward")),
])
def test_fault_spec(spec, parsed):
    assert TrainConfig(fault_inject=spec).fault() == parsed


@pytest.mark.parametrize("spec", ["1:3:explode", "1:3:kill:lunch", "1:3", "a:3:kill"])
def test_fault_spec_refused(spec):
    with pytest.raises(ConfigError, match="RANK:STEP:KIND\\[:PHASE\\]"):
        TrainConfig(fault_inject=spec).fault()


def test_young_daly_interval_wastes_least():
    from shardwise.planner.goodput import waste, young_daly

    cost, mtbf = 30.0, 50_000.0
    best = young_daly(cost, mtbf)
    assert best == pytest.approx((2 * cost * mtbf) ** 0.5)
    for other in (best / 2, best * 0.9, best * 1.1, best * 2):
        assert waste(best, cost, 0, 0, mtbf) < waste(other, cost, 0, 0, mtbf)


def test_plan_reports_goodput_per_row(capsys):
    """Each row's goodput terms: the Llama 3 MTBF by default, memory copies beat disk checkpoints, and the table
    shows them when --mtbf-gpu-hours is given; a bad figure exits 2."""
    import json

    from shardwise.commands.plan import main
    from shardwise.planner.goodput import LLAMA3_MTBF_GPU_HOURS

    assert round(LLAMA3_MTBF_GPU_HOURS) == 50_677
    explain = ["plan", "--model", "llama3-8b", "--gpus", "64", "--explain", "dp=8,tp=8"]
    assert main([*explain, "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["goodput"]
    assert g["mtbf_job_h"] == pytest.approx(LLAMA3_MTBF_GPU_HOURS / 64)
    assert 0 < g["goodput_disk"] < g["goodput_mem"] < 1 and g["mem_ckpt_every"] <= g["save_every"]
    assert main([*explain, "--mtbf-gpu-hours", "500"]) == 0  # failures 100x as often: checkpoints more often
    shown = re.search(r"Young–Daly --save-every (\d+):", capsys.readouterr().out)
    assert 0 < int(shown.group(1)) < g["save_every"] / 5, shown  # the interval scales as sqrt(MTBF)
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--top", "1", "--mtbf-gpu-hours", "1000"]) == 0
    out = capsys.readouterr().out
    assert "good disk" in out and "mem-every" in out
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--mtbf-gpu-hours", "0"]) == 2
    assert "--mtbf-gpu-hours 0.0 must be positive" in capsys.readouterr().err


# ---------------------------------------------------------------- elastic data parallelism (no processes)
def _elastic_cfg(**kw):
    from shardwise.config import ParallelConfig
    from shardwise.training.assemble import assemble

    par = {k: kw.pop(k) for k in ("dp", "pp", "tp", "ep", "cp") if k in kw}
    return assemble(TrainConfig(model=kw.pop("model", "tiny"), parallel=ParallelConfig(**par), seq_len=32, **kw))


def test_only_whole_replicas_survive():
    from shardwise.config import ParallelConfig
    from shardwise.resilience.elastic import survivors

    assert survivors(ParallelConfig(dp=2, tp=2), [2, 3], 1) == [0, 1]
    assert survivors(ParallelConfig(dp=4), [0, 1], 2) == [2, 3]
    assert survivors(ParallelConfig(dp=2, pp=2), [3], 1) == [0, 1]  # rank 2 leaves with its replica
    assert survivors(ParallelConfig(dp=4, tp=2), [3], 1) == [0, 1, 4, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"took DP replica\(s\) \[0, 1\] of 2 with them; 0 left, below --min-dp 1"):
        survivors(ParallelConfig(dp=2, tp=2), [1, 2], 1)


def test_fit_world_keeps_the_global_batch():
    from shardwise.resilience.elastic import fit_world

    cfg = _elastic_cfg(dp=2, tp=2, micro_batch=2, global_batch=8, min_dp=1, fault_inject="2:3:gone")
    assert fit_world(cfg, 4) is cfg
    small = fit_world(cfg, 2)
    assert (small.parallel.dp, small.parallel.tp, small.global_batch, small.grad_accum) == (1, 2, 8, 4)
    assert small.fault_inject is None  # the fault named the first start's ranks
    assert fit_world(_elastic_cfg(dp=2, tp=2, min_dp=0), 2).parallel.dp == 2  # off: the mesh refuses later
    with pytest.raises(ConfigError, match="--min-dp 2 needs at least 4"):
        fit_world(_elastic_cfg(dp=2, tp=2, min_dp=2), 2)
    with pytest.raises(ConfigError, match="global batch 3 is not a multiple of micro-batch 1 × dp 2"):
        fit_world(_elastic_cfg(dp=3, micro_batch=1, global_batch=3, min_dp=1), 2)
    with pytest.raises(ConfigError, match="ep 4 does not divide dp 2"):
        fit_world(_elastic_cfg(model="tiny-moe", dp=4, ep=4, micro_batch=1, min_dp=1), 2)
    with pytest.raises(ConfigError, match="--min-dp 3 must be an integer from 0"):
        _elastic_cfg(dp=2, min_dp=3)


def test_recut_reads_every_old_copy_a_new_shard_intersects():
    """Old ZeRO shards [0, 6) and [6, 12) of one 12-element tensor, full copies of another: a new rank holding
    [4, 12) reads both shards' owners, and only the first owner for the replicated tensor."""
    from shardwise.rules.geometry import coords_of
    from shardwise.resilience.elastic import Grid, needed, preference

    def meta(off):
        return {"layout": [["optim.w.exp_avg@0", [6], "torch.float32"], ["model.b@0", [3, 2], "torch.float32"]],
                "offsets": [[off], [0, 0]]}

    metas = {0: meta(0), 1: meta(6)}
    new = [("optim.w.exp_avg@0", (4,), torch.zeros(8)), ("model.b@0", (0, 0), torch.zeros(3, 2))]
    old = Grid(2, 1, 1, 1)
    assert preference(coords_of(old, 0) | {"dp": 0}, old) == [0, 1]
    assert needed(new, metas, [0, 1]) == [0, 1]
    assert needed(new[1:], metas, [1, 0]) == [1]
    with pytest.raises(ValueError, match="do not cover optim.w.exp_avg@0"):
        needed([("optim.w.exp_avg@0", (4,), torch.zeros(9))], metas, [0, 1])


@pytest.mark.slow
def test_simulate_counts_the_memory_copies_host_memory():
    """`simulate --mem-ckpt-every`: each rank holds two copies of its weights and optimizer state (its own, its
    ward's) in host memory — measured on the fake rank's state as the copy serialises it, and planned."""
    from shardwise.planner.goodput import peer_copy_host_bytes
    from shardwise.simulate.cli import render, run
    from shardwise.training.assemble import assemble
    from shardwise.config import ParallelConfig

    assert peer_copy_host_bytes({"weights": 3.0, "optimizer": 5.0, "gradients": 7.0}) == 16.0
    cfg = assemble(TrainConfig(parallel=ParallelConfig(dp=2, tp=2, zero=1), seq_len=32, steps=2, mem_ckpt_every=1))
    report = run(cfg, [0], 2)
    copies = report["ranks"][0]["peer_copy_host_bytes"]
    assert copies["measured"] > 0 and abs(copies["measured"] / copies["planned"] - 1) < 0.01, copies
    assert "memory copies (own + ward's)" in render(report)
    plain = run(dataclasses.replace(cfg, mem_ckpt_every=0), [0], 1)
    assert "peer_copy_host_bytes" not in plain["ranks"][0]
