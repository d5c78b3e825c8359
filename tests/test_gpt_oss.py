"""gpt-oss against transformers' GptOssForCausalLM, and its parts on their own.

The attention core (learned sinks merged through the fused kernel's LSE, sliding windows, document masks) is
checked against an explicit softmax with the sink as an extra column (transformers' eager formula), forward and
every gradient sinks included. The model, on a small random GptOss saved with `save_pretrained` (biases and sinks
drawn at 0.5, weights at 0.2, YaRN with truncate false, a 5-token window on layer 0 of a 16-token sequence):
logits, loss and every gradient equal transformers' on one device; MXFP4 expert tensors (`*_blocks`,
`*_scales`) quantised here dequantise exactly and load into the same model; export loads back into transformers.
Multi-rank (one 2-rank fork, two 4-rank forks): `verify` on dp2×tp2×SP, dp4×ep2 ZeRO-1, dp2×cp2 ring×ep2 ZeRO-3,
dp2×cp2 Ulysses and dp2×pp2 (three steps each); tp2×SP, dp2×ep2, cp2 ring and Ulysses, pp2 against transformers'
loss and every gradient; cp4 ring and Ulysses attention with sinks, windows and documents against one device,
and the windowed ring's ledger equal to the blocks it sends. Also: greedy `generate` against transformers', the
published config.json against the presets, the planner's tensors, totals, windowed FLOPs and expert activations,
and bad config fields refused.
"""
import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")

from shardwise.hf import weights as hf  # noqa: E402
from shardwise.config import MODEL_PRESETS, ConfigError, ParallelConfig, TrainConfig  # noqa: E402
from shardwise.context_parallel import ring_attention, shard_sequence, ulysses_attention  # noqa: E402
from shardwise.context_parallel.local import bands, local_attention  # noqa: E402
from shardwise.rules.partition import ring_step_list, window_cut  # noqa: E402
from shardwise.hf.config import config_from_hf, hf_config  # noqa: E402
from shardwise.hf.mxfp4 import FP4_VALUES, dequantize  # noqa: E402
from shardwise.models.documents import document_ids  # noqa: E402
from shardwise.parallelize import plain_model  # noqa: E402

from _dist import fresh_seed, global_grads, grad_slices, make_mesh, run_ranks, verify_all  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 8}
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
             max_position_embeddings=32, initializer_range=0.2, rope_parameters=YARN, swiglu_limit=1.0)
# swiglu_limit 1 (7 in the released models): at these weights' scale the clamp then bites on both sides
SEQ = 16
TOL = dict(rtol=2e-5, atol=2e-5)


def _save(path, **changes):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**(SHAPE | changes)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or n.endswith("sinks"):  # HF zero-initialises the expert biases
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return _save(str(tmp_path_factory.mktemp("gpt_oss")))


# ---------------------------------------------------------------- the attention core, no model
def _explicit(q, k, v, sinks, window, doc):
    """transformers' eager_attention_forward: scores, masked, the sink as one more column, softmax, dropped."""
    s, g = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i = torch.arange(s)
    keep = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
    if doc is not None:
        keep = keep & (doc[:, None, :, None] == doc[:, None, None, :])
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    return (scores.softmax(-1)[..., :s]) @ v


@pytest.mark.parametrize("window", [0, 3, 7])  # 3: four bands of 3 rows over 12 tokens; 7 > 12/2: one masked call
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("sinks", [False, True])
def test_local_attention_equals_explicit_softmax(window, docs, sinks):
    g = torch.Generator().manual_seed(fresh_seed())
    b, s, d = 2, 12, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (4, 2, 2))
    sink = torch.randn(4, generator=g) * 2 if sinks else None
    tokens = torch.randint(0, 4, (b, s), generator=g)
    doc = document_ids(tokens, eos=0) if docs else None
    dout = torch.randn(b, 4, s, d, generator=g)
    ins = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sinks else [])
    ref_ins = [t.detach().clone().requires_grad_() for t in ins]
    out = local_attention(*ins[:3], sinks=ins[3] if sinks else None, window=window, doc_ids=doc)
    ref = _explicit(*ref_ins[:3], ref_ins[3] if sinks else None, window, doc)
    out.backward(dout)
    ref.backward(dout)
    assert_close(out, ref, **TOL)
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), ins, ref_ins):
        assert_close(a.grad, r.grad, **TOL, msg=lambda m: f"{name}: {m}")


