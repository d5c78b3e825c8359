"""A Hugging Face config.json as ModelConfig fields, strictly or leniently: the planner also plans models
`shardwise train` cannot build (GPT-2, shapes the strict reader refuses), so it asks for the lenient reading,
which falls back from `hf_config.config_from_hf` to the shapes alone. Torch-free; reads through
`hf_config.read_hf_config`, the one reader of the file."""
from __future__ import annotations

import dataclasses
import os

from ..config import ConfigError
from .config import DSA, MULTIMODAL, QWEN3_NEXT, SUPPORTED, config_file, config_from_hf, read_hf_config

LENIENT_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt2", "gpt_oss",
                 "deepseek_v2", *QWEN3_NEXT, *MULTIMODAL, "kimi_linear")
"""model_types a lenient reading accepts: gpt2 besides the trainer's families the planner models."""
STRICT_ONLY = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", *QWEN3_NEXT, *MULTIMODAL,
               "kimi_linear")  # gpt-oss and the linear-attention hybrids: strictly
"""Families with no shape-only reading (their expert and attention layouts need the strict one)."""
LENIENT_TYPES = LENIENT_TYPES + ("glm4_moe", "minimax_m2")  # GLM-4.5 and MiniMax-M2 (docs/families-2026.md):
STRICT_ONLY = STRICT_ONLY + ("glm4_moe", "minimax_m2")  # strictly
LENIENT_TYPES += DSA  # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): strictly, like DeepSeek-V3
STRICT_ONLY += DSA
# Hugging Face's defaults for max_position_embeddings where a config.json leaves it out.
_HF_MAX_POS = {"llama": 2048, "mistral": 32768, "mixtral": 32768, "qwen2": 32768, "qwen3": 32768}


def model_fields_from_hf(path: str, *, lenient: bool = False) -> tuple[dict, str]:
    """ModelConfig fields of the HF model at `path`, and why `shardwise train` refuses it ('' = it builds it).

    Strict (the default) is `config_from_hf`. `lenient` accepts LENIENT_TYPES, and reads a refused llama,
    mistral, mixtral, qwen2 or qwen3 config, and any gpt2 one, for its shapes alone; gpt2's fields add the
    architecture variants only the planner models (mlp, norm, linear_bias, learned_pos). Errors of the lenient
    reading do not name the file (the caller does)."""
    if not lenient:
        cfg = config_from_hf(path)
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, ""
    hf = read_hf_config(path)
    mt = hf.get("model_type")
    if mt not in LENIENT_TYPES:
        raise ConfigError(f"model_type {mt!r} is not supported; supported: {', '.join(LENIENT_TYPES)}")
    refusal = f"shardwise train has no model_type {mt!r}"
    if mt in SUPPORTED or mt in MULTIMODAL:  # a multimodal config.json: its language model, strictly
        try:
            return model_fields_from_hf(path)
        except ConfigError as e:
            if mt in STRICT_ONLY:
                raise
            refusal = f"shardwise train refuses it: {e}"
    return _shape_fields(hf, mt, str(hf.get("_name_or_path") or os.path.basename(os.path.dirname(
        os.path.abspath(config_file(path)))) or mt)), refusal


def _shape_fields(hf: dict, mt: str, name: str) -> dict:
    """The shapes of a config.json alone: sizes, head layout, experts; nothing refused for its arithmetic."""
    def need(key: str) -> int:
        v = hf.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{key!r} must be a positive integer for model_type {mt!r}, got {v!r}")
        return v

    if mt == "gpt2":
        h, heads = need("n_embd"), need("n_head")
        if h % heads:
            raise ConfigError(f"n_embd={h} is not divisible by n_head={heads}")
        return dict(name=name, vocab_size=need("vocab_size"), dim=h, n_layers=need("n_layer"), n_heads=heads,
                    n_kv_heads=heads, head_dim=h // heads, ffn_dim=hf.get("n_inner") or 4 * h,
                    max_seq_len=hf.get("n_positions", 1024), tie_embeddings=hf.get("tie_word_embeddings", True),
                    mlp="gelu", norm="layernorm", linear_bias=True, learned_pos=True,
                    dropout=float(hf.get("resid_pdrop", 0.1)), attn_dropout=float(hf.get("attn_pdrop", 0.1)))
    h, heads = need("hidden_size"), need("num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or (128 if mt == "qwen3" else h // heads)
    if not hf.get("head_dim") and h % heads:
        raise ConfigError(f"hidden_size={h} is not divisible by num_attention_heads={heads}")
    if heads % kv:
        raise ConfigError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv}")
    out = dict(name=name, vocab_size=need("vocab_size"), dim=h, n_layers=need("num_hidden_layers"), n_heads=heads,
               n_kv_heads=kv, head_dim=head_dim, ffn_dim=need("intermediate_size"),
               max_seq_len=hf.get("max_position_embeddings", _HF_MAX_POS[mt]),
               tie_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=(mt == "qwen2"),
               attn_dropout=float(hf.get("attention_dropout", 0.0)), qk_norm=(mt == "qwen3"))
    if mt == "mixtral":
        out |= dict(moe_experts=need("num_local_experts"), moe_topk=need("num_experts_per_tok"),
                    moe_softmax_before_topk=False)
    return out
