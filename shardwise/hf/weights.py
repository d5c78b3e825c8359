"""Hugging Face interop: LlamaForCausalLM-shaped checkpoints in and out of any layout.

* `config_from_hf(dir)` (in the torch-free `hf_config.py`) maps a `config.json` (llama,
  mistral, qwen2, mixtral) to a ModelConfig and refuses, naming the field and its value, anything the
  model would silently compute differently.
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
from typing import Callable

import torch
from torch import nn

from . import kimi_linear as hf_kimi_linear, qwen3_next as hf_qwen3_next
from ..config import ConfigError, ModelConfig
from .config import export_config, glm_minimax_type, is_gpt_oss
from .gpt_oss import EXPERT as GPT_OSS_EXPERT, expert_source, export_tensors as gpt_oss_tensors
from .multimodal import into_multimodal, is_multimodal, multimodal_config, stored_name, text_view
from ..pipeline.tied_embedding import tied_name
from ..tensor_parallel.layers import get_spec

INDEX = "model.safetensors.index.json"


# ---------------------------------------------------------------- reading slices
def need_safetensors(command: str) -> None:
    """The optional package, or one line naming the extra that installs it."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError(f"{command} reads and writes .safetensors files: pip install 'shardwise[hf]' (the "
                          "safetensors package is not installed)") from None


def weight_file_names(path: str) -> list[str]:
    """The *.safetensors files of a model directory: those its index names, else every one there."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                return sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} is unreadable ({e.__class__.__name__}: {e})") from None
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def check_weight_files(path: str, what: str) -> None:
    """Every safetensors file of `path` whole: its header parses and the file reaches the end of the last
    tensor it lists (a download cut short is one line here, not a traceback in the middle of loading)."""
    for fn in weight_file_names(path):
        problem = safetensors_problem(fn)
        if problem:
            raise ConfigError(f"{what} {path}: {os.path.basename(fn)} {problem}; download or export it again")


def safetensors_problem(fn: str) -> str | None:
    """Why `fn` is not a whole safetensors file (None when it is): an 8-byte header length, the JSON header,
    then the tensors' bytes up to the largest `data_offsets` end."""
    try:
        size = os.path.getsize(fn)
        with open(fn, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"has {size} bytes: no header (truncated)"
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                return f"has {size} bytes but its header alone needs {8 + n} (truncated)"
            header = json.loads(f.read(n))
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return "has a header that is not JSON (not a safetensors file, or damaged)"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object (damaged)"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return "has a header without valid data_offsets (damaged)"
    if 8 + n + end > size:
        return f"has {size} bytes, its header says {8 + n + end} (truncated)"
    return None


class WeightFiles:
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
        # A multimodal checkpoint (Qwen3.5): its language model under text-only names, the rest set aside.
        self.view, self.aside, self._files = None, {}, self.where
        if is_multimodal(self.where):
            self.view, self.aside = text_view(self.where, path)
            self.where = {k: self.where[v] for k, v in self.view.items()}

    def _handle(self, fn: str):
        if fn not in self._handles:
            self._handles[fn] = self._open(fn, framework="pt")
        return self._handles[fn]

    def read_stored(self, stored: str) -> torch.Tensor:
        """A whole tensor of any part of the checkpoint by its stored name (a multimodal one's vision tower too)."""
        return self._handle(self._files[stored]).get_tensor(stored)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str):
        if name not in self.where:
            raise KeyError(f"{self.path}: the checkpoint has no tensor {stored_name(name, self.view)!r}")
        return self._handle(self.where[name]).get_slice(stored_name(name, self.view))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        return self._slice(name)[box]


