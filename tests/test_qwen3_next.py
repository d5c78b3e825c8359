"""Qwen3-Next / Qwen3.5: the Gated DeltaNet layer, gated attention, the hybrid model, its HF interop and its layouts.

Fast (one process):
* the chunked gated delta rule equals transformers' token-by-token recurrence (`torch_recurrent_gated_delta_rule`)
  in outputs, final state and the gradients of q, k, v, g and β, over two 64-token chunks and a padded tail, from
  a non-zero initial state; its state map and effective queries are exact (S_end = M S_0 + B, o = o(0) + Q S_0);
* document resets equal running each document alone (recurrence and convolution);
* Qwen3NextForCausalLM (dense and MoE with the gated shared expert), Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM
  on small random configs saved with save_pretrained: logits, loss and every gradient equal transformers';
* export writes the tensors it read, and transformers loads them with the same logits;
* preset sizes against the published totals.

Slow (one 4-rank fork): a Gated DeltaNet layer under cp 2 and 4 (contiguous and balanced order, with and without
document masks) equals the single-device layer in outputs and every gradient, and the ledger holds exactly the
two all-gathers' bytes (and their reduce-scatters); TP 2 of a whole hybrid model equals transformers' logits;
`verify` (three steps) passes tp2×SP, cp2×tp2, tp2 with ZeRO-3 and pp2 with ZeRO-1 and full recompute.
"""
import dataclasses
import json

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from shardwise.hf import weights as hf  # noqa: E402
from shardwise.config import MODEL_PRESETS, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from shardwise.hf.config import config_from_hf  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.models.gated_deltanet import (GatedDeltaNet, causal_conv, chunk_gated_delta_rule, l2norm,  # noqa: E402
                                             resets_from_documents)
from shardwise.parallelize import build_model  # noqa: E402

from _dist import fresh_seed, hf_hybrid_grad_bounds, make_mesh, run_ranks  # noqa: E402

from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule  # noqa: E402

SHAPE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = {  # name -> (config class, model class, extra config)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(num_experts=0)),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", MOE | dict(shared_expert_intermediate_size=32)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE | dict(shared_expert_intermediate_size=16)),
}
# A small hybrid for layouts: 3 linear : 1 full, heads divisible by tp 2 and cp chunks of ≥ 3 tokens.
HYBRID = ModelConfig(name="hybrid", vocab_size=257, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                     ffn_dim=48, max_seq_len=64, qk_norm=True, attn_output_gate=True, partial_rotary=0.5,
                     linear_layers=(0, 1, 2), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8)


def _save(path, family, seed=0):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**(SHAPE | extra)))
    with torch.no_grad():  # zero-centred norms start at 0 in HF: random ones make the +1 and the permutation matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    return model


# ---------------------------------------------------------------- the recurrence
def _inputs(g, b=2, h=3, s=150, dk=8, dv=6):
    q, k = l2norm(torch.randn(b, h, s, dk, generator=g)), l2norm(torch.randn(b, h, s, dk, generator=g))
    v = torch.randn(b, h, s, dv, generator=g)
    decay = -torch.rand(b, h, s, generator=g) * 0.05  # weak: a state that leaks past a reset stays visible
    beta = torch.rand(b, h, s, generator=g)
    return q * dk ** -0.5, k, v, decay, beta


def _recurrence(q, k, v, g, beta, state=None):
    """transformers' token loop on already normalised inputs (it rescales q by d_k^-½ itself)."""
    o, final = torch_recurrent_gated_delta_rule(*(t.transpose(1, 2) for t in (q * q.shape[-1] ** 0.5, k, v, g, beta)),
                                                initial_state=state, output_final_state=True)
    return o.transpose(1, 2), final


def test_chunked_rule_matches_transformers_recurrence():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    inputs = [t.requires_grad_() for t in _inputs(g)]
    s0 = torch.randn(2, 3, 8, 6, generator=g)
    o, final, (m, reads) = chunk_gated_delta_rule(*inputs, initial_state=s0, transition=True)
    ref_o, ref_final = _recurrence(*inputs, state=s0)
    assert_close(o, ref_o, rtol=1e-5, atol=1e-5, msg=lambda e: f"seed {seed}: {e}")
    assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
    w_o, w_s = torch.randn_like(o), torch.randn_like(final)
    grads = torch.autograd.grad((o * w_o).sum() + (final * w_s).sum(), inputs)
    ref = torch.autograd.grad((ref_o * w_o).sum() + (ref_final * w_s).sum(), inputs)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), grads, ref):
        assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda e: f"seed {seed} d{name}: {e}")
    with torch.no_grad():  # affine in the initial state: what context parallelism composes
        o0, b0, _ = chunk_gated_delta_rule(*inputs)
        assert_close(final, m @ s0 + b0, rtol=1e-5, atol=1e-5)
        assert_close(o, o0 + reads @ s0, rtol=1e-5, atol=1e-5)


def test_document_resets_equal_separate_documents():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    q, k, v, decay, beta = _inputs(g, b=1, s=150)
    # a one-token document, a start inside chunk 0, one inside chunk 1 followed by chunk 2 (the chunk's decay and
    # state pass must be cut there), a document spanning chunks 1 and 2
    cuts = [0, 30, 31, 90, 150]
    doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]).unsqueeze(0)
    resets = resets_from_documents(doc)
    o, final, _ = chunk_gated_delta_rule(q, k, v, decay, beta, resets=resets)
    runs = [chunk_gated_delta_rule(*(t[:, :, a:b] for t in (q, k, v, decay, beta))) for a, b in zip(cuts, cuts[1:])]
    alone = torch.cat([r[0] for r in runs], dim=2)
    assert_close(o, alone, rtol=1e-5, atol=1e-6, msg=lambda e: f"seed {seed}: {e}")
    assert_close(final, runs[-1][1], rtol=1e-5, atol=1e-6)
    x, w = torch.randn(1, 150, 5, generator=g), torch.randn(5, 4, generator=g)
    conv = causal_conv(x, w, resets=torch.nn.functional.pad(resets, (3, 0)))
    conv_alone = torch.cat([causal_conv(x[:, a:b], w) for a, b in zip(cuts, cuts[1:])], dim=1)
    assert_close(conv, conv_alone, rtol=1e-6, atol=1e-6)
    broken = chunk_gated_delta_rule(q, k, v, decay, beta)[0]  # the check sees a missing reset
    assert (broken - alone).abs().max() > 1e-2


# ---------------------------------------------------------------- transformers as the oracle
@pytest.mark.parametrize("family", list(FAMILIES))
def test_single_device_matches_transformers(tmp_path, family):
    ref_model = _save(tmp_path, family)
    cfg = config_from_hf(str(tmp_path))
    model = build_model(cfg, Mesh.single(), seed=0)
    hf.load_hf_into(model, str(tmp_path))
    # MoE: fixed tokens, as tests/test_hf.py's: a fresh batch may hold a top-k near-tie the two fp32 sums resolve
    # differently (a routing flip, not a mapping error); the dense families draw fresh ones
    seed = 0 if "moe" in family else fresh_seed()
    x = torch.randint(0, 101, (2, 25), generator=torch.Generator().manual_seed(seed))
    logits, ref_logits = model(x[:, :-1]), ref_model(x[:, :-1]).logits
    # hf-compare's bound (1e-4 of the largest logit): at initializer_range 0.2 both fp32 models sit ~1e-5 apart
    diff, scale = float((logits - ref_logits).abs().max()), max(1.0, float(ref_logits.abs().max()))
    assert diff <= 1e-4 * scale, (family, seed, diff, scale)
    loss = model.loss_fn(logits, x[:, 1:]).mean()
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), x[:, 1:].flatten())
    assert abs(float(loss.detach()) - float(ref_loss.detach())) < 1e-6 * float(ref_loss.detach())
    loss.backward()
    ref_loss.backward()
    for n, rel, bound in hf_hybrid_grad_bounds(model, ref_model, cfg, x):
        assert rel < bound, (family, seed, n, rel, bound)


def test_export_round_trip(tmp_path):
    ref_model = _save(tmp_path / "in", "qwen3_next_moe")
    cfg = config_from_hf(str(tmp_path / "in"))
    model = build_model(cfg, Mesh.single(), seed=0)
    hf.load_hf_into(model, str(tmp_path / "in"))
    hf.export_hf(model, cfg, str(tmp_path / "out"))
    assert config_from_hf(str(tmp_path / "out")) == dataclasses.replace(cfg, name="hf-qwen3_next")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    theirs, ours = ref_model.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    for n, t in theirs.items():
        assert_close(ours[n], t, rtol=0, atol=2.4e-7, msg=lambda e: f"{n}: {e}")  # norms: +1 then −1 in fp32, ≤ 1 ulp of 1
    x = torch.randint(0, 101, (1, 20))
    assert_close(back(x).logits, ref_model(x).logits, rtol=1e-5, atol=1e-5)


def test_config_json_mapping(tmp_path):
    _save(tmp_path, "qwen3_next_moe")
    cfg = config_from_hf(str(tmp_path))
    assert cfg.linear_layers == (0, 1, 2) and cfg.attn_output_gate and cfg.partial_rotary == 0.5
    assert cfg.rope_dim == 8 and cfg.moe_shared_experts == 2 and cfg.moe_shared_gate
    assert not cfg.moe_softmax_before_topk  # norm_topk_prob: a softmax over the chosen k
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    hf_cfg.pop("layer_types")
    hf_cfg["full_attention_interval"] = 2
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    assert config_from_hf(str(tmp_path)).linear_layers == (0, 2)


# ---------------------------------------------------------------- published sizes
@pytest.mark.parametrize("preset,total,active", [("qwen3-next-80b-a3b", 80e9, 3e9), ("qwen3.5-35b-a3b", 35e9, 3e9)])
def test_preset_sizes_match_published(preset, total, active):
    """Totals within 1% of the model cards' (80B: 79.67B, 35B: 34.66B text-only); the cards' active "3B" is the
    count rounded down (3.87B and 3.45B with embedding and head)."""
    cfg = MODEL_PRESETS[preset]
    cfg.validate()
    assert abs(cfg.num_params() / total - 1) < 0.01, cfg.num_params()
    assert active <= cfg.num_active_params() < active + 1e9, cfg.num_active_params()


# ---------------------------------------------------------------- layouts (one fork)
def _layer_cp_checks(seed, cp, order, documents):
    """A Gated DeltaNet layer under cp against the single-device layer: output, input and weight gradients, and
    this rank's ledger rows (cp all-gathers forward, reduce-scatters backward)."""
    from shardwise.context_parallel import shard_sequence
    from shardwise.context_parallel.plan import ContextParallel
    from shardwise.models.context import ParallelContext
    from shardwise.models.documents import document_ids

    mesh = make_mesh(cp=cp)
    axis = mesh["cp"]
    g = torch.Generator().manual_seed(seed)
    cfg = dataclasses.replace(HYBRID, linear_k_dim=4, linear_v_dim=4)
    ref = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    layer = GatedDeltaNet(cfg, ParallelContext(cp=ContextParallel(axis, order)))
    layer.load_state_dict(ref.state_dict())
    b, s = 2, 8 * cp
    x = torch.randn(b, s, cfg.dim, generator=g)
    doc = document_ids(torch.randint(0, 6, (b, s), generator=g), 0) if documents else None
    w = torch.randn(b, s, cfg.dim, generator=g)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref, doc_ids=doc) * w).sum().backward()
    x_loc = shard_sequence(x, axis.rank, cp, order).requires_grad_()
    mesh.ledger.reset()
    out = layer(x_loc, doc_ids=doc)
    fwd = mesh.ledger.snapshot().get("cp", {})
    (out * shard_sequence(w, axis.rank, cp, order)).sum().backward()
    total = mesh.ledger.snapshot().get("cp", {})
    what = f"seed {seed} cp{cp} {order} docs={documents}"
    with torch.no_grad():
        assert_close(out, shard_sequence(ref(x, doc_ids=doc), axis.rank, cp, order), rtol=1e-5, atol=1e-5,
                     msg=lambda e: f"{what} out: {e}")
    assert_close(x_loc.grad, shard_sequence(x_ref.grad, axis.rank, cp, order), rtol=1e-5, atol=1e-5,
                 msg=lambda e: f"{what} dx: {e}")
    import torch.distributed as dist

    for (n, p), r in zip(layer.named_parameters(), ref.parameters()):  # each rank holds its tokens' share
        dist.all_reduce(p.grad, group=axis.group)
        rel = float((p.grad - r.grad).norm() / r.grad.norm())  # norm-wise, verify's first-step bound
        assert rel < 1e-5, f"{what} d{n}: relative difference {rel}"
    return what, fwd, total


