"""Pipeline parallelism end to end: every schedule against the single-device model, memory, errors."""
import dataclasses

import pytest
import torch

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks, verify_all


def _cfg(seed, microbatches=4, **parallel):
    cfg = TrainConfig(parallel=ParallelConfig(**parallel), steps=2, seq_len=32, micro_batch=2, seed=seed,
                      progress=False)
    return dataclasses.replace(cfg, global_batch=microbatches * cfg.micro_batch * cfg.parallel.dp)


def _peaks(cfgs):
    peaks = []
    for cfg in cfgs:
        cfg = cfg.resolved()
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        trainer.train_step(0)
        peaks.append(trainer.executor.peak_inflight)
    return peaks


def test_every_schedule_pp2():
    seed = fresh_seed()
    cfgs = [_cfg(seed, pp=2, schedule=s, vp=2 if s == "interleaved" else 1)
            for s in ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")]
    for cfg, result in zip(cfgs, run_ranks(2, verify_all, cfgs)[0]):
        assert result["passed"], (seed, cfg.parallel, result)


def test_pp4_and_compositions():
    seed = fresh_seed()
    cfgs = [_cfg(seed, pp=4, schedule="gpipe"), _cfg(seed, microbatches=2, pp=4, schedule="1f1b"),
            _cfg(seed, pp=4, schedule="interleaved", vp=2), _cfg(seed, pp=2, tp=2, sequence_parallel=True),
            _cfg(seed, microbatches=3, pp=2, dp=2, schedule="zb", zero=1),
            _cfg(seed, pp=2, tp=2, schedule="interleaved", vp=2, pp_scatter_gather=True),
            dataclasses.replace(_cfg(seed, pp=4, pp_layers=[3, 2, 2, 1]), global_batch=8),
            # steady state at p=4: m = 2p microbatches
            _cfg(seed, microbatches=8, pp=4, schedule="1f1b"), _cfg(seed, microbatches=8, pp=4, schedule="zb"),
            _cfg(seed, microbatches=8, pp=4, schedule="dualpipev")]
    for cfg, result in zip(cfgs, run_ranks(4, verify_all, cfgs)[0]):
        assert result["passed"] and result["first_step_grad_rel_diff"] < 1e-5, (seed, cfg.parallel, result)


def test_peak_inflight_activations():
    seed = fresh_seed()
    m, p = 6, 4
    cfgs = [_cfg(seed, microbatches=m, pp=p, schedule=s) for s in ("gpipe", "1f1b", "zb")]
    per_rank = run_ranks(p, _peaks, cfgs)
    for i, name in enumerate(("gpipe", "1f1b", "zb")):
        peaks = [per_rank[r][i] for r in range(p)]
        if name == "gpipe":
            assert peaks == [m] * p
        else:
            assert all(pk <= p - s for s, pk in enumerate(peaks)), (name, peaks)
            assert peaks[0] == p


@pytest.mark.parametrize("parallel, gb, message", [
    (dict(pp=4, schedule="interleaved", vp=2), 6, "must be a multiple of p=4"),
    (dict(pp=2, schedule="dualpipev"), 3, "m >= 2p = 4"),
    (dict(pp=3), 8, "8 layers cannot be split evenly over 3 stages"),
    (dict(pp=2, pp_layers=[4, 3]), 8, "summing to the model's 8 layers"),
    (dict(pp=2, schedule="nope"), 8, "--schedule 'nope' is unknown"),
    (dict(pp=2, vp=2), 8, "--vp 2 needs --schedule interleaved"),
    (dict(pp=2, tp=2, sequence_parallel=True, pp_scatter_gather=True), 8, "--pp-scatter-gather needs --tp > 1"),
])
def test_pipeline_config_errors(parallel, gb, message):
    cfg = TrainConfig(parallel=ParallelConfig(**parallel), micro_batch=1, global_batch=gb)
    with pytest.raises(ConfigError, match=message):
        cfg.resolve_world()


def _pp_send_bytes(cfgs):
    out = []
    for cfg in cfgs:
        cfg = cfg.resolved()
        mesh = make_mesh(cfg, torch.device("cpu"))
        trainer = Trainer(cfg, mesh)
        mesh.ledger.reset()
        trainer.train_step(0)
        axes = mesh.ledger.steps[-1]["axes"]
        out.append((axes["pp"]["send"], axes["tp"].get("all_gather", {"count": 0, "bytes": 0})))
    return out


def test_scatter_gather_sends_one_tp_share():
    seed = fresh_seed()
    cfgs = [_cfg(seed, pp=2, tp=2), _cfg(seed, pp=2, tp=2, pp_scatter_gather=True)]
    (plain, _), (scattered, gathered) = run_ranks(4, _pp_send_bytes, cfgs)[0]
    assert scattered["count"] == plain["count"] and scattered["bytes"] * 2 == plain["bytes"]
    assert gathered["count"] == plain["count"] and gathered["bytes"] == scattered["bytes"]  # one gather per receive
