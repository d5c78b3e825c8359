"""Hugging Face `config.json` <-> ModelConfig, torch-free: the one reader of a config.json (a multimodal Qwen3.5
one read as its language model, `language_model_config`). The trainer's
`--model-config`, `hf.py` (weights in and out of any layout) and the planner all read through it.

Strictly (`config_from_hf`) it refuses, naming the field and its value, anything shardwise's model would
silently compute differently. The planner, which also plans models train cannot build, asks for a lenient
reading (`hf_shapes.model_fields_from_hf(..., lenient=True)`): what this one refuses is read for its shapes only.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

from ..config import ConfigError, ModelConfig
from ..rules.hf_types import MULTIMODAL, SUPPORTED, model_types

# Each model class's rope_theta when config.json omits it (HF's class defaults).
DEFAULT_THETA = {"llama": 10000.0, "mistral": 10000.0, "qwen2": 10000.0, "mixtral": 1e6, "qwen3": 10000.0,
                 "qwen3_moe": 10000.0, "deepseek_v2": 10000.0, "deepseek_v3": 10000.0, "gpt_oss": 150000.0,
                 "qwen3_next": 10000.0, "qwen3_5_text": 10000.0, "qwen3_5_moe_text": 10000.0, "kimi_linear": 10000.0}
ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                "deepseek_v2": "DeepseekV2ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "kimi_linear": "KimiLinearForCausalLM"}
QWEN3_NEXT = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # Gated DeltaNet + gated attention hybrids
MULTIMODAL_ARCHITECTURE = {"qwen3_5": "Qwen3_5ForConditionalGeneration",
                           "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
QWEN3 = ("qwen3", "qwen3_moe", *QWEN3_NEXT)  # per-head q/k RMSNorm, explicit head_dim
# DeepSeek Sparse Attention: DeepSeek-V3's architecture plus a lightning indexer per layer (models/sparse_attention.py)
DSA = ("deepseek_v32", "glm_moe_dsa")
DEFAULT_THETA.update({"deepseek_v32": 10000.0, "glm_moe_dsa": 10000.0})
ARCHITECTURE.update({"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"})
# ModelConfig fields that newer shardwise versions add; a config needing a missing one is refused.
_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


# ---------------------------------------------------------------- config.json -> ModelConfig
def config_file(path: str) -> str:
    """`path` itself when it is a file (`--model-config config.json`), else `path`/config.json (a model directory)."""
    return str(path) if os.path.isfile(path) else os.path.join(path, "config.json")


def read_hf_config(path: str) -> dict:
    cfg_file = config_file(path)
    try:
        with open(cfg_file) as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json (no such file; expected a Hugging Face config.json or model "
                          "directory)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object")
    return hf


def language_model_config(hf: dict, where: str) -> dict:
    """A multimodal config.json's language model as a text-only config.json (`hf` itself for a text model).

    Its fields are `text_config`'s, but tie_word_embeddings is the top level's (default false, as in
    Qwen3_5Config): that is the flag the *ForConditionalGeneration class ties its lm_head by."""
    mt = hf.get("model_type")
    if mt not in MULTIMODAL:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: model_type={mt!r} is multimodal but config.json has no text_config object")
    text = dict(text)
    if text.setdefault("model_type", MULTIMODAL[mt]) != MULTIMODAL[mt]:
        raise ConfigError(f"{where}: text_config.model_type={text['model_type']!r} does not belong to "
                          f"model_type={mt!r}; expected {MULTIMODAL[mt]!r}")
    text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    return text


def _yarn(src: dict, hf: dict, where: str, field: str) -> tuple[tuple, float]:
    """(ModelConfig.rope_yarn, MLA's softmax mscale²) as transformers reads a yarn RoPE: `_compute_yarn_parameters`
    (factor defaulting to max_position_embeddings / original_max_position_embeddings, attention_factor from
    mscale / mscale_all_dim, beta_fast 32 and beta_slow 1 when absent or 0, truncate default true) and
    DeepSeek's `yarn_apply_mscale` (the softmax scale times yarn_get_mscale(factor, mscale_all_dim)²)."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    try:
        old = int(src["original_max_position_embeddings"])
    except KeyError:
        raise ConfigError(f"{where}: {field} of rope_type 'yarn' lacks 'original_max_position_embeddings'") from None
    factor = src.get("factor")
    factor = float(factor) if factor is not None else int(_req(hf, "max_position_embeddings", where)) / old
    attention = src.get("attention_factor")
    m, m_all = src.get("mscale"), src.get("mscale_all_dim")
    if attention is None:
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    yarn = (factor, old, float(src.get("beta_fast") or 32), float(src.get("beta_slow") or 1), float(attention),
            bool(src.get("truncate", True)))
    softmax = mscale(float(src["factor"]), m_all) ** 2 if m_all and src.get("factor") is not None else 1.0
    return yarn, softmax


def _rope(hf: dict, where: str, mt: str) -> tuple[float, tuple | None, tuple | None, float]:
    """(theta, llama3 scaling or None, yarn or None, MLA softmax mscale²) from either the 4.x keys (rope_theta,
    rope_scaling) or 5.x rope_parameters."""
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where}: per-layer-type rope_parameters={params!r} are not supported")
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA[mt])))
    src = params if params.get("rope_type", "default") != "default" else legacy
    kind = src.get("rope_type", src.get("type", "default"))
    if kind == "default":
        return theta, None, None, 1.0
    field = "rope_parameters" if src is params else "rope_scaling"
    if kind == "yarn":
        return (theta, None, *_yarn(src, hf, where, field))
    if kind != "llama3":
        raise ConfigError(f"{where}: {field}.rope_type={kind!r} is not supported (only 'default', 'llama3' and "
                          "'yarn' RoPE are implemented)")
    if "rope_scaling" not in _FIELDS:
        raise ConfigError(f"{where}: {field}.rope_type='llama3' needs ModelConfig.rope_scaling, which this "
                          "shardwise lacks")
    try:
        scaling = (float(src["factor"]), float(src["low_freq_factor"]), float(src["high_freq_factor"]),
                   int(src["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"{where}: {field} of rope_type 'llama3' lacks {e.args[0]!r}") from None
    return theta, scaling, None, 1.0


def _max_positions(hf: dict, where: str, mt: str) -> int:
    """max_position_embeddings, clamped to a sliding window if one is in effect.

    Within its window a sliding-window layer sees every earlier token, exactly like full causal
    attention; shardwise has no sliding-window kernel, so sequences are capped at the window instead.
    """
    n = int(_req(hf, "max_position_embeddings", where))
    window = hf.get("sliding_window")
    if mt in ("qwen2", *QWEN3) and not hf.get("use_sliding_window", False):
        window = None
    if mt == "gpt_oss":  # its windows are computed (ModelConfig.sliding_window), so the context is not capped
        window = None
    if window is not None and int(window) < n:
        warnings.warn(f"{where}: sliding_window={window} < max_position_embeddings={n}: sequences are limited to "
                      f"{window} tokens, where full causal attention equals sliding-window attention", stacklevel=3)
        return int(window)
    return n


def _req(hf: dict, key: str, where: str):
    if hf.get(key) is None:
        raise ConfigError(f"{where}: config.json lacks {key!r}")
    return hf[key]


def config_from_hf(path: str) -> ModelConfig:
    """The ModelConfig of the HF model in directory `path` (or of config.json `path`); ConfigError for anything
    not supported."""
    where = config_file(path)
    outer = read_hf_config(path)
    arch = outer.get("architectures") or []
    if outer.get("model_type") in MULTIMODAL:
        want = MULTIMODAL_ARCHITECTURE[outer["model_type"]]
        if arch and want not in arch:
            raise ConfigError(f"{where}: architectures={arch!r}: model_type={outer['model_type']!r} is read as "
                              f"{want}'s language model")
        arch = []
    hf = language_model_config(outer, where)
    where = where if hf is outer else f"{where} text_config"
    mt = hf.get("model_type")
    if mt == "kimi_linear":
        hf = kimi_keys(hf)
    if mt not in SUPPORTED:
        raise ConfigError(f"{where}: model_type={mt!r} is not supported; supported: {', '.join(model_types())}")
    if arch and not any(a.endswith("ForCausalLM") for a in arch):
        raise ConfigError(f"{where}: architectures={arch!r}: only *ForCausalLM models (and Qwen3.5's "
                          f"{', '.join(MULTIMODAL_ARCHITECTURE.values())}) are supported")

    def refuse(field, why):
        raise ConfigError(f"{where}: {field}={hf.get(field)!r} is not supported: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "shardwise's MLP is SwiGLU with silu")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "shardwise's MLP has no biases")
    quant = hf.get("quantization_config")
    if quant and not (mt == "gpt_oss" and quant.get("quant_method") == "mxfp4"):  # gpt-oss's MXFP4 is dequantised
        refuse("quantization_config", "load an unquantized checkpoint (or gpt-oss's MXFP4 experts)")
    dim, heads = int(_req(hf, "hidden_size", where)), int(_req(hf, "num_attention_heads", where))
    head_dim = 0
    if mt in QWEN3:  # Qwen3Attention: getattr(config, "head_dim", ...); Qwen3Config's default is 128, Qwen3-MoE's
        head_dim = int(hf.get("head_dim") or (128 if mt == "qwen3" else 256 if mt in QWEN3_NEXT else dim // heads))
        if hf.get("use_sliding_window"):
            refuse("use_sliding_window", "shardwise has no sliding-window attention")
        types = hf.get("layer_types")
        if mt not in QWEN3_NEXT and types and any(t != "full_attention" for t in types):
            refuse("layer_types", "only full_attention layers are supported")
    elif mt in ("deepseek_v2", "deepseek_v3", "kimi_linear", *DSA):
        head_dim = int(_req(hf, "qk_nope_head_dim", where))  # its head_dim key is the rotary size
    elif mt == "gpt_oss":  # GptOssConfig: head_dim 64 by default, independent of hidden_size
        head_dim = int(hf.get("head_dim") or 64)
    elif mt in GLM_MINIMAX:  # getattr(config, "head_dim", hidden_size // heads): GLM-4.5's 96·128 > 5120
        head_dim = int(hf.get("head_dim") or (128 if mt == "minimax_m2" else dim // heads))
    elif hf.get("head_dim") is not None and int(hf["head_dim"]) * heads != dim:
        refuse("head_dim", f"shardwise needs head_dim = hidden_size / num_attention_heads = {dim // heads}")
    # Qwen2 always has q/k/v biases; Llama's and Qwen3's attention_bias also put one on o_proj, which shardwise lacks.
    if mt not in ("qwen2", "gpt_oss", "glm4_moe") and hf.get("attention_bias"):
        refuse("attention_bias", "only q/k/v biases (model_type qwen2) are supported")
    theta, scaling, yarn, mla_mscale = _rope(hf, where, mt)
    # Qwen3_5MoeTextConfig has no intermediate_size: every layer is MoE (the dense size is the expert's, unused)
    ffn = int(hf.get("moe_intermediate_size") or 512) if mt == "qwen3_5_moe_text" else \
        int(_req(hf, "intermediate_size", where))
    kw = dict(name=f"hf-{mt}", vocab_size=int(_req(hf, "vocab_size", where)), dim=dim,
              n_layers=int(_req(hf, "num_hidden_layers", where)), n_heads=heads,
              n_kv_heads=int(hf.get("num_key_value_heads") or heads),
              ffn_dim=ffn, max_seq_len=_max_positions(hf, where, mt),
              rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
              attn_dropout=float(hf.get("attention_dropout", 0.0)), head_dim=head_dim)
    if mt in QWEN3:
        kw["qk_norm"] = True
    if scaling is not None:
        kw["rope_scaling"] = scaling
    if yarn is not None:
        kw["rope_yarn"] = yarn
        if mt in ("deepseek_v2", "deepseek_v3", *DSA):  # only DeepSeek's attention scales its softmax by mscale²
            kw["mla_mscale"] = mla_mscale
    if mt == "qwen2":
        if "attention_bias" not in _FIELDS:
            raise ConfigError(f"{where}: model_type='qwen2' has q/k/v biases, which need ModelConfig.attention_bias "
                              "(not in this shardwise)")
        kw["attention_bias"] = True
    if mt == "qwen3_moe" or (mt in QWEN3_NEXT and int(hf.get("num_experts") or 0)):
        _qwen3_moe(hf, kw, where)
    if mt in QWEN3_NEXT:
        _qwen3_next(mt, hf, kw, refuse)
    if mt in ("deepseek_v2", "deepseek_v3"):
        _deepseek(mt, hf, kw, where, refuse)
    if mt in DSA:
        _dsa(mt, hf, kw, where, refuse)
    if mt == "gpt_oss":
        _gpt_oss(hf, kw, where, refuse)
    if mt in GLM_MINIMAX:
        _glm_minimax(mt, hf, kw, where, refuse)
    if mt == "kimi_linear":
        _kimi_linear(hf, kw, where, refuse)
    if mt == "mixtral":
        # HF Mixtral: softmax over all experts, top-k, renormalise = softmax over the top-k logits; dropless. Its
        # aux loss is Qwen3-MoE's (`load_balancing_loss_func`, pooled over all layers), added only when
        # output_router_logits asks for it: shardwise's pooled scope, as for Qwen3-MoE.
        coef = float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0
        kw.update(moe_experts=int(_req(hf, "num_local_experts", where)),
                  moe_topk=int(_req(hf, "num_experts_per_tok", where)), moe_every=1, moe_ffn_dim=kw["ffn_dim"],
                  moe_shared_experts=0, moe_softmax_before_topk=False, moe_score="softmax",
                  moe_aux_loss_coef=coef, moe_aux_loss_scope="model")
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


def _qwen3_moe(hf: dict, kw: dict, where: str) -> None:
    """Qwen3-MoE's experts: softmax over all experts, top-k, renormalised when norm_topk_prob (= a softmax over
    the chosen k logits, shardwise's softmax-after-top-k), unscaled otherwise; layer i is MoE unless it is in
    mlp_only_layers or (i + 1) % decoder_sparse_step != 0; dropless; no shared experts."""
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if n_experts is None:
        raise ConfigError(f"{where}: config.json lacks 'num_experts'")
    step = int(hf.get("decoder_sparse_step", 1))
    if step < 1:
        raise ConfigError(f"{where}: decoder_sparse_step={step} must be >= 1")
    only = {int(i) for i in hf.get("mlp_only_layers") or []}
    dense = tuple(i for i in range(kw["n_layers"]) if i in only or (i + 1) % step)
    coef = float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0
    kw.update(moe_experts=int(n_experts), moe_topk=int(hf.get("num_experts_per_tok", 8)), moe_every=1,
              moe_dense_layers=dense, moe_ffn_dim=int(hf.get("moe_intermediate_size", 768)), moe_shared_experts=0,
              moe_softmax_before_topk=not hf.get("norm_topk_prob", False), moe_score="softmax",
              moe_aux_loss_coef=coef, moe_aux_loss_scope="model")


def _gpt_oss(hf: dict, kw: dict, where: str, refuse) -> None:
    """GptOssForCausalLM: q/k/v/o biases (attention_bias, default true), per-head sinks, `layer_types` of
    sliding_attention (window `sliding_window`) and full_attention (default: even layers sliding), every layer MoE
    (router with a bias, top-k logits softmaxed, experts with biases and the clamped SwiGLU); HF's pooled aux loss
    only with output_router_logits."""
    n = kw["n_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        refuse("layer_types", f"need {n} entries of sliding_attention / full_attention")
    window = int(hf.get("sliding_window") or 0)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else ()
    bias = bool(hf.get("attention_bias", True))
    coef = float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0
    kw.update(attention_bias=bias, attention_out_bias=bias, attention_sinks=True, sliding_window=window,
              sliding_layers=sliding, moe_experts=int(_req(hf, "num_local_experts", where)),
              moe_topk=int(hf.get("num_experts_per_tok", 4)), moe_every=1, moe_ffn_dim=kw["ffn_dim"],
              moe_softmax_before_topk=False, moe_score="softmax", moe_router_bias=True, moe_expert_bias=True,
              moe_swiglu_limit=float(hf.get("swiglu_limit", 7.0)), moe_swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
              moe_aux_loss_coef=coef, moe_aux_loss_scope="model")


def _dsa(mt: str, hf: dict, kw: dict, where: str, refuse) -> None:
    """DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM: DeepSeek-V3's MLA and sigmoid-routed experts (the query latent
    always on; dense layers as mlp_layer_types lists them, else the first first_k_dense_replace), every layer's
    lightning indexer: index_n_heads of index_head_dim, index_topk keys, RoPE on halves (V3.2) or interleaved (GLM).
    GLM's "shared" layers, which reuse an earlier layer's top-k, are refused."""
    _deepseek("deepseek_v3", {k: v for k, v in hf.items() if k != "rope_interleave"}, kw, where, refuse)
    types = hf.get("mlp_layer_types")
    if types is not None:
        if len(types) != kw["n_layers"] or any(t not in ("dense", "sparse") for t in types):
            refuse("mlp_layer_types", f"need {kw['n_layers']} entries, each dense or sparse")
        kw["moe_dense_layers"] = tuple(i for i, t in enumerate(types) if t == "dense")
    if any(t != "full" for t in hf.get("indexer_types") or []):
        refuse("indexer_types", "only 'full' layers (each runs its own indexer) are supported")
    if not kw["q_lora_rank"]:
        refuse("q_lora_rank", "DeepSeek Sparse Attention's indexer reads the query latent")
    kw.update(index_topk=int(hf.get("index_topk", 2048)), index_n_heads=int(hf.get("index_n_heads", 64)),
              index_head_dim=int(hf.get("index_head_dim", 128)), index_rope_interleave=mt == "glm_moe_dsa")


def _dsa_config(cfg: ModelConfig, refuse) -> dict:
    """config.json of a DeepseekV32ForCausalLM (indexer RoPE on halves) or GlmMoeDsaForCausalLM (interleaved)."""
    out = _deepseek_config(cfg, refuse)
    if out["model_type"] != "deepseek_v3" or not cfg.q_lora_rank:
        refuse("moe_score", "DeepSeek Sparse Attention models route with sigmoid scores and have a query latent")
    mt = "glm_moe_dsa" if cfg.index_rope_interleave else "deepseek_v32"
    for k in ("rope_interleave", "topk_method", "scoring_func"):  # not fields of these classes
        out.pop(k, None)
    out.update(architectures=[ARCHITECTURE[mt]], model_type=mt, index_topk=cfg.index_topk,
               index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
               mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.n_layers)])
    if mt == "glm_moe_dsa":
        out["indexer_types"] = ["full"] * cfg.n_layers
    return out


def is_gpt_oss(cfg: ModelConfig) -> bool:
    """A model with any of gpt-oss's parts: exported as gpt_oss, its tensors under GptOss's names."""
    return bool(cfg.attention_sinks or cfg.sliding_layers or cfg.attention_out_bias or cfg.moe_router_bias
                or cfg.moe_expert_bias or cfg.moe_swiglu_limit)


def _gpt_oss_config(cfg: ModelConfig, refuse) -> dict:
    """config.json of a GptOssForCausalLM: every part gpt-oss has, none it lacks."""
    checks = [("attention_sinks", True), ("attention_bias", True), ("attention_out_bias", True),
              ("moe_router_bias", True), ("moe_expert_bias", True), ("moe_every", 1), ("moe_dense_layers", ()),
              ("moe_shared_experts", 0), ("moe_score", "softmax"), ("moe_softmax_before_topk", False),
              ("qk_norm", False), ("tie_embeddings", False), ("rope_scaling", None)]
    for field, want in checks:
        if getattr(cfg, field) != want:
            refuse(field, f"GptOssForCausalLM has {field}={want!r}")
    if not cfg.moe_experts or (cfg.moe_ffn_dim or cfg.ffn_dim) != cfg.ffn_dim or not cfg.moe_swiglu_limit:
        refuse("moe_experts", "GptOssForCausalLM's every layer is MoE of intermediate_size, with the clamped SwiGLU")
    out = {"architectures": [ARCHITECTURE["gpt_oss"]], "model_type": "gpt_oss", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "tie_word_embeddings": False, "attention_dropout": cfg.attn_dropout,
           "attention_bias": True, "sliding_window": cfg.sliding_window or None,
           "layer_types": ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.n_layers)],
           "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_topk,
           "swiglu_limit": cfg.moe_swiglu_limit, "swiglu_alpha": cfg.moe_swiglu_alpha,
           "router_aux_loss_coef": cfg.moe_aux_loss_coef,
           "output_router_logits": bool(cfg.moe_aux_loss_coef) and cfg.moe_aux_loss_scope == "model",
           "torch_dtype": "float32"}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_yarn is not None:
        rope.update(_yarn_json(cfg))
    out["rope_parameters"] = rope
    return out


def _qwen3_next(mt: str, hf: dict, kw: dict, refuse) -> None:
    """Qwen3-Next / Qwen3.5: `layer_types` (or every full_attention_interval-th layer full) say which layers are
    Gated DeltaNet; full-attention layers are gated, with partial rotary; the MoE's shared expert (one SwiGLU of
    shared_expert_intermediate_size, a multiple of the expert size here) has a sigmoid gate."""
    n = kw["n_layers"]
    types = hf.get("layer_types")
    if types is None:
        every = int(hf.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in ("linear_attention", "full_attention") for t in types):
        refuse("layer_types", f"valid: {n} entries, each linear_attention or full_attention")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the Gated DeltaNet convolution and the MLP use silu")
    if hf.get("attn_output_gate", True) is not True:  # Qwen3.5's text_config spells it out; the HF classes gate always
        refuse("attn_output_gate", "the full-attention layers of Qwen3-Next / Qwen3.5 are gated")
    params = hf.get("rope_parameters") or {}
    rope = params.get("rope_type", "default")
    if rope != "default" and rope is not None:
        refuse("rope_parameters", "only the default RoPE of Qwen3-Next is supported")
    if params.get("mrope_section") and not params.get("mrope_interleaved", True):
        refuse("rope_parameters", "text-only positions need the interleaved M-RoPE (equal to plain RoPE)")
    kw.update(linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
              linear_k_heads=int(hf.get("linear_num_key_heads", 16)), linear_v_heads=int(hf.get("linear_num_value_heads", 32)),
              linear_k_dim=int(hf.get("linear_key_head_dim", 128)), linear_v_dim=int(hf.get("linear_value_head_dim", 128)),
              linear_conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)), attn_output_gate=True,
              partial_rotary=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))))
    if kw.get("moe_experts"):  # Qwen3.5-MoE always renormalises the top-k; Qwen3-Next's norm_topk_prob defaults on
        kw["moe_softmax_before_topk"] = not (mt == "qwen3_5_moe_text" or hf.get("norm_topk_prob", True))
    if mt == "qwen3_5_moe_text":  # its decoder layers are all MoE: it has no mlp_only_layers or decoder_sparse_step
        kw.update(moe_dense_layers=(), moe_ffn_dim=int(hf.get("moe_intermediate_size") or 512))
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    if kw.get("moe_experts") and shared:
        expert = kw["moe_ffn_dim"]
        if shared % expert:
            refuse("shared_expert_intermediate_size", f"must be a multiple of moe_intermediate_size={expert}")
        kw.update(moe_shared_experts=shared // expert, moe_shared_gate=True)


def _deepseek(mt: str, hf: dict, kw: dict, where: str, refuse) -> None:
    """DeepseekV3ForCausalLM / DeepseekV2ForCausalLM: MLA, first_k_dense_replace dense layers, then MoE layers
    with n_shared_experts (one SwiGLU of n_shared · moe_intermediate_size) and routed_scaling_factor.
    V3: sigmoid scores plus e_score_correction_bias for selection, groups scored by their top-2, optional
    renormalisation; transformers computes this whatever topk_method says, so noaux_tc and greedy both load.
    V2: softmax probabilities, top-k unnormalised (transformers ignores norm_topk_prob), "greedy" or
    "group_limited_greedy" (groups scored by their max); its complex RoPE rotates interleaved pairs."""
    v3 = mt == "deepseek_v3"
    methods = ("noaux_tc", "greedy") if v3 else ("greedy", "group_limited_greedy")
    if hf.get("topk_method", methods[0]) not in methods:
        refuse("topk_method", f"valid: {', '.join(methods)}")
    if hf.get("scoring_func", "sigmoid" if v3 else "softmax") != ("sigmoid" if v3 else "softmax"):
        refuse("scoring_func", f"{ARCHITECTURE[mt]} routes with {'sigmoid' if v3 else 'softmax'} scores")
    if int(hf.get("moe_layer_freq", 1)) != 1:
        refuse("moe_layer_freq", "every layer after first_k_dense_replace is MoE")
    if v3 and hf.get("rope_interleave", True) is not True:
        refuse("rope_interleave", "shardwise's MLA rotates interleaved pairs (rope_interleave true)")
    if hf.get("num_key_value_heads") not in (None, kw["n_heads"]):
        refuse("num_key_value_heads", "MLA has one K/V head per query head")
    n_layers, first = kw["n_layers"], int(hf.get("first_k_dense_replace") or 0)
    grouped = v3 or hf.get("topk_method") == "group_limited_greedy"
    n_group = int(hf.get("n_group") or 1) if grouped else 1
    kw.update(n_kv_heads=kw["n_heads"], q_lora_rank=int(hf.get("q_lora_rank") or 0),
              kv_lora_rank=int(_req(hf, "kv_lora_rank", where)), qk_rope_dim=int(_req(hf, "qk_rope_head_dim", where)),
              v_head_dim=int(_req(hf, "v_head_dim", where)),
              moe_experts=int(_req(hf, "n_routed_experts", where)), moe_topk=int(_req(hf, "num_experts_per_tok", where)),
              moe_every=1, moe_dense_layers=tuple(range(min(first, n_layers))),
              moe_ffn_dim=int(_req(hf, "moe_intermediate_size", where)),
              moe_shared_experts=int(hf.get("n_shared_experts") or 0), moe_score="sigmoid" if v3 else "softmax",
              moe_softmax_before_topk=True, moe_n_group=n_group,
              moe_topk_group=int(hf.get("topk_group") or n_group) if grouped else 1, moe_group_topk=2 if v3 else 1,
              moe_norm_topk=bool(hf.get("norm_topk_prob", True)) if v3 else False,
              moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)), moe_aux_loss_coef=0.0)


