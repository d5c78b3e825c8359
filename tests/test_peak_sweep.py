"""The planner's bounds on the sweep's layouts (`shardwise/simulate/sweep.py`), in this one process: for every
simulated rank the planner's live peak within 3% of the traced one, saved activations within 2%, comm
bytes per axis equal, and static bytes exactly equal (the planner counts shardwise's own buffers,
`tests/test_planner_ledger.py`).

CI runs the layouts that exercise a distinct planner moment (about a minute on two cores) and one full-size MoE plan;
the sweep module runs them all (`python -m shardwise.simulate.sweep`), Qwen3-235B's top row on 512 GPUs included
(about 50 CPU-s).
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.planner import peak
from shardwise.simulate import sweep

CI = [
    "dp4-z2",                  # ZeRO-2: microbatch 2's bucket filling beside microbatch 1's in flight
    "dp2-tp2-sp-z2",           # ZeRO-2 under SP: deferred norm gradients are static until the TP sum
    "dp4-hs2-z3-bf16",         # hybrid-sharded ZeRO-3
    "dp4-tp2-sp-pp2-z3",       # ZeRO-3 over tp×pp: first backward with nothing in flight; the head's loss
    "dp4-tp2-sp-pp2-z3-full",
    "pp2-int-z2",              # ZeRO-2 per chunk under interleaving
    "pp2-dualpipev-hs1-z2",    # ZeRO-2 buckets filling from B to W
    "cp2-ulysses-hs1-z3",
    "moe-ep2-tp2-sp-z1-bf16-full",
    "pp2-zb-tp2-sp",
    "pp2-zb-z3-bf16",          # split backward: vector buckets launch at B, matrix buckets in their own queue at W
    "moe-ep2-cp2-hs1-z3-full",  # the fp32 expert loop: unbind's backward, no zero-filled gradient per expert
    "pp2-dualpipev-z1-bf16",   # dualpipev's turn: chunk inputs and handed-over outputs held from F to B, in bf16
    "moe-ep2-tp2-sp-z1-bf16-full-rl1",  # ... and the recomputed MoE block's repeated all-to-alls and SP collectives
    "deepseek-v3-2048-1f1b-m4",  # plan's top DeepSeek-V3 row: tp1 with 32 local experts, MLA, MTP on the last stage
]


def _check(report: dict) -> None:
    for r in report["ranks"]:
        where = (r["rank"], r["stage"], r["peak_phase"], r["top_live"])
        for key, tol in (("peak_bytes", 0.03), ("activation_bytes", 0.02)):
            m, p = r[key]["measured"], r[key]["planned"]
            assert abs(m - p) <= tol * p, (key, m, p, m / p, where)
        assert r["static_bytes"]["measured"] == r["static_bytes"]["planned"], (r["static_bytes"], where)
        assert all(v["measured"] == v["planned"] for v in r["comm_bytes"].values()), (r["comm_bytes"], where)
    assert report["passed"]


@pytest.mark.parametrize("name", CI)
def test_sweep_layout_within_bounds(name, shared_simulations):
    _check(sweep.simulate(sweep.LAYOUTS[name], sweep.ranks_of(name)))


def test_layouts_cover_every_pairing():
    """The sweep crosses every pairing the planner models: every ZeRO stage, hybrid sharding, tp with and without SP,
    every schedule, ring and Ulysses, ep, every recompute mode (and --recompute-layers), fp32 and bf16, in at most
    16 ranks; and full-size plans, each with the ranks it runs."""
    runs = list(sweep.LAYOUTS.values())
    ps = [c.parallel for c in runs]
    assert {1, 2, 3} <= {p.zero for p in ps}
    assert {"interleaved", "zb", "dualpipev"} <= {p.schedule for p in ps if p.pp > 1}
    assert {"selective", "full"} <= {p.recompute for p in ps}
    assert any(p.sequence_parallel for p in ps) and any(p.cp_impl == "ulysses" for p in ps)
    assert any(p.ep == 2 for p in ps) and any(c.dtype == "bf16" for c in runs)
    assert any(p.hsdp and p.zero == 2 for p in ps) and any(p.hsdp and p.zero == 3 for p in ps)
    assert any(p.tp == 2 and not p.sequence_parallel for p in ps)
    assert any(p.cp == 2 and p.cp_impl == "ring" for p in ps)
    assert any(p.recompute_layers for p in ps if p.recompute == "full") and \
        any(p.recompute_layers for p in ps if p.recompute == "selective")
    assert all(c.parallel.world_size <= 16 for c in sweep.LAYOUTS.values() if c.model not in ("deepseek-v3",
                                                                                              "qwen3-235b-a22b",
                                                                                              "llama3-70b",
                                                                                              "gpt-oss-120b"))
    assert set(sweep.RANKS) <= set(sweep.LAYOUTS) and {"deepseek-v3", "qwen3-235b-a22b"} <= {
        sweep.LAYOUTS[name].model for name in sweep.RANKS}


def test_a_broken_zero2_term_fails(monkeypatch, shared_simulations):
    """ZeRO-2 with the earlier microbatch's buckets left out of the backward (as the planner had it): the
    traced peak is 1.29 of planned and the bounds fail. (The trace is the within-bounds test's: only the planner
    is patched.)"""
    walk = peak.zero2_bucket_moments
    monkeypatch.setattr(peak, "zero2_bucket_moments",
                        lambda spec, stage, lay, wl, per, again, before: walk(spec, stage, lay, wl, per, False, 0))
    report = sweep.simulate(sweep.LAYOUTS["dp4-z2"])
    assert not report["passed"]
    r = report["ranks"][0]["peak_bytes"]
    assert r["measured"] > 1.2 * r["planned"]


def test_static_needs_the_deferred_gradients(monkeypatch):
    """Under ZeRO-2 with SP the norms' whole gradients live from backward to the TP sum (the planner's static):
    leaving them out of the measured static (as simulate had it: 0.999) breaks the exact match."""
    from shardwise.simulate import world

    monkeypatch.setattr(world, "deferred_grad_bytes", lambda trainer: 0)
    report = sweep.simulate(sweep.LAYOUTS["dp2-tp2-sp-z2"])
    r = report["ranks"][0]["static_bytes"]
    assert r["planned"] - r["measured"] == 4 * 96 * (2 * 8 + 1)  # tiny's 17 norms, fp32


def test_partial_recompute_within_bounds_and_needs_the_freed_plain_layers(monkeypatch):
    """--recompute-layers 1 of 4 (pp2 bf16 full) within every bound. The recomputed layer is rebuilt in backward
    after the chunk's other layers freed that microbatch's saved tensors; leaving those out (the rebuilt layer on
    top of every held activation, as when every layer is recomputed) plans stage 0 about 8% above the same
    trace, outside the bound."""
    import copy

    from shardwise.planner import activations
    from shardwise.training.assemble import assemble
    from shardwise.simulate.predict import planned

    report = sweep.simulate(sweep.LAYOUTS["pp2-1f1b-bf16-full-rl1"])
    _check(report)
    monkeypatch.setattr(activations, "_plain_chunk_bytes", lambda *args: 0.0)
    measured = report["ranks"][0]["peak_bytes"]["measured"]
    broken = planned(assemble(copy.deepcopy(sweep.LAYOUTS["pp2-1f1b-bf16-full-rl1"])), 0)["peak_bytes"]
    assert measured < 0.95 * broken, (measured, broken)


def _planned_peak(layout, stage: int) -> float:
    """The planner's peak of `layout` (a sweep layout's name, or the layout) at pipeline stage `stage`."""
    import copy

    from shardwise.training.assemble import assemble
    from shardwise.simulate.predict import planned

    layout = sweep.LAYOUTS[layout] if isinstance(layout, str) else layout
    return planned(assemble(copy.deepcopy(layout)), stage)["peak_bytes"]


def test_full_recompute_pipeline_terms_are_needed(monkeypatch):
    """bf16 full recompute on 8 stages (1F1B): within every bound on stages 1 and 6, and each derived term is needed —
    the rebuilt layer's weight casts through its MLP's backward (without them both stages trace ~4.5% above the
    plan), and the received chunk inputs counted once, as the first layer's checkpoint saves them (counted again
    among the boundary tensors, stage 1 plans 7 of them too many: ~5% above its trace)."""
    name = "pp8-1f1b-bf16-full"
    report = sweep.simulate(sweep.LAYOUTS[name], sweep.ranks_of(name))
    _check(report)
    traced = {r["stage"]: r["peak_bytes"]["measured"] for r in report["ranks"]}
    with monkeypatch.context() as m:
        m.setattr(peak, "rebuilt_weight_copies", lambda *a, **k: 0.0)
        assert all(traced[s] > 1.03 * _planned_peak(name, s) for s in (1, 6))
    walk = peak.boundary_buffers
    monkeypatch.setattr(peak, "boundary_buffers", lambda *a: walk(*a[:-1], False))
    assert traced[1] < 0.97 * _planned_peak(name, 1)


def test_the_lm_heads_copy_is_gone_by_a_layers_backward(monkeypatch, shared_simulations):
    """Llama 70B interleaved ZeRO-3, bf16 full recompute, the last stage (its peak a layer's backward): keeping the LM
    head's bf16 weight copy there (262.7 MB, as the planner did on every schedule but 1F1B) plans it above its trace
    by more than the bound: the trace is 0.958 of that plan at 8k tokens, 0.947 at the 4k tokens run here
    (test_simulate checks this run's every bound; `shared_simulations`: one simulation for both)."""
    name = "llama3-70b-int-z3-full-s8192"
    layout = replace(sweep.LAYOUTS[name], seq_len=4096)
    report = sweep.simulate(layout, sweep.ranks_of(name))
    _check(report)
    traced = report["ranks"][0]["peak_bytes"]["measured"]
    monkeypatch.setattr(peak, "head_copy_bytes", lambda *a: 0.0)
    assert traced < 0.97 * _planned_peak(layout, 3)
