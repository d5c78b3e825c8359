"""Qwen3-Next's (and Qwen3.5's) tensors in Hugging Face's layout ↔ shardwise's, for `hf.py`.

What differs from the Llama-shaped families:
* RMSNorms are zero-centred in HF (`x̂ · (1 + w)`, weights stored near 0); shardwise stores the scale itself, so
  import adds 1 and export subtracts it (in fp32: the same number HF's forward computes). The gated norm of the
  linear layers is a plain scale in both.
* Gated attention's q_proj holds per head [q | gate] rows; RoPE rotates only the first `rope_dim` of each q/k head
  (partial rotary), so only those rows are permuted from HF's rotate-half order to interleaved pairs.
* Gated DeltaNet: Qwen3-Next fuses q/k/v/z into `in_proj_qkvz` and b/a into `in_proj_ba`, grouped per key head
  ([q_h | k_h | v of its value heads | z of its value heads]); Qwen3.5 keeps `in_proj_qkv` ([q | k | v]), `in_proj_z`,
  `in_proj_b`, `in_proj_a`. The depthwise `conv1d` [q | k | v channels, 1, K] is split into shardwise's three
  kernels, so TP cuts each by heads.
* The shared expert is `mlp.shared_expert` with its gate `mlp.shared_expert_gate`.

A derived tensor is read whole and cut afterwards (a TP rank reads the projection, not only its rows).
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from ..config import ModelConfig

_NORMS = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def is_family(cfg: ModelConfig) -> bool:
    """Qwen3-Next-shaped: gated attention (every Qwen3-Next / Qwen3.5 checkpoint has it)."""
    return cfg.attn_output_gate


def rope_rows(t: torch.Tensor, head_rows: int, rope_dim: int, to_interleaved: bool) -> torch.Tensor:
    """Permute the first `rope_dim` rows of every `head_rows`-row head: HF rotate-half ↔ interleaved pairs."""
    x = t.reshape(-1, head_rows, *t.shape[1:])
    rot, rest = x[:, :rope_dim], x[:, rope_dim:]
    pair = (2, rope_dim // 2) if to_interleaved else (rope_dim // 2, 2)
    rot = rot.reshape(x.shape[0], *pair, *t.shape[1:]).transpose(1, 2).reshape(rot.shape)
    return torch.cat((rot, rest), dim=1).reshape(t.shape)


def _linear_parts(cfg: ModelConfig) -> dict[str, int]:
    nk, nv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    return {"q": nk * dk, "k": nk * dk, "v": nv * dv, "z": nv * dv, "b": nv, "a": nv}


def _split_grouped(t: torch.Tensor, cfg: ModelConfig, names: str) -> dict[str, torch.Tensor]:
    """Qwen3-Next's per-key-head grouping ([q_h | k_h | v_h | z_h] or [b_h | a_h]) → one tensor per part."""
    nk, r = cfg.linear_k_heads, cfg.linear_v_heads // cfg.linear_k_heads
    widths = {"q": cfg.linear_k_dim, "k": cfg.linear_k_dim, "v": r * cfg.linear_v_dim, "z": r * cfg.linear_v_dim,
              "b": r, "a": r}
    groups = t.reshape(nk, -1, *t.shape[1:]).split([widths[n] for n in names], dim=1)
    return {n: g.reshape(-1, *t.shape[1:]) for n, g in zip(names, groups)}


def _join_grouped(parts: dict[str, torch.Tensor], cfg: ModelConfig, names: str) -> torch.Tensor:
    nk = cfg.linear_k_heads
    return torch.cat([parts[n].reshape(nk, -1, *parts[n].shape[1:]) for n in names], dim=1).flatten(0, 1)


def source(name: str, cfg: ModelConfig, files, offset: float = 1.0
           ) -> tuple[str, tuple[int, ...], Callable] | None:
    """(HF name, shardwise global shape, read(files) → the global tensor) for a tensor this family lays out
    differently; None for one `hf.py` maps as usual (embedding, head, dense MLP, router, routed experts).
    `offset` is what import adds to a zero-centred norm (0 maps gradients)."""
    def whole(n):
        return files.read(n, tuple(slice(0, s) for s in files.shape(n))).float()

    if name == "norm.weight":
        return "model.norm.weight", files.shape("model.norm.weight"), lambda f: whole("model.norm.weight") + offset
    m = re.fullmatch(r"layers\.(\d+)\.(\w+(?:\.\w+)*)\.(weight|A_log|dt_bias|conv_[qkv])", name)
    if m is None:
        return None
    i, module, leaf = int(m.group(1)), m.group(2), m.group(3)
    base = f"model.layers.{i}"
    if module in _NORMS:
        hf = f"{base}.{_NORMS[module]}.weight"
        return hf, files.shape(hf), lambda f: whole(hf) + offset
    sm = re.fullmatch(r"feed_forward\.shared\.(w[123])", module)
    if sm is not None:
        hf = f"{base}.mlp.shared_expert.{_FFN[sm.group(1)]}.weight"
        return hf, files.shape(hf), lambda f: whole(hf)
    if module == "feed_forward.shared_gate":
        hf = f"{base}.mlp.shared_expert_gate.weight"
        return hf, files.shape(hf), lambda f: whole(hf)
    if cfg.is_linear_layer(i) and module.startswith("attention"):
        return _linear_source(module, leaf, cfg, files, f"{base}.linear_attn", whole)
    hd, rd = cfg.head_dim, cfg.rope_dim
    attn = f"{base}.self_attn"
    if module == "attention.wq":
        hf = f"{attn}.q_proj.weight"
        return hf, files.shape(hf), lambda f: rope_rows(whole(hf), 2 * hd, rd, True)
    if module == "attention.wk":
        hf = f"{attn}.k_proj.weight"
        return hf, files.shape(hf), lambda f: rope_rows(whole(hf), hd, rd, True)
    if module in ("attention.q_norm", "attention.k_norm"):
        hf = f"{attn}.{module.split('.')[1]}.weight"
        return hf, files.shape(hf), lambda f: rope_rows(whole(hf) + offset, hd, rd, True)
    return None


