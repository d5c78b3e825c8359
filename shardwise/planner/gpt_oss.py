"""gpt-oss's terms in the planner, each a hook the generic counting calls: the tensors its biases and sinks add
(in shardwise's parameter order) and the attention-core work of its sliding-window layers.

Tensors are (element count on one rank, `Tensor` flags) pairs, so the generic `models.py` makes them without this
module importing it. Under TP the sinks split with the query heads (complete gradients), wo's bias is replicated
(partial under SP, like every replicated weight fed sequence shards); the router's bias is replicated like the
router; the expert biases split over ep with their experts. A sliding layer's query sees min(W, s) keys instead of
s (the planner's core FLOPs count every key, no causal discount, so the window scales them by min(W, s)/s).
"""
from __future__ import annotations

from shardwise.partition import ring_step_list


def attention_sinks(spec, tp: int) -> list[tuple[int, dict]]:
    """Before wq (the attention module's own parameter comes before its projections'): this rank's heads' sinks."""
    return [(spec.n_heads // tp, dict(matrix=False))] if spec.attention_sinks else []


def out_bias(spec) -> list[tuple[int, dict]]:
    """After wo's weight: its bias."""
    return [(spec.dim, dict(matrix=False, sp_replicated=True))] if spec.attention_out_bias else []


def router_extras(spec) -> list[tuple[int, dict]]:
    """After the router's weight: its bias (replicated over tp and ep)."""
    return [(spec.moe_experts, dict(matrix=False, sp_replicated=True))] if spec.moe_router_bias else []


def expert_extras(spec, ep: int) -> list[tuple[int, dict]]:
    """After the routed experts' w1, w3, w2: their biases b1, b3 [E/ep, ffn] and b2 [E/ep, h]."""
    if not spec.moe_expert_bias:
        return []
    e, f = spec.moe_experts // ep, spec.expert_ffn_dim
    kw = dict(matrix=False, expert=True, sp_replicated=True)
    return [(e * f, kw), (e * f, kw), (e * spec.dim, kw)]


def idle_expert_bias(spec) -> int:
    """Expert-bias parameters one token does not use in one MoE layer (its E − k unchosen experts)."""
    return (2 * spec.expert_ffn_dim + spec.dim) * (spec.moe_experts - spec.moe_topk) if spec.moe_expert_bias else 0


def window_share(spec, layer: int, seq_len: int) -> float:
    """The fraction of a full layer's attention-core FLOPs layer `layer` does at `seq_len` tokens."""
    w = spec.window(layer)
    return min(w, seq_len) / seq_len if w else 1.0


def expert_activation_bytes(spec, act_bytes: int, rows: int) -> int:
    """What the grouped experts save beyond silu(w1 x)·w3 x for `rows` routed rows: the clamped SwiGLU keeps three
    more [rows, ffn] tensors (the clamped gate, up + 1, the gate's sigmoid), and each of the three row-bias
    gathers its int64 index (one per row)."""
    clamp = 3 * act_bytes * rows * spec.expert_ffn_dim if spec.moe_swiglu_limit else 0
    return clamp + (3 * 8 * rows if spec.moe_expert_bias else 0)


def ring_hops(spec, lay, wl, layer_ids, attention_layers: int) -> int:
    """K/V hops one ring pass makes, summed over a stage's `attention_layers` (cp − 1 each; a sliding layer's ring
    runs only the steps of `partition.ring_step_list`, the runtime's own list). `layer_ids` are the stage's layers
    (None: no sliding windows)."""
    if layer_ids is None:
        return attention_layers * (lay.cp - 1)
    s_local = wl.seq_len // lay.cp
    return sum(len(ring_step_list(lay.cp, lay.cp_order, s_local, spec.window(i))) - 1
               for i in layer_ids if not spec.is_linear_layer(i))
