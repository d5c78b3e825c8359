"""Measured activation memory equals the planner's, with and without recompute.

One 2-rank spawn runs the first training step of tp2, tp2+SP, pp2 1f1b, cp2 ring, cp2 Ulysses and
dp2×ep2 tiny-moe under each recompute mode inside a `SavedActivationMeter` (peak bytes of distinct
saved storages, parameters excluded; max over ranks) and compares it with
`predicted_activation_bytes` (the planner's per-stage figure for exactly that run). Agreement is
within 3% (in practice < 1% for dense layouts: the loader's token ids are views of its whole batch;
~2% for MoE, whose routed rows follow the router), and recompute must order full < selective < none.
The same spawn runs `train_main` once to check the keys summary.json reports.
"""
import torch

from shardwise import comm
from shardwise.activation_memory import SavedActivationMeter, predicted_activation_bytes
from shardwise.config import ParallelConfig, TrainConfig
from shardwise.train import Trainer, make_mesh, train_main

from _dist import fresh_seed, run_ranks

LAYOUTS = {"tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True), "pp2-1f1b": dict(pp=2),
           "cp2-ring": dict(cp=2), "cp2-ulysses": dict(cp=2, cp_impl="ulysses"), "dp2-ep2-moe": dict(dp=2, ep=2)}
MODES = ("none", "selective", "full")


def _cfg(name, mode, seed, **kw) -> TrainConfig:
    moe = "ep" in LAYOUTS[name]
    cfg = TrainConfig(model="tiny-moe" if moe else "tiny", parallel=ParallelConfig(recompute=mode, **LAYOUTS[name]),
                      steps=1, seq_len=64, micro_batch=2, global_batch=8 if moe else 4, seed=seed, progress=False,
                      **kw)
    cfg.resolve_world()
    return cfg


def _measure(seed, out_dir):
    res = {}
    for name in LAYOUTS:
        for mode in MODES:
            cfg = _cfg(name, mode, seed)
            trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
            with SavedActivationMeter(trainer.model.parameters()) as meter:
                trainer.train_step(0)
            res[(name, mode)] = max(comm.all_gather_object(meter.peak, trainer.mesh["world"]))
    summary = train_main(_cfg("tp2-sp", "full", seed, out=out_dir, report=False))
    return res, summary


def test_measured_activation_memory_matches_planner(tmp_path):
    with torch.device("meta"):  # warm torch's lazy imports once, before forking
        torch.nn.Embedding(2, 2)
    seed = fresh_seed()
    (measured, summary), _ = run_ranks(2, _measure, seed, str(tmp_path))
    for (name, mode), got in measured.items():
        want = predicted_activation_bytes(_cfg(name, mode, seed))["held"]
        assert abs(got / want - 1) < 0.03, f"{name} recompute {mode}: measured {got}, predicted {want} (seed {seed})"
    for name in LAYOUTS:
        none, selective, full = (measured[(name, m)] for m in MODES)
        assert full < selective < none, (name, full, selective, none)
    pred = predicted_activation_bytes(_cfg("tp2-sp", "full", seed))
    assert summary["activation_bytes_measured"] == measured[("tp2-sp", "full")]
    assert summary["activation_bytes_predicted"] == pred["held"]
    assert summary["activation_recompute_transient_bytes_predicted"] == pred["recompute_transient"] > 0