# ---------------------------------------------------------------- GLM-4.5 / MiniMax-M2 (docs/families-2026.md)
GLM_MINIMAX = ("glm4_moe", "minimax_m2")
DEFAULT_THETA.update({"glm4_moe": 10000.0, "minimax_m2": 5e6})
ARCHITECTURE.update({"glm4_moe": "Glm4MoeForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM"})


def _partial_rotary(mt: str, hf: dict, head_dim: int) -> float:
    """The rotary fraction as transformers reads it: rope_parameters' or the top-level partial_rotary_factor
    (Glm4MoeConfig's default 0.5), or MiniMax-M2's legacy rotary_dim / head_dim."""
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if factor is None and mt == "minimax_m2" and hf.get("rotary_dim"):
        factor = int(hf["rotary_dim"]) / head_dim
    return float(factor if factor is not None else 0.5 if mt == "glm4_moe" else 1.0)


def _glm_minimax(mt: str, hf: dict, kw: dict, where: str, refuse) -> None:
    """Glm4MoeForCausalLM: q/k/v biases (attention_bias), per-head q/k norms (use_qk_norm), partial rotary,
    first_k_dense_replace dense layers then MoE ones routed as DeepSeek-V3's (sigmoid, e_score_correction_bias for
    selection, groups by their top-2, renormalised top-k × routed_scaling_factor) with n_shared_experts; no aux loss
    (transformers computes none). MiniMaxM2ForCausalLM: q/k norms over all heads' width, partial rotary, every layer
    MoE of intermediate_size, sigmoid top-k renormalised, no shared expert; its load-balancing loss (softmax of the
    logits) is refused, as is router jitter."""
    n, rotary = kw["n_layers"], _partial_rotary(mt, hf, kw["head_dim"])
    kw.update(partial_rotary=rotary, moe_every=1, moe_score="sigmoid", moe_softmax_before_topk=True,
              moe_aux_loss_coef=0.0, moe_topk=int(_req(hf, "num_experts_per_tok", where)))
    if mt == "glm4_moe":
        first = int(hf.get("first_k_dense_replace", 1) or 0)
        n_group = int(hf.get("n_group") or 1)
        kw.update(attention_bias=bool(hf.get("attention_bias", False)), qk_norm=bool(hf.get("use_qk_norm", False)),
                  moe_experts=int(_req(hf, "n_routed_experts", where)),
                  moe_ffn_dim=int(_req(hf, "moe_intermediate_size", where)),
                  moe_shared_experts=int(hf.get("n_shared_experts", 1) or 0),
                  moe_dense_layers=tuple(range(min(first, n))), moe_n_group=n_group,
                  moe_topk_group=int(hf.get("topk_group") or 1), moe_group_topk=2,
                  moe_norm_topk=bool(hf.get("norm_topk_prob", True)),
                  moe_routed_scaling=float(hf.get("routed_scaling_factor", 1.0)))
        if not kw["moe_shared_experts"]:
            refuse("n_shared_experts", "shardwise reads a GLM-4.5 MoE with its shared expert (n_shared_experts >= 1)")
        return
    if hf.get("output_router_logits"):
        refuse("output_router_logits", "MiniMax-M2's load-balancing loss softmaxes its sigmoid router's logits; "
                                       "train with it off (shardwise's loss-free bias: --moe-bias-update-rate)")
    if float(hf.get("router_jitter_noise") or 0.0):
        refuse("router_jitter_noise", "router input jitter is not implemented (valid: 0)")
    experts_ffn = kw["ffn_dim"]
    kw.update(qk_norm=True, qk_norm_full=True, moe_experts=int(_req(hf, "num_local_experts", where)),
              moe_ffn_dim=experts_ffn, moe_shared_experts=0, moe_norm_topk=True)


