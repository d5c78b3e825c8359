"""--tp-overlap and the fused projections: parity with the unsharded model, equal ledger bytes, fused = unfused.

The overlapped regions cut each SP all-gather / reduce-scatter into tp chunks; verify holds them to the single-device
model like any layout, and the ledger must show the same bytes per axis as without overlap in more messages.
"""
import dataclasses

import pytest

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.planner.tp_overlap import exposed_tp, messages_per_layer
from shardwise.tensor_parallel.overlap import chunk_bounds
from shardwise.verify.main import verify_main

from _dist import fresh_seed, run_ranks, verify_all
from test_model_families import DEEPSEEK, DEEPSEEK_NOQ


def _cfg(seed, **degrees):
    extra = {k: degrees.pop(k) for k in ("model", "global_batch", "dtype") if k in degrees}
    cfg = TrainConfig(parallel=ParallelConfig(**dict(sequence_parallel=True, tp_overlap=True) | degrees), steps=2,
                      seq_len=64, micro_batch=2, seed=seed, progress=False, warmup_steps=20, lr_decay_steps=200)
    cfg = dataclasses.replace(cfg, **extra)
    cfg = cfg.resolved()
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

    from shardwise.training.trainer import Trainer, make_mesh

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
    """Overlap with and without fused projections; the fused projections alone (TP's f region, no SP); fused under
    SP without overlap on DeepSeek's shape (MLA's fused down-projections, fused shared experts) with ZeRO-3."""
    seed = fresh_seed()
    fused_tp4 = _cfg(seed, tp=4, fused_projections=True)
    fused_no_sp = TrainConfig(parallel=ParallelConfig(tp=2, dp=2, fused_projections=True), steps=2, seq_len=64,
                              micro_batch=2, seed=seed, progress=False, warmup_steps=20, lr_decay_steps=200)
    fused_no_sp = fused_no_sp.resolved()
    mla_zero3 = _cfg(seed, tp=2, dp=2, zero=3, model=DEEPSEEK, global_batch=4, tp_overlap=False, fused_projections=True)
    for result in run_ranks(4, verify_all, [fused_tp4, _cfg(seed, tp=2, dp=2), fused_no_sp, mla_zero3])[0]:
        assert result["passed"] and result["max_loss_abs_diff"] < 1e-5, (seed, result)


def _fused_storage_and_checkpoints(fused, unfused, zero3, root):
    """Inside ranks: whether every fused region is one storage (built, after a step, after loading, under ZeRO-3),
    and a checkpoint of the fused run loaded by the unfused one (and back) gives the same parameters."""
    import torch

    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    from shardwise.tensor_parallel.fused import region_stored
    from shardwise.training.trainer import Trainer, make_mesh

    def trainer(cfg):
        return Trainer(cfg, make_mesh(cfg, torch.device("cpu")))

    def stored(t):
        regions = {id(m.region): m.region for m in t.model.modules() if getattr(m, "region", None) is not None}
        return [region_stored(r) for r in regions.values() if r.fused]

    def same(a, b):
        pb = dict(b.model.named_parameters())
        return [n for n, p in a.model.named_parameters() if not torch.equal(p, pb[n])]

    out = {}
    a = trainer(fused)
    out["built"] = stored(a)
    a.train_step(0)
    out["trained"] = stored(a)
    save_checkpoint(f"{root}/fused", 1, a)
    b = trainer(unfused)
    load_checkpoint(f"{root}/fused", b)
    out["fused_to_unfused_differ"] = same(a, b)
    out["next_losses"] = (a.train_step(1)["loss"], b.train_step(1)["loss"])
    save_checkpoint(f"{root}/unfused", 2, b)
    c = trainer(fused)
    load_checkpoint(f"{root}/unfused", c)
    out["unfused_to_fused_differ"], out["loaded"] = same(b, c), stored(c)
    z = trainer(zero3)
    z.train_step(0)
    out["zero3"] = stored(z)
    return out


def test_fused_storage_and_checkpoints_interchange(tmp_path):
    """tp2 + SP + overlap: each fused region is one storage when built, after a step and after a checkpoint load;
    a fused run's checkpoint loads into an unfused run and back, parameter for parameter; ZeRO-3's flat buckets
    keep the regions contiguous."""
    seed = fresh_seed()
    fused = _cfg(seed, tp=2, fused_projections=True)
    unfused = _cfg(seed, tp=2)
    zero3 = dataclasses.replace(unfused, model=DEEPSEEK, global_batch=4,
                                parallel=ParallelConfig(dp=2, zero=3, fused_projections=True))
    zero3 = zero3.resolved()
    for out in run_ranks(2, _fused_storage_and_checkpoints, fused, unfused, zero3, str(tmp_path)):
        assert len(out["built"]) == 2 * 8 and all(out["built"]) and all(out["trained"]) and all(out["loaded"]), out
        assert out["fused_to_unfused_differ"] == [] and out["unfused_to_fused_differ"] == [], (seed, out)
        assert abs(out["next_losses"][0] - out["next_losses"][1]) < 1e-5, (seed, out)
        assert len(out["zero3"]) == 8 and all(out["zero3"]), (seed, out)  # 4 MLA, 1 dense MLP, 3 shared experts


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

    from shardwise.training.trainer import Trainer, make_mesh

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
