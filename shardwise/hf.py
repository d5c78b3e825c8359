"""Hugging Face interop: LlamaForCausalLM-shaped checkpoints in and out of any layout.

* `config_from_hf(dir)` maps a `config.json` (llama, mistral, qwen2, mixtral) to a ModelConfig and
  refuses, naming the field and its value, anything the model would silently compute differently.
* `load_hf_into(model, dir)` fills the model `build_model` made for this rank straight from the
  `*.safetensors` files: every parameter's ShardSpec gives the box of the global tensor this rank
  holds, and only that box is read (`safe_open(...).get_slice(name)[box]`), so a 70B checkpoint
  never has to fit in one rank's memory. Parameters a pipeline stage pruned are simply not asked for.
* `train --init-from-hf DIR` (fine-tuning) uses `load_hf_into` too; its checks are in `hf_init.py`.
* `export_hf(model_or_state, cfg, dir)` writes `config.json` + `model.safetensors` back from a
  single-device model or a global state dict (e.g. `checkpoint.load_global_tensors`).

RoPE: shardwise rotates interleaved pairs (Meta's Llama); HF rotates halves (`rotate_half`), so
HF's converter permutes the rows of q/k within each head. Loading undoes that permutation and
exporting redoes it. TP shards q/k by whole heads, so permuting a slice of whole heads is exact.

safetensors is imported lazily: it is needed only here, and shardwise does not depend on it.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import warnings

import torch
from torch import nn

from .config import ConfigError, ModelConfig
from .pipeline.tied_embedding import tied_name
from .tensor_parallel.layers import get_spec

SUPPORTED = ("llama", "mistral", "qwen2", "mixtral")
# Each model class's rope_theta when config.json omits it (HF's class defaults).
DEFAULT_THETA = {"llama": 10000.0, "mistral": 10000.0, "qwen2": 10000.0, "mixtral": 1e6}
ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}
INDEX = "model.safetensors.index.json"
# ModelConfig fields that newer shardwise versions add; a config needing a missing one is refused.
_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


# ---------------------------------------------------------------- config.json -> ModelConfig
def read_hf_config(path: str) -> dict:
    cfg_file = os.path.join(path, "config.json")
    try:
        with open(cfg_file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json (expected a Hugging Face model directory)") from None
    except ValueError as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None


def _rope(hf: dict, where: str, mt: str) -> tuple[float, tuple | None]:
    """(theta, llama3 scaling or None) from either the 4.x keys (rope_theta, rope_scaling) or 5.x rope_parameters."""
    params = hf.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"{where}: per-layer-type rope_parameters={params!r} are not supported")
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA[mt])))
    src = params if params.get("rope_type", "default") != "default" else legacy
    kind = src.get("rope_type", src.get("type", "default"))
    if kind == "default":
        return theta, None
    field = "rope_parameters" if src is params else "rope_scaling"
    if kind != "llama3":
        raise ConfigError(f"{where}: {field}.rope_type={kind!r} is not supported (only 'default' and 'llama3' "
                          "RoPE are implemented)")
    if "rope_scaling" not in _FIELDS:
        raise ConfigError(f"{where}: {field}.rope_type='llama3' needs ModelConfig.rope_scaling, which this "
                          "shardwise lacks")
    try:
        scaling = (float(src["factor"]), float(src["low_freq_factor"]), float(src["high_freq_factor"]),
                   int(src["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"{where}: {field} of rope_type 'llama3' lacks {e.args[0]!r}") from None
    return theta, scaling


def _max_positions(hf: dict, where: str, mt: str) -> int:
    """max_position_embeddings, clamped to a sliding window if one is in effect.

    Within its window a sliding-window layer sees every earlier token, exactly like full causal
    attention; shardwise has no sliding-window kernel, so sequences are capped at the window instead.
    """
    n = int(_req(hf, "max_position_embeddings", where))
    window = hf.get("sliding_window")
    if mt == "qwen2" and not hf.get("use_sliding_window", False):
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
    """The ModelConfig of the HF model in directory `path`; ConfigError for anything not supported."""
    hf = read_hf_config(path)
    where = os.path.join(path, "config.json")
    mt = hf.get("model_type")
    if mt not in SUPPORTED:
        raise ConfigError(f"{where}: model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED)}")
    arch = hf.get("architectures") or []
    if arch and not any(a.endswith("ForCausalLM") for a in arch):
        raise ConfigError(f"{where}: architectures={arch!r}: only *ForCausalLM models are supported")

    def refuse(field, why):
        raise ConfigError(f"{where}: {field}={hf.get(field)!r} is not supported: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "shardwise's MLP is SwiGLU with silu")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "shardwise's MLP has no biases")
    if hf.get("quantization_config"):
        refuse("quantization_config", "load an unquantized checkpoint")
    dim, heads = int(_req(hf, "hidden_size", where)), int(_req(hf, "num_attention_heads", where))
    if hf.get("head_dim") is not None and int(hf["head_dim"]) * heads != dim:
        refuse("head_dim", f"shardwise needs head_dim = hidden_size / num_attention_heads = {dim // heads}")
    # Qwen2 always has q/k/v biases; Llama's attention_bias also puts one on o_proj, which shardwise lacks.
    if mt != "qwen2" and hf.get("attention_bias"):
        refuse("attention_bias", "only q/k/v biases (model_type qwen2) are supported")
    theta, scaling = _rope(hf, where, mt)
    kw = dict(name=f"hf-{mt}", vocab_size=int(_req(hf, "vocab_size", where)), dim=dim,
              n_layers=int(_req(hf, "num_hidden_layers", where)), n_heads=heads,
              n_kv_heads=int(hf.get("num_key_value_heads") or heads),
              ffn_dim=int(_req(hf, "intermediate_size", where)), max_seq_len=_max_positions(hf, where, mt),
              rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
              attn_dropout=float(hf.get("attention_dropout", 0.0)))
    if scaling is not None:
        kw["rope_scaling"] = scaling
    if mt == "qwen2":
        if "attention_bias" not in _FIELDS:
            raise ConfigError(f"{where}: model_type='qwen2' has q/k/v biases, which need ModelConfig.attention_bias "
                              "(not in this shardwise)")
        kw["attention_bias"] = True
    if mt == "mixtral":
        # HF Mixtral: softmax over all experts, top-k, renormalise = softmax over the top-k logits; dropless.
        kw.update(moe_experts=int(_req(hf, "num_local_experts", where)),
                  moe_topk=int(_req(hf, "num_experts_per_tok", where)), moe_every=1, moe_ffn_dim=kw["ffn_dim"],
                  moe_shared_experts=0, moe_softmax_before_topk=False, moe_score="softmax",
                  moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


# ---------------------------------------------------------------- reading slices
class _Files:
    """The checkpoint's tensors by name: one lazily opened safe_open handle per file (headers only)."""

    def __init__(self, path: str):
        import safetensors

        self.path, self._open, self._handles = path, safetensors.safe_open, {}
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors files (and no {INDEX})")
            self.where = {k: fn for fn in files for k in self._handle(fn).keys()}

    def _handle(self, fn: str):
        if fn not in self._handles:
            self._handles[fn] = self._open(fn, framework="pt")
        return self._handles[fn]

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str):
        if name not in self.where:
            raise KeyError(f"{self.path}: the checkpoint has no tensor {name!r}")
        return self._handle(self.where[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        return self._slice(name)[box]


@dataclasses.dataclass
class _Source:
    """Where a shardwise global tensor comes from: one HF tensor (rows shifted by `offset` along dim 1:
    a half of Mixtral's fused gate_up_proj), q/k rows to un-permute per head, or per-expert tensors to stack."""

    names: list[str]
    shape: tuple[int, ...]
    kind: str = "direct"  # direct | heads | stacked
    offset: int = 0
    head_dim: int = 0

    def read(self, files: _Files, box: tuple[slice, ...]) -> torch.Tensor:
        if self.kind == "stacked":
            return torch.stack([files.read(self.names[e], box[1:]) for e in range(box[0].start, box[0].stop)])
        if self.offset:
            box = (box[0], slice(box[1].start + self.offset, box[1].stop + self.offset), *box[2:])
        t = files.read(self.names[0], box)
        return to_interleaved(t, self.head_dim) if self.kind == "heads" else t


def to_interleaved(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF (rotate_half) → Meta (interleaved pairs) order of the rows of whole heads of q/k (weight or bias)."""
    return t.reshape(-1, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_rotate_half(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Meta → HF row order: the permutation of HF's convert_llama_weights_to_hf.py."""
    return t.reshape(-1, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}


def _hf_name(name: str) -> tuple[str, bool]:
    """shardwise name → (HF name, whether its rows are q/k heads to permute), for the non-MoE tensors."""
    if name in _TOP:
        return _TOP[name], False
    m = re.fullmatch(r"layers\.(\d+)\.(\w+(?:\.\w+)?)\.(weight|bias)", name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"shardwise parameter {name!r} has no Hugging Face counterpart")
    module = m.group(2)
    return f"model.layers.{m.group(1)}.{_LAYER[module]}.{m.group(3)}", module in ("attention.wq", "attention.wk")


def _source(name: str, cfg: ModelConfig, files: _Files) -> _Source:
    """How to read shardwise's global tensor `name` from this checkpoint (legacy or fused Mixtral experts)."""
    m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.(w1|w2|w3))", name)
    if m is None:
        hf, heads = _hf_name(name)
        return _Source([hf], files.shape(hf), "heads" if heads else "direct", head_dim=cfg.head_dim)
    i, which = m.group(1), m.group(3)
    legacy = f"model.layers.{i}.block_sparse_moe"
    fused = f"model.layers.{i}.mlp"
    if which is None:
        hf = f"{legacy}.gate.weight" if f"{legacy}.gate.weight" in files else f"{fused}.gate.weight"
        return _Source([hf], files.shape(hf))
    per_expert = [f"{legacy}.experts.{e}.{which}.weight" for e in range(cfg.moe_experts)]  # same w1/w2/w3 names
    if per_expert[0] in files:
        return _Source(per_expert, (cfg.moe_experts, *files.shape(per_expert[0])), "stacked")
    if which == "w2":
        hf = f"{fused}.experts.down_proj"
        return _Source([hf], files.shape(hf))
    hf = f"{fused}.experts.gate_up_proj"  # [E, 2·ffn, dim]: gate (w1) rows first, then up (w3)
    e, two_f, d = files.shape(hf)
    return _Source([hf], (e, two_f // 2, d), offset=0 if which == "w1" else two_f // 2)


@torch.no_grad()
def load_hf_into(model: nn.Module, path: str, mesh=None) -> dict:
    """Fill every parameter this rank holds from the HF checkpoint in `path`, reading only its slices.

    Works on any layout's model from `build_model` (TP/SP shards, padded vocabulary, EP expert
    ranges, PP-pruned stages). Returns {"tensors", "bytes_read"} for this rank. `mesh` only names
    the rank in errors.
    """
    cfg, files = model.cfg, _Files(path)
    who = f"rank {mesh.rank}: " if mesh is not None and mesh["world"].active else ""
    n = nbytes = 0
    for name, p in model.named_parameters():
        spec = get_spec(p)
        src = _source(tied_name(name, p), cfg, files)  # a tied LM head's PP copy reads the embedding
        if tuple(src.shape) != tuple(spec.global_shape):
            raise ValueError(f"{who}{path}: {src.names[0]} has shape {tuple(src.shape)}, shardwise's {name} needs "
                             f"{tuple(spec.global_shape)} (config.json and weights disagree?)")
        box = [slice(0, s) for s in spec.global_shape]
        dst = p
        if spec.dim is not None:
            box[spec.dim] = slice(spec.start, spec.start + spec.valid)
            dst = p.narrow(spec.dim, 0, spec.valid)
            p.narrow(spec.dim, spec.valid, spec.length - spec.valid).zero_()  # vocabulary padding rows
        if src.kind == "heads" and (spec.start % cfg.head_dim or spec.valid % cfg.head_dim):
            raise ValueError(f"{who}{name}: rows [{spec.start}, {spec.start + spec.valid}) are not whole heads")
        if dst.numel():
            t = src.read(files, tuple(box))
            dst.copy_(t)
            nbytes += t.numel() * t.element_size()
        n += 1
    return {"tensors": n, "bytes_read": nbytes}


# ---------------------------------------------------------------- export
def hf_config(cfg: ModelConfig) -> dict:
    """config.json for `cfg`: llama, qwen2 (q/k/v biases) or mixtral; ConfigError for what HF cannot express."""
    def refuse(field, why):
        raise ConfigError(f"export: {field}={getattr(cfg, field)!r} has no Hugging Face equivalent: {why}")

    bias = getattr(cfg, "attention_bias", False)
    if cfg.moe_experts:
        if bias:
            refuse("attention_bias", "Mixtral has no attention biases")
        for field, want, why in (("moe_every", 1, "every Mixtral block is MoE"),
                                 ("moe_shared_experts", 0, "Mixtral has no shared experts"),
                                 ("moe_score", "softmax", "Mixtral's router is a softmax"),
                                 ("moe_softmax_before_topk", False, "Mixtral renormalises over the top-k")):
            if getattr(cfg, field) != want:
                refuse(field, why)
    mt = "mixtral" if cfg.moe_experts else "qwen2" if bias else "llama"
    ffn = (cfg.moe_ffn_dim or cfg.ffn_dim) if cfg.moe_experts else cfg.ffn_dim  # Mixtral: the expert size
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
    out["rope_parameters"] = rope  # transformers >= 5 reads this, 4.x reads rope_theta / rope_scaling
    if mt == "mixtral":
        out.update(num_local_experts=cfg.moe_experts, num_experts_per_tok=cfg.moe_topk, sliding_window=None,
                   router_aux_loss_coef=cfg.moe_aux_loss_coef, output_router_logits=False)
    if mt == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def _hf_tensors(name: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.(w1|w2|w3))", name)
    if m is None:
        hf, heads = _hf_name(name)
        return {hf: to_rotate_half(t, cfg.head_dim) if heads else t}
    base = f"model.layers.{m.group(1)}.block_sparse_moe"
    if m.group(3) is None:
        return {f"{base}.gate.weight": t}
    return {f"{base}.experts.{e}.{m.group(3)}.weight": t[e] for e in range(t.shape[0])}


def export_hf(source, cfg: ModelConfig, out_dir: str) -> str:
    """Write `out_dir`/config.json and model.safetensors from a global state (or single-device model).

    `source` is an unsharded model (every degree 1) or a dict of global tensors under shardwise's
    names, such as `checkpoint.load_global_tensors(step_dir)`. Returns `out_dir`.
    """
    from safetensors.torch import save_file

    from .models.llama import Transformer

    config = hf_config(cfg)
    if isinstance(source, nn.Module):
        for n, p in source.named_parameters():
            if tuple(p.shape) != tuple(get_spec(p).global_shape):
                raise ValueError(f"export: {n} is a shard {tuple(p.shape)} of {get_spec(p).global_shape}: export a "
                                 "single-device model or a global state dict (checkpoint.load_global_tensors)")
        state = source.state_dict()
    else:
        state = dict(source)
    for n, t in state.items():
        if n.endswith("router.expert_bias") and bool(t.any()):
            raise ValueError(f"export: {n} is non-zero; Mixtral has no selection bias (moe_bias_update_rate)")
    with torch.device("meta"):
        expected = dict(Transformer(cfg).named_parameters())  # tied output.weight appears once, as the embedding
    missing = [n for n in expected if n not in state]
    extra = [n for n in state if n not in expected and not n.endswith("router.expert_bias")
             and not (n == "output.weight" and cfg.tie_embeddings)]
    if missing or extra:
        raise KeyError(f"export: the state does not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    tensors = {}
    for n, ref in expected.items():
        t = state[n].detach().to("cpu", torch.float32)
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"export: {n} has shape {tuple(t.shape)}, the config needs {tuple(ref.shape)}")
        tensors.update({k: v.contiguous().clone() for k, v in _hf_tensors(n, t, cfg).items()})
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir

