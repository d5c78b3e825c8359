"""DeepSeek Sparse Attention's indexer objective (`--dsa-stage`): DeepSeek-V3.2's KL term, checked against its
definition with transformers' attention probabilities as the target.

One device, both stages: the target p is transformers' (eager) attention probabilities summed over heads and
L1-normalised per query — over every causal key in the dense warm-up (transformers with index_topk = s), over the
selected keys in sparse training; the KL's value and the indexer's gradients equal KL(p ‖ softmax(I)) computed here
from the definition, and every other gradient is transformers' language-loss gradient (sparse: the KL reaches no
main-model weight, the language loss no indexer weight) or absent (warm-up: the main model frozen). One spawn of 4
gloo ranks: both stages under tp2 + SP, cp2 ring × tp2, cp2 Ulysses × dp2 and pp2 × ep2 give the one-device loss
and gradients (the target's tp all-reduce, the indexer keys' cp all-gather and its gradient's reduce-scatter).
"""
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from shardwise.config import ParallelConfig, TrainConfig  # noqa: E402
from shardwise.hf import weights as hf  # noqa: E402
from shardwise.hf.config import config_from_hf  # noqa: E402
from shardwise.models import sparse_attention  # noqa: E402
from shardwise.models.sparse_attention import SparseMLA, set_indexer_objective  # noqa: E402
from shardwise.parallelize import plain_model  # noqa: E402
from _dist import HFGrads, fresh_seed, global_grads, grad_slices, hf_grad, run_ranks  # noqa: E402

SEQ, TOPK, WEIGHT = 32, 8, 0.7
SHAPE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, initializer_range=0.2, moe_intermediate_size=16,
             n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
             topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
             qk_nope_head_dim=12, v_head_dim=10, index_topk=TOPK, index_n_heads=16, index_head_dim=16)
STAGES = ("dense-warmup", "sparse")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    torch.manual_seed(3)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**SHAPE))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # random norms make a wrong mapping visible
                p.normal_(1.0 if n.endswith("weight") else 0.0, 0.5)
    out = str(tmp_path_factory.mktemp("dsv32"))
    model.save_pretrained(out)
    return out


def _hf_run(path, x, y, stage):
    """transformers (eager attention, training mode): logits, mean loss, gradients and each layer's attention
    probabilities [b, h, s, s] — dense (index_topk = s) for the warm-up."""
    kw = dict(index_topk=SEQ) if stage == "dense-warmup" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                              **kw)
    model.train()
    out = model(x, output_attentions=True)
    loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    loss.backward()
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return out.logits.detach(), float(loss), grads, [a.detach() for a in out.attentions]


def _kl_by_definition(block, h, cos, sin, attn, keep):
    """Σ_t KL(p_t ‖ softmax(I_t)) over the keys `keep` [b, s, t]: p = the heads' probabilities summed and
    L1-normalised, I the indexer's scores from the block's input (gradient to the indexer only)."""
    h = h.detach()
    ix = block.indexer
    q, w = ix.queries(h, block.q_a_norm(block.wq_a(h)).detach(), cos, sin)
    scores = ix.scores(q, w, ix.keys(h, cos, sin))
    p = attn.sum(1)
    p = p / p.sum(-1, keepdim=True)
    logq = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1).masked_fill(~keep, 0.0)
    return (torch.xlogy(p, p) - p * logq)[keep].sum()


@pytest.mark.parametrize("stage", STAGES)
def test_kl_and_gradients_match_the_definition(path, stage, monkeypatch):
    seed = fresh_seed()
    cfg = config_from_hf(path)
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, cfg.vocab_size, (2, SEQ), generator=g) for _ in range(2))
    ref_logits, ref_loss, ref_grads, attns = _hf_run(path, x, y, stage)

    picked = []
    select = sparse_attention.select
    monkeypatch.setattr(sparse_attention, "select", lambda *a, **k: picked.append(select(*a, **k)) or picked[-1])
    model = plain_model(cfg)
    hf.load_hf_into(model, path)
    set_indexer_objective(model, stage, WEIGHT, x.numel())
    blocks = [m for m in model.modules() if isinstance(m, SparseMLA)]
    inputs = []
    for b in blocks:
        b.register_forward_pre_hook(lambda m, args: inputs.append(args[:3]))
    logits = model(x)
    loss = model.loss_fn(logits, y).mean()
    loss.backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=2e-5, msg=lambda m: f"seed {seed}: {m}")
    assert abs(float(loss) - ref_loss) <= 1e-6 * ref_loss, (seed, float(loss), ref_loss)

    causal = torch.ones(SEQ, SEQ).tril().bool().expand(2, -1, -1)
    if stage == "sparse":
        assert len(picked) == cfg.n_layers
        keeps = [torch.zeros(2, SEQ, SEQ, dtype=torch.bool).scatter(-1, idx, valid) for idx, valid in picked]
        assert all(int(k.sum(-1).max()) == TOPK for k in keeps)  # a strict subset of the causal keys
    else:
        assert not picked  # dense: the indexer selects nothing
        keeps = [causal] * cfg.n_layers
    kls = [_kl_by_definition(b, *inp, a, k) for b, inp, a, k in zip(blocks, inputs, attns, keeps)]
    ref_kl = sum(kls) * WEIGHT / x.numel()
    assert float(ref_kl) > 1e-3
    got = sum(float(b.step_kl) for b in blocks)
    assert abs(got - float(ref_kl)) <= 1e-5 * float(ref_kl), (seed, got, float(ref_kl))

    indexer = [(n, p) for n, p in model.named_parameters() if ".indexer." in n]
    expected = torch.autograd.grad(ref_kl, [p for _, p in indexer])
    for (n, p), ref in zip(indexer, expected):
        assert float(ref.abs().max()) > 0, n
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()),
                                   msg=lambda m: f"seed {seed} {n}: {m}")
    grads = HFGrads(ref_grads)
    for n, p in model.named_parameters():
        if ".indexer." in n:
            continue
        if stage == "dense-warmup":  # frozen: no gradient at all
            assert not p.requires_grad and p.grad is None, n
            continue
        ref = hf_grad(n, cfg, grads)  # the language loss's alone: the KL reaches no main-model weight
        torch.testing.assert_close(p.grad, ref, rtol=1e-5, atol=max(1e-6, 1e-5 * float(ref.abs().max())),
                                   msg=lambda m: f"seed {seed} {n}: {m}")


