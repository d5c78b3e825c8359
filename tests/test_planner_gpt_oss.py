"""gpt-oss in the planner against the runtime: the full-size gpt-oss-120b layout `plan` recommends, traced by
`shardwise simulate` (static and comm bytes equal, activations within 2%, the live peak within 3%), and the attention
core's FLOPs of sliding-window layers — one device and Ulysses in bands, the ring over the steps and block pairs some
window reaches — against torch's FlopCounterMode on the runtime's own attention functions."""
from __future__ import annotations

import copy

import pytest

from shardwise.planner import comm_model
from shardwise.simulate import sweep

OSS120 = "gpt-oss-120b-64-cp8-pp2-ep32-z1-bf16-sel"


def _check(report):
    for r in report["ranks"]:
        assert r["static_bytes"]["measured"] == r["static_bytes"]["planned"], r["static_bytes"]
        assert all(v["measured"] == v["planned"] for v in r["comm_bytes"].values()), r["comm_bytes"]
        for key, tol in (("activation_bytes", 0.02), ("peak_bytes", 0.03)):
            m, p = r[key]["measured"], r[key]["planned"]
            assert abs(m - p) <= tol * p, (key, m, p, m / p)


def test_gpt_oss_120b_full_size_within_bounds(monkeypatch):
    """gpt-oss-120b on 64 GPUs (dp4 pp2 cp8 ep32, selective recompute, bf16, ZeRO-1: a row of `plan --gpus 64
    --global-batch 256`), its first stage over the full step's 64 microbatches (simulate runs 3 and scales the rest):
    18 layers, 4 of 128 experts per rank, a balanced cp 8 ring whose nine sliding layers run steps 0, 1 and 7 only —
    in the forward, the backward and the selective recompute's forward again. Counting the recomputed sliding layers'
    ring at all c − 1 hops (as the planner did) or not at all makes the cp bytes differ from the ledger."""
    from shardwise.training.assemble import assemble
    from shardwise.simulate.predict import planned

    layout = sweep.LAYOUTS[OSS120]
    report = sweep.simulate(layout, "0")
    _check(report)
    measured = {a: v["measured"] for a, v in report["ranks"][0]["comm_bytes"].items()}
    cfg = assemble(copy.deepcopy(layout))
    assert planned(cfg, 0)["comm_bytes"] == measured
    monkeypatch.setattr(comm_model, "recomputed_layer_ids", lambda spec, lay: set())  # recomputed rings left out
    assert planned(cfg, 0)["comm_bytes"]["cp"] != measured["cp"]


def _math_kernels(monkeypatch):
    """Every attention block on the fp32 math path (explicit matmuls FlopCounterMode counts; it has no formula for
    CPU flash): the same block pairs and bands, counted."""
    from shardwise.context_parallel import kernels

    pick = kernels.pick
    monkeypatch.setattr(kernels, "pick", lambda site, q, v, backend="auto", mask="causal", entry="raw":
                        pick(site, q, v, "math", mask, entry))


def _oss_config(window: int):
    from shardwise.config import ModelConfig

    return ModelConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                       max_seq_len=128, attention_sinks=True, attention_bias=True, attention_out_bias=True,
                       sliding_window=window, sliding_layers=(0,))


WINDOWS = [4, 12, 32, 64]
"""At s = 64: bands of 4 and of 12 (a short last band), one masked call (s ≤ 2W), a window as long as the sequence."""


