"""Elastic data parallelism (--min-dp) and the chaos layouts beyond test_resilience_chaos's dp×tp and dp×pp.

* The re-cut against the planned run, on fresh inputs: dp2 ZeRO-1 ranks train two steps and copy their state; one
  device re-cuts those copies into its dp1 layout with the same global batch (`fit_world`, `recut`) and trains the
  next two steps: the same losses bitwise (each gradient element is a sum of the same two microbatch terms either
  way), the same gradient norms and parameters within verify's bounds (ZeRO-1 sums the norm's squares by shard).
  A re-cut that leaves AdamW's moments at zero is caught.
* The launcher: a node gone for good restarts the group on the survivors, renumbered, each in its old node's store;
  too few replicas left is one line (ConfigError: exit 2 from the CLI). No model: forked ranks that die on cue.
* The CLI, slow (one module fixture runs the jobs at once, apart from test_resilience_chaos's so neither job set
  slows the other's detection): dp4×ep2 MoE with ZeRO-3, a rank SIGKILLed mid-forward (bitwise) and node 0 gone
  before an optimizer step then back (dp4×ep2 → dp2×ep2 → dp4×ep2, ZeRO-3 shards re-cut both ways, within
  verify's bounds); 8 ranks of dp2×pp2×tp2 interleaved with ZeRO-1, a node of four lost mid-backward (bitwise).
"""
import json
import os
import signal
import threading
import time

import pytest
import torch

from _dist import ForkedCli, fresh_seed, run_ranks, warm_parent
from test_resilience_chaos import COMMON, _recoveries, _same_run, _wait_jobs

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.training.assemble import assemble


# ---------------------------------------------------------------- the re-cut against the planned run
def _cfg(seed: int, **par) -> TrainConfig:
    return assemble(TrainConfig(parallel=ParallelConfig(**par), steps=4, seq_len=32, micro_batch=2, global_batch=4,
                                seed=seed, dropout=0.0, min_dp=1, progress=False))


def _planned(cfg):
    """Inside ranks: steps 1-2, this rank's copy after step 2, then steps 3-4 (loss, grad norm) and the parameters."""
    from shardwise.resilience.snapshot import snapshot
    from shardwise.training.trainer import Trainer, make_mesh

    trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
    for step in range(2):
        trainer.train_step(step)
    blob = snapshot(trainer, 2).numpy().tobytes()
    recs = [trainer.train_step(step) for step in (2, 3)]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return blob, [(r["loss"], r["grad_norm"]) for r in recs], params


def _recut_run(cfg, blobs: list[bytes]):
    """One device: `cfg` fitted to one rank, its state re-cut from the dp ranks' copies, steps 3-4."""
    from shardwise.mesh import Mesh
    from shardwise.resilience import elastic
    from shardwise.resilience.snapshot import read_meta
    from shardwise.training.trainer import Trainer

    small = elastic.fit_world(cfg, 1)
    assert (small.parallel.dp, small.grad_accum) == (1, 2)
    trainer = Trainer(small, Mesh.single())
    got = {o: torch.frombuffer(bytearray(b), dtype=torch.uint8) for o, b in enumerate(blobs)}
    metas = {o: read_meta(t)[0] for o, t in got.items()}
    assert elastic.recut(trainer, got, metas, 0) == 2
    recs = [trainer.train_step(step) for step in (2, 3)]
    return [(r["loss"], r["grad_norm"]) for r in recs], dict(trainer.model.named_parameters())


@pytest.mark.slow
def test_recut_to_fewer_replicas_computes_the_planned_steps():
    from shardwise.resilience import elastic
    from shardwise.verify.checks import Values

    seed = fresh_seed()
    cfg = _cfg(seed, dp=2, zero=1)
    (b0, planned, params), (b1, planned1, _) = run_ranks(2, _planned, cfg)
    assert planned == planned1
    ours, mine = _recut_run(cfg, [b0, b1])
    assert [loss for loss, _ in ours] == [loss for loss, _ in planned], (ours, planned, seed)
    torch.testing.assert_close(torch.tensor([g for _, g in ours]), torch.tensor([g for _, g in planned]),
                               rtol=1e-5, atol=0)
    for n, p in params.items():
        assert (mine[n].detach() - p).norm() <= Values.bound * p.norm(), (n, seed)

    recut = elastic.recut

    def recut_without_moments(trainer, *args):
        step = recut(trainer, *args)
        for state in trainer.reducer.optimizer.state.values():
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        return step

    elastic.recut = recut_without_moments
    try:
        broken, _ = _recut_run(cfg, [b0, b1])
    finally:
        elastic.recut = recut
    assert broken[0][0] == planned[0][0] and broken[1][0] != planned[1][0], (broken, planned, seed)


