"""Document masking (--attention-mask document) and --reset-positions.

Single device: a document packed after another gives the logits it gives alone (fp32, 1e-5). Every
axis: `verify_main` against the single-device model on windows that hold several short documents
(tp2+SP, pp2 1f1b with full recompute, cp2 ring with selective recompute, cp2 Ulysses, dp2×ep2 MoE),
plus ring attention's masked block pairs (fused and math kernels) against masked SDPA, forward and
backward — all in one 2-rank fork.
"""
import dataclasses
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.testing import assert_close

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.context_parallel import ring_attention, shard_sequence
from shardwise.context_parallel.ring_attention import block_plan, document_plan
from shardwise.mesh import Mesh
from shardwise.models.documents import document_ids, document_mask, document_positions
from shardwise.parallelize import build_model

from _dist import fresh_seed, make_mesh, run_ranks

EOS = 256
DENSE = ModelConfig(name="doc", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128)
MOE = dataclasses.replace(DENSE, name="doc-moe", moe_experts=4, moe_topk=2, moe_every=2, moe_ffn_dim=64)


def packed_stream(seed: int, n_tokens: int = 2048, longest: int = 40) -> torch.Tensor:
    """Documents of 2..`longest` tokens (mostly short), each closed by EOS: windows hold several."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while sum(map(len, out)) < n_tokens:
        n = int(torch.randint(1, longest if torch.rand(1, generator=g) < 0.3 else 12, (1,), generator=g))
        out.append(torch.cat([torch.randint(0, EOS, (n,), generator=g), torch.tensor([EOS])]))
    return torch.cat(out)


# ---------------------------------------------------------------- no processes
def test_ids_positions_and_mask():
    x = torch.tensor([[5, EOS, 7, 8, EOS, EOS, 9], [1, 2, 3, 4, 5, 6, EOS]])
    doc = document_ids(x, EOS)
    assert doc.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 0, 0, 0, 0, 0, 0]]  # EOS closes its own document
    assert document_positions(doc).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]]
    m = document_mask(doc, doc)[:, 0]
    assert torch.equal(m[1], torch.ones(7, 7, dtype=torch.bool).tril())
    assert m[0, 4].tolist() == [False, False, True, True, True, False, False]


def test_ring_plan_skips_fully_masked_pairs():
    """cp=2 balanced, s=16: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (4 tokens each)."""
    doc = torch.tensor([[0] * 12 + [1] * 4] * 2)  # chunk 3 is a document of its own
    own, other = document_plan(0, 2, "balanced", True, 8, doc)
    assert other == []  # chunk 3 would see chunks 1 and 2 (causal plan), but shares no document with them
    (qs, ks, causal, make_mask), = own  # chunks 0 and 3: two documents → explicit mask, causal by position
    mask = make_mask()
    assert not causal and mask.shape == (2, 1, 8, 8) and mask[:, :, :4, 4:].sum() == 0
    own, other = document_plan(1, 2, "balanced", True, 8, doc)  # chunks 1, 2 and chunk 0: all document 0
    assert own == [(slice(0, 8), slice(0, 8), True, None)] and other == [(slice(0, 8), slice(0, 4), False, None)]
    doc[1, 9:] = 1  # row 1's chunk 2 now reaches into chunk 3's document: the pair is kept, masked
    _, other = document_plan(0, 2, "balanced", True, 8, doc)
    (qs, ks, causal, make_mask), = other
    mask = make_mask()
    assert mask[0].sum() == 0 and mask[1].sum() == 4 * 3  # row 1: chunk 3's 4 queries see tokens 9..11


def test_ring_plan_decisions_match_the_masks():
    """Every pair the causal plan keeps is dropped exactly when its document mask is empty, and left
    unmasked exactly when the mask equals the causal one."""
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        c, order = (2, 3, 4)[trial % 3], ("balanced", "contiguous")[trial % 2]
        s = 8 * c
        ends = torch.rand(3, s, generator=g) < (0.05, 0.2, 0.5)[trial % 3]
        doc = (ends.int().cumsum(1) - ends.int()).int()
        for r in range(c):
            pos_q = torch.arange(s).view(1, -1)
            for step, pairs in enumerate(document_plan(r, c, order, True, s // c, doc)):
                kv = (r - step) % c
                full = block_plan(r, kv, c, order, True, s // c)
                qd, kd = shard_sequence(doc, r, c, order), shard_sequence(doc, kv, c, order)
                qp, kp = shard_sequence(pos_q, r, c, order)[0], shard_sequence(pos_q, kv, c, order)[0]
                kept = {(p[0].start, p[1].start): p for p in pairs}
                for qs, ks, is_causal in full:
                    m = document_mask(qd[:, qs], kd[:, ks], qp[qs], kp[ks])
                    pair = kept.get((qs.start, ks.start))
                    assert (pair is not None) == bool(m.any()), (trial, r, step)
                    if pair is not None and pair[3] is None:
                        causal = document_mask(torch.zeros_like(qd[:, qs]), torch.zeros_like(kd[:, ks]),
                                               qp[qs], kp[ks])
                        assert torch.equal(m, causal), (trial, r, step)
                    elif pair is not None:
                        assert torch.equal(pair[3](), m)


def _logits_and_rotated_q(model, tokens, **side):
    """Logits and the first layer's rotated queries [b, h, s, d] (what RoPE's positions reach)."""
    seen = {}

    def look(module, args):
        seen["q"] = args[0]

    spy = model.layers["0"].attention.core.register_forward_pre_hook(look)
    try:
        with torch.no_grad():
            return model(tokens, **side), seen["q"]
    finally:
        spy.remove()


def test_packed_document_equals_it_alone():
    seed = fresh_seed()
    model = build_model(DENSE, Mesh.single(torch.device("cpu")), seed)
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, EOS, (2, 23), generator=g)
    first[:, -1] = EOS
    second = torch.randint(0, EOS, (2, 41), generator=g)
    packed = torch.cat([first, second], 1)
    doc = document_ids(packed, EOS)
    alone, q_alone = _logits_and_rotated_q(model, second)
    masked, q_masked = _logits_and_rotated_q(model, packed, doc_ids=doc)
    reset, q_reset = _logits_and_rotated_q(model, packed, doc_ids=doc, positions=document_positions(doc))
    causal, _ = _logits_and_rotated_q(model, packed)
    n = first.shape[1]
    # --reset-positions: the second document's positions (and so its rotated queries) and logits are its own.
    assert_close(q_reset[:, :, n:], q_alone, rtol=1e-5, atol=1e-5)
    assert_close(reset[:, n:], alone, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    # Without it the positions are offset by the first document's length: RoPE rotates the queries
    # differently, but scores depend only on position differences, so the logits agree all the same.
    assert (q_masked[:, :, n:] - q_alone).abs().max() > 0.1, seed
    assert_close(masked[:, n:], alone, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    # The mask matters: causal attention across the boundary changes the second document's logits,
    # and leaves the first document's unchanged.
    assert (causal[:, n:] - alone).abs().max() > 1e-2, seed
    assert_close(reset[:, :n], causal[:, :n], rtol=1e-5, atol=1e-5)


def test_bad_attention_mask_exits_2_with_one_line():
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--attention-mask", "foo"],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--attention-mask 'foo' is unknown; valid: causal, document" in lines[0], r.stderr


# ---------------------------------------------------------------- two ranks
def _ring_checks(seed):
    """cp=2 ring attention with a document mask against masked SDPA, forward and backward, for the
    fused kernel and the math fallback, both orders, GQA."""
    mesh = make_mesh(cp=2)
    cp = mesh["cp"]
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, s, d = 2, 4, 2, 32, 16
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv, hq))
    doc = document_ids(packed_stream(seed, 2 * s, longest=8)[:2 * s].view(b, s), EOS)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = document_mask(doc, doc)
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, enable_gqa=True)
    ref.backward(dout)
    worst = 0.0
    for order in ("balanced", "contiguous"):
        for backend in ("auto", "math"):
            mine = [shard_sequence(t, cp.rank, 2, order, dim=2).detach().requires_grad_() for t in (q, k, v)]
            out = ring_attention(*mine, cp, order=order, backend=backend, doc_ids=doc)
            out.backward(shard_sequence(dout, cp.rank, 2, order, dim=2))
            assert torch.isfinite(out).all()
            pairs = [(out, ref)] + [(m.grad, r.grad) for m, r in zip(mine, ref_in)]
            for a, r in pairs:
                expect = shard_sequence(r.detach(), cp.rank, 2, order, dim=2)
                worst = max(worst, float((a.detach() - expect).abs().max()))
                assert_close(a, expect, rtol=2e-5, atol=2e-5, msg=f"{order} {backend} seed {seed}")
    return worst


def _verify_layouts(seed, cfgs):
    from shardwise.verify.main import verify_main

    tokens = packed_stream(seed)
    out = [_ring_checks(seed)]
    for cfg in cfgs:
        cfg = cfg.resolved()
        out.append(verify_main(cfg, tokens=tokens))
    return out


LAYOUTS = {
    "tp2_sp": (dict(tp=2, sequence_parallel=True), {}),
    "pp2_1f1b_full_recompute": (dict(pp=2, schedule="1f1b", recompute="full"), dict(global_batch=4)),
    "cp2_ring_selective": (dict(cp=2, recompute="selective"), {}),
    "cp2_ulysses": (dict(cp=2, cp_impl="ulysses"), {}),
    "moe_dp2_ep2": (dict(dp=2, ep=2), dict(model=MOE)),
}


def test_verify_every_axis_with_document_mask():
    seed = fresh_seed()
    base = TrainConfig(model=DENSE, steps=2, seq_len=64, micro_batch=2, seed=seed, progress=False,
                       attention_mask="document", reset_positions=True)
    cfgs = [dataclasses.replace(base, parallel=ParallelConfig(**deg), **extra) for deg, extra in LAYOUTS.values()]
    ring_err, *results = run_ranks(2, _verify_layouts, seed, cfgs)[0]
    assert ring_err < 2e-5
    for name, r in zip(LAYOUTS, results):
        assert r["passed"], (name, seed, r)
        assert r["max_loss_abs_diff"] < 1e-5 and r["first_step_grad_rel_diff"] < 1e-5, (name, seed, r)


def test_document_plan_is_computed_once_per_doc_ids(monkeypatch):
    """Every layer's ring call (forward and backward) of one microbatch reuses one plan: the plan costs a
    host sync. A new doc_ids tensor, even with equal values, gets its own; the cache stays bounded."""
    import importlib

    ra = importlib.import_module("shardwise.context_parallel.ring_attention")  # the package exports the function

    calls = []
    real = ra._document_plan
    monkeypatch.setattr(ra, "_document_plan", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(ra, "_PLANS", {})
    doc = torch.tensor([[0] * 5 + [1] * 11])
    first = document_plan(0, 2, "balanced", True, 8, doc)
    assert document_plan(0, 2, "balanced", True, 8, doc) is first and len(calls) == 1
    document_plan(1, 2, "balanced", True, 8, doc)  # another rank's layout: its own plan
    again = document_plan(0, 2, "balanced", True, 8, doc.clone())
    assert len(calls) == 3 and again is not first
    for _ in range(100):
        document_plan(0, 2, "balanced", True, 8, doc.clone())
    assert len(ra._PLANS) <= ra._MAX_PLANS