def glm_minimax_type(cfg: ModelConfig) -> str | None:
    """The model_type an export of `cfg` writes: sigmoid-routed experts without MLA are GLM-4.5's (minimax_m2's
    with the width q/k norms); None for every other family."""
    if cfg.is_mla or not cfg.moe_experts or cfg.moe_score != "sigmoid":
        return None
    return "minimax_m2" if cfg.qk_norm_full else "glm4_moe"


def _glm_minimax_config(cfg: ModelConfig, refuse) -> dict:
    """config.json of a Glm4MoeForCausalLM or MiniMaxM2ForCausalLM; what neither expresses is refused."""
    mt = glm_minimax_type(cfg)
    first = next((i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)), cfg.n_layers)
    if any(cfg.is_moe_layer(i) != (i >= first) for i in range(cfg.n_layers)):
        refuse("moe_dense_layers", "GLM-4.5's dense layers are the first first_k_dense_replace ones")
    checks = [("attention_out_bias", False), ("attention_sinks", False), ("sliding_layers", ()), ("linear_layers", ()),
              ("attn_output_gate", False), ("rope_scaling", None), ("moe_router_bias", False),
              ("moe_expert_bias", False), ("moe_swiglu_limit", 0.0), ("moe_shared_gate", False),
              ("moe_softmax_before_topk", True)]
    if mt == "minimax_m2":
        checks += [("attention_bias", False), ("moe_shared_experts", 0), ("moe_n_group", 1), ("moe_norm_topk", True),
                   ("moe_routed_scaling", 1.0), ("moe_dense_layers", ()), ("tie_embeddings", False)]
    elif cfg.moe_n_group > 1:
        checks += [("moe_group_topk", 2)]
    for field, want in checks:
        if getattr(cfg, field) != want:
            refuse(field, f"{ARCHITECTURE[mt]} has {field}={want!r}")
    if mt == "glm4_moe" and not cfg.moe_shared_experts:
        refuse("moe_shared_experts", "Glm4MoeForCausalLM's MoE layers have a shared expert")
    expert = cfg.moe_ffn_dim or cfg.ffn_dim
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary}
    if cfg.rope_yarn is not None:
        rope.update(_yarn_json(cfg))
    out = {"architectures": [ARCHITECTURE[mt]], "model_type": mt, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "intermediate_size": expert if mt == "minimax_m2" else cfg.ffn_dim,
           "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
           "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "partial_rotary_factor": cfg.partial_rotary, "rope_parameters": rope,
           "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": cfg.attn_dropout,
           "num_experts_per_tok": cfg.moe_topk, "output_router_logits": False, "torch_dtype": "float32"}
    if mt == "glm4_moe":
        out.update(attention_bias=cfg.attention_bias, use_qk_norm=cfg.qk_norm, n_routed_experts=cfg.moe_experts,
                   moe_intermediate_size=expert, n_shared_experts=cfg.moe_shared_experts, first_k_dense_replace=first,
                   n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group, norm_topk_prob=cfg.moe_norm_topk,
                   routed_scaling_factor=cfg.moe_routed_scaling, num_nextn_predict_layers=cfg.mtp_layers)
    else:
        out.update(num_local_experts=cfg.moe_experts, rotary_dim=cfg.rope_dim, router_jitter_noise=0.0,
                   router_aux_loss_coef=0.0, qk_norm_type="per_layer", use_routing_bias=True,
                   scoring_func="sigmoid")
    return out


