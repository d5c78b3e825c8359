"""`--fp8 RECIPE` under `--tp-overlap`: the overlapped SP regions' chunk GEMMs in FP8, each scale the single device's.

The overlapped run equals the plain FP8 run (`tensor_parallel/overlap.py`): each chunk's rows are cast as the whole
operand is (tensorwise: with the whole's scale, fixed before the first chunk's gather from the shard's amax
max-reduced over tp; the other recipes scale the gathered operands per row) and a GEMM treats rows independently,
so the loss and every linear's gradient are bit for bit the plain run's. The norms' weight gradients are not:
their incoming gradient, the chunked reduce-scatter's shard, has another memory layout than the whole
reduce-scatter's, and the RMSNorm backward sums its tokens in another order — as without FP8
(test_tp_overlap.py compares losses only); they are held to fp32's reordering error. The ledger's `fp8_amax` and
`fp8_grad` all-reduces equal the planner's (tensorwise: each overlapped linear's x or g amax reduces over tp too).

verify refuses `--fp8` with `--tp-overlap`: FP8 replay does not reach the chunk casts, and the twin's budget alone
failed correct runs at fresh seeds; the exactness rests on the bitwise parity with the plain FP8 run, which verify
replays.
"""
import dataclasses

import pytest
import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.planner import Cluster, estimate, get_gpu
from shardwise.planner.layout import from_train_config

from _dist import fresh_seed, run_ranks
from test_fp8_mla_tp import MLA_DENSE
from test_planner_fp8 import assert_ops_as_planned, one_step

WIDE = {"dim": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256}
"""tiny with 32-row weight blocks per tp2 rank (mxfp8's 32-element blocks must not cut across ranks)."""
FP8_TAGS = ("all_reduce:fp8_amax", "all_reduce:fp8_grad")


def _cfg(seed: int, fp8: str, overlap: bool = True, tp: int = 2, dp: int = 1, steps: int = 1, model="tiny",
         overrides=None, global_batch=None, **par) -> TrainConfig:
    overrides = {"n_layers": 2} | (overrides or {}) if model == "tiny" else {}
    return TrainConfig(model=model, parallel=ParallelConfig(tp=tp, dp=dp, sequence_parallel=True, tp_overlap=overlap,
                                                            **par),
                       steps=steps, seq_len=64, micro_batch=2,
                       global_batch=global_batch or 2 * dp * (2 if steps > 1 else 1),
                       seed=seed, progress=False, fp8=fp8, warmup_steps=20, lr_decay_steps=200,
                       model_overrides=overrides).resolved(tp * dp * par.get("pp", 1))


def _plain(cfg: TrainConfig) -> TrainConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp_overlap=False))


def _fp8_ops(axes: dict) -> dict:
    return {(a, op): (v["count"], v["bytes"]) for a, ops in axes.items() for op, v in ops.items() if op in FP8_TAGS}


def _planned(cfg: TrainConfig) -> dict:
    spec, lay, wl = from_train_config(cfg)
    return estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)["stages"][0][
        "comm_ops_per_step"]


def _runs(cfgs) -> list:
    """Inside ranks: (loss, this rank's local gradients, ledger axes) of one forward-backward of each config."""
    from shardwise.training.trainer import Trainer, make_mesh

    torch.set_num_threads(1)
    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        trainer.mesh.ledger.reset()
        loss = float(trainer.forward_backward(0))
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        out.append((loss, grads, trainer.mesh.ledger.snapshot()))
    return out


def _assert_equal_runs(plain, over, where: str) -> None:
    """Loss and every linear's gradient bit for bit; the norms' weight gradients within fp32 reordering error."""
    (l0, g0, _), (l1, g1, _) = plain, over
    assert l0 == l1, (where, l0, l1)
    assert set(g0) == set(g1), where
    for name in g0:
        if name.endswith("norm.weight"):
            scale = float(g0[name].abs().max())
            torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=2**-18 * scale, msg=f"{where} {name}")
        else:
            assert torch.equal(g0[name], g1[name]), (where, name, float((g0[name] - g1[name]).abs().max()))


def test_fp8_overlap_equals_plain_fp8_and_its_all_reduces_are_planned():
    """tp2 + SP, tensorwise and (with --fused-projections) rowwise: overlapped = plain bit for bit; the overlapped
    runs' FP8 all-reduces as the planner counts them, tensorwise's more on tp than the plain run's."""
    seed = fresh_seed()
    _check_pairs({"tensorwise": _cfg(seed, "tensorwise")}, seed)


