"""Qwen3.5's published checkpoints: multimodal config.json and weights, and the published sizes.

Fast (one process):
* a tiny random `Qwen3_5ForConditionalGeneration` (tied) and `Qwen3_5MoeForConditionalGeneration` (a one-block
  vision tower beside the language model) saved with save_pretrained: `config_from_hf` reads `text_config`,
  `load_hf_into` reads `model.language_model.*`; logits, loss and every language-model gradient equal transformers'
  text forward (`input_ids` only, which runs its interleaved M-RoPE on three equal position streams: the claim that
  this is ordinary partial RoPE is checked here, not assumed); the text-only export loads in transformers and
  generates the multimodal model's tokens;
* what is set aside is the vision tower and MTP only: an unknown tensor, a missing and an unused language-model
  tensor are each one clear error; export back into the layout only for the same language model;
* `train --init-from-hf` → `hf-export` (lr 0) writes the multimodal checkpoint back, tensor for tensor, vision
  tower kept, and transformers' multimodal class generates from it what the source generates;
* the planner reads the multimodal config.json as the same model; the published config.json of 27B, 35B-A3B,
  122B-A10B and 397B-A17B (Qwen3.5-MoE's has no intermediate_size) read as the presets, whose totals are within 1%
  of the published ones.

Slow (one 4-rank fork): the dense checkpoint at tp2×cp2 and the MoE one at tp2×ep2 read their slices through the
multimodal names and give transformers' logits.
"""
import dataclasses
import json

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from shardwise.hf import weights as hf  # noqa: E402
from shardwise.config import MODEL_PRESETS, ConfigError, ParallelConfig, TrainConfig  # noqa: E402
from shardwise.hf.config import config_from_hf  # noqa: E402
from shardwise.hf.init import check_init_from_hf, not_trained_line  # noqa: E402
from shardwise.hf.export import multimodal_source  # noqa: E402
from shardwise.hf.multimodal import multimodal_config, text_view  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.parallelize import build_model  # noqa: E402

from _dist import HFGrads, fresh_seed, hf_hybrid_grad_bounds, run_ranks  # noqa: E402

# mrope_section sums to rope_dim / 2 = 4 frequencies; interleaved, as every published Qwen3.5 config.json has it.
TEXT = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.2,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [1, 1, 2], "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4,
              num_position_embeddings=16)
FAMILIES = {  # name -> (config class, model class, text_config extra, top-level extra)
    "dense": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {}, {}),
    # the small published sizes tie their embeddings, by the top level's flag (the one the class ties by)
    "dense_tied": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {"tie_word_embeddings": False},
                   {"tie_word_embeddings": True}),
    "moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", MOE, {})}


def _save(path, family, seed=0, mtp=0, **text):
    """save_pretrained of a tiny random multimodal model; `mtp` MTP-drafter tensors added to its file, as the
    published checkpoints carry them (transformers' classes neither make nor read them)."""
    cfg_cls, model_cls, extra, top = FAMILIES[family]
    torch.manual_seed(seed)
    text_config = {k: v for k, v in (TEXT | extra | text).items()  # Qwen3_5MoeTextConfig has no intermediate_size
                   if not (k == "intermediate_size" and "num_experts" in extra)}
    config = getattr(transformers, cfg_cls)(text_config=text_config, vision_config=VISION, **top)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # zero-centred norms start at 0 in HF: random ones make the +1 and the permutation matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(path))
    if mtp:
        _rewrite(path, lambda t: t | {f"mtp.layers.0.w{i}.weight": torch.zeros(2, 2) for i in range(mtp)})
    return model.eval()


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file

    f = str(path / "model.safetensors")
    save_file(edit(load_file(f)), f, metadata={"format": "pt"})


