"""Activation recompute is exact: the same losses and gradients as no recompute, on real layouts."""
from __future__ import annotations

import pytest
import torch

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks

LAYOUTS = {  # 2 ranks each
    "tp2-sp": ("tiny", dict(tp=2, sequence_parallel=True)),
    "pp2-zb": ("tiny", dict(pp=2, schedule="zb")),
    "pp2-dualpipev-dropout": ("tiny", dict(pp=2, schedule="dualpipev")),
    "pp2-1f1b": ("tiny", dict(pp=2)),
    "cp2-ring": ("tiny", dict(cp=2)),
    "ep2-moe": ("tiny-moe", dict(dp=2, ep=2)),
}


def _step(name, mode, seed):
    model, par = LAYOUTS[name]
    cfg = TrainConfig(model=model, parallel=ParallelConfig(**par, recompute=mode), steps=1, seed=seed,
                      progress=False, seq_len=32, micro_batch=2, global_batch=8,
                      dropout=0.1 if "dropout" in name else None)
    cfg = cfg.resolved()
    trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
    loss = trainer.forward_backward(0)
    trainer.finish_gradients()  # overlapped reduction: buckets may still be in flight after backward
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss, grads


def _all(seed):
    """Inside each rank: [(layout, mode, problem)] for every mismatch against recompute none."""
    bad = []
    for name in LAYOUTS:
        loss0, grads0 = _step(name, "none", seed)
        for mode in ("selective", "full"):
            loss, grads = _step(name, mode, seed)
            if loss != loss0:
                bad.append((name, mode, f"loss {loss} != {loss0}"))
            if grads.keys() != grads0.keys() or not grads0:
                bad.append((name, mode, "different set of gradients"))
            # same arithmetic order: bitwise
            bad += [(name, mode, n) for n, g in grads0.items() if n in grads and not torch.equal(grads[n], g)]
    return bad


def test_recompute_equals_no_recompute():
    seed = fresh_seed()
    for rank, bad in enumerate(run_ranks(2, _all, seed)):
        assert bad == [], f"rank {rank} (seed {seed}): {bad}"


@pytest.mark.parametrize("par,bad", [(dict(recompute="partial"), "--recompute 'partial'"),
                                     (dict(pp=2, recompute="full", recompute_layers=5), "--recompute-layers 5")])
def test_bad_recompute_flags(par, bad):
    cfg = TrainConfig(parallel=ParallelConfig(**par))
    with pytest.raises(ConfigError, match=bad):
        cfg.resolve_world()
