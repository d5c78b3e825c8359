"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in the planner: the tensors one rank holds of a
linear-attention layer's mixer, in shardwise's `named_parameters` order, under its TP plan
(`parallelize._linear_attention_tensor_parallel`): key heads and the value heads they serve split over tp, the
q/k/v/z/b/a projections and the convolution kernels, A_log and dt_bias cut by heads, `wo` by input columns, the
gated norm's one-head weight replicated with a gradient partial over tp under any TP (head-partial).

Torch-free; `planner/models.py` asks for these instead of attention's for the layers in `linear_layers`.
"""
from __future__ import annotations


def linear_attention_tensors(spec, tp: int, tensor_cls, norm: list) -> list:
    """The block's input norm (`norm`), then wq, wk, wv, wz, wb, wa, conv_q, conv_k, conv_v, A_log, dt_bias,
    norm.weight, wo as `tensor_cls` (planner.models.Tensor) entries for one tp rank."""
    h, kw = spec.dim, spec.linear_conv_kernel
    nk, nv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    qk, v = nk * spec.linear_k_dim, nv * spec.linear_v_dim
    out = list(norm)
    out += [tensor_cls(rows * h) for rows in (qk, qk, v, v, nv, nv)]
    out += [tensor_cls(rows * kw) for rows in (qk, qk, v)]  # depthwise kernels [channels, K]: matrices
    out += [tensor_cls(nv, matrix=False), tensor_cls(nv, matrix=False)]
    out += [tensor_cls(spec.linear_v_dim, matrix=False, sp_replicated=True), tensor_cls(v * h)]
    return out