# KimiLinearConfig's attribute_map: the names its config.json (Moonshot's and transformers' own) uses → the names
# the readers here share with DeepSeek-V3.
_KIMI_KEYS = {"model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
              "num_expert_group": "n_group", "num_experts": "num_local_experts",
              "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts"}


def kimi_keys(hf: dict) -> dict:
    """A Kimi-Linear config.json under DeepSeek's key names (either spelling accepted, as KimiLinearConfig does)."""
    out = dict(hf)
    for theirs, ours in _KIMI_KEYS.items():
        if theirs in hf and ours not in hf:
            out[ours] = hf[theirs]
    return out


def _kimi_linear(hf: dict, kw: dict, where: str, refuse) -> None:
    """KimiLinearForCausalLM: Kimi Delta Attention layers (`layer_types`, else linear_attn_config's 1-based
    kda_layers / full_attn_layers, else every 4th layer from the 5th full) between MLA layers without RoPE; the
    MLP kinds from `mlp_layer_types` (else first_k_dense_replace, default 1, dense layers first); MoE layers are
    DeepSeek-V3's (sigmoid scores with the selection bias, groups scored by their top 2, optional renormalisation,
    routed_scaling_factor, shared experts)."""
    n = kw["n_layers"]
    la = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if types is None and "full_attn_layers" in la and "kda_layers" in la:
        types = [None] * n
        for i in la["full_attn_layers"]:
            types[int(i) - 1] = "full_attention"
        for i in la["kda_layers"]:
            types[int(i) - 1] = "linear_attention"
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in ("linear_attention", "full_attention") for t in types):
        refuse("layer_types", f"valid: {n} entries, each linear_attention or full_attention")
    first = int(hf.get("first_k_dense_replace", 1))
    mlps = hf.get("mlp_layer_types") or ["dense" if i < first else "sparse" for i in range(n)]
    if len(mlps) != n or any(t not in ("dense", "sparse") for t in mlps):
        refuse("mlp_layer_types", f"valid: {n} entries, each dense or sparse")
    if hf.get("num_key_value_heads") not in (None, kw["n_heads"]):
        refuse("num_key_value_heads", "MLA has one K/V head per query head")
    if hf.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        refuse("moe_router_activation_func", "KimiLinearForCausalLM routes with sigmoid scores")
    heads = int(la.get("num_heads", hf.get("linear_num_heads", 32)))
    width = int(la.get("head_dim", hf.get("linear_head_dim", 128)))
    n_group = int(hf.get("n_group") or 1)
    kw.update(n_kv_heads=kw["n_heads"], q_lora_rank=int(hf.get("q_lora_rank") or 0),
              kv_lora_rank=int(_req(hf, "kv_lora_rank", where)), qk_rope_dim=int(_req(hf, "qk_rope_head_dim", where)),
              v_head_dim=int(_req(hf, "v_head_dim", where)), mla_nope=True, kda=True,
              linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
              linear_k_heads=heads, linear_v_heads=heads, linear_k_dim=width, linear_v_dim=width,
              linear_conv_kernel=int(la.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))),
              moe_experts=int(_req(hf, "num_local_experts", where)), moe_topk=int(hf.get("num_experts_per_tok") or 8),
              moe_every=1, moe_dense_layers=tuple(i for i, t in enumerate(mlps) if t == "dense"),
              moe_ffn_dim=int(_req(hf, "moe_intermediate_size", where)),
              moe_shared_experts=int(hf.get("n_shared_experts") or 0), moe_score="sigmoid",
              moe_softmax_before_topk=True, moe_n_group=n_group, moe_topk_group=int(hf.get("topk_group") or n_group),
              moe_group_topk=2, moe_norm_topk=bool(hf.get("norm_topk_prob", True)),
              moe_routed_scaling=float(hf.get("routed_scaling_factor", 2.446)), moe_aux_loss_coef=0.0)