def _check_pairs(pairs: dict, seed: int, world: int = 2, planned: bool = True) -> None:
    """Each overlapped config against its plain FP8 run (`_assert_equal_runs`) and, `planned`, both runs' FP8
    all-reduces against the plan (one microbatch per step)."""
    cfgs = [c for over in pairs.values() for c in (_plain(over), over)]
    ranks = run_ranks(world, _runs, cfgs, timeout_s=600)
    for rank, runs in enumerate(ranks):
        for i, (name, over) in enumerate(pairs.items()):
            plain_run, over_run = runs[2 * i], runs[2 * i + 1]
            where = f"{name} rank {rank} (seed {seed})"
            _assert_equal_runs(plain_run, over_run, where)
            if planned:
                assert _fp8_ops(over_run[2]) == _fp8_ops(_planned(over)), where
                assert _fp8_ops(plain_run[2]) == _fp8_ops(_planned(_plain(over))), where
    if "tensorwise" in pairs:
        plain_tp, over_tp = (_fp8_ops(r[2])[("tp", "all_reduce:fp8_amax")][0] for r in ranks[0][:2])
        assert over_tp > plain_tp, (plain_tp, over_tp)


@pytest.mark.slow
def test_fp8_overlap_equals_plain_fp8_every_recipe():
    """The other recipes (rowwise with --fused-projections, blockwise, mxfp8 on 32-row blocks per rank), as above."""
    seed = fresh_seed()
    _check_pairs({"rowwise fused": _cfg(seed, "rowwise", fused_projections=True),
                  "blockwise": _cfg(seed, "blockwise"), "mxfp8": _cfg(seed, "mxfp8", overrides=WIDE)}, seed)


# name: config builder (seed -> TrainConfig), all with SP and --tp-overlap
VERIFY_TP2 = {
    "tensorwise": lambda s: _cfg(s, "tensorwise", steps=2),
    "rowwise_fused": lambda s: _cfg(s, "rowwise", steps=2, fused_projections=True),
    "blockwise": lambda s: _cfg(s, "blockwise", steps=2),
    "mxfp8": lambda s: _cfg(s, "mxfp8", steps=2, overrides=WIDE),
    # MLA: the replicated down-projections' output gradients summed over tp before their casts (fp8_grad)
    "mla_tensorwise": lambda s: _cfg(s, "tensorwise", steps=2, model=MLA_DENSE),
}


def test_verify_refuses_fp8_under_tp_overlap():
    """`verify --fp8 RECIPE --tp-overlap` is refused with one line naming both flags and what to verify instead: the
    chunks' casts are not replayed, and the twin's budget alone failed correct runs at fresh seeds (291337267: tp2
    tensorwise param ratio 1.30, tp4 rowwise grad ratio 12.6). The exactness is the bitwise parity above, with the
    plain FP8 layouts verified elsewhere (test_fp8_layouts.py, test_fp8_mla_tp.py)."""
    from shardwise.config import ConfigError
    from shardwise.verify.main import verify_main

    for name, make in VERIFY_TP2.items():
        with pytest.raises(ConfigError, match="with --tp-overlap.*verify the layout without --tp-overlap"):
            verify_main(make(1))


@pytest.mark.slow
def test_fp8_tp_overlap_four_ranks_pairs_and_the_ledger_at_dp2():
    """pp2 zero-bubble × tp2 (the overlapped regions' FP8 weight-gradient casts deferred to W) equals its plain FP8
    run bit for bit; one dp2×tp2 tensorwise step's ledger equals the plan (the overlapped linears' amaxes over dp_cp
    and tp)."""
    seed = fresh_seed()
    _check_pairs({"pp2 zb": _cfg(seed, "tensorwise", pp=2, schedule="zb", global_batch=4)}, seed, world=4,
                 planned=False)
    cfg = _cfg(seed, "tensorwise", dp=2)
    for rank, axes in enumerate(run_ranks(4, _one_step_axes, cfg)):
        got = assert_ops_as_planned(axes, _planned(cfg), f"dp2 tp2 rank {rank} (seed {seed})")
        assert {k[0] for k in got if k[1] == "all_reduce:fp8_amax"} == {"tp", "dp_cp"}, got


def _one_step_axes(cfg):
    torch.set_num_threads(1)
    return one_step(cfg)[2]