def test_windowed_core_flops_equal_the_one_device_model(monkeypatch):
    """A gpt-oss-shaped model (sinks, biases, layer 0 sliding, layer 1 full) on one device: FlopCounterMode over its
    forward equals the planner's count — every projection and the LM head, a full layer's core at s keys per query,
    the sliding layer's core at `work_share` of it (its bands' scores) — for windows that band, one that does not,
    and windows as long as the sequence, where the sliding layer costs exactly a full one. Counting the sliding
    layer at min(W, s) keys per query (the model-FLOPs convention) instead differs for every banded window."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.parallelize import plain_model
    from shardwise.rules.partition import local_scores
    from shardwise.planner import gpt_oss
    from shardwise.planner.estimate import layer_flops_per_token
    from shardwise.planner.layout import Layout
    from shardwise.planner.models import ModelSpec
    from shardwise.rules.flops import window_share

    _math_kernels(monkeypatch)
    b, s = 2, 64
    for window in WINDOWS:
        cfg = _oss_config(window)
        model = plain_model(cfg)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.1)
        with FlopCounterMode(display=False) as counter:
            model(torch.randint(0, cfg.vocab_size, (b, s)))
        spec = ModelSpec.of(cfg)
        matmul, core = layer_flops_per_token(spec, False, s)
        shares = [gpt_oss.work_share(spec, i, Layout(), s) for i in range(cfg.n_layers)]
        assert shares[0] == local_scores(s, window) / s ** 2 and shares[1] == 1.0
        expected = b * s * (cfg.n_layers * matmul + core * sum(shares) + 2 * cfg.dim * cfg.vocab_size)
        assert counter.get_total_flops() == expected, (window, counter.get_total_flops(), expected)
        if window >= s:
            assert shares[0] == 1.0  # the full-causal count: one s × s call
        if window < s // 2:  # banded: fewer scores than s², more than s·min(W, s)
            model_share = window_share(spec, 0, s)
            assert model_share < shares[0] < 1.0 and b * s * core * (shares[0] - model_share) > 0


def _ring_forward_flops(monkeypatch, rank, cp, order, window, b=1, hq=4, hkv=2, d=8, s_local=16):
    """FlopCounterMode over one cp rank's ring attention forward, its p2p stubbed out (the blocks' values do not
    change what is computed; the block pairs and steps are the runtime's own)."""
    import types

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise import comm
    from shardwise.context_parallel import ring_attention

    monkeypatch.setattr(comm, "p2p", lambda ops, tag=None: [])
    monkeypatch.setattr(comm, "wait_all", lambda works, axis, op: None)
    axis = types.SimpleNamespace(rank=rank, size=cp, active=True)
    q = torch.randn(b, hq, s_local, d)
    k, v = torch.randn(b, hkv, s_local, d), torch.randn(b, hkv, s_local, d)
    with FlopCounterMode(display=False) as counter:
        ring_attention(q, k, v, axis, True, order, sinks=torch.zeros(hq), window=window)
    return counter.get_total_flops()


