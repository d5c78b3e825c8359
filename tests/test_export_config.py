"""hf-export keeps the model it started from: the config.json of every family shardwise reads (tiny random
transformers configs, saved with save_pretrained) comes back key by key through `train --init-from-hf`'s config
mapping and the export's, its architecture and the fields shardwise does not read included; a field the run changed
(the aux-loss coefficient) is the only one rewritten. One whole run (Qwen3.5-MoE text, the case that was exported as
Qwen3-Next with its router_aux_loss_coef zeroed) goes through train → hf-export → transformers."""
import argparse
import json
import os

import pytest

from shardwise.hf.config import export_config, init_model_config

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
NEXT = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = {  # name -> (config class, its fields beyond BASE)
    "llama": ("LlamaConfig", dict(rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=12)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", MOE | dict(head_dim=12, mlp_only_layers=[1], norm_topk_prob=True)),
    "deepseek_v2": ("DeepseekV2Config", dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
                                             v_head_dim=10)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=16,
                                             q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)),
    "qwen3_next": ("Qwen3NextConfig", NEXT | MOE | dict(shared_expert_intermediate_size=32)),
    "qwen3_next_dense": ("Qwen3NextConfig", NEXT | dict(num_experts=0)),
    "qwen3_5_text": ("Qwen3_5TextConfig", NEXT),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", NEXT | MOE | dict(shared_expert_intermediate_size=16)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=5, num_hidden_layers=2)),
}
MOE_FAMILIES = {"mixtral", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "gpt_oss"}


def _save_config(folder, family):
    cls, extra = FAMILIES[family]
    fields = BASE | extra
    if family == "qwen3_5_moe_text":  # Qwen3_5MoeTextConfig has no intermediate_size
        fields.pop("intermediate_size")
    arch = cls.replace("TextConfig", "Config").replace("Config", "ForCausalLM")  # what the model class writes
    getattr(transformers, cls)(**fields, architectures=[arch]).save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _differing(a: dict, b: dict) -> dict:
    return {k: (a.get(k, "absent"), b.get(k, "absent")) for k in set(a) | set(b) if a.get(k, "absent") != b.get(k, "absent")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_json_round_trips_key_by_key(family, tmp_path):
    src = _save_config(str(tmp_path), family)
    cfg = init_model_config(str(tmp_path), None, {})
    out = export_config(cfg, str(tmp_path))
    fp32 = {k: "float32" for k in ("dtype", "torch_dtype") if k in src}  # the export writes fp32 weights
    assert _differing(src | fp32, out) == {}, family
    assert out["architectures"] == src["architectures"] and out["model_type"] == src["model_type"]
    if family in MOE_FAMILIES:  # a fine-tune with the aux loss on rewrites just the keys that say so
        changed = export_config(init_model_config(str(tmp_path), None, {"moe_aux_loss_coef": 0.01}), str(tmp_path))
        assert _differing(out, changed) == {"router_aux_loss_coef": (src["router_aux_loss_coef"], 0.01),
                                            "output_router_logits": (False, True)}, family


def test_without_its_source_the_model_alone_is_written(tmp_path):
    """No run source (or one that is gone): config.json is generated from the model, as before."""
    _save_config(str(tmp_path), "llama")
    cfg = init_model_config(str(tmp_path), None, {})
    assert export_config(cfg, str(tmp_path / "gone")) == export_config(cfg)
    assert export_config(cfg)["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_qwen3_5_moe_fine_tune_exports_its_own_config(tmp_path, capsys):
    """train --init-from-hf of a Qwen3_5MoeForCausalLM (one step at lr 0) → hf-export: config.json is the source's
    but for the fp32 dtype and the token ids the run trained with, and transformers' logits of the export equal the source's."""
    import torch

    from shardwise.cli import main
    from shardwise.commands.hf import hf_logits

    cls, extra = FAMILIES["qwen3_5_moe_text"]
    fields = {k: v for k, v in (BASE | extra).items() if k != "intermediate_size"}
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(getattr(transformers, cls)(**fields, router_aux_loss_coef=0.001))
    src = str(tmp_path / "src")
    model.save_pretrained(src)
    text = tmp_path / "bytes.txt"  # byte-level text (no tokenizer to check against): ids < 257 fit the vocabulary
    text.write_text("shardwise fine-tunes a hybrid MoE on a few bytes of text. " * 20)
    run = str(tmp_path / "run")
    assert main(["train", "--init-from-hf", src, "--lr", "0", "--steps", "1", "--seq-len", "16", "--micro-batch", "1",
                 "--out", run, "--no-report", "--no-progress", "--data", str(text)]) == 0
    out = str(tmp_path / "exported")
    from shardwise.commands.hf import run_export

    assert run_export(argparse.Namespace(ckpt_dir=os.path.join(run, "checkpoints"), out_dir=out)) == 0
    assert f"{os.path.abspath(src)}'s config.json" in capsys.readouterr().out
    source, exported = (json.load(open(os.path.join(d, "config.json"))) for d in (src, out))
    fp32 = {k: "float32" for k in ("dtype", "torch_dtype") if k in source}
    # the ids of the tokenizer the run trained with (bytes: end of document 256) fill the ones the source lacks
    assert _differing(source | fp32, exported) == {k: (None, 256) for k in ("bos_token_id", "eos_token_id",
                                                                            "pad_token_id")}
    assert exported["architectures"] == ["Qwen3_5MoeForCausalLM"] and exported["router_aux_loss_coef"] == 0.001
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf_logits(out, tokens), hf_logits(src, tokens), atol=1e-5, rtol=0)
