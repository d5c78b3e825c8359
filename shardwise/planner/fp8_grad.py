"""`--fp8` under tp: a linear replicated over tp whose output feeds each rank's own heads (MLA's down-projections,
KDA's gate down-projections: head-partial in `rules.inventory`) gets a per-rank partial output gradient, which the
runtime all-reduces over tp before its FP8 backward casts (`shardwise.fp8.linear`, `all_reduce:fp8_grad`): one
[tokens, out] gradient in the activations' dtype per such linear and microbatch (the tokens a rank's heads see: the
whole sequence, gathered under SP). Its weight gradient is then whole on every rank: it leaves the per-step tp sum
and, under ZeRO ≥ 2, the deferred buckets (reduce-scattered every microbatch like any whole gradient).
"""
from __future__ import annotations

from dataclasses import replace

from shardwise.planner.fp8 import block_linears
from shardwise.planner.layout import Layout, Stage, Workload
from shardwise.planner.models import ModelSpec
from shardwise.rules.fp8 import GRAD_TAG, summed_before_cast


def fp8_spec(spec: ModelSpec, wl: Workload) -> ModelSpec:
    """`spec` as an --fp8 run's planner sees it (`ModelSpec.fp8_summed_heads`): the entry points (`estimate`,
    `memory_by_stage`, `stage_ledgers`) take it, so every ZeRO bucket and tp sum below them agrees."""
    return replace(spec, fp8_summed_heads=True) if wl.fp8 and not spec.fp8_summed_heads else spec


def fp8_grad_sums(led, spec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """One microbatch's `all_reduce:fp8_grad` over tp of every such FP8 linear of `stage`."""
    if lay.tp == 1:
        return
    kinds = stage.kinds or (False,) * stage.n_dense + (True,) * stage.n_moe
    linear = stage.linear or (False,) * len(kinds)
    n = lay.mb * wl.seq_len // lay.cp
    for moe, lin in zip(kinds, linear):
        for p in block_linears(spec, moe, lin):
            if summed_before_cast(p):
                led.add("tp", f"all_reduce:{GRAD_TAG}", n * p.shape[0] * wl.act_bytes, lay.tp)
