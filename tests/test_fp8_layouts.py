"""`shardwise verify --fp8 RECIPE` on the layouts test_fp8.py leaves out: CP Ulysses, PP interleaved, ZeRO-1/2/3,
HSDP (dp_shard 1 of dp 2), MLA+MTP (DeepSeek-shaped MoE, dp2×ep2), EP over grouped experts and TP with blockwise
tiles, every recipe at least once (spread over the layouts: one two-rank spawn runs them all). Each layout is held,
as verify holds every fp32 --fp8 run, to a multiple of the spread the single-device FP8 model shows against its one-ulp
twin, after FP8 replay (docs/fp8.md); its verdict names the amax all-reduces of step 1 per axis, which must sit on
the axis that splits the scaled tensors. With per-shard scales (`scaling.reduce_amaxes` patched to keep each rank's
own amax: the wrong scale group) verify fails a token-split (MLA+MTP dp2×ep2, tensorwise), a feature-split (tp2,
blockwise) and a rowwise (dp2 ZeRO-3) layout at the replay's scale-group check.

MLA under TP: tests/test_fp8_mla_tp.py.

Every layout runs under FP8 replay (the references cast the layout's operands, each flip explained;
docs/fp8.md), which checks each scale against the single device's bit for bit — so rowwise's per-shard scales fail
too (dp2_zero3), although, being powers of two, they only rescale FP8 values exactly (subnormals aside).
"""
import pytest
import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.fp8 import scaling

from _dist import fresh_seed, run_ranks
from test_mtp import DEEPSEEK_MTP

# name: (recipe, parallel degrees, extra TrainConfig fields, the axes its step-1 amax all-reduces run on)
LAYOUTS = {
    "cp2_ulysses": ("rowwise", dict(cp=2, cp_impl="ulysses"), dict(seq_len=128), {"dp_cp"}),
    "pp2_interleaved": ("blockwise", dict(pp=2, schedule="interleaved", vp=2),
                        dict(global_batch=4, model_overrides={"n_layers": 4}), set()),
    "dp2_zero1": ("mxfp8", dict(dp=2, zero=1), {}, set()),  # 32-token tiles within each rank's sequences
    "dp2_zero2": ("blockwise", dict(dp=2, zero=2), {}, set()),
    "dp2_zero3": ("rowwise", dict(dp=2, zero=3), {}, {"dp_cp"}),
    "hsdp_dp2_shard1_zero3": ("tensorwise", dict(dp=2, dp_shard=1, zero=3), {}, {"dp_cp"}),
    "mla_mtp_dp2_ep2": ("tensorwise", dict(dp=2, ep=2), dict(model=DEEPSEEK_MTP, seq_len=32), {"dp_cp"}),
    "tiny_tp2_blockwise": ("blockwise", dict(tp=2), {}, {"tp"}),
    "moe_dp2_ep2_grouped": ("rowwise", dict(dp=2, ep=2), dict(model="tiny-moe"), {"dp_cp"}),
}
BROKEN = ("mla_mtp_dp2_ep2", "tiny_tp2_blockwise", "dp2_zero3")  # per-shard scales fail these: the scale group


UNREPLAYED = ()  # every layout runs under FP8 replay, pipelines too (each stage its own layers; docs/fp8.md)


def _cfg(name: str, seed: int) -> TrainConfig:
    fp8, degrees, extra, _ = LAYOUTS[name]
    extra = dict(extra)
    extra.setdefault("model_overrides", {} if isinstance(extra.get("model"), type(DEEPSEEK_MTP)) else {"n_layers": 2})
    cfg = TrainConfig(parallel=ParallelConfig(**degrees), steps=2, seq_len=extra.pop("seq_len", 64), micro_batch=2,
                      seed=seed, progress=False, fp8=fp8, warmup_steps=20, lr_decay_steps=200, **extra)
    return cfg.resolved(2)


def _verify_all(seed: int) -> dict:
    """Inside ranks: every layout's verdict, then the broken ones' with per-shard scales."""
    from shardwise.verify.main import verify_main

    torch.set_num_threads(1)
    out = {name: verify_main(_cfg(name, seed)) for name in LAYOUTS}
    scaling.reduce_amaxes = lambda amaxes, axes_per: list(amaxes)  # the wrong scale group
    out |= {f"{name}/per_shard": verify_main(_cfg(name, seed)) for name in BROKEN}
    return out


@pytest.mark.slow
def test_verify_fp8_on_every_layout():
    seed = fresh_seed()
    out = run_ranks(2, _verify_all, seed, timeout_s=600)[0]
    assert {LAYOUTS[n][0] for n in LAYOUTS} == {"tensorwise", "rowwise", "blockwise", "mxfp8"}
    wrong = []  # every layout judged before the assertion, so a failure names all that failed
    for name, (fp8, _, _, axes) in LAYOUTS.items():
        v = out[name]
        replayed = v.get("fp8_replay", {}).get("replayed_casts", 0) > 0
        if not (v["passed"] and v["coverage"] == 1.0 and len(v["losses"]) == 2 and set(v["fp8_amax"]) == axes
                and replayed == (name not in UNREPLAYED)):
            wrong.append((name, fp8, v["passed"], v["fp8_budget"]["ratios"], v["coverage"], v["fp8_amax"],
                          v.get("fp8_replay")))
    for name in BROKEN:
        v = out[f"{name}/per_shard"]
        if v["passed"] or v["fp8_amax"] or (v["fp8_replay"]["unexplained"] or {}).get("what") != "scale group":
            wrong.append((f"{name}/per_shard", v["passed"], v["fp8_budget"]["ratios"], v["fp8_amax"],
                          v["fp8_replay"]["unexplained"]))
    assert not wrong, (seed, wrong)
