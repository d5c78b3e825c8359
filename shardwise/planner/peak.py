"""The live peak of one rank: what `shardwise simulate`'s trace of real steps shows beside the static state
and the saved activations (`memory`), term by term.

At its worst moment a rank holds its static state, the activations of the microbatches in flight, and
transient buffers that no saved-tensor hook sees: the LM head's loss buffers (the last stage), a layer's
backward gradients, the pipeline's send and receive buffers, autocast's cached weight copies under full
recompute, ZeRO-3's gathered units and in-flight reduce-scatter buckets, and the weight-gradient store of
split-backward schedules. `peak_terms` adds them up; the planner's "fits" uses the total.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners
from shardwise.planner.memory import (
    _region_input, _stage_units, head_activation_bytes, microbatch_activation_bytes, recompute_transient_bytes,
    stage_activation_bytes, stage_params, static_bytes, zero_buckets,
)
from shardwise.planner.models import ModelSpec, local_kv_heads, padded_vocab
from shardwise.planner.schedule import in_flight


def head_transient_bytes(spec: ModelSpec, lay: Layout, wl: Workload) -> float:
    """Beyond what the head saves, the worst moment of the LM head's loss on one rank (n tokens, V_l
    local vocabulary columns, x = n·V_l): the logits (activation dtype e), and
    * fused cross-entropy (tp = 1): forward an fp32 copy under bf16; backward the fp32 gradients of
      nll_loss and of log-softmax (8·x);
    * vocabulary-parallel (tp > 1): forward the fp32 copy under bf16, the shifted logits (4·x) and, on the
      rank whose shard runs past the vocabulary, a masked clone (4·x); backward the fp32 gradient (4·x)
      and its cast back to bf16.
    Without a pipeline the training loop still holds the logits through backward; a pipeline stage
    replaces them by the loss."""
    n = lay.mb * wl.seq_len // lay.cp
    x = n * (padded_vocab(spec, lay.tp) // lay.tp)
    e = wl.act_bytes
    cast = 4 * x if e != 4 else 0
    logits = e * x
    held = logits if lay.pp == 1 else 0
    if lay.tp == 1:
        return float(max(logits + cast, 8 * x + held))
    clone = 4 * x if spec.vocab_size % lay.tp else 0
    return float(max(logits + cast + 4 * x + clone, 4 * x + (e * x if e != 4 else 0) + held))


def layer_backward_transient_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """While a layer's MLP runs backward, beyond what it saved: the gradients of its inner tensors (three
    [rows, ffn] in the activation dtype: the down-projection's input, silu's and the up-projection's
    outputs) less the saved product autograd has already freed, i.e. two, and two [n, h] gradients of the
    residual stream. Dense: n = mb·s/cp rows and ffn/tp; MoE: the n_r·k routed rows and the expert size."""
    if not stage.n_layers:
        return 0.0
    e, r = wl.act_bytes, wl.resid_bytes
    n = lay.mb * wl.seq_len // lay.cp
    out = 0.0
    if stage.n_dense:
        out = 2 * e * n * (spec.ffn_dim // lay.tp)
    if stage.n_moe:
        n_r = n // lay.tp if lay.sp else n
        out = max(out, 2 * e * n_r * spec.moe_topk * spec.expert_ffn_dim)
    return out + 2 * r * n * spec.dim


def pipeline_buffer_bytes(spec: ModelSpec, lay: Layout, wl: Workload) -> float:
    """A pipeline rank's p2p buffers beside its activations: the receive buffer of the next input and an
    output whose send has not completed (each mb·s/cp tokens of the residual dtype; 1/tp under SP)."""
    if lay.pp == 1:
        return 0.0
    n = lay.mb * wl.seq_len // lay.cp
    return 2.0 * wl.resid_bytes * (n // lay.tp if lay.sp else n) * spec.dim


def autocast_cache_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """Under bf16 autocast with full recompute: autocast caches its low-precision copy of every weight it
    casts until the autocast region ends, and each chunk's forward is one region — so at the end of a
    chunk's forward the copies of all its linears are alive together, though checkpoint saves none.
    (Without full recompute the same copies are saved for backward and counted as activations, as the LM
    head's always is: it is never recomputed.)"""
    if wl.act_bytes == 4 or lay.recompute != "full" or not stage.n_layers:
        return 0.0
    chunks = sum(1 for o in chunk_owners(lay) if o == stage.index)
    p = stage_params(spec, Stage(0, stage.n_dense, stage.n_moe, False, False), lay)
    return float(wl.act_bytes * (p.total - p.vectors) / chunks)


def zero3_gathered_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """ZeRO-3: the unit running and the one prefetched beside it are gathered in full (fp32), the largest
    adjacent pair of the stage's units."""
    if lay.zero < 3:
        return 0.0
    units = _stage_units(spec, stage, lay)
    sizes = [(c, sum(x.numel for x, _ in ts)) for c, ts in units]
    pairs = [a[1] + b[1] for a, b in zip(sizes, sizes[1:]) if a[0] == b[0]]
    return 4.0 * max(pairs + [n for _, n in sizes] + [0])


def inflight_bucket_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """ZeRO 2/3: the full fp32 gradient buffers of the reduce-scatters still in flight — GradReducer lets two
    run at once, and they outlive the backward that filled them (the largest two of the stage's buckets)."""
    if lay.zero < 2:
        return 0.0
    sizes = sorted((b.padded for b in zero_buckets(spec, stage, lay) if not b.deferred), reverse=True)
    return 4.0 * sum(sizes[:2])


def deferred_w_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """What a split-backward schedule's weight-gradient store keeps per microbatch through one rank's
    layers between its B and its W: every linear's input (kept past B, when autograd would free it) and
    its output gradient (activation dtype). Dense layers and the LM head; routed experts compute dW in B."""
    e, r, t, h = wl.act_bytes, wl.resid_bytes, lay.tp, spec.dim
    n = lay.mb * wl.seq_len // lay.cp
    hq, hkv, dk, dv = spec.n_heads // t, local_kv_heads(spec, t), spec.k_dim, spec.v_dim
    ffn = spec.ffn_dim // t
    mats = 3 if spec.mlp == "swiglu" else 2
    layer = (_region_input(n, h, 3, e, r) + e * n * hq * dv + _region_input(n, h, mats - 1, e, r) + e * n * ffn
             + e * n * (hq * dk + hkv * (dk + dv)) + 2 * e * n * h + (mats - 1) * e * n * ffn)
    head = _region_input(n, h, 1, e, r) + e * n * (padded_vocab(spec, t) // t) if stage.head else 0
    return float(layer * stage.n_dense + head)


@lru_cache(maxsize=1024)
def _split_states(schedule: str, p: int, m: int, v: int, k: int) -> tuple[tuple[int, int], ...]:
    """Every (chunks with F done and B not, chunks with B done and W not) rank k passes through."""
    from shardwise.pipeline.schedules import build_schedule

    sched = build_schedule(schedule, p, m, v)
    if not sched.split_bw:
        return ()
    held = pending = 0
    states = set()
    for a in sched.actions[k]:
        held += a.kind == "F"
        if a.kind == "B":
            held, pending = held - 1, pending + 1
        pending -= a.kind == "W"
        states.add((held, pending))
    return tuple(sorted(states))


def weight_store_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """Split-backward schedules (zb, dualpipev): what the weight-gradient store holds at the worst moment,
    beyond the activations of the microbatches in flight (`deferred_w_bytes` per pending microbatch)."""
    if lay.pp == 1 or lay.schedule not in ("zb", "dualpipev"):
        return 0.0
    chunks = sum(1 for o in chunk_owners(lay) if o == stage.index)
    mb = microbatch_activation_bytes(spec, stage, lay, wl)
    act = (mb["total"] - mb["head"]) / chunks
    w = deferred_w_bytes(spec, stage, lay, wl) / chunks
    try:
        states = _split_states(lay.schedule, lay.pp, lay.m, lay.vp, stage.index)
    except (ImportError, ValueError):
        return 0.0
    peak = max((act * held + w * pending for held, pending in states), default=0.0)
    return max(0.0, peak - act * chunks * in_flight(lay, stage.index))


def peak_terms(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, static: float, activation: float) -> dict:
    """The live peak of one rank of `stage`, by part: static state, the activations held at the worst moment
    (`stage_activation_bytes`), and the transient buffers the trace of a real step shows beside them
    (`shardwise simulate` measures the sum): the worst of the head's loss (last stage) and a layer's
    backward (on the last stage the layers' backward starts once the head's saved tensors are freed), and
    the pipeline's send and receive buffers."""
    # Relative to static + `activation` (which includes the layer full recompute rebuilds in backward), the
    # worst of three moments: the head's loss and the end of a chunk's forward (autocast's cache) come
    # before anything is rebuilt; a layer's backward comes after the head's saved tensors were freed (the
    # non-pipelined loop still holds the logits).
    rebuilt = recompute_transient_bytes(spec, stage, lay, wl)
    moments = [autocast_cache_bytes(spec, stage, lay, wl) - rebuilt]
    if stage.n_layers:
        layer = layer_backward_transient_bytes(spec, stage, lay, wl)
        if stage.head:
            n = lay.mb * wl.seq_len // lay.cp
            logits = wl.act_bytes * n * (padded_vocab(spec, lay.tp) // lay.tp) if lay.pp == 1 else 0
            layer -= head_activation_bytes(spec, lay, wl) - logits
        moments.append(layer)
    if stage.head:
        moments.append(head_transient_bytes(spec, lay, wl) - rebuilt)
    out = {"static": float(static), "activations": float(activation), "transient": max(moments),
           "zero3_gathered": zero3_gathered_bytes(spec, stage, lay),
           "reduce_scatter_buckets": inflight_bucket_bytes(spec, stage, lay),
           "weight_gradient_store": weight_store_bytes(spec, stage, lay, wl),
           "pipeline_buffers": pipeline_buffer_bytes(spec, lay, wl)}
    out["total"] = sum(out.values())
    return out


def peak_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, mem: dict | None = None) -> float:
    """Live peak of one rank of `stage` during a step (`peak_terms`' total)."""
    if mem is None:
        local = stage_params(spec, stage, lay)
        static = static_bytes(local, lay, zero_buckets(spec, stage, lay) if lay.zero else None)["total"]
        act = stage_activation_bytes(spec, stage, lay, wl)
    else:
        static, act = mem["static"]["total"], mem["activation"]
    return peak_terms(spec, stage, lay, wl, static, act)["total"]
