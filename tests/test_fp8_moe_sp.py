"""`--fp8 blockwise` / `mxfp8` on MoE models: the weight-gradient GEMM's 128- (32-) token tiles of an expert's rows
are the single device's only where one rank holds every token of its experts in the single device's order. Under SP
each TP rank routes its own sequence shard, under cp its own part of each sequence, and at ep < dp an expert's tokens
sit on dp/ep ranks: each rank tiles rows the single device tiles differently, and which rows an expert gets depends
on the routing, so no amax reduction over a fixed axis repairs it. `TrainConfig` refuses those layouts
(`rules.validation.fp8_moe_problem`); the planner counts no amax reduction for the routed experts' token tiles
(they are taken on each rank's rows), as the runtime sends none.

Checked: the refusals (no spawn); one step's ledger at dp2 (DeepSeek-shaped MoE, blockwise, ep 1, the refusal
lifted) equals the plan — no `edp` `fp8_amax` all-reduce on either side; `verify` (one two-rank spawn, slow, fresh
seeds: FP8 replay places the routed experts' rows, verify/fp8_replay.py) passes blockwise tiny-moe at tp2 without SP
and at dp2×ep2 with every cast replayed, and fails it, the refusal lifted, at tp2 with SP and at dp2×ep1 — at the
replay's scale-group check on an expert's token tiles —, as it fails tensorwise at tp2 with SP with per-rank amaxes.
"""
import dataclasses

import pytest
import torch

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.config import training

from _dist import fresh_seed, run_ranks
from test_mtp import DEEPSEEK_MTP
from test_planner_fp8 import assert_ops_as_planned, one_step

ALLOWED = {"tp2": dict(tp=2), "dp2_ep2": dict(dp=2, ep=2)}
REFUSED = {"tp2_sp": dict(tp=2, sequence_parallel=True), "dp2_ep1": dict(dp=2)}
PER_SHARD = ("tensorwise", dict(tp=2, sequence_parallel=True))
"""The routed experts' scales over their rows, split over tp under SP, taken on each rank's own rows (their layout
emptied of axes): verify must fail it at the replay's scale-group check on an expert's operand."""


def _lift_refusal() -> None:
    """Let the refused layouts build (the planner plans them; the tests below show why they are refused)."""
    training.fp8_moe_problem = lambda *args: None


def _cfg(degrees: dict, seed: int, fp8: str = "blockwise", **extra) -> TrainConfig:
    kw = dict(model="tiny-moe", steps=2, seq_len=64, micro_batch=2, model_overrides={"n_layers": 2}) | extra
    return TrainConfig(parallel=ParallelConfig(**degrees), seed=seed, progress=False, fp8=fp8,
                       warmup_steps=20, lr_decay_steps=200, **kw).resolved(2)


@pytest.mark.parametrize("fp8,degrees,extra,message", [
    ("blockwise", dict(tp=2, sequence_parallel=True), {}, "under --tp 2 --sequence-parallel (each TP rank routes"),
    ("mxfp8", dict(cp=2), dict(seq_len=256), "under --cp 2 (each rank routes its own part"),
    ("blockwise", dict(dp=2), {}, "under --dp 2 --ep 1 (an expert's tokens are split over 2 ranks)"),
    ("blockwise", dict(dp=2, ep=2), dict(seq_len=32, micro_batch=1), "micro_batch × seq_len a multiple of 128"),
])
def test_token_tiles_split_over_ranks_are_refused(fp8, degrees, extra, message):
    with pytest.raises(ConfigError, match="tiles the MoE's rows") as e:
        TrainConfig(model="tiny-moe", parallel=ParallelConfig(**degrees), fp8=fp8, **extra).resolved()
    assert message in str(e.value) and "use --fp8 tensorwise or rowwise" in str(e.value)


@pytest.mark.parametrize("fp8,degrees", [("rowwise", dict(tp=2, sequence_parallel=True)),
                                         ("tensorwise", dict(dp=2)), ("blockwise", dict(dp=2, ep=2)),
                                         ("blockwise", dict(tp=2))])
