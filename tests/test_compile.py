"""--compile: torch.compile of each transformer block (inductor on CPU), exact against the eager reference.

Inductor compiles cold in tens of seconds per process, so the multi-rank checks share ONE 2-rank
fork: verify at tp2 (with full and selective recompute), pp2 and cp2 on a 2-layer model, and the
ledger of compiled training steps against eager ones. The compile cache is shared across ranks.
"""
from __future__ import annotations

import os

import pytest
import torch

from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig

from _dist import fresh_seed, run_ranks

MODEL = ModelConfig(name="c", vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
LAYOUTS = {"tp2": dict(tp=2), "tp2_full": dict(tp=2, recompute="full"), "tp2_selective": dict(tp=2, recompute="selective"),
           "pp2": dict(pp=2), "cp2": dict(cp=2)}


def _cfg(seed: int, compile: bool = True, **degrees) -> TrainConfig:
    return TrainConfig(model=MODEL, parallel=ParallelConfig(**degrees, compile=compile), steps=2, seq_len=32,
                       micro_batch=2, global_batch=4 if degrees.get("pp", 1) > 1 else None, seed=seed, progress=False)


def _rank(seed: int):
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from shardwise.training.trainer import Trainer, make_mesh
    from shardwise.verify.main import verify_main

    inductor_config.compile_threads = 1  # two ranks on two cores: no pool of compile workers per rank
    results = {}
    for name, degrees in LAYOUTS.items():
        cfg = _cfg(seed, **degrees)
        cfg = cfg.resolved()
        results[name] = verify_main(cfg)
    graphs = counters["stats"]["unique_graphs"]
    ledgers = {}  # every collective (and so every ledger entry) runs eagerly under compile
    for compile in (True, False):
        cfg = _cfg(seed, compile, tp=2)
        cfg = cfg.resolved()
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        for step in range(2):
            trainer.train_step(step)
        ledgers[compile] = trainer.mesh.ledger.steps
    return results, graphs, ledgers


def test_verify_compile_tp2_pp2_cp2_in_one_fork(tmp_path_factory, monkeypatch):
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(tmp_path_factory.getbasetemp() / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", cache)  # inherited by the forked ranks: they share kernels
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # two ranks, two cores: no compile worker pools
    seed = fresh_seed()
    (results, graphs, ledgers), _ = run_ranks(2, _rank, seed, timeout_s=900)
    for name, r in results.items():
        assert r["passed"] and r["layout"]["compile"], (name, seed, r)
        assert r["max_loss_abs_diff"] < 1e-5 and r["first_step_grad_rel_diff"] < 1e-5, (name, seed, r)
    assert graphs > 0, "nothing was compiled"
    assert ledgers[True] == ledgers[False]


def test_compile_unavailable_is_a_config_error(monkeypatch, capsys):
    """`--compile` where torch.compile cannot run: exit 2 with one line, before any rank starts."""
    import torch._dynamo.eval_frame as eval_frame

    from shardwise.cli import main

    def unsupported():
        raise RuntimeError("Python 3.99+ not yet supported for torch.compile")

    monkeypatch.setattr(eval_frame, "check_if_dynamo_supported", unsupported)
    with pytest.raises(ConfigError, match="--compile: torch.compile is unavailable here"):
        _cfg(1, tp=2).resolve_world()
    assert main(["verify", "--tp", "2", "--compile", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compile: torch.compile is unavailable here (Python 3.99+" in err[0], err


def test_a_collective_bound_before_the_barriers_runs_eagerly():
    """The barrier is the op's own: a name taken from comm before `compile_barriers` ran still breaks the
    graph, and the op's body runs with Dynamo off (its ledger updates and c10d calls are never traced)."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    from torch._dynamo.utils import counters

    from shardwise.comm import compile_barriers
    from shardwise.comm.collectives import wait
    from shardwise.mesh import Axis

    eager = []

    class Work:
        def wait(self):
            eager.append(get_eval_frame_callback() is None)

    work, axis = Work(), Axis("tp")

    def step(x):
        y = x.sin()
        wait(work, axis, "all_reduce")
        return y.cos()

    compile_barriers()
    counters.clear()
    compiled = torch.compile(step, backend="eager")
    x = torch.randn(4)
    for _ in range(2):
        assert torch.equal(compiled(x), x.sin().cos())
    assert eager == [True, True]  # each compiled call ran the op, with Dynamo off
    assert counters["stats"]["unique_graphs"] == 2  # sin | the collective | cos