def _kimi_linear_config(cfg: ModelConfig, refuse) -> dict:
    """config.json of a KimiLinearForCausalLM, in the key names transformers writes."""
    if not (cfg.is_mla and cfg.mla_nope and cfg.moe_experts and cfg.moe_score == "sigmoid"):
        refuse("kda", "KimiLinearForCausalLM pairs Kimi Delta Attention with RoPE-free MLA and sigmoid-routed experts")
    if cfg.qk_norm or cfg.attention_bias or cfg.tie_embeddings or cfg.moe_group_topk != 2:
        refuse("qk_norm" if cfg.qk_norm else "attention_bias" if cfg.attention_bias else
               "tie_embeddings" if cfg.tie_embeddings else "moe_group_topk",
               "KimiLinearForCausalLM has none of these (groups scored by their top 2)")
    return {"architectures": [ARCHITECTURE["kimi_linear"]], "model_type": "kimi_linear", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
            "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.qk_rope_dim, "v_head_dim": cfg.v_head_dim,
            "hidden_act": "silu", "model_max_length": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": cfg.attn_dropout,
            "layer_types": ["linear_attention" if cfg.is_linear_layer(i) else "full_attention"
                            for i in range(cfg.n_layers)],
            "mlp_layer_types": ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.n_layers)],
            "linear_num_heads": cfg.linear_v_heads, "linear_head_dim": cfg.linear_v_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel, "num_experts": cfg.moe_experts,
            "num_experts_per_token": cfg.moe_topk, "moe_intermediate_size": cfg.moe_ffn_dim or cfg.ffn_dim,
            "num_shared_experts": cfg.moe_shared_experts, "num_expert_group": cfg.moe_n_group,
            "topk_group": cfg.moe_topk_group, "moe_renormalize": cfg.moe_norm_topk,
            "routed_scaling_factor": cfg.moe_routed_scaling, "torch_dtype": "float32",
            # KimiLinearConfig's defaults are the 163840-token vocabulary's ids: none unless a tokenizer gives them
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