def test_other_layouts_are_accepted(fp8, degrees):
    TrainConfig(model="tiny-moe", parallel=ParallelConfig(**degrees), fp8=fp8).resolved()


def _ledger(seed: int) -> dict:
    """Inside ranks: the ledger of one train step at dp2, DeepSeek-shaped MoE, blockwise, ep 1 (refusal lifted)."""
    torch.set_num_threads(1)
    _lift_refusal()
    return one_step(_cfg(dict(dp=2), seed, model=DEEPSEEK_MTP, seq_len=32, global_batch=4, steps=1))[2]


def test_ledger_equals_the_plan(monkeypatch):
    """The routed experts' token tiles are taken on each rank's rows: no `edp` amax all-reduce, measured or planned
    (the planner counted 9, 27,648 B, at this layout before); every other op as the planner counts it."""
    from shardwise.planner import Cluster, estimate, get_gpu
    from shardwise.planner.layout import from_train_config

    seed = fresh_seed()
    with torch.device("meta"):  # torch's lazy imports once, before forking
        torch.nn.Embedding(2, 2)
    runs = run_ranks(2, _ledger, seed)
    monkeypatch.setattr(training, "fp8_moe_problem", lambda *args: None)
    spec, lay, wl = from_train_config(_cfg(dict(dp=2), seed, model=DEEPSEEK_MTP, seq_len=32, global_batch=4,
                                           steps=1))
    planned = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl,
                       detail=True)["stages"][0]["comm_ops_per_step"]
    assert "all_reduce:fp8_amax" not in planned.get("edp", {})
    for rank, run in enumerate(runs):
        where = f"rank {rank} (seed {seed})"
        got = assert_ops_as_planned(run, planned, where)
        assert got.get(("edp", "all_reduce")), f"{where}: no expert gradient all-reduce on edp measured"


def _verify_all(seed: int) -> dict:
    """Inside ranks: verify's verdict on the accepted layouts, then on the refused ones with the refusal lifted."""
    from shardwise.verify.main import verify_main

    from shardwise.fp8 import experts as fp8_experts
    from shardwise.fp8.linear import LinearLayout

    torch.set_num_threads(1)
    out = {name: verify_main(_cfg(degrees, seed)) for name, degrees in ALLOWED.items()}
    _lift_refusal()
    out |= {name: verify_main(_cfg(degrees, seed)) for name, degrees in REFUSED.items()}
    grouped = fp8_experts.fp8_linears  # the routed experts' scales taken on each rank's rows: the wrong group
    fp8_experts.fp8_linears = lambda cfg, *args: grouped(dataclasses.replace(cfg, layout=LinearLayout(seq_global=0)),
                                                         *args)
    return out | {"per_shard": verify_main(_cfg(PER_SHARD[1], seed, PER_SHARD[0]))}


def _expert_scale_group(v: dict) -> bool:
    """Whether verify failed `v` at the replay's scale-group check on a routed expert's operand."""
    why = (v.get("fp8_replay") or {}).get("unexplained") or {}
    return not v["passed"] and why.get("what") == "scale group" and ".experts.w" in why.get("where", "")


@pytest.mark.slow
def test_verify_blockwise_moe():
    seed = fresh_seed()
    out = run_ranks(2, _verify_all, seed, timeout_s=900)[0]
    wrong = [(name, out[name]["fp8_budget"]["ratios"], out[name].get("fp8_replay")) for name in ALLOWED
             if not (out[name]["passed"] and out[name]["coverage"] == 1.0 and len(out[name]["losses"]) == 2
                     and out[name]["fp8_replay"]["own_casts"] == 0)]
    wrong += [(name, "not failed at an expert's tiles", out[name].get("fp8_replay")) for name in (*REFUSED, "per_shard")
              if not _expert_scale_group(out[name])]
    assert not wrong, (seed, wrong)