def _linear_source(module: str, leaf: str, cfg: ModelConfig, files, la: str, whole):
    parts = _linear_parts(cfg)
    fused = f"{la}.in_proj_qkvz.weight" in files  # Qwen3-Next; Qwen3.5 keeps in_proj_qkv, _z, _b, _a
    h = cfg.dim
    pm = re.fullmatch(r"attention\.w([qkvzba])", module)
    if pm is not None:
        p = pm.group(1)
        shape = (parts[p], h)
        if fused:
            names = "qkvz" if p in "qkvz" else "ba"
            hf = f"{la}.in_proj_{names}.weight"
            return hf, shape, lambda f: _split_grouped(whole(hf), cfg, names)[p]
        if p in "qkv":
            hf = f"{la}.in_proj_qkv.weight"
            return hf, shape, lambda f: dict(zip("qkv", whole(hf).split([parts[c] for c in "qkv"])))[p]
        hf = f"{la}.in_proj_{p}.weight"
        return hf, shape, lambda f: whole(hf)
    if leaf.startswith("conv_"):
        hf, p = f"{la}.conv1d.weight", leaf[-1]
        return hf, (parts[p], cfg.linear_conv_kernel), \
            lambda f: dict(zip("qkv", whole(hf)[:, 0].split([parts[c] for c in "qkv"])))[p]
    simple = {("attention", "A_log"): "A_log", ("attention", "dt_bias"): "dt_bias",
              ("attention.norm", "weight"): "norm.weight", ("attention.wo", "weight"): "out_proj.weight"}
    key = simple.get((module, leaf))
    if key is None:
        raise KeyError(f"shardwise parameter {module}.{leaf} of a linear-attention layer has no Hugging Face "
                       "counterpart")
    hf = f"{la}.{key}"
    return hf, files.shape(hf), lambda f: whole(hf)


def export_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, offset: float = 1.0,
                   fused: bool = True) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(HF tensors, the shardwise names they cover) for everything `source` maps; `fused` writes Qwen3-Next's
    in_proj_qkvz / in_proj_ba, else Qwen3.5's separate projections."""
    out, used = {}, set()

    def take(n):
        used.add(n)
        return state[n].detach().float().cpu()

    if "norm.weight" in state:
        out["model.norm.weight"] = take("norm.weight") - offset
    hd, rd = cfg.head_dim, cfg.rope_dim
    for i in range(cfg.n_layers):
        lay, base = f"layers.{i}", f"model.layers.{i}"
        for ours, theirs in _NORMS.items():
            out[f"{base}.{theirs}.weight"] = take(f"{lay}.{ours}.weight") - offset
        for w, proj in _FFN.items():
            if f"{lay}.feed_forward.shared.{w}.weight" in state:
                out[f"{base}.mlp.shared_expert.{proj}.weight"] = take(f"{lay}.feed_forward.shared.{w}.weight")
        if f"{lay}.feed_forward.shared_gate.weight" in state:
            out[f"{base}.mlp.shared_expert_gate.weight"] = take(f"{lay}.feed_forward.shared_gate.weight")
        a = f"{lay}.attention"
        if not cfg.is_linear_layer(i):
            sa = f"{base}.self_attn"
            out[f"{sa}.q_proj.weight"] = rope_rows(take(f"{a}.wq.weight"), 2 * hd, rd, False)
            out[f"{sa}.k_proj.weight"] = rope_rows(take(f"{a}.wk.weight"), hd, rd, False)
            for n in ("q_norm", "k_norm"):
                out[f"{sa}.{n}.weight"] = rope_rows(take(f"{a}.{n}.weight") - offset, hd, rd, False)
            continue
        la = f"{base}.linear_attn"
        p = {c: take(f"{a}.w{c}.weight") for c in "qkvzba"}
        if fused:
            out[f"{la}.in_proj_qkvz.weight"] = _join_grouped(p, cfg, "qkvz")
            out[f"{la}.in_proj_ba.weight"] = _join_grouped(p, cfg, "ba")
        else:
            out[f"{la}.in_proj_qkv.weight"] = torch.cat([p[c] for c in "qkv"])
            for c in "zba":
                out[f"{la}.in_proj_{c}.weight"] = p[c]
        out[f"{la}.conv1d.weight"] = torch.cat([take(f"{a}.conv_{c}") for c in "qkv"]).unsqueeze(1)
        out[f"{la}.A_log"], out[f"{la}.dt_bias"] = take(f"{a}.A_log"), take(f"{a}.dt_bias")
        out[f"{la}.norm.weight"] = take(f"{a}.norm.weight")
        out[f"{la}.out_proj.weight"] = take(f"{a}.wo.weight")
    return out, used
