"""`shardwise verify --fp8` on pipeline layouts under FP8 replay (verify/fp8_replay.py): each stage records its own
layers' casts, the ranks all-gather the recorded keys and shapes, and the references cast the layout's operands.

Seed 887019381 at pp2×tp2+SP (tensorwise, 1f1b) failed verify before replay reached pipelines (grad ratio 3.69 against
the one-ulp twin's noise): the reference's own e5m2 cast of the last layer's w2 output gradient rounded one element
apart from the layout's, its amax moved by fp32 reordering only. Under replay it passes, with that one element named.
"""
import pytest
import torch

from shardwise.fp8 import scaling

from _dist import fresh_seed, run_ranks
from test_fp8_overlap import _cfg

FLIP_SEED = 887019381  # a seed whose pp2×tp2+SP run flips one e5m2 element (see the module docstring)


def _pp(seed: int, fp8: str = "tensorwise", **par):
    return _cfg(seed, fp8, overlap=False, pp=2, global_batch=4, steps=2, **par)


def _verify(cfgs, per_shard: list) -> list:
    """Inside ranks: each config's verdict, then each of `per_shard`'s with per-shard amaxes (the wrong scale
    group)."""
    from shardwise.verify.main import verify_main

    torch.set_num_threads(1)
    out = [verify_main(c) for c in cfgs]
    scaling.reduce_amaxes = lambda amaxes, axes_per: list(amaxes)
    return out + [verify_main(c) for c in per_shard]


def _replayed(v: dict) -> bool:
    """Passed, every FP8 cast of the references replayed, nothing unexplained."""
    r = v.get("fp8_replay") or {}
    return (v["passed"] and v["coverage"] == 1.0 and r.get("replayed_casts", 0) > 0 and r["own_casts"] == 0
            and r["unexplained"] is None)


def _broken(v: dict) -> bool:
    return not v["passed"] and (v["fp8_replay"]["unexplained"] or {}).get("what") == "scale group"


def test_pp_tp_sp_flip_seed_replayed_and_per_shard_fails():
    """The seed that failed before (one flip, now explained and named) and the per-shard sabotage, one spawn."""
    cfg = _pp(FLIP_SEED)
    flip, broken = run_ranks(4, _verify, [cfg], [cfg], timeout_s=300)[0]
    assert _replayed(flip), flip.get("fp8_replay")
    apart = flip["fp8_replay"]["rounded_apart_per_operand"]
    assert flip["fp8_replay"]["reference_rounded_apart"] >= 1 and all("layers.1." in a["operand"] for a in apart), apart
    assert flip["fp8_budget"]["ratios"]["grad"] < 1, flip["fp8_budget"]
    assert _broken(broken), broken.get("fp8_replay")


@pytest.mark.slow
def test_pp_schedules_fresh_seed():
    """1f1b tensorwise, interleaved blockwise (4 layers, vp 2), zero-bubble rowwise (dW deferred to its W action):
    all at pp2×tp2+SP, a fresh seed, every reference cast replayed; per-shard rowwise fails under zb too."""
    seed = fresh_seed()
    cfgs = {"1f1b tensorwise": _pp(seed),
            "interleaved blockwise": _pp(seed, "blockwise", schedule="interleaved", vp=2, overrides={"n_layers": 4}),
            "zb rowwise": _pp(seed, "rowwise", schedule="zb")}
    out = run_ranks(4, _verify, list(cfgs.values()), [cfgs["zb rowwise"]], timeout_s=600)[0]
    wrong = [(name, v["fp8_budget"]["ratios"], v.get("fp8_replay")) for name, v in zip(cfgs, out)
             if not _replayed(v)]
    if not _broken(out[-1]):
        wrong.append(("zb rowwise/per_shard", out[-1].get("fp8_replay")))
    assert not wrong, (seed, wrong)


def _mla(seed: int) -> list:
    """Inside ranks: DeepSeek-shaped MLA+MTP at tp2+SP, then with its output gradients left partial."""
    from shardwise.fp8 import apply
    from shardwise.verify.main import verify_main
    from test_fp8_mla_tp import _cfg as mla_cfg

    torch.set_num_threads(1)
    out = [verify_main(mla_cfg("tp2_sp_tensorwise", seed))]
    apply._sum_output_gradient = lambda layer, tp: None
    return out + [verify_main(mla_cfg("tp2_sp_tensorwise", seed))]


@pytest.mark.slow
def test_mla_grad_sum_g_replayed():
    """MLA's down-projections sum their output gradient over tp before casting it (`grad_sum`): that summed g is
    replayed too (it was the last of the references' own casts); left partial, verify still fails."""
    seed = fresh_seed()
    whole, partial = run_ranks(2, _mla, seed, timeout_s=600)[0]
    assert _replayed(whole), (seed, whole["fp8_budget"]["ratios"], whole.get("fp8_replay"))
    assert not partial["passed"], (seed, partial["fp8_budget"]["ratios"], partial.get("fp8_replay"))