@dataclasses.dataclass
class TensorSource:
    """Where a shardwise global tensor comes from: one HF tensor (rows shifted by `offset` along dim 1:
    a half of Mixtral's fused gate_up_proj), q/k rows to un-permute per head, per-expert tensors to stack, or a
    tensor `derive(files)` computes whole (Qwen3-Next's fused and zero-centred tensors, hf_qwen3_next.py)."""

    names: list[str]
    shape: tuple[int, ...]
    kind: str = "direct"  # direct | heads | stacked | derived
    offset: int = 0
    head_dim: int = 0
    derive: Callable | None = None
    rope_dim: int = 0
    """Rows of each head RoPE rotates (partial rotary: GLM-4.5, MiniMax-M2); 0 = the whole head."""

    def read(self, files: WeightFiles, box: tuple[slice, ...]) -> torch.Tensor:
        if self.kind == "derived":
            return self.derive(files)[box]
        if self.kind == "stacked":
            return torch.stack([files.read(self.names[e], box[1:]) for e in range(box[0].start, box[0].stop)])
        if self.offset:
            box = (box[0], slice(box[1].start + self.offset, box[1].stop + self.offset), *box[2:])
        t = files.read(self.names[0], box)
        return to_interleaved(t, self.head_dim, self.rope_dim) if self.kind == "heads" else t


def to_interleaved(t: torch.Tensor, head_dim: int, rope_dim: int = 0) -> torch.Tensor:
    """HF (rotate_half) → Meta (interleaved pairs) order of the rows of whole heads of q/k (weight or bias); with
    partial rotary only each head's first `rope_dim` rows move."""
    if rope_dim and rope_dim < head_dim:
        return hf_qwen3_next.rope_rows(t, head_dim, rope_dim, True)
    return t.reshape(-1, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_rotate_half(t: torch.Tensor, head_dim: int, rope_dim: int = 0) -> torch.Tensor:
    """Meta → HF row order: the permutation of HF's convert_llama_weights_to_hf.py (partial: `to_interleaved`'s)."""
    if rope_dim and rope_dim < head_dim:
        return hf_qwen3_next.rope_rows(t, head_dim, rope_dim, False)
    return t.reshape(-1, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
          # DeepSeek-V3: MLA's projections and latent norms, the shared experts
          "attention.wq_a": "self_attn.q_a_proj", "attention.q_a_norm": "self_attn.q_a_layernorm",
          "attention.wq_b": "self_attn.q_b_proj", "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
          "attention.kv_a_norm": "self_attn.kv_a_layernorm", "attention.wkv_b": "self_attn.kv_b_proj",
          "feed_forward.shared.w1": "mlp.shared_experts.gate_proj", "feed_forward.shared.w3": "mlp.shared_experts.up_proj",
          "feed_forward.shared.w2": "mlp.shared_experts.down_proj"}


# DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5)
_LAYER.update({f"attention.indexer.{n}": f"self_attn.indexer.{n}" for n in ("wq_b", "wk", "k_norm", "weights_proj")})

_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


_MTP = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "head_norm": "shared_head.norm"}


def _as_layer(name: str, cfg: ModelConfig) -> str:
    """MTP module k's block is DeepSeek's layer n_layers + k (0-based k): `mtp.k.block.X` → `layers.{L+k}.X`."""
    m = re.match(r"mtp\.(\d+)\.block\.", name)
    return f"layers.{cfg.n_layers + int(m.group(1))}.{name[m.end():]}" if m else name


def _hf_name(name: str, cfg: ModelConfig) -> tuple[str, bool]:
    """shardwise name → (HF name, whether its rows are q/k heads to permute), for the non-MoE tensors. MLA's
    rotary rows are already interleaved in HF (rope_interleave): nothing to permute."""
    if name in _TOP:
        return _TOP[name], False
    m = re.fullmatch(r"mtp\.(\d+)\.(enorm|hnorm|eh_proj|head_norm)\.weight", name)
    if m is not None:  # DeepSeek's MTP-only tensors of layer n_layers + k
        return f"model.layers.{cfg.n_layers + int(m.group(1))}.{_MTP[m.group(2)]}.weight", False
    m = re.fullmatch(r"layers\.(\d+)\.attention\.sinks", name)
    if m is not None:  # gpt-oss: one logit per head, no rows to permute
        return f"model.layers.{m.group(1)}.self_attn.sinks", False
    m = re.fullmatch(r"layers\.(\d+)\.(\w+(?:\.\w+)*)\.(weight|bias)", name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"shardwise parameter {name!r} has no Hugging Face counterpart")
    module = m.group(2)
    # q/k norm weights are one head's rows in HF's rotate-half order: permuted like each head of wq / wk.
    heads = module in ("attention.wq", "attention.wk", "attention.q_norm", "attention.k_norm") and not cfg.is_mla
    return f"model.layers.{m.group(1)}.{_LAYER[module]}.{m.group(3)}", heads


