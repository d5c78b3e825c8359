"""DeepSeek-V3 multi-token prediction (docs/mtp.md).

* Oracle: the report's equations written here in plain PyTorch — each depth on the *truncated* sequence
  (positions 0..S-k-1, no padding), its own RMSNorm, concatenation [enorm(Emb(t_{i+k})); hnorm(h^{k-1})],
  projection, the head, cross-entropies averaged per depth — on the same weights (the transformer blocks are
  called as black boxes: they are proven against transformers in test_hf.py), against shardwise's loss and
  every parameter gradient, with random tokens and random loss masks.
* verify with MTP on: TP+SP, PP (1f1b, zb, interleaved), CP ring and Ulysses, EP, ZeRO-3, a 4-rank composition.
* Refusals.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from shardwise.mesh import Mesh
from shardwise.models.mtp import IGNORE, depth_counts, shift_inputs
from shardwise.parallelize import build_model
from shardwise.run import assemble
from shardwise.trainer import Trainer

from _dist import fresh_seed, run_ranks, verify_all

# test_model_families' DeepSeek-V3 shape (MLA with a q latent, layer 0 dense, sigmoid group-limited top-2 of 8)
# with two MTP modules; both MTP blocks are MoE blocks (layers 4 and 5), as DeepSeek-V3's layer 61.
DEEPSEEK_MTP = ModelConfig(name="deepseek-mtp", vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=4,
                           head_dim=16, ffn_dim=96, max_seq_len=64, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=24,
                           qk_rope_dim=8, v_head_dim=12, moe_experts=8, moe_topk=2, moe_ffn_dim=32,
                           moe_shared_experts=1, moe_dense_layers=(0,), moe_score="sigmoid", moe_n_group=4,
                           moe_topk_group=2, moe_routed_scaling=2.5, moe_bias_update_rate=0.01, mtp_layers=2)


def _cfg(seed, model=DEEPSEEK_MTP, global_batch=4, lam=0.3, **parallel):
    return TrainConfig(model=model, parallel=ParallelConfig(**parallel), steps=2, seq_len=32, micro_batch=2,
                       global_batch=global_batch, seed=seed, progress=False, mtp_loss_weight=lam)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _oracle(model, x, y, lam):
    """Main loss + λ/D Σ_k CE_k from the report's equations, each depth on its truncated sequence."""
    cfg = model.cfg
    emb, out_w = model.tok_embeddings.weight, model.output.weight
    s = x.shape[1]
    cos, sin = model.rope(s, x.device)
    h = F.embedding(x, emb)
    for block in model.layers.values():
        h = block(h, cos, sin)
    h = _rms(h, model.norm.weight, cfg.norm_eps)  # h^0: after the main model's final norm
    loss = F.cross_entropy((h @ out_w.T).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="mean")
    mtp = []
    for k, layer in enumerate(model.mtp.values(), start=1):
        t = s - k  # depth k predicts t_{i+k+1} from h^{k-1}_i and Emb(t_{i+k}) for i < S - k
        cos, sin = model.rope(t, x.device)
        e = _rms(F.embedding(x[:, k:], emb), layer.enorm.weight, cfg.norm_eps)
        hk = _rms(h[:, :t], layer.hnorm.weight, cfg.norm_eps)
        h = layer.block(torch.cat([e, hk], -1) @ layer.eh_proj.weight.T, cos, sin)
        logits = _rms(h, layer.head_norm.weight, cfg.norm_eps) @ out_w.T
        mtp.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten(), ignore_index=IGNORE, reduction="mean"))
    return loss + lam * sum(mtp) / len(mtp)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_loss_and_every_gradient_match_the_report_equations():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 257, (4 * 33 * 4,), generator=gen)
    lam = 0.3
    cfg = assemble(dataclasses.replace(_cfg(seed % 1000, lam=lam), overlap_grad_reduce=False))
    t = Trainer(cfg, Mesh.single(torch.device("cpu")), tokens)
    loss = t.forward_backward(0)  # two microbatches of 2: the per-depth means span the global batch
    got = _grads(t.model)
    x, y = t.loader.global_batch_at(0)
    model = build_model(cfg.model_config(), Mesh.single(torch.device("cpu")), cfg.seed)  # same seeded weights
    ref = _oracle(model, x, y, lam)
    ref.backward()
    want = _grads(model)
    assert abs(loss - ref.item()) < 1e-5 * abs(ref.item()), (seed, loss, ref.item())
    assert any(n.startswith("mtp.1.") for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n} (seed {seed}): {m}")

    # loss masks (SFT prompts): random ignored targets, through the model's own MTP inputs
    y_masked = torch.where(torch.rand(y.shape, generator=gen) < 0.3, IGNORE, y)
    for p in model.parameters():
        p.grad = None
    ids, labels = shift_inputs(x, y_masked, 2)
    counts = depth_counts(y_masked, 4, 32, 2)
    scale = torch.tensor([lam / (2 * n) for n in counts])
    logits = model(x, mtp_ids=ids, mtp_labels=labels, mtp_scale=scale)
    n_main = int((y_masked != IGNORE).sum())
    mine = model.loss_fn(logits, y_masked).sum() / n_main
    mine.backward()
    value = mine.item() + model.mtp_loss.item()
    got = _grads(model)
    for p in model.parameters():
        p.grad = None
    ref = _oracle(model, x, y_masked, lam)
    ref.backward()
    assert abs(value - ref.item()) < 1e-5 * abs(ref.item()), (seed, value, ref.item())
    for n, g in _grads(model).items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"masked {n} (seed {seed}): {m}")


def test_shift_pads_past_the_window():
    x = torch.arange(10).view(2, 5)
    y = x + 1
    y[0, 3] = IGNORE
    ids, labels = shift_inputs(x, y, 2)
    assert ids[0].tolist() == [[1, 2, 3, 4, 0], [6, 7, 8, 9, 0]]
    assert labels[1].tolist() == [[3, IGNORE, 5, IGNORE, IGNORE], [8, 9, 10, IGNORE, IGNORE]]
    assert depth_counts(y, 2, 5, 2) == [7, 5] and depth_counts(None, 2, 5, 2) == [8, 6]


def _check(cfgs, world, seed):
    for cfg, result in zip(cfgs, run_ranks(world, verify_all, cfgs, timeout_s=300)[0]):
        assert result["passed"] and result["first_step_grad_rel_diff"] < 1e-5, (seed, cfg.parallel, result)


def test_verify_two_rank_layouts():
    """TP+SP and TP (eh_proj replicated: its gradient is TP-partial under SP), CP ring and Ulysses (shifted on
    the host before the cut: no extra communication), EP with the MTP block's experts, ZeRO-3; PP 1f1b, zb and
    interleaved (the MTP modules on the last stage with a copy of the embedding, summed over emb), dualpipev (both
    ends on rank 0: one matrix used by two chunks), tied embeddings under PP (MTP reads the head's copy)."""
    seed = fresh_seed()
    tied = dataclasses.replace(DEEPSEEK_MTP, tie_embeddings=True)
    cfgs = [_cfg(seed, tp=2, sequence_parallel=True), _cfg(seed, tp=2), _cfg(seed, cp=2),
            _cfg(seed, cp=2, cp_impl="ulysses"), _cfg(seed, dp=2, ep=2),
            _cfg(seed, global_batch=8, dp=2, ep=2, zero=3),
            _cfg(seed, global_batch=8, pp=2, schedule="1f1b"), _cfg(seed, global_batch=8, pp=2, schedule="zb"),
            _cfg(seed, global_batch=8, pp=2, schedule="interleaved", vp=2),
            _cfg(seed, global_batch=8, pp=2, schedule="dualpipev"),
            _cfg(seed, tied, global_batch=8, pp=2, schedule="1f1b")]
    _check(cfgs, 2, seed)


def test_verify_four_rank_compositions():
    """pp×tp×SP zb, dp×ep×tp×SP, dp×pp ZeRO-3 (the embedding copy is a ZeRO-3 unit), pp4 (middle stages hold
    neither end)."""
    seed = fresh_seed()
    cfgs = [_cfg(seed, global_batch=8, pp=2, tp=2, sequence_parallel=True, schedule="zb"),
            _cfg(seed, global_batch=8, dp=2, ep=2, tp=2, sequence_parallel=True),
            _cfg(seed, global_batch=8, dp=2, pp=2, zero=3), _cfg(seed, global_batch=8, pp=4, schedule="1f1b")]
    _check(cfgs, 4, seed)


def test_refusals():
    dense = dataclasses.replace(DEEPSEEK_MTP, mtp_layers=0)
    with pytest.raises(ConfigError, match=r"--mtp-layers 1: model 'tiny' has no multi-token prediction; valid only "
                                          r"on DeepSeek-V3-architecture"):
        assemble(TrainConfig(model="tiny", model_overrides={"mtp_layers": 1}))
    with pytest.raises(ConfigError, match=r"--mtp-layers -1 must be an integer >= 0"):
        dataclasses.replace(dense, mtp_layers=-1).validate()
    with pytest.raises(ConfigError, match=r"--mtp-loss-weight -0.1 must be a finite number >= 0"):
        assemble(_cfg(0, lam=-0.1))