# ---------------------------------------------------------------- export
def hf_config(cfg: ModelConfig) -> dict:
    """config.json for `cfg`: llama, qwen2 (q/k/v biases), mixtral, qwen3 or qwen3_moe (q/k norms); ConfigError for
    what HF cannot express."""
    def refuse(field, why):
        raise ConfigError(f"export: {field}={getattr(cfg, field)!r} has no Hugging Face equivalent: {why}")

    if glm_minimax_type(cfg):
        return _glm_minimax_config(cfg, refuse)
    bias = getattr(cfg, "attention_bias", False)
    if cfg.qk_norm and bias:
        refuse("attention_bias", "Qwen3 (q/k norms) has no q/k/v-only biases")
    if cfg.kda:
        return _kimi_linear_config(cfg, refuse)
    if cfg.is_dsa:
        return _dsa_config(cfg, refuse)
    if cfg.is_mla:
        return _deepseek_config(cfg, refuse)
    if is_gpt_oss(cfg):
        return _gpt_oss_config(cfg, refuse)
    if cfg.attn_output_gate:
        return _qwen3_next_config(cfg, refuse)
    mt = ("qwen3_moe" if cfg.moe_experts else "qwen3") if cfg.qk_norm else \
        "mixtral" if cfg.moe_experts else "qwen2" if bias else "llama"
    if cfg.moe_experts:
        fam = "Qwen3-MoE" if mt == "qwen3_moe" else "Mixtral"
        if bias:
            refuse("attention_bias", "Mixtral has no attention biases")
        checks = [("moe_shared_experts", 0, f"{fam} has no shared experts"),
                  ("moe_score", "softmax", f"{fam}'s router is a softmax")]
        if mt == "mixtral":
            checks += [("moe_every", 1, "every Mixtral block is MoE"),
                       ("moe_dense_layers", (), "every Mixtral block is MoE"),
                       ("moe_softmax_before_topk", False, "Mixtral renormalises over the top-k")]
        for field, want, why in checks:
            if getattr(cfg, field) != want:
                refuse(field, why)
    ffn = (cfg.moe_ffn_dim or cfg.ffn_dim) if mt == "mixtral" else cfg.ffn_dim  # Mixtral: the expert size
    out = {"architectures": [ARCHITECTURE[mt]], "model_type": mt, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "intermediate_size": ffn, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "hidden_act": "silu",
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": cfg.attn_dropout, "torch_dtype": "float32"}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling is not None:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        out["rope_scaling"] = {"rope_type": "llama3", **dict(zip(keys, scaling))}
        rope.update(out["rope_scaling"])
    if cfg.rope_yarn is not None:
        out["rope_scaling"] = _yarn_json(cfg)
        rope.update(out["rope_scaling"])
    out["rope_parameters"] = rope  # transformers >= 5 reads this, 4.x reads rope_theta / rope_scaling
    if mt == "mixtral":
        out.update(num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_topk, sliding_window=None,
                   router_aux_loss_coef=cfg.moe_aux_loss_coef,
                   output_router_logits=bool(cfg.moe_aux_loss_coef) and cfg.moe_aux_loss_scope == "model")
    if mt in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None)
    if mt in ("qwen3", "qwen3_moe"):
        out.update(attention_bias=False, max_window_layers=cfg.n_layers)
    if mt == "qwen3_moe":  # every layer's kind spelled out: decoder_sparse_step 1 plus the dense ones
        out.update(num_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_topk, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)],
                   moe_intermediate_size=cfg.moe_ffn_dim or cfg.ffn_dim,
                   norm_topk_prob=not cfg.moe_softmax_before_topk, router_aux_loss_coef=cfg.moe_aux_loss_coef,
                   output_router_logits=bool(cfg.moe_aux_loss_coef) and cfg.moe_aux_loss_scope == "model")
    return out