def _check_cp_ledger(fwd, total, cp, order):
    cfg = dataclasses.replace(HYBRID, linear_k_dim=4, linear_v_dim=4)
    pieces = 2 if order == "balanced" else 1
    channels = 2 * cfg.linear_k_heads * 4 + cfg.linear_v_heads * 4
    halo = pieces * 2 * (cfg.linear_conv_kernel - 1) * channels * 4  # per_rank·b rows of K−1 × C, fp32
    maps = pieces * 2 * cfg.linear_v_heads * 4 * (4 + 4) * 4  # per_rank·b·h maps of d_k × (d_k + d_v)
    assert set(fwd) == {"all_gather"} and fwd["all_gather"]["count"] == 2, fwd
    assert fwd["all_gather"]["bytes"] == halo + maps, fwd
    assert fwd["all_gather"]["wire_bytes"] == (cp - 1) * (halo + maps), fwd
    assert total["reduce_scatter"]["count"] == 2 and total["all_gather"] == fwd["all_gather"], total


def _rank_all(seed, hf_dir):
    from shardwise.commands.hf import rank_forward
    from shardwise.training.assemble import assemble
    from shardwise.verify.main import verify_main

    out = {"layer": [], "verify": []}
    for cp, order, documents in ((2, "balanced", False), (2, "contiguous", True), (4, "balanced", True)):
        out["layer"].append(_layer_cp_checks(seed, cp, order, documents) + (cp, order))
    tc = TrainConfig(model=config_from_hf(hf_dir), parallel=ParallelConfig(dp=2, tp=2), seq_len=24,
                     micro_batch=1, global_batch=2, steps=1, progress=False)
    tc = tc.resolved()
    out["tp2_logits"] = rank_forward(tc, hf_dir, _hf_tokens())["logits"]
    base = dict(model=HYBRID, seq_len=32, micro_batch=2, steps=3, progress=False, seed=seed % 10_000)
    layouts = {
        "tp2_sp": dict(parallel=ParallelConfig(dp=2, tp=2, sequence_parallel=True), global_batch=4),
        "cp2_tp2": dict(parallel=ParallelConfig(cp=2, tp=2), global_batch=2),  # balanced order
        "tp2_zero3": dict(parallel=ParallelConfig(dp=2, tp=2, zero=3), global_batch=4),
        "pp2_zero1_full": dict(parallel=ParallelConfig(dp=2, pp=2, zero=1, recompute="full"), global_batch=8),
    }
    for name, kw in layouts.items():  # A_log / dt_bias first-step gradients: verify's fp64 budget (docs/verify.md)
        out["verify"].append((name, verify_main(assemble(TrainConfig(**(base | kw))))))
    return out


def test_layouts_match_single_device_and_transformers(tmp_path):
    seed = fresh_seed()
    ref_model = _save(tmp_path, "qwen3_next_moe")
    try:
        per_rank = run_ranks(4, _rank_all, seed, str(tmp_path), timeout_s=300)
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    for r in per_rank:
        assert len(r["layer"]) == 3
        for what, fwd, total, cp, order in r["layer"]:
            _check_cp_ledger(fwd, total, cp, order)
        for name, result in r["verify"]:
            assert result["passed"], (seed, name, result)
    assert_close(per_rank[0]["tp2_logits"], ref_model(_hf_tokens()).logits, rtol=1e-5, atol=1e-4)


def _hf_tokens():
    """Fixed tokens for the MoE model against transformers (a fresh batch may hold a top-k near-tie)."""
    return torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(0))


def test_generate_carries_the_linear_state(tmp_path):
    """Greedy decoding with the linear layers' conv window and recurrent state carried token by token gives
    transformers' logits for the whole generated sequence at every step."""
    from shardwise.training.generate import generate_ids

    ref_model = _save(tmp_path, "qwen3_next")
    cfg = config_from_hf(str(tmp_path))
    model = build_model(cfg, Mesh.single(), seed=0).eval()
    hf.load_hf_into(model, str(tmp_path))
    prompt = [5, 17, 3, 99, 42, 8, 61]
    scores = []
    out, why = generate_ids(model, prompt, 6, eos_id=None, scores=scores)
    assert why == "max_new_tokens" and len(out) == 6
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    assert_close(torch.stack(scores), ref, rtol=1e-5, atol=5e-5)