# dense untied: the MoE case covers an untied lm_head, the fork below the dense model's logits
@pytest.mark.parametrize("family", ["dense_tied", "moe"])
def test_multimodal_checkpoint_matches_transformers(tmp_path, family):
    ref_model = _save(tmp_path / "in", family)
    cfg = config_from_hf(str(tmp_path / "in"))
    assert cfg.linear_layers == (0, 1, 2) and cfg.attn_output_gate and cfg.rope_dim == 8
    assert bool(cfg.moe_experts) == (family == "moe") and cfg.tie_embeddings == (family == "dense_tied")
    model = build_model(cfg, Mesh.single(), seed=0)
    hf.load_hf_into(model, str(tmp_path / "in"))
    # MoE: fixed tokens (a fresh batch may hold a top-k near-tie the two fp32 sums resolve differently)
    seed = 0 if family == "moe" else fresh_seed()
    x = torch.randint(0, 101, (2, 25), generator=torch.Generator().manual_seed(seed))
    logits, ref_logits = model(x[:, :-1]), ref_model(input_ids=x[:, :-1]).logits
    # hf-compare's bound (1e-4 of the largest logit); fp32 vs fp32 sits ~1e-5 apart, a wrong rotary row O(1)
    diff, scale = float((logits - ref_logits).abs().max()), max(1.0, float(ref_logits.abs().max()))
    assert diff <= 1e-4 * scale, (family, seed, diff, scale)
    loss = model.loss_fn(logits, x[:, 1:]).mean()
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), x[:, 1:].flatten())
    assert abs(float(loss.detach()) - float(ref_loss.detach())) < 1e-6 * float(ref_loss.detach())
    loss.backward()
    ref_loss.backward()
    text = text_view([n for n, _ in ref_model.named_parameters()], "grads")[0]  # the language model by text names
    for n, rel, bound in hf_hybrid_grad_bounds(model, ref_model, cfg, x, text):
        assert rel < bound, (family, seed, n, rel, bound)
    grads = HFGrads(ref_model, text)
    covered = set()
    for n, _ in model.named_parameters():
        covered.update(hf.tensor_source(n, cfg, grads).names)
    assert covered == set(grads.t), set(grads.t) ^ covered  # every language-model gradient was compared
    # export: the text model in a class transformers loads; it generates what the multimodal model generates
    hf.export_hf(model, cfg, str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    prompt = torch.tensor([[5, 17, 3, 99, 42, 8, 61]])
    with torch.no_grad():
        assert_close(back(prompt).logits, ref_model(input_ids=prompt).logits, rtol=1e-5, atol=1e-5)
        ours = back.generate(prompt, max_new_tokens=6, do_sample=False)
        theirs = ref_model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
    assert ours.tolist() == theirs.tolist()


def test_what_is_set_aside_and_what_is_refused(tmp_path):
    d = tmp_path / "mm"
    _save(d, "dense", mtp=3)
    cfg = config_from_hf(str(d))
    files = hf.WeightFiles(str(d))
    assert set(files.aside) == {"vision tower", "MTP drafter"} and len(files.aside["MTP drafter"]) == 3
    line = not_trained_line(str(d))
    assert "vision tower (model.visual.*" in line and "MTP drafter (mtp.*, 3 tensors)" in line, line
    record = check_init_from_hf(str(d), cfg, 50)
    assert record["not_trained"]["MTP drafter"] == 3
    # export back into the layout only for the same language model; a run whose source is gone exports the text
    # model and says so
    with pytest.raises(ConfigError, match=r"differs from .* language model in ffn_dim"):
        multimodal_config(str(d), dataclasses.replace(cfg, ffn_dim=64))
    (tmp_path / "run").mkdir()
    for source, written in ((d, "multimodal layout, its vision tower copied"), (tmp_path / "gone", "is gone")):
        (tmp_path / "run" / "config.json").write_text(json.dumps({"train": {"init_from_hf": str(source)}}))
        found, said = multimodal_source(str(tmp_path / "run" / "checkpoints"))
        assert found == (str(d) if source == d else None) and written in said, said
    # a tensor of no known part is refused, not skipped
    _rewrite(d, lambda t: t | {"model.projector.weight": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"'model.projector.weight' is neither the language model's"):
        check_init_from_hf(str(d), cfg, 50)
    # a missing language-model tensor names its stored name
    _rewrite(d, lambda t: {k: v for k, v in t.items() if k not in ("model.projector.weight",
                                                                   "model.language_model.layers.1.linear_attn.A_log")})
    with pytest.raises(ConfigError, match=r"no tensor 'model.language_model.layers.1.linear_attn.A_log'"):
        check_init_from_hf(str(d), cfg, 50)
    # a language-model tensor shardwise would not read is refused (never silently left untrained)
    _rewrite(d, lambda t: t | {"model.language_model.layers.1.linear_attn.A_log": torch.zeros(4),
                               "model.language_model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ConfigError, match=r"'model.language_model.layers.0.self_attn.q_proj.weight' \(and 0 more\) "
                                          "would not be trained"):
        check_init_from_hf(str(d), cfg, 50)


def test_config_json_fields(tmp_path):
    """text_config is the model; the top level's tie_word_embeddings is the one the class ties by; what shardwise
    cannot compute the same way is refused with the field named; the planner reads the same model."""
    from shardwise.planner.models import ModelSpec, load_hf_config

    _save(tmp_path, "moe")
    path = tmp_path / "config.json"
    outer = json.loads(path.read_text())
    cfg = config_from_hf(str(tmp_path))
    (tmp_path / "text.json").write_text(json.dumps(outer["text_config"] | {"architectures": ["Qwen3_5MoeForCausalLM"]}))
    assert config_from_hf(str(tmp_path / "text.json")) == cfg  # the text-only config.json of the same model
    assert cfg.moe_shared_experts == 1 and cfg.moe_shared_gate and not cfg.moe_softmax_before_topk
    spec = load_hf_config(path)
    assert not spec.untrainable and spec == dataclasses.replace(ModelSpec.of(cfg), name=spec.name)
    tied_text = outer["text_config"] | {"tie_word_embeddings": True}
    no_top = {k: v for k, v in outer.items() if k != "tie_word_embeddings"}
    for written, tied in ((outer | {"tie_word_embeddings": True}, True),
                          (outer | {"text_config": tied_text}, False),  # the top level's false wins
                          (no_top | {"text_config": tied_text}, False)):  # absent: Qwen3_5Config's default
        path.write_text(json.dumps(written))
        assert config_from_hf(str(tmp_path)).tie_embeddings == tied, written
    for edit, match in [
        (dict(text_config=None), "no text_config object"),
        (dict(architectures=["Qwen3_5ForCausalLM"]), "read as Qwen3_5MoeForConditionalGeneration's language model"),
        (dict(text_config=outer["text_config"] | {"attn_output_gate": False}), "attn_output_gate=False"),
        (dict(text_config=outer["text_config"] | {"model_type": "qwen3_5_text"}), "does not belong"),
    ]:
        path.write_text(json.dumps(outer | edit))
        with pytest.raises(ConfigError, match=match):
            config_from_hf(str(tmp_path))


def test_finetune_flow_writes_the_multimodal_checkpoint_back(tmp_path, capsys):
    """`train --init-from-hf` of a multimodal checkpoint (one step at lr 0) says in one line what it leaves out;
    `hf-export` writes the checkpoint back in its multimodal layout: every language-model and vision-tower tensor
    as it was (the MTP drafter, not trained with the model, left out), and transformers' multimodal class loads it
    and generates what the source generates."""
    import argparse

    from safetensors.torch import load_file

    from shardwise.cli import main
    from shardwise.commands.hf import run_export

    src, run, out = tmp_path / "src", str(tmp_path / "run"), str(tmp_path / "out")
    ref_model = _save(src, "moe", mtp=2, vocab_size=300)  # byte-level data (ids < 257) fits the vocabulary
    text = tmp_path / "bytes.txt"
    text.write_text("shardwise fine-tunes the language model of a multimodal checkpoint. " * 20)
    assert main(["train", "--init-from-hf", str(src), "--lr", "0", "--steps", "1", "--seq-len", "16",
                 "--micro-batch", "1", "--save-every", "1", "--out", run, "--no-report", "--no-progress",
                 "--data", str(text)]) == 0
    said = [ln for ln in capsys.readouterr().err.splitlines() if "multimodal" in ln]
    assert said == [f"shardwise train: --init-from-hf {src} is multimodal: its language model is trained; the vision "
                    "tower (model.visual.*, 21 tensors) and the MTP drafter (mtp.*, 2 tensors) are neither loaded nor "
                    "trained"], said
    assert run_export(argparse.Namespace(ckpt_dir=f"{run}/checkpoints", out_dir=out)) == 0
    assert "multimodal layout, its vision tower copied" in capsys.readouterr().out
    original, exported = load_file(str(src / "model.safetensors")), load_file(f"{out}/model.safetensors")
    assert sorted(exported) == sorted(n for n in original if not n.startswith("mtp."))
    for n, t in original.items():  # norms: +1 then −1 in fp32, within 1 ulp of 1
        if not n.startswith("mtp."):
            assert_close(exported[n], t, rtol=0, atol=2.4e-7, msg=lambda e: f"{n}: {e}")
    back = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(back) is type(ref_model)
    prompt = torch.tensor([[5, 17, 3, 299, 42, 8, 61]])
    with torch.no_grad():
        ours = back.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
        assert ours.tolist() == ref_model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False).tolist()


# ---------------------------------------------------------------- published sizes
@pytest.mark.parametrize("preset,total,active", [("qwen3.5-27b", 27e9, 27e9), ("qwen3.5-35b-a3b", 35e9, 3e9),
                                                 ("qwen3.5-122b-a10b", 122e9, 10e9),
                                                 ("qwen3.5-397b-a17b", 397e9, 17e9)])
def test_preset_sizes_match_published(preset, total, active):
    """The planner's totals within 1% of the model cards' (the text model: the cards' 27B dense is 26.90B here, the
    checkpoint's 27.8B adding the vision tower and MTP drafter); the cards' active counts are whole billions, which
    ours round to (35B-A3B: 3.45B, 122B-A10B: 9.77B, 397B-A17B: 17.35B)."""
    from shardwise.planner.models import PRESETS, active_params, total_params

    cfg, spec = MODEL_PRESETS[preset], PRESETS[preset]
    cfg.validate()
    assert total_params(spec) == cfg.num_params() and active_params(spec) == cfg.num_active_params()
    assert abs(total_params(spec) / total - 1) < 0.01, total_params(spec)
    assert round(active_params(spec) / 1e9) == active / 1e9, active_params(spec)


# The published config.json of Qwen/Qwen3.5-27B, -35B-A3B, -122B-A10B and -397B-A17B (text_config as public tools
# quote it: THUDM/slime's model scripts, Megatron-Bridge's and vLLM's Qwen3.5 tests; the vision config abridged):
# read as the presets.
PUBLISHED_TEXT = dict(attention_bias=False, attn_output_gate=True, full_attention_interval=4, head_dim=256,
                      hidden_act="silu", linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
                      linear_value_head_dim=128, mamba_ssm_dtype="float32", max_position_embeddings=262144,
                      mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, rms_norm_eps=1e-6,
                      partial_rotary_factor=0.25, vocab_size=248320, tie_word_embeddings=False,
                      rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                       "partial_rotary_factor": 0.25, "rope_theta": 10000000})
PUBLISHED = {
    "qwen3.5-27b": ("qwen3_5", dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                    num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48)),
    "qwen3.5-35b-a3b": ("qwen3_5_moe", dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                            num_key_value_heads=2, linear_num_value_heads=32, num_experts=256,
                                            num_experts_per_tok=8, moe_intermediate_size=512,
                                            shared_expert_intermediate_size=512)),
    "qwen3.5-122b-a10b": ("qwen3_5_moe", dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
                                              num_key_value_heads=2, linear_num_value_heads=64, num_experts=256,
                                              num_experts_per_tok=8, moe_intermediate_size=1024,
                                              shared_expert_intermediate_size=1024)),
    "qwen3.5-397b-a17b": ("qwen3_5_moe", dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                                              num_key_value_heads=2, linear_num_value_heads=64, num_experts=512,
                                              num_experts_per_tok=10, moe_intermediate_size=1024,
                                              shared_expert_intermediate_size=1024)),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_published_config_json_is_the_preset(tmp_path, preset):
    mt, text = PUBLISHED[preset]
    arch = "Qwen3_5MoeForConditionalGeneration" if mt == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": mt, "tie_word_embeddings": False, "image_token_id": 248056,
        "text_config": PUBLISHED_TEXT | text | {"model_type": f"{mt}_text"},
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 27, "hidden_size": 1152, "out_hidden_size": 5120}}))
    cfg = config_from_hf(str(tmp_path))
    want = MODEL_PRESETS[preset]
    # the shapes and the routing are the checkpoint's; the aux loss is a training choice (the preset's is
    # per-layer at 1e-3, config.json's none without output_router_logits)
    assert dataclasses.replace(cfg, name=want.name, moe_aux_loss_coef=want.moe_aux_loss_coef,
                               moe_aux_loss_scope=want.moe_aux_loss_scope) == want


