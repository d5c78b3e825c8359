"""Kimi-Linear's tensors in its Hugging Face checkpoint layout ↔ shardwise's, for `hf/weights.py`.

The layout is Moonshot's, which transformers' `save_pretrained` writes back (its conversion mapping fuses on load):
* a Kimi Delta Attention layer keeps q/k/v, f_a/f_b (the decay gate), b, g_a/g_b (the output gate), o_norm, o_proj
  under `self_attn`, one depthwise kernel per q/k/v (`q_conv1d.weight` [C, 1, K]), dt_bias [H·d] and A_log
  [1, 1, H, 1]: shardwise keeps the kernels [C, K] and A_log [H];
* every MLP sits under `block_sparse_moe`: a dense layer's gate/up/down_proj, an MoE layer's router (`gate`, with
  its selection bias `e_score_correction_bias`), routed experts `experts.{e}.w1/w2/w3` and `shared_experts`;
* MLA layers are DeepSeek-V3's names (`hf/weights.py` maps them), without RoPE: nothing to permute.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from ..config import ModelConfig

_KDA = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wf_a": "f_a_proj", "wf_b": "f_b_proj", "wb": "b_proj",
        "wg_a": "g_a_proj", "wg_b": "g_b_proj", "wo": "o_proj", "norm": "o_norm"}
_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def source(name: str, cfg: ModelConfig, files) -> tuple[str, tuple[int, ...], Callable | None] | None:
    """(HF name, shardwise global shape, read(files) → the global tensor, or None: read it as stored) for a tensor
    this family names or lays out differently; None for one `hf/weights.py` maps as usual (embedding, head, norms,
    MLA, the router and the routed experts, which it reads from `block_sparse_moe` already)."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|A_log|dt_bias|conv_[qkv])", name)
    if m is None:
        return None
    i, module, leaf = int(m.group(1)), m.group(2), m.group(3)
    base = f"model.layers.{i}"
    ffn = re.fullmatch(r"feed_forward(\.shared)?\.(w[123])", module)
    if ffn is not None:
        hf = f"{base}.block_sparse_moe.{'shared_experts.' if ffn.group(1) else ''}{_FFN[ffn.group(2)]}.weight"
        return hf, files.shape(hf), None
    if not (cfg.is_linear_layer(i) and module.split(".")[0] == "attention"):
        return None
    attn = f"{base}.self_attn"
    if leaf.startswith("conv_"):
        hf = f"{attn}.{leaf[-1]}_conv1d.weight"
        return hf, files.shape(hf)[:1] + files.shape(hf)[2:], lambda f: _whole(f, hf)[:, 0]
    if leaf == "A_log":
        hf = f"{attn}.A_log"
        return hf, (cfg.linear_v_heads,), lambda f: _whole(f, hf).reshape(-1)
    if leaf == "dt_bias":
        hf = f"{attn}.dt_bias"
        return hf, files.shape(hf), None
    part = module.split(".", 1)[1] if "." in module else ""
    if part not in _KDA:
        raise KeyError(f"shardwise parameter {name} of a Kimi Delta Attention layer has no Hugging Face counterpart")
    hf = f"{attn}.{_KDA[part]}.weight"
    return hf, files.shape(hf), None


def _whole(files, name: str) -> torch.Tensor:
    return files.read(name, tuple(slice(0, s) for s in files.shape(name)))


def export_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(HF tensors, the shardwise names they cover): the Kimi Delta Attention layers and every MLP / MoE tensor
    (router, its selection bias, routed and shared experts) under Moonshot's names."""
    out, used = {}, set()

    def take(n):
        used.add(n)
        return state[n].detach().float().cpu()

    for n in list(state):
        m = re.fullmatch(r"layers\.(\d+)\.(attention|feed_forward)\.(.+)", n)
        if m is None:
            continue
        i, kind, rest = int(m.group(1)), m.group(2), m.group(3)
        base = f"model.layers.{i}"
        if kind == "attention":
            if not cfg.is_linear_layer(i):
                continue
            attn = f"{base}.self_attn"
            if rest.startswith("conv_"):
                out[f"{attn}.{rest[-1]}_conv1d.weight"] = take(n).unsqueeze(1)
            elif rest == "A_log":
                out[f"{attn}.A_log"] = take(n).reshape(1, 1, -1, 1)
            elif rest == "dt_bias":
                out[f"{attn}.dt_bias"] = take(n)
            else:
                out[f"{attn}.{_KDA[rest.rsplit('.', 1)[0]]}.weight"] = take(n)
            continue
        moe = f"{base}.block_sparse_moe"
        ex = re.fullmatch(r"experts\.(w[123])", rest)
        if ex is not None:
            t = take(n)
            out.update({f"{moe}.experts.{e}.{ex.group(1)}.weight": t[e].clone() for e in range(t.shape[0])})
        elif rest == "router.weight":
            out[f"{moe}.gate.weight"] = take(n)
        elif rest == "router.expert_bias":
            out[f"{moe}.gate.e_score_correction_bias"] = take(n)
        else:
            f = re.fullmatch(r"(shared\.)?(w[123])\.weight", rest)
            if f is None:
                raise KeyError(f"export: {n} has no Kimi-Linear counterpart")
            out[f"{moe}.{'shared_experts.' if f.group(1) else ''}{_FFN[f.group(2)]}.weight"] = take(n)
    return out, used
