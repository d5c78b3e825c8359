"""gpt-oss's terms in the planner, each a hook the generic counting calls: the parameters its unchosen experts' biases
leave idle and the attention-core work of its sliding-window layers (its sinks and biases are inventory entries:
`rules/inventory.py`).

A sliding layer's attention core is counted twice over (docs/planner.md, "FLOPs"): its model FLOPs (MFU's
numerator) let each query see min(W, s) keys where a full layer's see s (no causal discount, as for full layers);
the work its kernels run (step time) is what the runtime computes — the bands of one device and Ulysses, the ring's
steps and block pairs some window reaches — counted by `partition`'s functions, the runtime's own rules.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.rules.partition import local_scores, ring_scores, ring_step_list


def idle_expert_bias(spec) -> int:
    """Expert-bias parameters one token does not use in one MoE layer (its E − k unchosen experts)."""
    return (2 * spec.expert_ffn_dim + spec.dim) * (spec.moe_experts - spec.moe_topk) if spec.moe_expert_bias else 0


@lru_cache(maxsize=1024)
def window_keys(seq_len: int, window: int, cp: int, cp_impl: str, order: str) -> float:
    """Keys per query a sliding layer's kernels score on the busiest cp rank: one device and Ulysses (every rank
    the whole sequence of its heads) the bands' scores over s, the ring its steps' visible block pairs over its
    s/cp queries (the contiguous order's later ranks do more than rank 0). s where the window spans the sequence."""
    if not window or window >= seq_len:
        return float(seq_len)
    if cp == 1 or cp_impl == "ulysses":
        return local_scores(seq_len, window) / seq_len
    s_local = seq_len // cp
    return max(ring_scores(cp, order, s_local, window)) / s_local


def work_share(spec, layer: int, lay, seq_len: int) -> float:
    """The fraction of a full layer's attention-core FLOPs (s keys per query) the kernels of layer `layer` run on
    layout `lay`'s busiest cp rank (1.0: a full layer, a Gated DeltaNet one, a window spanning the sequence)."""
    w = spec.window(layer)
    if not w or spec.is_linear_layer(layer):
        return 1.0
    return window_keys(seq_len, w, lay.cp, lay.cp_impl, lay.cp_order) / seq_len


def core_layers(spec, st, lay, seq_len: int, held_ids, recomputed) -> tuple[tuple[float, float], tuple[float, float]]:
    """Stage `st`'s (dense, MoE) layers in full-layer equivalents of attention-core work: those it runs, those its
    recompute runs again (`held_ids`: its layer ids, `recomputed`: the layout's recomputed ids). Without sliding
    layers: its layer counts (`Stage.recompute_split`)."""
    if not spec.sliding_layers:
        return (st.n_dense, st.n_moe), st.recompute_split(lay)[0]
    run, again = [0.0, 0.0], [0.0, 0.0]
    for i in held_ids:
        share, moe = work_share(spec, i, lay, seq_len), spec.is_moe_layer(i)
        run[moe] += share
        again[moe] += share if i in recomputed else 0.0
    return (run[0], run[1]), (again[0], again[1])


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
    windows = [spec.window(i) for i in layer_ids if not spec.is_linear_layer(i)]
    hops = {w: len(ring_step_list(lay.cp, lay.cp_order, s_local, w)) - 1 for w in set(windows)}  # one list per window
    return sum(hops[w] for w in windows)