def _qwen3_next_config(cfg: ModelConfig, refuse) -> dict:
    """config.json of a Qwen3NextForCausalLM (MoE, or dense with num_experts 0): its layer_types, gated attention,
    partial rotary and the gated shared expert."""
    if not cfg.qk_norm or cfg.attention_bias or cfg.rope_scaling is not None or cfg.rope_yarn is not None:
        refuse("qk_norm" if not cfg.qk_norm else "attention_bias" if cfg.attention_bias else "rope_scaling",
               "Qwen3-Next has q/k norms, no attention biases and plain RoPE")
    moe = cfg.moe_experts > 0
    if moe and (cfg.moe_score != "softmax" or cfg.moe_shared_experts and not cfg.moe_shared_gate):
        refuse("moe_score" if cfg.moe_score != "softmax" else "moe_shared_gate",
               "Qwen3-Next routes by softmax and gates its shared expert")
    out = {"architectures": [ARCHITECTURE["qwen3_next"]], "model_type": "qwen3_next", "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                               "partial_rotary_factor": cfg.partial_rotary},
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": cfg.attn_dropout,
           "layer_types": ["linear_attention" if cfg.is_linear_layer(i) else "full_attention"
                           for i in range(cfg.n_layers)],
           "linear_num_key_heads": cfg.linear_k_heads, "linear_num_value_heads": cfg.linear_v_heads,
           "linear_key_head_dim": cfg.linear_k_dim, "linear_value_head_dim": cfg.linear_v_dim,
           "linear_conv_kernel_dim": cfg.linear_conv_kernel, "torch_dtype": "float32",
           "num_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_topk, "decoder_sparse_step": 1,
           "mlp_only_layers": [i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)] if moe else [],
           "moe_intermediate_size": cfg.moe_ffn_dim or cfg.ffn_dim,
           "shared_expert_intermediate_size": cfg.moe_shared_experts * (cfg.moe_ffn_dim or cfg.ffn_dim),
           "norm_topk_prob": not cfg.moe_softmax_before_topk, "router_aux_loss_coef": cfg.moe_aux_loss_coef,
           "output_router_logits": bool(cfg.moe_aux_loss_coef) and cfg.moe_aux_loss_scope == "model"}
    return out


def _yarn_json(cfg: ModelConfig) -> dict:
    """rope_scaling / rope_parameters of a YaRN RoPE, as transformers reads it back (`_yarn`): attention_factor
    explicit; for MLA the mscale_all_dim that gives its softmax multiplier."""
    factor, old, beta_fast, beta_slow, attention, truncate = cfg.rope_yarn
    out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": old, "beta_fast": beta_fast,
           "beta_slow": beta_slow, "attention_factor": attention, "truncate": truncate}
    if cfg.mla_mscale != 1.0:
        out["mscale_all_dim"] = (math.sqrt(cfg.mla_mscale) - 1) / (0.1 * math.log(factor))
    return out