def test_bands_cover_every_row_once_and_every_window():
    """Each query row in one band, whose keys hold its whole window and nothing past the band's last row."""
    for s, w in ((12, 3), (13, 4), (40, 5), (9, 4)):
        rows = torch.zeros(s, dtype=torch.int64)
        for qs, ks in bands(s, w):
            rows[qs] += 1
            assert ks.start == max(0, qs.start - w + 1) and ks.stop == qs.stop and ks.stop - ks.start <= 2 * w - 1
        assert bool((rows == 1).all()), (s, w)
    assert bands(12, 0) is None and bands(12, 6) is None  # no window, or s ≤ 2W: one call


def test_window_arithmetic_and_ring_steps():
    assert window_cut([(10, 12)], [(0, 4)], 8) == (True, True)  # nearest 10 − 3 = 7 < 8, farthest 11 − 0 ≥ 8
    assert window_cut([(10, 12)], [(0, 4)], 7) == (False, True)  # nearest pair 10 − 3 = 7 ≥ 7: nothing visible
    assert window_cut([(4, 8)], [(0, 4)], 8) == (True, False)  # farthest pair 7 − 0 = 7 < 8: window cuts nothing
    # cp 4, 8 tokens per rank (chunks of 4, balanced): rank r holds chunks r and 7 − r
    assert ring_step_list(4, "balanced", 8, 0) == [0, 1, 2, 3] == ring_step_list(4, "balanced", 8, 32)
    assert ring_step_list(4, "contiguous", 8, 5) == [0, 1]  # a 5-token window reaches only the previous rank's block
    assert ring_step_list(4, "contiguous", 8, 9) == [0, 1] and ring_step_list(4, "contiguous", 8, 10) == [0, 1, 2]
    # balanced: chunk 7 − r sees chunk 6 − r, rank r + 1's, which the ring brings last; chunk r sees rank r − 1's:
    # steps 1 and 3 run, step 2 (rank r − 2's chunks, out of every window) is neither computed nor sent
    assert ring_step_list(4, "balanced", 8, 3) == [0, 1, 3] and ring_step_list(4, "balanced", 8, 5) == [0, 1, 3]
    assert ring_step_list(4, "balanced", 8, 6) == [0, 1, 2, 3]  # 6 > a 4-token chunk: reaches chunk 5 − r too
    assert ring_step_list(4, "contiguous", 8, 5) == [0, 1] and ring_step_list(4, "balanced", 8, 0) == [0, 1, 2, 3]


# ---------------------------------------------------------------- the model on one device
def _grads_by_hf_name(model, cfg, tmp):
    """shardwise's gradients under transformers' names: exported as if they were weights."""
    from safetensors.torch import load_file

    hf.export_hf({n: p.grad for n, p in model.named_parameters()}, cfg, tmp)
    return load_file(os.path.join(tmp, "model.safetensors"))