def tensor_source(name: str, cfg: ModelConfig, files: WeightFiles) -> TensorSource:
    """How to read shardwise's global tensor `name` from this checkpoint (legacy or fused Mixtral experts)."""
    name = _as_layer(name, cfg)
    gpt_oss = expert_source(name, cfg, files) if is_gpt_oss(cfg) else None
    if gpt_oss is not None:  # gpt-oss's router and experts (plain or MXFP4): hf_gpt_oss.py
        return gpt_oss
    derived = hf_qwen3_next.source(name, cfg, files) if hf_qwen3_next.is_family(cfg) else None
    if derived is not None:
        hf, shape, derive = derived
        return TensorSource([hf], tuple(shape), "derived", derive=derive)
    kimi = hf_kimi_linear.source(name, cfg, files) if cfg.kda else None
    if kimi is not None:  # Kimi-Linear's KDA layers and MLPs (hf_kimi_linear.py)
        hf, shape, derive = kimi
        return TensorSource([hf], tuple(shape), "direct" if derive is None else "derived", derive=derive)
    m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.(w1|w2|w3))", name)
    if m is None:
        hf, heads = _hf_name(name, cfg)
        return TensorSource([hf], files.shape(hf), "heads" if heads else "direct", head_dim=cfg.head_dim,
                            rope_dim=cfg.rope_dim)
    i, which = m.group(1), m.group(3)
    legacy = f"model.layers.{i}.block_sparse_moe"
    fused = f"model.layers.{i}.mlp"
    if which is None:
        hf = f"{legacy}.gate.weight" if f"{legacy}.gate.weight" in files else f"{fused}.gate.weight"
        return TensorSource([hf], files.shape(hf))
    per_expert = [f"{legacy}.experts.{e}.{which}.weight" for e in range(cfg.moe_experts)]  # same w1/w2/w3 names
    if per_expert[0] not in files:  # Qwen3-MoE: mlp.experts.{e}.gate_proj / up_proj / down_proj
        per_expert = [f"{fused}.experts.{e}.{_EXPERT[which]}.weight" for e in range(cfg.moe_experts)]
    if per_expert[0] in files:
        return TensorSource(per_expert, (cfg.moe_experts, *files.shape(per_expert[0])), "stacked")
    if which == "w2":
        hf = f"{fused}.experts.down_proj"
        return TensorSource([hf], files.shape(hf))
    hf = f"{fused}.experts.gate_up_proj"  # [E, 2·ffn, dim]: gate (w1) rows first, then up (w3)
    e, two_f, d = files.shape(hf)
    return TensorSource([hf], (e, two_f // 2, d), offset=0 if which == "w1" else two_f // 2)


@torch.no_grad()
def load_hf_into(model: nn.Module, path: str, mesh=None, mtp_init: str = "checkpoint") -> dict:
    """Fill every parameter this rank holds from the HF checkpoint in `path`, reading only its slices.

    Works on any layout's model from `build_model` (TP/SP shards, padded vocabulary, EP expert
    ranges, PP-pruned stages). Returns {"tensors", "bytes_read"} for this rank. `mesh` only names
    the rank in errors. `mtp_init="fresh"` (`--mtp-init fresh`) reads none of the MTP modules' own
    tensors: they keep `build_model`'s seeded initialisation, as in training from scratch, while the
    embedding and head they use are the main model's, read from the checkpoint.
    """
    cfg, files = model.cfg, WeightFiles(path)
    who = f"rank {mesh.rank}: " if mesh is not None and mesh["world"].active else ""
    n = nbytes = 0
    fresh = mtp_init == "fresh"
    for name, p in model.named_parameters():
        spec = get_spec(p)
        if fresh and tied_name(name, p).startswith("mtp."):
            continue
        src = tensor_source(tied_name(name, p), cfg, files)  # a tied LM head's PP copy reads the embedding
        if tuple(src.shape) != tuple(spec.global_shape):
            raise ValueError(f"{who}{path}: {src.names[0]} has shape {tuple(src.shape)}, shardwise's {name} needs "
                             f"{tuple(spec.global_shape)} (config.json and weights disagree?)")
        box = [slice(0, s) for s in spec.global_shape]
        dst = p
        if getattr(spec, "rows", None):  # placed experts (ExpertShard): local slot j is logical expert rows[j]
            for j, row in enumerate(spec.rows):
                t = src.read(files, (slice(row, row + 1), *box[1:]))
                p.narrow(0, j, 1).copy_(t)
                nbytes += t.numel() * t.element_size()
            n += 1
            continue
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
    for name, buf in model.named_buffers():  # DeepSeek-V3's selection bias (replicated; absent elsewhere)
        if fresh and name.startswith("mtp."):
            continue
        m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.router\.expert_bias", _as_layer(name, cfg))
        hf = m and f"model.layers.{m.group(1)}.{'block_sparse_moe' if cfg.kda else 'mlp'}.gate.e_score_correction_bias"
        if hf and hf not in files:  # MiniMax-M2 keeps it on the MoE block
            hf = f"model.layers.{m.group(1)}.block_sparse_moe.e_score_correction_bias"
        if hf and hf in files:
            buf.copy_(files.read(hf, (slice(0, buf.shape[0]),)))
            n, nbytes = n + 1, nbytes + buf.numel() * 4
    return {"tensors": n, "bytes_read": nbytes}


# ---------------------------------------------------------------- export
def _hf_tensors(name: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    name = _as_layer(name, cfg)
    m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(router\.weight|experts\.(w1|w2|w3))", name)
    if m is None:
        hf, heads = _hf_name(name, cfg)
        return {hf: to_rotate_half(t, cfg.head_dim, cfg.rope_dim) if heads else t}
    # Qwen3-MoE's / DeepSeek's / GLM-4.5's names (mlp.gate, mlp.experts.{e}.gate_proj); MiniMax-M2 keeps Mixtral's
    family = glm_minimax_type(cfg)
    qwen = (cfg.qk_norm or cfg.is_mla or family == "glm4_moe") and family != "minimax_m2"
    base = f"model.layers.{m.group(1)}.{'mlp' if qwen else 'block_sparse_moe'}"
    if m.group(3) is None:
        return {f"{base}.gate.weight": t}
    which = _EXPERT[m.group(3)] if qwen else m.group(3)
    return {f"{base}.experts.{e}.{which}.weight": t[e] for e in range(t.shape[0])}


def export_hf(source, cfg: ModelConfig, out_dir: str, tokenizer: dict | None = None,
              multimodal: str | None = None, hf_source: str | None = None) -> str:
    """Write `out_dir`/config.json and model.safetensors from a global state (or single-device model).

    `source` is an unsharded model (every degree 1) or a dict of global tensors under shardwise's
    names, such as `checkpoint.load_global_tensors(step_dir)`. With `tokenizer` (a run's
    `hf_export.tokenizer_record`) also the tokenizer files, bos/eos/pad ids and generation_config.json.
    With `multimodal` (the Qwen3.5 multimodal checkpoint the run started from) it writes that checkpoint again
    with the trained language model in it (`hf_multimodal.into_multimodal`). With `hf_source` (the text checkpoint
    the run started from) config.json is that checkpoint's, only what the run changed rewritten
    (`hf_config.export_config`). Returns `out_dir`.
    """
    from safetensors.torch import save_file

    from ..parallelize import plain_model

    config = export_config(cfg, hf_source)
    if multimodal is not None:
        config = multimodal_config(multimodal, cfg)
    if isinstance(source, nn.Module):
        for n, p in source.named_parameters():
            if tuple(p.shape) != tuple(get_spec(p).global_shape):
                raise ValueError(f"export: {n} is a shard {tuple(p.shape)} of {get_spec(p).global_shape}: export a "
                                 "single-device model or a global state dict (checkpoint.load_global_tensors)")
        state = source.state_dict()
    else:
        state = dict(source)
    for n, t in state.items():
        if n.endswith("router.expert_bias") and cfg.moe_score != "sigmoid" and bool(t.any()):
            raise ValueError(f"export: {n} is non-zero; only DeepSeek-V3 has a selection bias (moe_bias_update_rate)")
    with torch.device("meta"):
        expected = dict(plain_model(cfg).named_parameters())  # tied output.weight appears once, as the embedding
    missing = [n for n in expected if n not in state]
    extra = [n for n in state if n not in expected and not n.endswith("router.expert_bias")
             and not (n == "output.weight" and cfg.tie_embeddings)]
    if missing or extra:
        raise KeyError(f"export: the state does not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    tensors, done, gpt_oss = {}, set(), {}
    if hf_qwen3_next.is_family(cfg):
        tensors, done = hf_qwen3_next.export_tensors(state, cfg, fused=config.get("model_type") == "qwen3_next")
    if cfg.kda:
        tensors, done = hf_kimi_linear.export_tensors(state, cfg)
    for n, ref in expected.items():
        if n in done:
            continue
        t = state[n].detach().to("cpu", torch.float32)
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"export: {n} has shape {tuple(t.shape)}, the config needs {tuple(ref.shape)}")
        if is_gpt_oss(cfg) and GPT_OSS_EXPERT.fullmatch(n):  # gate and up interleave into one tensor: below
            gpt_oss[n] = t
            continue
        tensors.update({k: v.contiguous().clone() for k, v in _hf_tensors(n, t, cfg).items()})
    if gpt_oss:
        tensors.update({k: v.contiguous().clone() for k, v in gpt_oss_tensors(gpt_oss, cfg).items()})
    # DeepSeek-V3 and GLM-4.5 keep the selection bias as the gate's e_score_correction_bias, MiniMax-M2 the block's
    # (Kimi-Linear's: hf_kimi_linear's export)
    if (cfg.is_mla or glm_minimax_type(cfg)) and cfg.moe_score == "sigmoid" and not cfg.kda:
        where = "block_sparse_moe" if glm_minimax_type(cfg) == "minimax_m2" else "mlp.gate"
        for n, t in state.items():
            m = re.fullmatch(r"layers\.(\d+)\.feed_forward\.router\.expert_bias", _as_layer(n, cfg))
            if m:
                tensors[f"model.layers.{m.group(1)}.{where}.e_score_correction_bias"] = t.detach().float().cpu().clone()
    for k in range(cfg.mtp_layers):  # DeepSeek's checkpoints also hold each MTP layer's embedding and head
        layer, head = f"model.layers.{cfg.n_layers + k}", "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        tensors[f"{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"{layer}.shared_head.head.weight"] = tensors[head].clone()
    if multimodal is not None:
        tensors = into_multimodal(tensors, WeightFiles(multimodal))
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer is not None:
        from .export import write_generation_config, write_tokenizer

        ids = write_tokenizer(out_dir, tokenizer, cfg.max_seq_len, cfg.vocab_size)
        # the ids the run trained with; a source's list that holds the id (Llama-3's two eos ids) is kept
        config.update({k: v for k, v in ids.items() if v is not None
                       and not (isinstance(config.get(k), list) and v in config[k])})
        write_generation_config(out_dir, ids)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir

