"""--tp-overlap and the fused projections: parity with the unsharded model, equal ledger bytes, fused = unfused.

The overlapped regions cut each SP all-gather / reduce-scatter into tp chunks; verify holds them to the single-device
model like any layout, and the ledger must show the same bytes per axis as without overlap in more messages.
"""
import dataclasses

import pytest

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.planner.tp_overlap import exposed_tp, messages_per_layer
from shardwise.tensor_parallel.overlap import chunk_bounds
from shardwise.verify import verify_main

from _dist import fresh_seed, run_ranks, verify_all
from test_model_families import DEEPSEEK, DEEPSEEK_NOQ


def _cfg(seed, **degrees):
    extra = {k: degrees.pop(k) for k in ("model", "global_batch", "dtype") if k in degrees}
    cfg = TrainConfig(parallel=ParallelConfig(sequence_parallel=True, tp_overlap=True, **degrees), steps=2,
                      seq_len=64, micro_batch=2, seed=seed, progress=False, warmup_steps=20, lr_decay_steps=200)
    cfg = dataclasses.replace(cfg, **extra)
    cfg.resolve_world()
    return cfg


def test_chunk_bounds_cover_the_shard():
    assert chunk_bounds(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert chunk_bounds(5, 2) == [(0, 3), (3, 2)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 1)]  # never an empty chunk


def test_planner_exposed_tp_time():
    """Long GEMMs hide all but each collective's first chunk; short ones hide nothing and the extra messages'
    latency makes the overlapped layer slower; no TP, nothing exposed."""
    kw = dict(tokens=4096, dim=4096, act_bytes=2, rate=100e9, flops_per_s=500e12, latency=8e-6)
    slow = exposed_tp(tp=4, projection_flops=1e13, **kw)
    assert slow.overlap == pytest.approx(8 * (8e-6 + slow.comm / 32)) and slow.overlap < slow.plain
    fast = exposed_tp(tp=4, projection_flops=0.0, **kw)
    assert fast.overlap == pytest.approx(fast.comm + 32 * 8e-6) and fast.overlap > fast.plain
    assert exposed_tp(tp=1, projection_flops=1e13, **kw).plain == 0.0
    assert (messages_per_layer(4, False), messages_per_layer(4, True), messages_per_layer(1, True)) == (8, 32, 0)


def _ledgers(cfgs):
    """Inside ranks: the per-axis ledger of one forward/backward of each config, and its first losses."""
    import torch

    from shardwise.trainer import Trainer, make_mesh

    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        trainer.mesh.ledger.reset()
        loss = trainer.forward_backward(0)
        out.append((trainer.mesh.ledger.snapshot(), float(loss)))
    return out


def test_overlap_ledger_bytes_equal_and_loss_bitwise():
    """tp2 with SP: overlap on and off move the same bytes per (axis, op), the overlapped run in more messages;
    the chunked forward equals the whole one bit for bit (rows are independent in a GEMM)."""
    seed = fresh_seed()
    on = _cfg(seed, tp=2)
    off = dataclasses.replace(on, parallel=dataclasses.replace(on.parallel, tp_overlap=False))
    (led_on, loss_on), (led_off, loss_off) = run_ranks(2, _ledgers, [on, off])[0]
    assert loss_on == loss_off, seed
    for op in ("all_gather", "reduce_scatter"):
        assert led_on["tp"][op]["bytes"] == led_off["tp"][op]["bytes"], (op, led_on["tp"], led_off["tp"])
        assert led_on["tp"][op]["count"] > led_off["tp"][op]["count"], (op, led_on["tp"], led_off["tp"])
    assert {a: sum(v["bytes"] for v in ops.values()) for a, ops in led_on.items()} == \
        {a: sum(v["bytes"] for v in ops.values()) for a, ops in led_off.items()}


def test_verify_overlap_tp2_tp4_and_fused_projections():
    """Overlap with and without fused projections, and the fused projections alone (TP's f region, no SP)."""
    seed = fresh_seed()
    fused_tp4 = _cfg(seed, tp=4)
    fused_tp4.parallel.fused_projections = True
    fused_no_sp = TrainConfig(parallel=ParallelConfig(tp=2, dp=2, fused_projections=True), steps=2, seq_len=64,
                              micro_batch=2, seed=seed, progress=False, warmup_steps=20, lr_decay_steps=200)
    fused_no_sp.resolve_world()
    for result in run_ranks(4, verify_all, [fused_tp4, _cfg(seed, tp=2, dp=2), fused_no_sp])[0]:
        assert result["passed"] and result["max_loss_abs_diff"] < 1e-5, (seed, result)


LAYOUTS = {
    "pp2_tp2": dict(tp=2, pp=2, global_batch=4),
    "pp2_tp2_zb_fused": dict(tp=2, pp=2, schedule="zb", global_batch=4, fused_projections=True),
    "tp2_recompute_full": dict(tp=2, recompute="full"),
    "cp2_tp2": dict(tp=2, cp=2),
    "moe_ep2_tp2": dict(tp=2, dp=2, ep=2, model="tiny-moe"),
    "zero3_tp2": dict(tp=2, dp=2, zero=3),
    "mla_tp2": dict(tp=2, model=DEEPSEEK),
    "mla_noq_tp2_fused": dict(tp=2, model=DEEPSEEK_NOQ, fused_projections=True),
    "bf16_tp2": dict(tp=2, dtype="bf16"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_verify_overlap_layouts(name):
    cfg = _cfg(fresh_seed(), **dict(LAYOUTS[name]))
    result = run_ranks(cfg.resolve_world(), verify_main, cfg)[0]
    assert result["passed"], (cfg.seed, result)


def _step_ledgers(cfgs):
    """Inside ranks: each config's comm ledger of one training step, without the bookkeeping tags."""
    import torch

    from shardwise.trainer import Trainer, make_mesh

    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        trainer.train_step(0)
        axes = trainer.mesh.ledger.steps[-1]["axes"]
        out.append({a: {op: v for op, v in ops.items() if op.partition(":")[2] not in ("metrics", "grad_norm")}
                    for a, ops in axes.items()})
    return out


def test_planner_predicts_the_overlapped_ledger():
    """The planner's op-by-op prediction (count, bytes, wire bytes) under --tp-overlap equals the real ledger,
    with full recompute (the replayed entries are chunked too) and under bf16 payloads."""
    from shardwise.planner import Cluster, estimate, get_gpu
    from shardwise.planner.layout import from_train_config

    seed = fresh_seed()
    cfgs = [dataclasses.replace(_cfg(seed, tp=2, global_batch=4), steps=1),
            dataclasses.replace(_cfg(seed, tp=2, recompute="full", dtype="bf16", global_batch=4), steps=1)]
    for cfg, got in zip(cfgs, run_ranks(2, _step_ledgers, cfgs)[0]):
        spec, lay, wl = from_train_config(cfg)
        est = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)
        predicted = est["stages"][0]["comm_ops_per_step"]
        assert {a: ops for a, ops in got.items() if ops} == predicted, (seed, cfg.parallel)
