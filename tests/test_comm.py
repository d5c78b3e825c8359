"""The comm ledger counts exactly what the analytic model says one TP layer and one step move."""
import torch

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.models.llama import rope_tables
from shardwise.parallelize import build_model
from shardwise.training.trainer import Trainer

from _dist import fresh_seed, make_mesh, run_ranks

CFG = ModelConfig(name="t", vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=64, max_seq_len=64)


def _layer_ledger(seed, sp):
    mesh = make_mesh(tp=4)
    tp = mesh["tp"]
    model = build_model(CFG, mesh, seed, ParallelConfig(tp=mesh["tp"].size, sequence_parallel=sp))
    block = model.layers["0"]
    b, s = 2, 16
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s // tp.size if sp else s, CFG.dim, generator=g, requires_grad=True)
    cos, sin = rope_tables(CFG.head_dim, s, CFG.rope_theta, "cpu")
    mesh.ledger.reset()
    block(x, cos, sin).sum().backward()
    return mesh.ledger.snapshot()


def _step_ledger(seed, zero):
    mesh = make_mesh(dp=2, tp=2)
    cfg = TrainConfig(model=CFG, parallel=ParallelConfig(dp=2, tp=2, zero=zero), steps=1, seq_len=16,
                      micro_batch=2, global_batch=8, seed=seed)
    trainer = Trainer(cfg, mesh)
    mesh.ledger.reset()
    trainer.train_step(0)
    local_numel = sum(p.numel() for p in trainer.model.parameters())
    return mesh.ledger.steps[-1]["axes"], local_numel


def test_tp_layer_bytes_match_analytic():
    seed = fresh_seed()
    b, s, h, t, e = 2, 16, CFG.dim, 4, 4
    full = b * s * h * e
    plain = run_ranks(4, _layer_ledger, seed, False)[0]["tp"]
    assert plain == {"all_reduce": {"count": 4, "bytes": 4 * full, "wire_bytes": round(4 * 2 * (t - 1) / t * full)}}
    sp = run_ranks(4, _layer_ledger, seed, True)[0]["tp"]
    assert sp["all_gather"] == {"count": 4, "bytes": 4 * full // t, "wire_bytes": 4 * (t - 1) * full // t}
    assert sp["reduce_scatter"] == {"count": 4, "bytes": 4 * full, "wire_bytes": 4 * (t - 1) * full // t}
    # Sequence parallelism moves the same volume on the wire as the all-reduces it replaces.
    assert sp["all_gather"]["wire_bytes"] + sp["reduce_scatter"]["wire_bytes"] == plain["all_reduce"]["wire_bytes"]


def test_train_step_bytes_match_analytic():
    seed = fresh_seed()
    b, s, h, L, m = 2, 16, CFG.dim, CFG.n_layers, 2  # micro-batch, seq, dim, layers, microbatches per dp rank
    for zero in (0, 1):
        axes, numel = run_ranks(4, _step_ledger, seed, zero)[0]
        tp = axes["tp"]
        act = b * s * h * 4
        # per microbatch: embedding + 2/layer fwd + 2/layer bwd + LM-head bwd all-reduces, CE max and stats
        assert tp["all_reduce"]["count"] == m * (4 * L + 2 + 2)
        assert tp["all_reduce"]["bytes"] == m * ((4 * L + 2) * act + b * s * 4 + b * s * 2 * 4)
        dp = axes["dp_cp"]
        if zero == 0:
            assert dp["all_reduce"]["bytes"] == numel * 4
        else:
            # two flat groups (decay / no decay), each padded to a multiple of dp=2 elements
            assert 0 <= dp["reduce_scatter"]["bytes"] - numel * 4 <= 2 * 4
            assert dp["all_gather"]["bytes"] * 2 == dp["reduce_scatter"]["bytes"]
            assert "all_reduce" not in dp
        assert dp["all_reduce:metrics"]["count"] == 1