# ---------------------------------------------------------------- the launcher
def _lose_node_zero():
    """Inside ranks: on the first start, node 0's ranks mark their node gone and die; the others wait for them in a
    barrier that fails. On the restart: what the rank sees of its group."""
    import torch.distributed as dist

    env = os.environ
    if env["SHARDWISE_RESTART_COUNT"] == "0":
        if int(env["RANK"]) < 2:
            open(env["SHARDWISE_NODE_STORE"] + ".gone", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    failure = json.loads(env["SHARDWISE_FAILURE"])
    return (dist.get_world_size(), dist.get_rank(), os.path.basename(env["SHARDWISE_NODE_STORE"]),
            env["SHARDWISE_RANKS_PER_NODE"], failure["lost_for_good"], failure["elastic"])


def test_launcher_goes_on_with_the_surviving_replicas_or_refuses():
    from shardwise.resilience.elastic import survivor_rule
    from shardwise.training.launch import run_local

    def launch(min_dp):
        cfg = assemble(TrainConfig(parallel=ParallelConfig(dp=4), micro_batch=1, min_dp=min_dp))
        return run_local(_lose_node_zero, 4, timeout_s=60, grace_s=0.5, max_restarts=1, ranks_per_node=2,
                         node_stores=True, elastic=survivor_rule(cfg))

    out = launch(2)
    assert out == [(2, r, "node1", "2", [0, 1], {"old_world": 4, "new_world": 2}) for r in (0, 1)], out
    with pytest.raises(ConfigError, match=r"ranks \[0, 1\] took DP replica\(s\) \[0, 1\] of 4 with them; 2 left, "
                                          r"below --min-dp 3"):
        launch(3)


# ---------------------------------------------------------------- the CLI, with faults (slow)
# No dropout: after an elastic change of dp one replica would draw the masks of two. No Switch balance loss: it is
# pooled per global microbatch (the dp ranks' m-th microbatches), a grouping another dp changes (the routers then
# drift 0.4% apart, the loss stays within verify's bound); the aux-loss-free bias is per step, so it stays on.
EP = ["--model", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "3", "--micro-batch", "1", "--global-batch", "8",
      "--dropout", "0", "--moe-aux-loss-coef", "0"]
PP8 = ["--dp", "2", "--pp", "2", "--tp", "2", "--schedule", "interleaved", "--microbatches", "4", "--zero", "1"]
MEM = ["--max-restarts", "1", "--ranks-per-node", "2", "--mem-ckpt-every", "1"]
JOBS = {
    "base_ep": EP,
    "kill_ep": [*EP, *MEM, "--fault-inject", "2:3:kill:forward"],
    # node 0 gone before step 2's optimizer step; back once the shrunk group has resumed (`_bring_back`)
    "gone_ep": [*EP, *MEM, "--min-dp", "1", "--fault-inject", "0:2:gone:optimizer"],
    "base_pp8": PP8,
    "node_pp8": [*PP8, "--max-restarts", "1", "--ranks-per-node", "4", "--mem-ckpt-every", "1",
                 "--fault-inject", "5:3:node:backward"],
}


def _bring_back(cli: ForkedCli, run_dir, give_up: float) -> None:
    """The operator's side of a rejoin: once the shrunk group has recovered (recoveries.jsonl written), remove the
    launcher's marks of the nodes gone (`<shm>/shardwise-mem-<launcher pid>-*/node<k>.gone`)."""
    import glob

    from shardwise.resilience.store import shm_root

    while time.monotonic() < give_up and not (run_dir / "recoveries.jsonl").exists():
        time.sleep(0.2)
    for mark in glob.glob(os.path.join(shm_root(), f"shardwise-mem-{cli._proc.pid}-*", "node*.gone")):
        os.remove(mark)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    warm_parent()
    procs = {name: ForkedCli([*COMMON, *argv, "--out", str(out / name)]) for name, argv in JOBS.items()}
    back = threading.Thread(target=_bring_back, args=(procs["gone_ep"], out / "gone_ep", time.monotonic() + 600))
    return _wait_jobs(procs, out, "elastic", (back,))


def _one(run, step: int, lost_ranks: list[int]) -> dict:
    (rec,) = _recoveries(run)
    print(json.dumps(rec))
    assert (rec["restored_from"], rec["restored_step"], rec["steps_lost"]) == ("memory", step, 0), rec
    assert set(lost_ranks) <= set(rec["lost_ranks"]), rec
    assert 0 < rec["recovery_s"] < 300 and rec["restore_s"] >= 0, rec
    return rec


@pytest.mark.slow
def test_ep_zero3_and_8_ranks_interleaved_recover_bitwise(jobs):
    _same_run(jobs["kill_ep"], jobs["base_ep"])
    _one(jobs["kill_ep"], 2, [2])
    _same_run(jobs["node_pp8"], jobs["base_pp8"])
    rec = _one(jobs["node_pp8"], 2, [4, 5, 6, 7])
    assert rec["from_peer"] == [4, 5, 6, 7], rec


@pytest.mark.slow
def test_node_gone_and_back_regroups_ep_zero3_within_verify_bounds(jobs):
    """dp4×ep2 → dp2×ep2 → dp4×ep2: replicas 0 and 1 leave with node 0 (their ZeRO-3 shards and AdamW moments re-cut
    from the survivors' copies), then come back at a step boundary (the survivors' dp2 copies re-cut to dp4). The
    sums regroup (4 replicas' terms → 2 × 2), so within verify's bounds, not bitwise."""
    run = jobs["gone_ep"]
    _same_run(run, jobs["base_ep"], bitwise=False)
    shrink, grow = _recoveries(run)
    print(json.dumps(shrink), json.dumps(grow))
    assert (shrink["restored_from"], shrink["restored_step"], shrink["steps_lost"]) == ("memory", 1, 0), shrink
    assert (shrink["old_dp"], shrink["new_dp"], shrink["lost_for_good"]) == (4, 2, [0, 1]), shrink
    assert shrink["elastic"] == {"old_world": 4, "new_world": 2}, shrink
    assert "going on with 2 of 4 ranks (elastic data parallelism)" in run["err"], run["err"]
    assert (grow["restored_from"], grow["steps_lost"], grow["lost_ranks"]) == ("memory", 0, []), grow
    assert (grow["old_dp"], grow["new_dp"], grow["rejoined"]) == (2, 4, [0, 1]), grow
    assert 1 < grow["restored_step"] < 5 and grow["recovery_s"] > 0, grow
    assert "are back: the group stopped at a step boundary and restarts on all 4 ranks" in run["err"], run["err"]
    assert json.loads((run["dir"] / "summary.json").read_text())["layout"]["dp"] == 4
