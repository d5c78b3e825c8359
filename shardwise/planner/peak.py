"""The live peak of one rank: what `shardwise simulate`'s trace of real steps shows beside the static state
and the saved activations (`memory`), term by term.

At its worst moment a rank holds its static state, the activations of the microbatches in flight, and
transient buffers that no saved-tensor hook sees: the LM head's loss buffers (the last stage), a layer's
backward gradients, the pipeline's send and receive buffers, the bf16 weight copy an op uses under full
recompute, ZeRO-3's gathered units and in-flight reduce-scatter buckets, the TP reduction's concatenated
gradients, and the weight-gradient store of split-backward schedules. Which of them are alive together
depends on the moment of the step, so `peak_terms` takes the worst of a few moments (each with its own
share, and a name saying which runtime tensors make it); the planner's "fits" uses the total. ZeRO-2's and
ZeRO-3's buckets are walked in `zero2_inflight` and `zero3_inflight`, the weight gradients on their way from a
GEMM to the flat buffer are in `weight_grads`.
"""
from __future__ import annotations

from dataclasses import replace

from shardwise.planner import moe_skew
from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners
from shardwise.planner.activations import (
    head_activation_bytes, head_loss_saved_bytes, microbatch_activation_bytes, rebuilt_weight_copies,
    recompute_transient_bytes, stage_activation_bytes,
)
from shardwise.planner.memory import stage_params, stage_units, static_bytes, zero_buckets
from shardwise.planner.models import ModelSpec, padded_vocab
from shardwise.planner.muon import step_transient_bytes
from shardwise.planner.rank_actions import (
    backward_states, backwards_before_forward, boundary_buffers, head_held_at_other_backward,
)
from shardwise.planner.weight_grads import (
    embedding_weight_grad_bytes, expert_weight_grad_bytes, head_weight_grad_bytes,
)
from shardwise.planner.weight_store import weight_store_bytes
from shardwise.planner.zero2_inflight import zero2_bucket_moments
from shardwise.planner.zero3_mtp_held import head_backward_units, head_held_bytes, mtp_held_bytes
from shardwise.planner.zero3_inflight import (
    backward_inflight_bytes, forward_inflight_bytes, freed_per_layer, last_launched, layer_backward_moment,
    unit_bytes, zero3_gathered_bytes,
)


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
        out = max(out, 2 * e * moe_skew.busiest_rows(spec, lay, wl, n_r) * spec.expert_ffn_dim)
    return out + 2 * r * n * spec.dim