# ---------------------------------------------------------------- layouts (one fork)
def _rank_layouts(dense_dir, moe_dir, tokens):
    from shardwise.commands.hf import rank_forward

    out = {}
    for name, path, parallel in (("dense_tp2_cp2", dense_dir, ParallelConfig(cp=2, tp=2)),
                                 ("moe_tp2_ep2", moe_dir, ParallelConfig(dp=2, tp=2, ep=2))):
        tc = TrainConfig(model=config_from_hf(path), parallel=parallel, seq_len=tokens.shape[1], micro_batch=1,
                         global_batch=2, steps=1, progress=False)
        tc = tc.resolved()
        out[name] = rank_forward(tc, path, tokens)["logits"]
    return out


def test_multimodal_layouts_match_transformers(tmp_path):
    dense, moe = _save(tmp_path / "dense", "dense"), _save(tmp_path / "moe", "moe")
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    per_rank = run_ranks(4, _rank_layouts, str(tmp_path / "dense"), str(tmp_path / "moe"), tokens, timeout_s=300)
    with torch.no_grad():
        ref = {"dense_tp2_cp2": dense(input_ids=tokens).logits, "moe_tp2_ep2": moe(input_ids=tokens).logits}
    for name, want in ref.items():
        assert_close(per_rank[0][name], want, rtol=1e-5, atol=1e-4, msg=lambda e: f"{name}: {e}")