def test_windowed_ring_and_ulysses_core_flops_equal_the_runtime(monkeypatch):
    """Every rank of a cp 4 ring (chunks of 16 tokens; 8 in the balanced order), both orders, a window within a chunk,
    one across chunks, and none: the forward's FlopCounterMode count equals `partition.ring_scores` (the steps
    `ring_step_list` keeps, the block pairs some window reaches, each pair's call whole), and the planner's per-rank
    core (its busiest rank) their largest. Counting every step's pairs (the window ignored) differs, but for the
    balanced ring under a 20-token window, which reaches every pair. Ulysses: each rank runs the one-device bands
    over its heads."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.config import ModelConfig
    from shardwise.context_parallel.local import local_attention
    from shardwise.rules.partition import local_scores, ring_scores
    from shardwise.planner import gpt_oss
    from shardwise.planner.estimate import layer_flops_per_token
    from shardwise.planner.layout import Layout
    from shardwise.planner.models import ModelSpec

    _math_kernels(monkeypatch)
    cp, s_local, b, hq, d = 4, 16, 1, 4, 8
    s = cp * s_local
    per_score = 2 * b * hq * 2 * d  # QKᵀ and PV, per query-key pair
    for order in ("balanced", "contiguous"):
        for window in (5, 20, 0):
            counted = [_ring_forward_flops(monkeypatch, r, cp, order, window) for r in range(cp)]
            assert counted == [per_score * n for n in ring_scores(cp, order, s_local, window)], \
                (order, window, counted)
            if not window:
                continue
            spec = ModelSpec.of(ModelConfig(vocab_size=101, dim=32, n_layers=1, n_heads=hq, n_kv_heads=2, head_dim=d,
                                            ffn_dim=48, max_seq_len=128, sliding_window=window, sliding_layers=(0,)))
            _, core = layer_flops_per_token(spec, False, s)
            planned = b * s_local * core * gpt_oss.work_share(spec, 0, Layout(cp=cp, cp_order=order), s)
            assert planned == max(counted), (order, window, planned, counted)
            unwindowed = [per_score * n for n in ring_scores(cp, order, s_local, 0)]
            assert (counted != unwindowed) == (window == 5 or order == "contiguous")  # balanced W 20: every pair
    for window in (5, 20):  # Ulysses cp 2: the whole sequence, half the heads
        spec = ModelSpec.of(ModelConfig(vocab_size=101, dim=32, n_layers=1, n_heads=hq, n_kv_heads=2, head_dim=d,
                                        ffn_dim=48, max_seq_len=128, sliding_window=window, sliding_layers=(0,)))
        q, k, v = torch.randn(b, hq // 2, s, d), torch.randn(b, 1, s, d), torch.randn(b, 1, s, d)
        with FlopCounterMode(display=False) as counter:
            local_attention(q, k, v, sinks=torch.zeros(hq // 2), window=window)
        _, core = layer_flops_per_token(spec, False, s)
        lay = Layout(cp=2, cp_impl="ulysses")
        assert counter.get_total_flops() == b * (s // 2) * core * gpt_oss.work_share(spec, 0, lay, s) \
            == per_score // 2 * local_scores(s, window)


@pytest.mark.parametrize("cp, impl, order", [(1, "ring", "balanced"), (4, "ring", "contiguous"),
                                             (8, "ring", "balanced"), (4, "ulysses", "balanced")])
def test_step_time_counts_the_kernels_work(monkeypatch, cp, impl, order):
    """`estimate`'s compute time takes each sliding layer's core at `work_share` (fwd + bwd + the selective replay:
    4 forwards of it), so against counting them as full layers it saves exactly tokens × 4 × core × Σ(1 − share)
    per microbatch at the FLOP rate; the model FLOPs (MFU's numerator) are the same either way. gpt-oss-20b at
    s = 4096, one device, rings of cp 4 and 8, Ulysses."""
    from shardwise.config import MODEL_PRESETS
    from shardwise.planner import Assumptions, Cluster, Layout, Workload, estimate, get_gpu, gpt_oss
    from shardwise.planner.estimate import layer_flops_per_token, peak_flops
    from shardwise.planner.models import ModelSpec

    spec = ModelSpec.of(MODEL_PRESETS["gpt-oss-20b"])
    lay = Layout(cp=cp, cp_impl=impl, cp_order=order, zero=1, recompute="selective", mb=1, m=2)
    wl, cluster = Workload(seq_len=4096, global_batch=2), Cluster(get_gpu("h100-80gb"), cp, 8)
    saved = sum(1 - gpt_oss.work_share(spec, i, lay, wl.seq_len) for i in spec.sliding_layers)
    got = estimate(spec, cluster, lay, wl)
    monkeypatch.setattr(gpt_oss, "work_share", lambda *a: 1.0)
    full = estimate(spec, cluster, lay, wl)
    _, core = layer_flops_per_token(spec, True, wl.seq_len)
    rate = peak_flops(cluster, wl) * Assumptions().flops_efficiency
    assert 0 < saved < len(spec.sliding_layers)
    assert full["compute_time_s"] - got["compute_time_s"] == pytest.approx(
        lay.m * wl.seq_len // cp * 4 * core * saved / rate, rel=1e-9)
    assert full["model_flops_per_step"] == got["model_flops_per_step"]