def pipeline_buffer_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """A pipeline rank's boundary tensors beside its saved activations, (during a forward, during a backward):
    the executor's posted receives, chunk inputs and handed-over outputs it holds from F to B, sends not yet
    complete and gradients its loop still refers to — the most at any F, and at any B or W, of the rank's
    actions (`rank_actions.boundary_buffers`), each mb·s/cp tokens (1/tp under SP) of the residual dtype."""
    if lay.pp == 1:
        return 0.0, 0.0
    n = lay.mb * wl.seq_len // lay.cp
    one = wl.resid_bytes * (n // lay.tp if lay.sp else n) * spec.dim
    # the count repeats from the steady state on: walked at no more than 4·pp microbatches (`schedule.simulated`)
    # a chunk's input is saved by autograd under an fp32 residual, and by its first layer's checkpoint under full
    # recompute (`--recompute-layers` recomputes each chunk's first layers)
    at_f, at_b = boundary_buffers(lay.schedule, lay.pp, min(lay.m, 4 * lay.pp), lay.vp, stage.index,
                                  wl.resid_bytes == 4 or lay.recompute == "full")
    return float(one * at_f), float(one * at_b)


def layer_forward_transient_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """A layer's forward under full recompute (no autograd: nothing saved) at its worst op, the MLP's output
    projection: the residual input cast to the activation dtype, the down-projection's input product
    ([n, ffn/tp]) and output ([n, h]); under SP also the all-gathered MLP input and the contiguous copy the
    output's reduce-scatter sends (n = mb·s/cp rows, 1/tp of them in the residual stream under SP)."""
    (dense, moe), _ = stage.recompute_split(lay)
    if lay.recompute != "full" or not dense + moe:
        return 0.0
    e, h = wl.act_bytes, spec.dim
    n = lay.mb * wl.seq_len // lay.cp
    sp = lay.sp and lay.tp > 1
    inner = n * (spec.ffn_dim // lay.tp) if dense else moe_skew.busiest_rows(spec, lay, wl, n) * spec.expert_ffn_dim
    cast = e * (n // lay.tp if sp else n) * h if e != 4 else 0
    return float(cast + e * inner + e * n * h * (3 if sp else 1))


def head_loss_buffers(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """ZeRO 2/3, during the head's loss backward (before any gradient of this backward reaches a bucket):
    (ZeRO-3 gathered: the head unit and the final norm prefetched beside it, reduce-scatters in flight:
    what an earlier backward of the step launched last)."""
    if lay.zero < 2:
        return 0.0, 0.0
    again = lay.m > 1
    if lay.zero == 2:
        return 0.0, zero2_bucket_moments(spec, stage, lay, wl, 0.0, again, lay.m - 1)[1]
    units = [full for chunk, full, _, _ in unit_bytes(spec, stage, lay, wl)]
    norm, head = head_backward_units(spec, stage, lay)  # MTP: modules follow the head, and hold units beside it
    gathered = units[norm] + units[head] + head_held_bytes(spec, stage, lay)
    return gathered, last_launched(spec, stage, lay, wl) if again else 0.0


def backward_moments(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """ZeRO 2/3: at the worst moment of a backward, (ZeRO-3 units gathered, reduce-scatter buffers filling
    and in flight less the activations it holds below the stage's most): the first backward holds the most
    but finds nothing in flight."""
    if lay.pp == 1:
        states = ((0, False),) + (((0, True),) if lay.m > 1 else ())
    else:
        states = backward_states(lay.schedule, lay.pp, lay.m, lay.vp, stage.index)
    chunks = sum(1 for o in chunk_owners(lay) if o == stage.index)
    mb = microbatch_activation_bytes(spec, stage, lay, wl)
    per = (mb["total"] - (mb["head"] if lay.pp > 1 else 0)) / chunks
    per_layer = freed_per_layer(spec, stage, lay, wl)
    best = (0.0, 0.0)
    for deficit, prior in states:
        if lay.zero == 3:
            at, got = backward_inflight_bytes(spec, stage, lay, wl, prior)
        else:
            at, got = 0.0, zero2_bucket_moments(spec, stage, lay, wl, per_layer, prior, 0)[0]
        if at + got - deficit * per > sum(best):
            best = (at, got - deficit * per)
    return best


def autocast_moment_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """Under bf16 autocast, (weight copies, ZeRO-3 gathered units) at the worst moment of a chunk's forward.

    Full recompute: its layer's down-projection (`layer_forward_transient_bytes`). A recomputed block runs
    with autocast's weight cache off (`shardwise.recompute`), so a weight's bf16 copy lives only while its
    op runs: the down-projection's own copy (dense: [h, ffn/tp]; MoE: the local experts' three stacks, cast
    together for the grouped GEMM). Under ZeRO-3 the layer running and the next one of its chunk
    (prefetched) are gathered beside it: the largest such pair.

    zb and dualpipev without full recompute: their linears keep the fp32 weight on ctx (`grad_store`), so no
    copy is saved for backward and the cache, alive for the whole chunk's forward, is all there is:
    `_cached_copies`. (Otherwise the copies are saved for backward and counted as activations, as the LM
    head's always is: it is never recomputed.)"""
    split = lay.pp > 1 and lay.schedule in ("zb", "dualpipev")  # the tp linears save no copy (grad_store)
    if wl.act_bytes == 4 or (lay.recompute != "full" and not split) or not stage.n_layers:
        return 0.0, 0.0
    if lay.recompute != "full":
        return _cached_copies(spec, stage, lay, wl)
    (n_dense, n_moe), _ = stage.recompute_split(lay)  # the recomputed layers' kinds (--recompute-layers)
    dense = spec.ffn_dim // lay.tp * spec.dim if n_dense else 0
    moe = spec.mlp_mats * spec.moe_experts // lay.ep * spec.expert_ffn_dim * spec.dim if n_moe else 0
    copy = float(wl.act_bytes * max(dense, moe))
    if lay.zero < 3:
        return copy, 0.0
    units = unit_bytes(spec, stage, lay, wl)
    pairs = [full + (units[j + 1][1] if j + 1 < len(units) and units[j + 1][0] == chunk else 0)
             for j, (chunk, full, cast, _) in enumerate(units) if cast]
    return copy, float(max(pairs, default=0))


def _cached_copies(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """The cache's copies of the chunk's layers run so far (ZeRO-3: beside the running and prefetched units;
    the worst layer is the largest sum, often the last but one)."""
    if lay.zero < 3:
        chunks = sum(1 for o in chunk_owners(lay) if o == stage.index)
        p = stage_params(spec, Stage(0, stage.n_dense, stage.n_moe, False, False), lay)
        return float(wl.act_bytes * (p.total - p.vectors) / chunks), 0.0
    units = unit_bytes(spec, stage, lay, wl)
    best, copies = (0.0, 0.0), 0.0
    for j, (chunk, full, cast, _) in enumerate(units):
        copies = copies * (j > 0 and units[j - 1][0] == chunk) + wl.act_bytes * cast
        if not cast:
            continue
        nxt = units[j + 1][1] if j + 1 < len(units) and units[j + 1][0] == chunk else 0
        if copies + full + nxt > sum(best):
            best = (copies, float(full + nxt))
    return best


def head_forward_moment(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """Under bf16 autocast with full recompute, the last stage's LM head matmul: its logits just made, the
    head's own saved tensors held (its weight copy — outside every checkpoint, so cached and saved — and
    its input) but not yet the loss's (fp32 softmax, targets and masks: the loss runs after the region);
    no layer's copy (the recomputed blocks ran uncached). (transient beyond static + held activations,
    ZeRO-3 gathered bytes: the head unit alone — nothing follows it to prefetch.)"""
    if wl.act_bytes == 4 or lay.recompute != "full" or not stage.head or not stage.n_layers:
        return 0.0, 0.0
    n = lay.mb * wl.seq_len // lay.cp
    x = n * (padded_vocab(spec, lay.tp) // lay.tp)
    transient = float(wl.act_bytes * x - head_loss_saved_bytes(spec, lay, wl))
    return transient, float(unit_bytes(spec, stage, lay, wl)[-1][1]) if lay.zero >= 3 else 0.0


def autocast_cache_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """The weight copy of `autocast_moment_bytes` (the cache itself holds no recomputed block's copies)."""
    return autocast_moment_bytes(spec, stage, lay, wl)[0]


def head_copy_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """Under bf16 full recompute, the LM head's weight copy (outside every checkpoint: cached and saved, held
    with the head's activations), freed by the head's backward, so gone during a layer's backward: a layer's
    backward runs after the head's backward in the same B (the head's chunk), or in a B of another chunk while no
    head is in flight — each F of the head's chunk is its own autocast region, and on 1F1B, zb and interleaved the
    last rank's B of that chunk follows its F at once (GPipe holds the other microbatches' heads, each with its own
    copy, and `stage_activation_bytes` counts them). DualPipeV's rank 0 runs a B of its first chunk while a head is
    in flight (`head_held_at_other_backward`): the copy stays."""
    if wl.act_bytes == 4 or lay.recompute != "full" or not stage.head:
        return 0.0
    if lay.pp > 1 and head_held_at_other_backward(lay.schedule, lay.pp, min(lay.m, 4 * lay.pp), lay.vp, stage.index):
        return 0.0
    return float(wl.act_bytes * padded_vocab(spec, lay.tp) // lay.tp * spec.dim)


def tp_reduction_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """After backward, before the dp×cp reduction (no activation left): GradReducer._reduce_tp sums TP-partial
    gradients over tp through one fp32 concatenation of them all (under SP: norms, and every MoE gradient,
    experts included — MoE blocks are replicated over tp), and K/V heads shared by tp ranks through a
    [K/V heads, their local gradients] buffer beside that row's own concatenation.

    `stage_units` also flags a tied embedding's pipeline copies and MTP's embedding copy (their buckets wait for
    the emb sum), which `_reduce_tied` all-reduces in place: nothing concatenated. They are flagged without tp
    too, so the TP-partial gradients are the ones flagged at this tp and not at tp 1."""
    if lay.tp == 1:
        return 0.0
    without_tp = stage_units(spec, stage, replace(lay, tp=1))
    tp_sum = kv = 0
    for (_, tensors), (_, flags) in zip(stage_units(spec, stage, lay), without_tp, strict=True):
        for (x, partial), (_, copy) in zip(tensors, flags, strict=True):
            if partial and not copy:
                tp_sum += x.numel if x.sp_replicated else 0
                kv += 0 if x.sp_replicated else x.numel
    return 4.0 * (tp_sum + (kv * (spec.n_kv_heads + 1) if kv else 0))


PEAK_TERMS = {
    "static": "fp32 weights, gradients and Adam moments, ZeRO flat buffers",
    "activations": "the saved tensors of the microbatches in flight, and the layer full recompute rebuilds",
    "transient": "the short-lived tensors of that moment",
    "zero3_gathered": "ZeRO-3 units gathered in full (fp32) at that moment",
    "zero3_mtp_held": "ZeRO-3 units MTP's extra uses keep gathered beside a layer's backward (zero3_mtp_held)",
    "reduce_scatter_buckets": "gradient buckets filling and reduce-scatters in flight at that moment",
    "weight_gradient_store": "inputs and output gradients the split backward keeps for W (zb, dualpipev)",
    "pipeline_buffers": "boundary tensors the executor holds: posted receives, chunk inputs autograd does not save, "
                        "outputs handed to the next chunk, unfinished sends, the gradients its loop refers to",
}
"""`peak_terms`' keys (beside "total" and "moment") and the runtime tensors each stands for."""


def peak_terms(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, static: float, activation: float) -> dict:
    """The live peak of one rank of `stage`, by part: static state, the activations held at the worst moment
    (`stage_activation_bytes`), and what the trace of a real step shows beside them at that moment
    (`shardwise simulate` measures the sum). Each moment carries its own transient buffers, ZeRO-3
    gathered units and in-flight reduce-scatters: a chunk's forward (a layer's down-projection), the LM head's
    matmul, a layer's backward, the head's loss, the TP reduction after backward; `transient`,
    `zero3_gathered` and `reduce_scatter_buckets` are the worst moment's. The weight-gradient store and
    the pipeline's boundary tensors are added to every moment of a forward or a backward."""
    # Relative to static + `activation` (which includes the layer full recompute rebuilds in backward): a
    # forward, the head's matmul and loss come before anything is rebuilt; a layer's backward comes after
    # the head's saved tensors were freed (the non-pipelined loop still holds the logits); the TP
    # reduction after every activation is gone.
    rebuilt = recompute_transient_bytes(spec, stage, lay, wl)
    gathered = zero3_gathered_bytes(spec, stage, lay, wl)
    at_backward, buckets = backward_moments(spec, stage, lay, wl) if lay.zero >= 2 else (gathered, 0.0)
    copies, at_copies = autocast_moment_bytes(spec, stage, lay, wl)
    fwd_buckets = forward_inflight_bytes(spec, stage, lay, wl) if lay.zero == 3 else 0.0
    if lay.zero == 2:
        fwd_buckets = zero2_bucket_moments(spec, stage, lay, wl, 0.0, lay.m > 1 or lay.pp > 1,
                                           backwards_before_forward(lay, stage.index))[1]
    # during another chunk's forward no microbatch holds the head's tensors (its backward follows its
    # forward at once), except under GPipe, which holds every microbatch's head
    head = microbatch_activation_bytes(spec, stage, lay, wl)["head"] if stage.head and lay.schedule != "gpipe" else 0
    moments = [("forward: a layer's down-projection (its operands, the weights' bf16 copies)",
                copies + layer_forward_transient_bytes(spec, stage, lay, wl) - rebuilt - (head if copies else 0),
                at_copies if copies else gathered, fwd_buckets)]
    head_fwd, at_head = head_forward_moment(spec, stage, lay, wl)
    if head_fwd:
        moments.append(("forward: the LM head's matmul (its logits)", head_fwd - rebuilt, at_head, fwd_buckets))
    if stage.n_layers:
        after_head = 0.0  # a layer's backward comes after the head's: its saved tensors are gone
        if stage.head:
            n = lay.mb * wl.seq_len // lay.cp
            logits = wl.act_bytes * n * (padded_vocab(spec, lay.tp) // lay.tp) if lay.pp == 1 else 0
            after_head = head_activation_bytes(spec, lay, wl) - logits + head_copy_bytes(spec, stage, lay, wl)
        full16 = wl.act_bytes != 4 and lay.recompute == "full" and lay.zero == 3
        in_flight_now, gathered_now = (layer_backward_moment(spec, stage, lay, wl) if full16
                                       else (buckets, at_backward if lay.zero == 3 else gathered))
        gathered_now += mtp_held_bytes(spec, stage, lay)  # MTP under ZeRO-3: units held beside a backward
        copies = rebuilt_weight_copies(spec, stage, lay, wl)  # the rebuilt layer's casts, until its backward ends
        moments.append(("backward: a layer's MLP (its inner gradients, the residual stream's, the rebuilt layer's "
                        "weight casts)", layer_backward_transient_bytes(spec, stage, lay, wl) + copies - after_head,
                        gathered_now, in_flight_now))
        # a weight gradient precedes the ZeRO-2/3 bucket its accumulation allocates: no bucket term beside it
        at_grads = gathered_now if lay.zero == 3 else gathered
        experts = expert_weight_grad_bytes(spec, stage, lay, wl)
        if experts:
            moments.append(("backward: the experts' GEMMs (their stacks' weight gradients, an fp32 copy, the rebuilt "
                            "layer's weight casts)",
                            experts + rebuilt_weight_copies(spec, stage, lay, wl, moe=True) - after_head, at_grads, 0.0))
        embedding = embedding_weight_grad_bytes(spec, stage, lay, wl)
        if embedding:
            moments.append(("backward: the token embedding (its fp32 weight gradient)", embedding - rebuilt,
                            at_grads, 0.0))
    if stage.head:
        at_loss = head_loss_buffers(spec, stage, lay, wl)
        moments.append(("backward: the LM head's loss (logits' gradients)", head_transient_bytes(spec, lay, wl) - rebuilt,
                        *at_loss))
        head_grad = head_weight_grad_bytes(spec, stage, lay, wl)
        if head_grad:
            moments.append(("backward: the LM head's matmul (its weight gradient and fp32 copy)", head_grad - rebuilt,
                            *at_loss))
    moments.append(("after backward: the TP reduction's concatenated gradients",
                    tp_reduction_bytes(spec, stage, lay) - activation, 0.0, 0.0))
    if wl.optimizer == "muon":
        moments.append(("optimizer: Muon's step (Nesterov gradients, one group's whole matrices and Newton–Schulz)",
                        step_transient_bytes(spec, stage, lay) - activation, 0.0, 0.0))
    at_f, at_b = pipeline_buffer_bytes(spec, stage, lay, wl)  # none after backward: the executor has returned
    buffers = {"forward": at_f, "backward": at_b}
    moment, transient, gathered, buckets, pipe = max(
        ((*m, buffers.get(m[0].split(":")[0], 0.0)) for m in moments), key=lambda m: sum(m[1:]))
    held = mtp_held_bytes(spec, stage, lay) if moment.startswith(
        ("backward: a layer", "backward: the experts'", "backward: the token embedding")) else \
        head_held_bytes(spec, stage, lay) if moment.startswith("backward: the LM head") else 0.0
    out = {"static": float(static), "activations": float(activation), "transient": transient,
           "zero3_gathered": gathered - held, "zero3_mtp_held": held, "reduce_scatter_buckets": buckets,
           "weight_gradient_store": weight_store_bytes(spec, stage, lay, wl),
           "pipeline_buffers": pipe}
    out["total"] = sum(out.values())
    out["moment"] = moment
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