def _deepseek_config(cfg: ModelConfig, refuse) -> dict:
    """config.json of a DeepseekV3ForCausalLM (sigmoid routing) or DeepseekV2ForCausalLM (softmax): MLA, dense
    layers first, then MoE layers."""
    if cfg.qk_norm or cfg.attention_bias or cfg.rope_scaling is not None:
        refuse("qk_norm" if cfg.qk_norm else "attention_bias" if cfg.attention_bias else "rope_scaling",
               "DeepSeek has no q/k norms, attention biases or llama3 RoPE scaling")
    first = next((i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)), cfg.n_layers)
    if any(cfg.is_moe_layer(i) != (i >= first) for i in range(cfg.n_layers)):
        refuse("moe_dense_layers", "DeepSeek's dense layers are the first first_k_dense_replace ones")
    v3 = cfg.moe_score == "sigmoid"
    grouped = cfg.moe_n_group > 1
    if cfg.moe_experts and grouped and cfg.moe_group_topk != (2 if v3 else 1):
        refuse("moe_group_topk", "DeepSeek-V3 scores a group by its top 2, V2 by its max")
    if cfg.moe_experts and not v3 and not cfg.moe_softmax_before_topk:
        refuse("moe_softmax_before_topk", "DeepSeek-V2 weights experts by their unnormalised probabilities")
    mt = "deepseek_v3" if v3 else "deepseek_v2"
    out = {"architectures": [ARCHITECTURE[mt]], "model_type": mt, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
           "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
           "qk_nope_head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.qk_rope_dim, "v_head_dim": cfg.v_head_dim,
           "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
           "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
           **({"rope_scaling": _yarn_json(cfg)} if cfg.rope_yarn is not None else {}),
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": cfg.attn_dropout,
           "n_routed_experts": cfg.moe_experts or None, "num_experts_per_tok": cfg.moe_topk,
           "moe_intermediate_size": cfg.moe_ffn_dim or cfg.ffn_dim, "n_shared_experts": cfg.moe_shared_experts,
           "first_k_dense_replace": first, "n_group": cfg.moe_n_group, "topk_group": cfg.moe_topk_group,
           "routed_scaling_factor": cfg.moe_routed_scaling, "torch_dtype": "float32"}
    if v3:
        out.update(rope_interleave=True, norm_topk_prob=cfg.moe_norm_topk, topk_method="noaux_tc",
                   scoring_func="sigmoid", num_nextn_predict_layers=cfg.mtp_layers)
    else:
        out.update(norm_topk_prob=False, topk_method="group_limited_greedy" if grouped else "greedy",
                   scoring_func="softmax")
    return out


# ModelConfig fields a fine-tune may change and the config.json keys that say them (TRAINING_ONLY's others have no
# Hugging Face key: they exist only in training).
_CHANGED_KEYS = {"attn_dropout": ("attention_dropout",), "moe_aux_loss_coef": ("router_aux_loss_coef", "output_router_logits")}


def export_config(cfg: ModelConfig, source: str | None = None) -> dict:
    """config.json of an export. From a run that started from the Hugging Face text checkpoint `source`: that
    checkpoint's own config.json — its architecture and every field, those shardwise does not read included — with
    only what the run changed rewritten (`_CHANGED_KEYS`, the MTP depth it trained, the fp32 dtype the weights are
    written in). Without a source, or when `source` no longer describes `cfg`'s shapes: `hf_config(cfg)`."""
    generated = hf_config(cfg)
    if source is None:
        return generated
    try:
        hf, theirs = read_hf_config(source), config_from_hf(source)
    except ConfigError:
        return generated
    free = TRAINING_ONLY | {"mtp_layers"}
    if hf.get("model_type") in MULTIMODAL or dataclasses.replace(theirs, **{k: getattr(cfg, k) for k in free}) != cfg:
        return generated
    out = dict(hf)
    for field, keys in _CHANGED_KEYS.items():
        if getattr(theirs, field) != getattr(cfg, field):
            out.update({k: generated[k] for k in keys if k in generated})
    if cfg.mtp_layers and "num_nextn_predict_layers" in generated:  # the MTP modules the export writes
        out["num_nextn_predict_layers"] = cfg.mtp_layers
    out.update({k: "float32" for k in ("dtype", "torch_dtype") if k in out})
    return out


# ---------------------------------------------------------------- train --init-from-hf
# ModelConfig fields a fine-tune may set freely: they change training, not the checkpoint's shape.
TRAINING_ONLY = {"name", "dropout", "attn_dropout", "moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_update_rate",
                 "moe_capacity_factor"}


def init_model_config(path: str, model, overrides: dict) -> ModelConfig:
    """The model of `train --init-from-hf path`: the checkpoint's config.json plus training-only overrides.

    A preset (`--model`) or a shape flag whose value differs from the checkpoint's is a ConfigError:
    silently training another shape than the weights would fail later, on some rank, with less to go on.
    """
    base = config_from_hf(path)
    if model is not None and not (isinstance(model, ModelConfig) and dataclasses.replace(model, name=base.name) == base):
        shown = model if isinstance(model, str) else model.name
        raise ConfigError(f"--model {shown} contradicts --init-from-hf {path}: the model's shape comes from its "
                          "config.json (drop --model)")
    mtp = overrides.get("mtp_layers")
    if mtp:  # MTP modules the checkpoint has may be trained (all, or the first D); more cannot be loaded
        have = int(read_hf_config(path).get("num_nextn_predict_layers") or 0)
        if isinstance(mtp, int) and mtp > have:
            raise ConfigError(f"--mtp-layers {mtp} exceeds the MTP modules of --init-from-hf {path}: its config.json "
                              f"has num_nextn_predict_layers={have}; valid: 0..{have}")
    for k, v in overrides.items():
        if v is None or k in TRAINING_ONLY or k == "mtp_layers":
            continue
        if k not in _FIELDS or getattr(base, k) != v:
            have = getattr(base, k, "no such field")
            raise ConfigError(f"--{k.replace('_', '-')} {v} contradicts --init-from-hf {path}: its config.json gives "
                              f"{k}={have!r} (drop the flag)")
    cfg = dataclasses.replace(base, **{k: v for k, v in overrides.items()
                                       if v is not None and (k in TRAINING_ONLY or k == "mtp_layers")})
    cfg.validate()
    return cfg