def _hf_step(path, tokens, targets):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.train()
    logits = ref(tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return ref, logits.detach(), loss.detach()


def test_single_device_matches_transformers(gpt_oss, tmp_path):
    cfg = config_from_hf(gpt_oss)
    assert cfg.sliding_layers == (0,) and cfg.sliding_window == 5 and cfg.rope_yarn[-1] is False
    g = torch.Generator().manual_seed(fresh_seed())
    tokens, targets = (torch.randint(0, 64, (2, SEQ), generator=g) for _ in range(2))
    ref, ref_logits, ref_loss = _hf_step(gpt_oss, tokens, targets)
    model = plain_model(cfg)
    hf.load_hf_into(model, gpt_oss)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grads = _grads_by_hf_name(model, cfg, str(tmp_path / "grads"))
    names = dict(ref.named_parameters())
    assert set(grads) == set(names)
    for n, p in names.items():
        assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------- MXFP4
def _quantise(w):
    """[..., rows, cols] values of the form FP4 · 2^e per 32-block → (blocks uint8 [..., G, 16], scales [..., G])."""
    *lead, cols = w.shape
    blk = w.reshape(*lead, cols // 32, 32)
    exp = torch.floor(torch.log2(blk.abs().amax(-1).clamp_min(2.0 ** -100))) - 2  # 6 = 1.5·2² is FP4's top
    mant = blk / torch.ldexp(torch.ones_like(exp), exp.int()).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (mant.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    assert torch.equal(lut[codes.long()], mant.where(mant != 0, lut[codes.long()])), "not representable"
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)), (exp + 127).to(torch.uint8)


def test_mxfp4_dequantises_exactly(gpt_oss, tmp_path):
    g = torch.Generator().manual_seed(fresh_seed())
    lut = torch.tensor(FP4_VALUES)
    scale = torch.ldexp(torch.ones(3, 6, 2), torch.randint(-8, 4, (3, 6, 2), generator=g))
    exact = lut[torch.randint(0, 16, (3, 6, 64), generator=g)] * scale.repeat_interleave(32, -1)
    blocks, scales = _quantise(exact)
    assert blocks.shape == (3, 6, 2, 16) and scales.shape == (3, 6, 2)
    assert torch.equal(dequantize(blocks, scales), exact)
    assert torch.equal(dequantize(blocks, scales, torch.bfloat16).float(), exact)  # exact in bf16 too
    # A checkpoint whose experts are MXFP4: rounded to representable values, then stored as blocks and scales
    # ([E, out, in], rows interleaved like the plain tensor's columns): it loads as the same model.
    from safetensors.torch import load_file, save_file

    mx, plain = str(tmp_path / "mx"), str(tmp_path / "plain")
    shutil.copytree(gpt_oss, mx)
    shutil.copytree(gpt_oss, plain)
    tensors = load_file(os.path.join(gpt_oss, "model.safetensors"))
    for n in [n for n in tensors if n.endswith("gate_up_proj") or n.endswith("down_proj")]:
        w = tensors[n].transpose(1, 2)  # [E, out, in]
        rounded = dequantize(*_quantise(_round_fp4(w)))
        tensors[n] = rounded.transpose(1, 2).contiguous()
    save_file(tensors, os.path.join(plain, "model.safetensors"))
    quant = {}
    for n, t in tensors.items():
        if n.endswith("gate_up_proj") or n.endswith("down_proj"):
            quant[f"{n}_blocks"], quant[f"{n}_scales"] = _quantise(t.transpose(1, 2).contiguous())
        else:
            quant[n] = t
    save_file(quant, os.path.join(mx, "model.safetensors"))
    with open(os.path.join(mx, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(os.path.join(mx, "config.json"), "w") as f:
        json.dump(config, f)
    cfg = config_from_hf(mx)
    a, b = plain_model(cfg), plain_model(cfg)
    hf.load_hf_into(a, plain)
    hf.load_hf_into(b, mx)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(ConfigError, match="quantization_config"):
        config["model_type"], config["architectures"] = "mixtral", ["MixtralForCausalLM"]
        with open(os.path.join(mx, "config.json"), "w") as f:
            json.dump(config | {"num_local_experts": 4}, f)
        config_from_hf(mx)


def _round_fp4(w):
    """Each 32-block rounded to FP4 values times a power of two (the MXFP4 grid)."""
    *lead, cols = w.shape
    blk = w.reshape(*lead, cols // 32, 32)
    exp = torch.floor(torch.log2(blk.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100))) - 2
    scale = torch.ldexp(torch.ones_like(exp), exp.int())
    lut = torch.tensor(FP4_VALUES)
    return lut[((blk / scale).unsqueeze(-1) - lut).abs().argmin(-1)].mul(scale).reshape(w.shape)


# ---------------------------------------------------------------- configs, presets, export
PUBLISHED = {  # openai/gpt-oss-{20b,120b} config.json (the fields shardwise reads)
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(num_hidden_layers=36, num_local_experts=128),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_json_equals_the_preset(name, tmp_path):
    n = PUBLISHED[name]["num_hidden_layers"]
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
              "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
              "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
              "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * (n // 2),
              "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
              "num_key_value_heads": 8, "output_router_logits": False, "pad_token_id": 199999,
              "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                 "model.embed_tokens", "lm_head"],
                                      "quant_method": "mxfp4"},
              "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                      "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                      "truncate": False},
              "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
              "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
              "vocab_size": 201088, **PUBLISHED[name]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = config_from_hf(str(tmp_path))
    want = dataclasses.replace(MODEL_PRESETS[name], name=got.name, moe_aux_loss_coef=0.0, moe_aux_loss_scope="model")
    assert got == want


def test_published_sizes():
    """Totals as published (model card: 116.83B / 20.91B); active as published counts no input embedding."""
    for name, total, active in (("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)):
        cfg = MODEL_PRESETS[name]
        assert abs(cfg.num_params() / total - 1) < 1e-3, (name, cfg.num_params())
        assert abs((cfg.num_active_params() - cfg.vocab_size * cfg.dim) / active - 1) < 1e-3, name


def test_export_loads_in_transformers_with_the_same_logits(gpt_oss, tmp_path):
    cfg = config_from_hf(gpt_oss)
    model = plain_model(cfg)
    hf.load_hf_into(model, gpt_oss)
    out = hf.export_hf(model, cfg, str(tmp_path / "export"))
    tokens = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(fresh_seed()))
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert_close(ref(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    assert config_from_hf(out) == cfg
    with pytest.raises(ConfigError, match="attention_sinks"):
        hf_config(dataclasses.replace(cfg, attention_sinks=False))


# ---------------------------------------------------------------- layouts against transformers (one 2-rank fork)
LAYOUTS = {  # degrees; a global batch of 4 sequences of 16 tokens, two microbatches of 2 per dp rank
    "tp2_sp": dict(tp=2, sequence_parallel=True),  # heads and their sinks split, wo's bias added once
    "dp2_ep2": dict(dp=2, ep=2),  # two experts per rank, biases and clamp in the grouped GEMMs
    "cp2_ring": dict(cp=2),  # sinks merged once after the ring; layer 0's 5-token window cuts and skips blocks
    "cp2_ulysses": dict(cp=2, cp_impl="ulysses"),  # sinks follow the heads
    "pp2": dict(pp=2),
}
TRAIN_TOKENS = torch.randint(0, SHAPE["vocab_size"], (2048,), generator=torch.Generator().manual_seed(1))


def _rank_steps(path):
    """Inside each rank, for every layout: load the checkpoint, one forward+backward, the loss and this rank's
    reduced gradient slices (global name, shard dim, start, rows, values)."""
    from shardwise.training.trainer import Trainer, make_mesh as trainer_mesh

    out = []
    for degrees in LAYOUTS.values():
        cfg = TrainConfig(model=config_from_hf(path), parallel=ParallelConfig(**degrees), steps=1, seq_len=SEQ,
                          micro_batch=2, global_batch=4, grad_clip=1e30, progress=False)
        cfg = cfg.resolved()
        trainer = Trainer(cfg, trainer_mesh(cfg, torch.device("cpu")), tokens=TRAIN_TOKENS)
        hf.load_hf_into(trainer.model, path)
        loss = trainer.forward_backward(0)
        trainer.finish_gradients()
        out.append((loss, grad_slices(trainer)))
    return out



def test_layouts_match_transformers(gpt_oss, tmp_path):
    from safetensors.torch import save_file

    from shardwise.data import Loader

    per_rank = run_ranks(2, _rank_steps, gpt_oss)
    x, y = Loader(TRAIN_TOKENS, SEQ, 4, TrainConfig().seed).global_batch_at(0)
    ref, _, ref_loss = _hf_step(gpt_oss, x, y)
    grad_dir = str(tmp_path / "hf_grads")
    os.makedirs(grad_dir)
    save_file({n: p.grad.contiguous() for n, p in ref.named_parameters()}, os.path.join(grad_dir, "model.safetensors"))
    shutil.copy(os.path.join(gpt_oss, "config.json"), grad_dir)
    cfg = config_from_hf(gpt_oss)
    files = hf.WeightFiles(grad_dir)
    shapes = {n: p.shape for n, p in plain_model(cfg).named_parameters()}
    for i, layout in enumerate(LAYOUTS):
        assert abs(per_rank[0][i][0] - float(ref_loss)) <= 1e-6 * float(ref_loss), (layout, per_rank[0][i][0])
        ours = global_grads([g for r in per_rank for g in r[i][1]], shapes)
        for n, g in ours.items():
            want = hf.tensor_source(n, cfg, files).read(files, tuple(slice(0, s) for s in shapes[n]))
            assert float(want.abs().max()) > 0, n
            assert_close(g, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{layout} {n}: {m}")


# ---------------------------------------------------------------- cp4 attention with sinks and windows (one 4-rank fork)
def _rank_attention(seed):
    """Every rank draws the same global q, k, v, sinks, documents and output gradient; ring and Ulysses on cp4
    against `local_attention` on the whole sequence; the contiguous windowed ring's ledger."""
    g = torch.Generator().manual_seed(seed)
    mesh = make_mesh(cp=4)
    axis = mesh["cp"]
    b, s, d, window = 2, 32, 8, 5
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g)
    doc = document_ids(torch.randint(0, 6, (b, s), generator=g), eos=0)
    dout = torch.randn(b, 4, s, d, generator=g)
    ledgers = {}
    for attn in (ring_attention, ulysses_attention):
        for order in ("balanced", "contiguous"):
            for docs in (None, doc):
                ref_in = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
                ref = local_attention(*ref_in[:3], sinks=ref_in[3], window=window, doc_ids=docs)
                ref.backward(dout)
                loc = [shard_sequence(t, axis.rank, 4, order, dim=2).requires_grad_() for t in (q, k, v)]
                own_sinks = sinks.clone().requires_grad_()
                mesh.ledger.reset()
                out = attn(*loc, axis, order=order, doc_ids=docs, sinks=own_sinks, window=window)
                out.backward(shard_sequence(dout, axis.rank, 4, order, dim=2))
                ledgers[(attn.__name__, order, docs is not None)] = mesh.ledger.snapshot().get("cp", {})
                what = f"{attn.__name__} {order} docs={docs is not None}"
                for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc)),
                                           (ref, *(t.grad for t in ref_in[:3]))):
                    assert_close(got, shard_sequence(want, axis.rank, 4, order, dim=2), **TOL,
                                 msg=lambda m: f"{what} {name}: {m}")
                # each rank's sink gradient covers its rows (ring) or its heads (Ulysses): they sum to the whole
                total = own_sinks.grad.clone()
                import torch.distributed as dist
                dist.all_reduce(total, group=axis.group)
                assert_close(total, ref_in[3].grad, **TOL, msg=lambda m: f"{what} dsinks: {m}")
    return ledgers


def test_cp4_sinks_windows_and_documents_match_one_device():
    seed = fresh_seed()
    try:
        per_rank = run_ranks(4, _rank_attention, seed)
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    blk = 2 * 2 * 8 * 8 * 4  # K or V of one rank: b · hkv · s_local · d fp32 bytes
    for ledgers in per_rank:
        # contiguous, window 5 over 8-token blocks: only the previous rank's block is in reach (ring_steps 2):
        # forward K, V once; backward K, V once more and dK, dV once (straight home); nothing else is sent
        for docs in (False, True):
            sent = ledgers[("ring_attention", "contiguous", docs)]["send"]
            assert sent["count"] == 6 and sent["bytes"] == 6 * blk, sent
        # balanced: steps 1 and 3 only (rank r − 1's block passed on, rank r + 1's sent straight); forward K, V twice;
        # backward K, V twice and dK, dV home from each step (a run of one step each): 12 sends, not the full ring's 18
        for docs in (False, True):
            sent = ledgers[("ring_attention", "balanced", docs)]["send"]
            assert sent["count"] == 12 and sent["bytes"] == 12 * blk, sent


# ---------------------------------------------------------------- verify on every axis (one 4-rank fork)
VERIFY_LAYOUTS = {  # three steps each on seeded weights; the degrees fill a world of 4
    "dp2_tp2_sp": ParallelConfig(dp=2, tp=2, sequence_parallel=True),  # heads and their sinks split
    "dp4_ep2_zero1": ParallelConfig(dp=4, ep=2, zero=1),  # experts' biases and clamp, the router's bias
    # ring with layer 0's window and the sinks merged after the ring; experts on dp×cp; every parameter sharded
    "dp2_cp2_ring_ep2_zero3": ParallelConfig(dp=2, cp=2, ep=2, zero=3),
    "dp2_cp2_ulysses": ParallelConfig(dp=2, cp=2, cp_impl="ulysses"),  # sinks follow the heads
    "dp2_pp2": ParallelConfig(dp=2, pp=2),
}


def test_verify_every_axis(gpt_oss):
    """`verify` (loss, every reduced gradient, every parameter and update, three AdamW steps, routing replay) of the
    small gpt-oss on each layout of VERIFY_LAYOUTS in one fork; vocabulary 257 for verify's byte data."""
    seed = fresh_seed()
    model = dataclasses.replace(config_from_hf(gpt_oss), vocab_size=257)
    cfgs = [TrainConfig(model=model, parallel=p, seq_len=SEQ, micro_batch=2, global_batch=2 * p.dp, steps=3,
                        seed=seed, progress=False) for p in VERIFY_LAYOUTS.values()]
    try:
        results = run_ranks(4, verify_all, cfgs, timeout_s=300)[0]
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    for name, result in zip(VERIFY_LAYOUTS, results):
        assert result["passed"], (seed, name, result)


def test_generate_decodes_with_windows_and_sinks_as_transformers(gpt_oss):
    """The KV-cache decode (a sliding layer's newest token sees its window's latest keys, the sinks join every
    softmax) equals transformers' greedy `generate` step by step and the full forward, past the 5-token window."""
    from shardwise.training.generate import KVCache, generate_ids, load_source

    model, *_ = load_source(gpt_oss)
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(fresh_seed()))
    scores = []
    ids, _ = generate_ids(model, prompt[0].tolist(), 6, None, scores=scores)
    ref = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        assert ids == out.sequences[0, 4:].tolist()
        assert_close(torch.stack(scores), torch.cat(out.logits).float(), rtol=1e-4, atol=1e-4)
        tokens = torch.cat([out.sequences, prompt], 1)  # 14 tokens: the window slides past the prompt
        cache = KVCache(model)
        steps = [cache.forward(tokens[:, :4])] + [cache.forward(tokens[:, i:i + 1]) for i in range(4, 14)]
        assert_close(torch.cat(steps, 1), model(tokens)[..., :64], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- planner
def test_planner_tensors_totals_and_windowed_flops(gpt_oss):
    """The planner's totals are the model's and the published ones (within 0.1%); a sliding layer's attention core
    counts min(W, s) keys. (Its tensors are the inventory's: tests/test_rules_inventory.py.)"""
    from shardwise.planner.estimate import model_flops
    from shardwise.planner.layout import Workload
    from shardwise.planner.models import ModelSpec, active_params, total_params

    cfg = config_from_hf(gpt_oss)
    spec = ModelSpec.of(cfg)
    model = plain_model(cfg)
    assert total_params(spec) == cfg.num_params() == sum(p.numel() for p in model.parameters())
    for name, total, active in (("gpt-oss-120b", 116.83e9, 5.13e9), ("gpt-oss-20b", 20.91e9, 3.61e9)):
        big = ModelSpec.of(MODEL_PRESETS[name])
        assert abs(total_params(big) / total - 1) < 1e-3, name
        assert abs((active_params(big) - big.vocab_size * big.dim) / active - 1) < 1e-3, name
    big = ModelSpec.of(MODEL_PRESETS["gpt-oss-120b"])
    full = dataclasses.replace(big, sliding_layers=(), sliding_window=0)
    wl = Workload(seq_len=4096, global_batch=8)
    core_per_layer = 3 * 8 * 4096 * 2.0 * 4096 * big.n_heads * 2 * big.head_dim  # fwd + bwd, every key
    saved = core_per_layer * (1 - 128 / 4096) * len(big.sliding_layers)
    assert model_flops(full, wl) - model_flops(big, wl) == pytest.approx(saved, rel=1e-12)


@pytest.mark.parametrize("changes,message", [
    (dict(sliding_window=-1), "sliding_window=-1 must be an integer >= 0"),
    (dict(sliding_layers=(0, 30)), "sliding_layers entry 30 is not a layer index in \\[0, 24\\)"),
    (dict(sliding_window=0), "sliding_layers=.* need sliding_window > 0"),
    (dict(attn_dropout=0.1), "attn_dropout=0.1 with attention sinks or sliding windows is not supported"),
    (dict(moe_swiglu_limit=-1.0), "moe_swiglu_limit=-1.0 must be >= 0"),
])
def test_bad_gpt_oss_fields_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(MODEL_PRESETS["gpt-oss-20b"], **changes).validate()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planner_expert_activations_equal_what_autograd_saves(dtype):
    """The clamped SwiGLU's and the expert biases' saved bytes (the grouped GEMM path) are the planner's hook."""
    from shardwise.expert_parallel.experts import GroupedExperts
    from shardwise.mesh import Axis
    from shardwise.planner import gpt_oss as planner_gpt_oss

    def saved(**kw):
        experts = GroupedExperts(4, 32, 64, Axis("ep"), grouped_mm=True, **kw)
        for p in experts.parameters():
            torch.nn.init.normal_(p)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        rows = torch.randn(40, 32, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                experts(rows, [10] * 4, torch.tensor([10] * 4))
        return sum(storages.values())

    cfg = dataclasses.replace(MODEL_PRESETS["gpt-oss-20b"], moe_ffn_dim=64)
    from shardwise.planner.models import ModelSpec

    spec = ModelSpec.of(cfg)
    e = 4 if dtype == torch.float32 else 2
    assert saved(bias=True, swiglu_limit=7.0) - saved() == planner_gpt_oss.expert_activation_bytes(spec, e, 40)
