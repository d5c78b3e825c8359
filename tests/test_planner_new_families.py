"""The planner's terms for Gated DeltaNet layers (Qwen3-Next / Qwen3.5) and gpt-oss's sliding-window rings against
the runtime: `shardwise simulate` (the real trainer, comm layer and ledger on fake tensors, in this process) on a
small hybrid — static bytes equal, saved activations within 2%, the live peak within 3%, every comm byte equal
(TP's partial norm gradients, CP's state-map and halo gathers) — and the ring's step count equal to the runtime's;
the Gated DeltaNet mixer's saved bytes, term by term, equal to what autograd's saved-tensor hooks see."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.planner import gpt_oss, linear_attention
from shardwise.simulate import sweep

HYBRID = dict(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, attn_output_gate=True,
              partial_rotary=0.5, linear_layers=(0, 1, 2), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
              linear_v_dim=8)


def _hybrid(dtype="fp32", **parallel) -> TrainConfig:
    p = ParallelConfig(**parallel)
    return TrainConfig(model="tiny", parallel=p, steps=2, seq_len=128, micro_batch=2, global_batch=4 * p.dp,
                       dtype=dtype, model_overrides=dict(HYBRID))


def _check(report, activations=0.02, peak=0.03):
    for r in report["ranks"]:
        assert r["static_bytes"]["measured"] == r["static_bytes"]["planned"], r["static_bytes"]
        assert all(v["measured"] == v["planned"] for v in r["comm_bytes"].values()), r["comm_bytes"]
        for key, tol in (("activation_bytes", activations), ("peak_bytes", peak)):
            m, p = r[key]["measured"], r[key]["planned"]
            assert abs(m - p) <= tol * p, (key, m, p, m / p)


@pytest.mark.parametrize("name, layout", [("fp32", _hybrid()), ("bf16-tp2", _hybrid("bf16", tp=2)),
                                          ("fp32-full", _hybrid(recompute="full"))])
def test_hybrid_within_bounds(name, layout):
    """One device; tp 2 without SP (the six projections as one column region, the gated norm's partial gradient
    summed once per step in place of the attention layer's q/k norms; SP: the full-size layout below); full
    recompute, whose rebuilt layer is a Gated DeltaNet one."""
    _check(sweep.simulate(layout))


def _comm_differs(layout, report) -> bool:
    """Whether the planner's comm bytes (as now patched) differ from the ledger's in `report`."""
    from shardwise.training.assemble import assemble
    from shardwise.simulate.predict import planned

    measured = {a: v["measured"] for a, v in report["ranks"][0]["comm_bytes"].items()}
    return planned(assemble(copy.deepcopy(layout)), 0)["comm_bytes"] != measured


def test_hybrid_cp_comm_equals_the_ledger(monkeypatch):
    """cp 2 (balanced) under full recompute: the linear layers' map and halo gathers (repeated by the recompute)
    and their reduce-scatters, beside the gated-attention layer's ring. Without the linear layers' term the planner
    misses them. Activations within bounds too (chunks of 32 tokens: shorter than one rule chunk)."""
    layout = _hybrid(cp=2, recompute="full")
    report = sweep.simulate(layout)
    _check(report)
    monkeypatch.setattr(linear_attention, "cp_comm", lambda *a: None)
    assert _comm_differs(layout, report)


def test_ring_hops_follow_the_runtimes_step_list():
    """The planner's ring hops come from `partition.ring_step_list`, the list the runtime's loops run: a sliding
    layer on the balanced cp 4 ring with a window within a chunk makes 2 hops (steps 1 and 3), not 3."""
    from shardwise.planner.layout import Layout
    from shardwise.planner.models import ModelSpec

    spec = ModelSpec.of(ModelConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                    max_seq_len=128, sliding_window=4, sliding_layers=(0,)))
    wl = type("Workload", (), {"seq_len": 64})()
    hops = {order: gpt_oss.ring_hops(spec, Layout(cp=4, cp_order=order), wl, [0, 1], 2)
            for order in ("balanced", "contiguous")}
    assert hops == {"balanced": 2 + 3, "contiguous": 1 + 3}, hops


@pytest.mark.parametrize("name, ranks", [("qwen3-next-80b-cp2-tp2-sp-pp4-ep2-z1-bf16", "0"),
                                         ("qwen3.5-35b-a3b-dp2-cp2-tp2-sp-pp2-ep4-z1-bf16", "0"),
                                         ("gpt-oss-20b-cp4c-tp2-sp-pp2-ep4-z1-bf16", "stages")])
def test_full_size_layout_within_bounds(name, ranks):
    """One full-size layout of each family from the sweep (shortened steps): Qwen3-Next's first stage (nine Gated
    DeltaNet layers, three gated-attention ones, 256 of 512 experts per rank), Qwen3.5-35B-A3B's first stage (the
    embedding, fifteen Gated DeltaNet layers and five gated-attention ones, 64 of 256 experts per rank, dp beside
    cp) and both gpt-oss-20b stages. Every term derived: held to 0.2% (counting the Gated DeltaNet layers' casts as
    attention's was 1.2% off on Qwen3.5, 0.4% on Qwen3-Next)."""
    _check(sweep.simulate(sweep.LAYOUTS[name], ranks), activations=0.002, peak=0.002)


@pytest.mark.parametrize("order", ["contiguous", "balanced"])
def test_windowed_ring_comm_equals_the_ledger(monkeypatch, order):
    """The hybrid with gpt-oss's attention (sinks, biases, a 16-token window on its attention layer) on a cp 4 ring:
    the window stops the contiguous ring after one step, and the balanced one (16-token chunks) runs steps 1 and 3
    only; the linear layers gather one chunk's maps per rank, and the planner counts the ledger's bytes; counting
    every ring step instead fails. Activations within bounds (cp chunks of 16 and 32 tokens)."""
    from shardwise.rules.partition import ring_step_list

    assert ring_step_list(4, order, 32, 16) == ([0, 1] if order == "contiguous" else [0, 1, 3])
    layout = TrainConfig(model="tiny", parallel=ParallelConfig(cp=4, cp_order=order), steps=2, seq_len=128,
                         micro_batch=2, global_batch=4, dtype="fp32",
                         model_overrides=dict(HYBRID, attention_sinks=True, attention_bias=True,
                                              attention_out_bias=True, sliding_window=16, sliding_layers=(3,)))
    report = sweep.simulate(copy.deepcopy(layout))
    _check(report)
    monkeypatch.setattr(gpt_oss, "ring_step_list", lambda cp, *a: list(range(cp)))  # every step, window ignored
    assert _comm_differs(layout, report)


def test_hybrid_flops_equal_the_runtimes_matmuls():
    """The planner's forward FLOPs of a hybrid (three Gated DeltaNet layers, one gated-attention layer with its
    gate rows in wq) against torch's FlopCounterMode on the model's forward: every projection, the conv, every chunk
    matmul, the MLPs and the LM head, exactly. The counter has no formula for the triangular solves (C·(d_k + d_v) per
    value head and token, taken out) nor for CPU SDPA (the attention cores, left out)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.config import ModelConfig
    from shardwise.models.llama import Transformer
    from shardwise.planner.estimate import layer_flops_per_token, linear_layer_delta
    from shardwise.planner.models import ModelSpec
    from shardwise.rules.flops import linear_flops_per_token

    cfg = ModelConfig(vocab_size=101, dim=32, ffn_dim=48, max_seq_len=128, **HYBRID)
    model = Transformer(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    s = 2 * linear_attention.CHUNK
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (1, s)))
    spec = ModelSpec.of(cfg)
    matmul, _ = layer_flops_per_token(spec, False, s)
    d_matmul, _ = linear_layer_delta(spec, s)
    _, core = linear_flops_per_token(spec, s)
    solves = cfg.linear_v_heads * linear_attention.CHUNK * (cfg.linear_k_dim + cfg.linear_v_dim)
    linear = len(cfg.linear_layers)
    expected = s * (cfg.n_layers * matmul + linear * (d_matmul + core - solves) + 2 * cfg.dim * cfg.vocab_size)
    assert counter.get_total_flops() == expected


def _mixer_saved(shape, dtype, cp=1, rank=0, order="balanced"):
    """(bytes of the distinct storages a `GatedDeltaNet` mixer's forward saves for backward, its config): b
    sequences of s tokens (this rank's, under cp), nk/nv heads of d_k/d_v. Parameters, the input (the region input
    the block counts) and the linears' bf16 weight copies (autocast_weight_bytes) are left out. Under cp the layer
    runs this rank's chunks of `context_parallel/linear_attention.py` with the gathers standing in by
    concatenation (a gather saves nothing; its output is what the composition saves)."""
    import types

    import torch

    from shardwise.context_parallel import linear_attention as cp_rule
    from shardwise.models.gated_deltanet import GatedDeltaNet

    b, s, nk, nv, dk, dv = shape
    cfg = ModelConfig(vocab_size=101, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=512,
                      linear_layers=(0,), linear_k_heads=nk, linear_v_heads=nv, linear_k_dim=dk, linear_v_dim=dv)
    layer = GatedDeltaNet(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    if cp > 1:
        axis = types.SimpleNamespace(rank=rank, size=cp)
        layer.ctx = types.SimpleNamespace(cp=types.SimpleNamespace(
            linear_conv=lambda x, w, doc_ids=None: cp_rule.conv_halo(x, w, axis, order),
            delta_rule=lambda q, k, v, g, beta, doc_ids=None: cp_rule.delta_rule(q, k, v, g, beta, axis, order)))
    act = torch.bfloat16 if dtype == "bf16" else torch.float32
    x = (torch.randn(b, s, cfg.dim, requires_grad=True) * 1).to(act)
    skip = {p.untyped_storage()._cdata for p in layer.parameters()} | {x.untyped_storage()._cdata}
    seen, held = {}, []

    def pack(t):
        st = t.untyped_storage()
        weight_copy = t.dtype == torch.bfloat16 and type(t.grad_fn).__name__ == "TBackward0"
        if st._cdata not in skip and st.nbytes() and not weight_copy:
            seen[st.data_ptr()] = st.nbytes()
        held.append(t)  # alive until counted: no address reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            layer(x)
    return sum(seen.values()), cfg


MIXERS = [(1, 192, 2, 4, 8, 16), (2, 150, 2, 4, 8, 16), (1, 40, 2, 2, 16, 8), (2, 64, 1, 1, 8, 8), (2, 128, 1, 2, 8, 8)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mixer_terms_equal_the_saved_tensors(monkeypatch, dtype):
    """Every term of `linear_attention.mixer_terms` / `cp_mixer_terms` is a storage autograd keeps: their sum equals
    the saved-tensor hooks' bytes exactly, on one device (whole chunks, padded tails, one chunk, one head; a tp
    rank's layer is one with its heads: tp 2 of twice the heads; one key head serving two value heads), and on
    every rank of cp 2 and 4 in both orders (one and two rule chunks per cp chunk, a padded one, nk = 1 with
    nv = 2). Under bf16 autocast the chunk rule still saves fp32 tensors only; the conv kernels' first bf16 copy
    is autocast_weight_bytes'."""
    import torch

    from shardwise import comm
    from shardwise.planner.models import ModelSpec

    e = 4 if dtype == "fp32" else 2

    def kernel(cfg) -> int:
        """The conv kernels' one bf16 copy, which autocast_weight_bytes counts."""
        return 0 if e == 4 else e * cfg.linear_conv_kernel * (
            2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim)

    for shape in MIXERS:
        got, cfg = _mixer_saved(shape, dtype)
        wide = ModelSpec.of(dataclasses.replace(cfg, linear_k_heads=2 * cfg.linear_k_heads,
                                                linear_v_heads=2 * cfg.linear_v_heads))
        planned = [linear_attention.mixer_activation_bytes(ModelSpec.of(cfg), shape[0], shape[1], 1, e),
                   linear_attention.mixer_activation_bytes(wide, shape[0], shape[1], 2, e)]
        assert [got - kernel(cfg)] * 2 == planned, (shape, got, planned)
    monkeypatch.setattr(comm, "gather_from_sequence", lambda x, axis, dim: torch.cat([x] * axis.size, dim))
    for shape, cp, order in [((1, 128, 2, 4, 8, 16), 2, "contiguous"), ((1, 128, 2, 4, 8, 16), 2, "balanced"),
                             ((2, 200, 2, 4, 8, 8), 4, "contiguous"), ((2, 200, 2, 4, 8, 8), 4, "balanced"),
                             ((2, 256, 1, 2, 8, 8), 2, "balanced")]:
        for rank in range(cp):
            got, cfg = _mixer_saved(shape, dtype, cp, rank, order)
            planned = linear_attention.cp_mixer_terms(ModelSpec.of(cfg), shape[0], shape[1], 1, e, cp, order, rank)
            assert got - kernel(cfg) == sum(planned.values()), (shape, cp, order, rank, got, sum(planned.values()))