def test_flags_are_validated():
    from shardwise.config.errors import ConfigError

    with pytest.raises(ConfigError, match="--dsa-stage sparse needs a DeepSeek Sparse Attention model"):
        TrainConfig(model="tiny", dsa_stage="sparse", progress=False).resolved()
    with pytest.raises(ConfigError, match="--dsa-stage 'warm' is unknown; valid: none, dense-warmup, sparse"):
        TrainConfig(model="tiny", dsa_stage="warm", progress=False).resolved()


# ---------------------------------------------------------------- layouts: one spawn of 4 ranks
LAYOUTS = {
    "sparse_dp2_tp2_sp": ("sparse", dict(dp=2, tp=2, sequence_parallel=True), 4),
    "sparse_cp2_ring_tp2": ("sparse", dict(cp=2, tp=2), 2),
    "sparse_pp2_dp2_ep2": ("sparse", dict(pp=2, dp=2, ep=2), 8),
    "warmup_cp2_ulysses_dp2": ("dense-warmup", dict(cp=2, dp=2, cp_impl="ulysses"), 4),
    "warmup_cp2_ring_tp2_sp": ("dense-warmup", dict(cp=2, tp=2, sequence_parallel=True), 2),
    "warmup_pp2_dp2_ep2": ("dense-warmup", dict(pp=2, dp=2, ep=2), 8),
}
TRAIN_TOKENS = torch.randint(0, SHAPE["vocab_size"], (4096,), generator=torch.Generator().manual_seed(int(
    os.environ.get("SHARDWISE_TEST_SEED", "5"))))


def _train_config(path, stage, degrees, global_batch):
    return TrainConfig(model=config_from_hf(path), parallel=ParallelConfig(**degrees), steps=1, seq_len=SEQ,
                       micro_batch=2, global_batch=global_batch, grad_clip=1e30, progress=False, dsa_stage=stage,
                       dsa_kl_weight=WEIGHT)


def _rank_steps(jobs):
    from shardwise.training.trainer import Trainer, make_mesh

    out = []
    for path, stage, degrees, global_batch in jobs:
        cfg = _train_config(path, stage, degrees, global_batch).resolved()
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")), tokens=TRAIN_TOKENS)
        hf.load_hf_into(trainer.model, path)
        loss = trainer.forward_backward(0)
        trainer.finish_gradients()
        kl = sum(float(m.step_kl) for m in trainer.model.modules() if isinstance(m, SparseMLA))
        out.append((loss, grad_slices(trainer), kl))
    return out


@pytest.fixture(scope="module")
def trained(path):
    jobs = [(path, stage, degrees, gb) for stage, degrees, gb in LAYOUTS.values()]
    return run_ranks(4, _rank_steps, jobs, timeout_s=180)


def _one_device(path, stage, global_batch):
    """The one-device step on the global batch: the language loss, every gradient, the KL's value."""
    from shardwise.data import Loader

    cfg = config_from_hf(path)
    x, y = Loader(TRAIN_TOKENS, SEQ, global_batch, TrainConfig().seed).global_batch_at(0)
    model = plain_model(cfg)
    hf.load_hf_into(model, path)
    set_indexer_objective(model, stage, WEIGHT, x.numel())
    loss = model.loss_fn(model(x), y).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    kl = sum(float(m.step_kl) for m in model.modules() if isinstance(m, SparseMLA))
    return float(loss), grads, kl, {n: p.shape for n, p in model.named_parameters()}


@pytest.mark.parametrize("i,layout", list(enumerate(LAYOUTS)))
def test_layout_equals_one_device(path, trained, i, layout):
    stage, degrees, global_batch = LAYOUTS[layout]
    ref_loss, ref_grads, ref_kl, shapes = _one_device(path, stage, global_batch)
    assert len({round(r[i][0], 12) for r in trained}) == 1
    assert abs(trained[0][i][0] - ref_loss) <= 1e-6 * ref_loss, (layout, trained[0][i][0], ref_loss)
    # the KL's value: each rank's queries and layers (without SP the tp ranks repeat theirs; under SP each has 1/tp)
    repeats = 1 if degrees.get("sequence_parallel") else degrees.get("tp", 1)
    assert sum(r[i][2] for r in trained) / repeats == pytest.approx(ref_kl, rel=1e-5), layout
    keep = set(ref_grads)
    if stage == "dense-warmup":
        assert all(".indexer." in n for n in keep)
    ours = global_grads([s for r in trained for s in r[i][1] if s[0] in keep], {n: shapes[n] for n in keep})
    assert not {s[0] for r in trained for s in r[i][1]} - keep  # the frozen weights are not in the reducer
    for n, g in ours.items():
        ref = ref_grads[n]
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=max(1e-7, 1e-5 * float(ref.abs().max())),
                                   msg=lambda m: f"{layout} {n}: {m}")
