"""The live peak of one rank: what `shardwise simulate`'s trace of real steps shows beside the static state
and the saved activations (`memory`), term by term.

At its worst moment a rank holds its static state, the activations of the microbatches in flight, and
transient buffers that no saved-tensor hook sees: the LM head's loss buffers (the last stage), a layer's
backward gradients, the pipeline's send and receive buffers, the bf16 weight copy an op uses under full
recompute, ZeRO-3's gathered units and in-flight reduce-scatter buckets, the TP reduction's concatenated
gradients, and the weight-gradient store of split-backward schedules. Which of them are alive together
depends on the moment of the step, so `peak_terms` takes the worst of a few moments (each with its own
share); the planner's "fits" uses the total.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.bucket_plan import MAX_INFLIGHT
from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners
from shardwise.planner.activations import (
    head_activation_bytes, layer_activation_bytes, microbatch_activation_bytes, recompute_transient_bytes,
    stage_activation_bytes,
)
from shardwise.planner.memory import bucket_layout, stage_params, stage_units, static_bytes, zero_buckets
from shardwise.planner.models import ModelSpec, padded_vocab
from shardwise.planner.rank_actions import (
    backward_states, backward_then_forward, backwards_before_forward,
)
from shardwise.planner.weight_store import weight_store_bytes
from shardwise.planner.zero2_inflight import zero2_bucket_moments


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


def layer_forward_transient_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """A layer's forward under full recompute (no autograd: nothing saved) at its worst op, the MLP's output
    projection: the residual input cast to the activation dtype, the down-projection's input product
    ([n, ffn/tp]) and output ([n, h]); under SP also the all-gathered MLP input and the contiguous copy the
    output's reduce-scatter sends (n = mb·s/cp rows, 1/tp of them in the residual stream under SP)."""
    if lay.recompute != "full" or not stage.n_layers:
        return 0.0
    e, h = wl.act_bytes, spec.dim
    n = lay.mb * wl.seq_len // lay.cp
    sp = lay.sp and lay.tp > 1
    ffn = spec.ffn_dim // lay.tp if stage.n_dense else spec.moe_topk * spec.expert_ffn_dim
    cast = e * (n // lay.tp if sp else n) * h if e != 4 else 0
    return float(cast + e * n * ffn + e * n * h * (3 if sp else 1))


def _unit_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> list[tuple[int, int, int, tuple]]:
    """(chunk, fp32 bytes of its gathered flat buffers, elements of its cast weights, its buckets as (fp32
    bytes, reduction group, deferred?) in `GradReducer`'s order) of every ZeRO-3 unit of the stage, in model order: a unit
    has one bucket per (expert?, matrix?) group, padded to its reduction group, deferred when it holds a
    TP-partial gradient; its layers' matrices are what autocast copies (the embedding table is not)."""
    return _units(spec, stage, bucket_layout(lay))


@lru_cache(maxsize=4096)
def _units(spec: ModelSpec, stage: Stage, lay: Layout) -> tuple:
    g = lay.dp
    gd = lay.dp_shard if lay.hsdp else g  # hybrid sharding: dense buckets pad to the shard group
    out = []
    for chunk, tensors in stage_units(spec, stage, lay):
        groups: dict[tuple, list[int]] = {}
        for x, partial in tensors:
            acc = groups.setdefault((x.expert, x.matrix), [0, 0])
            acc[0] += x.numel
            acc[1] |= partial
        buckets = tuple((4 * _pad(n, grp), grp, bool(d))
                        for key, (n, d) in sorted(groups.items()) for grp in [max(1, g // lay.ep) if key[0] else gd])
        cast = sum(x.numel for x, _ in tensors if x.matrix) if len(tensors) > 2 else 0  # a layer: > 2 tensors
        out.append((chunk, sum(b for b, _, _ in buckets), cast, buckets))
    return tuple(out)


def _launch_order(spec: ModelSpec, stage: Stage, lay: Layout) -> list[list[tuple[int, int, int, int]]]:
    return _launch_order_of(_unit_bytes(spec, stage, lay))


@lru_cache(maxsize=4096)
def _launch_order_of(units: tuple) -> list[list[tuple[int, int, int, int]]]:
    """Per chunk, (fp32 bytes, group, layers of the chunk whose backward is already over, ZeRO-3 bytes
    gathered then: the unit and the one prefetched before it) of its buckets a
    backward reduce-scatters as it goes, in launch order (reverse model order; deferred buckets wait for
    the end of the step)."""
    chunks: dict[int, list] = {}
    for chunk, full, cast, buckets in units:
        hooked = [(b, g) for b, g, deferred in buckets if not deferred]
        chunks.setdefault(chunk, []).append((hooked, bool(cast), full))
    out = []
    for parts in chunks.values():
        seq, done = [], 0
        for j in reversed(range(len(parts))):
            buckets, layer, full = parts[j]
            gathered = full + (parts[j - 1][2] if j else 0)  # the unit and the one prefetched before it
            seq += [(b, g, done, gathered) for b, g in reversed(buckets)]
            done += layer
        out.append(seq)
    return out


def _in_flight(b: int, g: int, wl: Workload) -> float:
    """A launched reduce-scatter's buffers: the fp32 gradient it reads, its copy in the reduce dtype (when
    that is not fp32) and the 1/g output shard."""
    r = wl.grad_reduce_bytes
    return b + (r * b / 4 if r != 4 else 0) + r * b / 4 / g


def forward_inflight_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """ZeRO-3, during a forward that follows a backward (any step of more than one microbatch): the two
    reduce-scatters a chunk's backward launched last are still in flight (GradReducer waits for the oldest
    only when a third starts) — those of the chunk's first buckets, e.g. the embedding's and the first
    layer's, not the largest two."""
    if lay.zero < 3 or not backward_then_forward(lay, stage.index):
        return 0.0
    if lay.pp > 1 and lay.schedule in ("zb", "dualpipev"):
        return _last_launched_at_w(spec, stage, lay, wl)
    return _last_launched(spec, stage, lay, wl)


def _last_launched_at_w(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """ZeRO-3 under split backward: the matrix buckets of a layer or the head (their linears' dW comes at W)
    launch in a queue of their own (`OverlappedReduction`), so a chunk's W leaves its first two such buckets
    in flight — two matrix buckets, where a joint backward ends on a matrix and a vector bucket."""
    key = bucket_layout(lay)
    gd = key.dp_shard if key.hsdp else key.dp
    late: dict[int, list[float]] = {}
    for u, (chunk, tensors) in enumerate(stage_units(spec, stage, key)):
        if u == 0 and stage.embedding:
            continue
        n = sum(x.numel for x, _ in tensors if x.matrix and not x.expert)
        if n and not any(d for x, d in tensors if x.matrix and not x.expert):
            late.setdefault(chunk, []).append(_in_flight(4 * _pad(n, gd), gd, wl))
    return float(max((sum(seq[:MAX_INFLIGHT]) for seq in late.values()), default=0))


def _last_launched(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """ZeRO-3: the two reduce-scatters a chunk's backward launched last, in flight (the worst chunk)."""
    return float(max((sum(_in_flight(b, g, wl) for b, g, *_ in seq[-MAX_INFLIGHT:]) for seq in _launch_order(spec, stage, lay)),
                     default=0))


def head_loss_buffers(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """ZeRO 2/3, during the head's loss backward (before any gradient of this backward reaches a bucket):
    (ZeRO-3 gathered: the head unit and the final norm prefetched beside it, reduce-scatters in flight:
    what an earlier backward of the step launched last)."""
    if lay.zero < 2:
        return 0.0, 0.0
    again = lay.m > 1
    if lay.zero == 2:
        return 0.0, zero2_bucket_moments(spec, stage, lay, wl, 0.0, again, lay.m - 1)[1]
    units = [full for chunk, full, _, _ in _unit_bytes(spec, stage, lay)]
    return float(sum(units[-2:])), _last_launched(spec, stage, lay, wl) if again else 0.0


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
    per_layer = _freed_per_layer(spec, stage, lay, wl)
    best = (0.0, 0.0)
    for deficit, prior in states:
        if lay.zero == 3:
            at, got = backward_inflight_bytes(spec, stage, lay, wl, prior)
        else:
            at, got = 0.0, zero2_bucket_moments(spec, stage, lay, wl, per_layer, prior, 0)[0]
        if at + got - deficit * per > sum(best):
            best = (at, got - deficit * per)
    return best


def backward_inflight_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload,
                            prior: bool | None = None) -> tuple[float, float]:
    """ZeRO-3, during a unit's backward: its bucket filling (fp32, allocated at its first gradient) beside
    the two launched before it — the previous units' of the chunk, or at the chunk's first unit those a
    former backward left in flight — less what the layers already backwarded have freed (one microbatch's
    saved tensors of each): the worst unit, as (units gathered then, reduce-scatter buffers)."""
    if lay.zero < 3:
        return 0.0, 0.0
    per_layer = _freed_per_layer(spec, stage, lay, wl)
    seqs = [[(b, _in_flight(b, g, wl), done, at) for b, g, done, at in seq] for seq in _launch_order(spec, stage, lay)]
    # what an earlier backward of the step launched last: its last one or two buckets
    prior = lay.m > 1 if prior is None else prior
    tail = [max((sum(f for _, f, *_ in seq[-k:]) for seq in seqs), default=0) if prior and k else 0
            for k in range(MAX_INFLIGHT + 1)]
    best = (0.0, 0.0)
    for seq in seqs:
        for i, (b, _, done, at) in enumerate(seq):
            flight = sum(f for _, f, *_ in seq[max(0, i - MAX_INFLIGHT):i]) + tail[max(0, MAX_INFLIGHT - i)]
            if at + b + flight - done * per_layer > sum(best):
                best = (float(at), b + flight - done * per_layer)
    return best


def _freed_per_layer(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """What a layer's finished backward has freed: one microbatch's saved tensors of its smallest kind."""
    return min((layer_activation_bytes(spec, moe, lay, wl) for moe, n in ((False, stage.n_dense),
                                                                           (True, stage.n_moe)) if n), default=0)


def _pad(n: int, g: int) -> int:
    return -(-n // g) * g


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
    dense = spec.ffn_dim // lay.tp * spec.dim if stage.n_dense else 0
    moe = spec.mlp_mats * spec.moe_experts // lay.ep * spec.expert_ffn_dim * spec.dim if stage.n_moe else 0
    copy = float(wl.act_bytes * max(dense, moe))
    if lay.zero < 3:
        return copy, 0.0
    units = _unit_bytes(spec, stage, lay)
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
    units = _unit_bytes(spec, stage, lay)
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
    transient = float(wl.act_bytes * x - (4 * x + 10 * n))
    return transient, float(_unit_bytes(spec, stage, lay)[-1][1]) if lay.zero >= 3 else 0.0


def autocast_cache_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """The weight copy of `autocast_moment_bytes` (the cache itself holds no recomputed block's copies)."""
    return autocast_moment_bytes(spec, stage, lay, wl)[0]


def head_copy_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """Under bf16 full recompute without a pipeline, the LM head's weight copy (outside every checkpoint:
    cached and saved, held with the head's activations) — freed by the head's backward, so gone during a
    layer's backward. (On a pipeline's last stage the trace still shows it there: interleaved 70B, stage 3.)"""
    if wl.act_bytes == 4 or lay.recompute != "full" or not stage.head or lay.pp > 1:
        return 0.0
    return float(wl.act_bytes * padded_vocab(spec, lay.tp) // lay.tp * spec.dim)


def layer_backward_moment(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """ZeRO-3 under bf16 full recompute (no forward moment outweighs it), (in-flight buckets less the
    activations already freed, gathered units) at the worst unit's backward, taken together: the unit
    running and the one before it in its chunk (prefetched by backward) gathered, beside its bucket filling
    and the two launched before it (`backward_inflight_bytes`), less one microbatch's saved tensors of each
    layer already backwarded."""
    per_layer = min((layer_activation_bytes(spec, moe, lay, wl) for moe, n in ((False, stage.n_dense),
                                                                                (True, stage.n_moe)) if n), default=0)
    units = _unit_bytes(spec, stage, lay)
    seqs = [[_in_flight(b, g, wl) for b, g, *_ in seq] for seq in _launch_order(spec, stage, lay)]
    tail = [max((sum(seq[-k:]) for seq in seqs), default=0) if lay.m > 1 and k else 0
            for k in range(MAX_INFLIGHT + 1)]
    best = (0.0, 0.0)
    for c in dict.fromkeys(u[0] for u in units):
        parts = [u for u in units if u[0] == c]
        seq, done = [], 0
        for k in reversed(range(len(parts))):
            _, full, cast, buckets = parts[k]
            pair = full + (parts[k - 1][1] if k else 0)
            for b, g, deferred in reversed(buckets):
                if deferred:
                    continue
                i = len(seq)
                moment = (b + sum(seq[max(0, i - MAX_INFLIGHT):i]) + tail[max(0, MAX_INFLIGHT - i)] - done * per_layer,
                          float(pair))
                best = max(best, moment, key=sum)
                seq.append(_in_flight(b, g, wl))
            done += bool(cast)
    return best


def zero3_gathered_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """ZeRO-3, outside a chunk's forward: the unit running and the one prefetched beside it are gathered in
    full (fp32), the largest adjacent pair of the stage's units."""
    if lay.zero < 3:
        return 0.0
    sizes = [(c, full) for c, full, _, _ in _unit_bytes(spec, stage, lay)]
    pairs = [a[1] + b[1] for a, b in zip(sizes, sizes[1:]) if a[0] == b[0]]
    return float(max(pairs + [n for _, n in sizes] + [0]))


def tp_reduction_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """After backward, before the dp×cp reduction (no activation left): GradReducer sums TP-partial
    gradients over tp through one fp32 concatenation of them all (under SP: norms, and every MoE gradient,
    experts included — MoE blocks are replicated over tp), and K/V heads shared by tp ranks through a
    [K/V heads, their local gradients] buffer beside that row's own concatenation."""
    if lay.tp == 1:
        return 0.0
    tp_sum = kv = 0
    for _, tensors in stage_units(spec, stage, lay):
        for x, partial in tensors:
            if partial:
                tp_sum += x.numel if x.sp_replicated else 0
                kv += 0 if x.sp_replicated else x.numel
    return 4.0 * (tp_sum + (kv * (spec.n_kv_heads + 1) if kv else 0))


def peak_terms(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, static: float, activation: float) -> dict:
    """The live peak of one rank of `stage`, by part: static state, the activations held at the worst moment
    (`stage_activation_bytes`), and what the trace of a real step shows beside them at that moment
    (`shardwise simulate` measures the sum). Each moment carries its own transient buffers, ZeRO-3
    gathered units and in-flight reduce-scatters: a chunk's forward (a layer's down-projection), the LM head's
    matmul, a layer's backward, the head's loss, the TP reduction after backward; `transient`,
    `zero3_gathered` and `reduce_scatter_buckets` are the worst moment's. The weight-gradient store and
    the pipeline's send and receive buffers are added to every moment."""
    # Relative to static + `activation` (which includes the layer full recompute rebuilds in backward): a
    # forward, the head's matmul and loss come before anything is rebuilt; a layer's backward comes after
    # the head's saved tensors were freed (the non-pipelined loop still holds the logits); the TP
    # reduction after every activation is gone.
    rebuilt = recompute_transient_bytes(spec, stage, lay, wl)
    gathered = zero3_gathered_bytes(spec, stage, lay)
    at_backward, buckets = backward_moments(spec, stage, lay, wl) if lay.zero >= 2 else (gathered, 0.0)
    copies, at_copies = autocast_moment_bytes(spec, stage, lay, wl)
    fwd_buckets = forward_inflight_bytes(spec, stage, lay, wl) if lay.zero == 3 else 0.0
    if lay.zero == 2:
        fwd_buckets = zero2_bucket_moments(spec, stage, lay, wl, 0.0, lay.m > 1 or lay.pp > 1,
                                           backwards_before_forward(lay, stage.index))[1]
    # during another chunk's forward no microbatch holds the head's tensors (its backward follows its
    # forward at once), except under GPipe, which holds every microbatch's head
    head = microbatch_activation_bytes(spec, stage, lay, wl)["head"] if stage.head and lay.schedule != "gpipe" else 0
    moments = [(copies + layer_forward_transient_bytes(spec, stage, lay, wl) - rebuilt - (head if copies else 0),
                at_copies if copies else gathered, fwd_buckets)]
    head_fwd, at_head = head_forward_moment(spec, stage, lay, wl)
    if head_fwd:
        moments.append((head_fwd - rebuilt, at_head, fwd_buckets))
    if stage.n_layers:
        layer = layer_backward_transient_bytes(spec, stage, lay, wl)
        if stage.head:
            n = lay.mb * wl.seq_len // lay.cp
            logits = wl.act_bytes * n * (padded_vocab(spec, lay.tp) // lay.tp) if lay.pp == 1 else 0
            layer -= head_activation_bytes(spec, lay, wl) - logits + head_copy_bytes(spec, stage, lay, wl)
        full16 = wl.act_bytes != 4 and lay.recompute == "full" and lay.zero == 3
        in_flight_now, gathered_now = (layer_backward_moment(spec, stage, lay, wl) if full16
                                       else (buckets, at_backward if lay.zero == 3 else gathered))
        moments.append((layer, gathered_now, in_flight_now))
    if stage.head:
        moments.append((head_transient_bytes(spec, lay, wl) - rebuilt, *head_loss_buffers(spec, stage, lay, wl)))
    moments.append((tp_reduction_bytes(spec, stage, lay) - activation, 0.0, 0.0))
    transient, gathered, buckets = max(moments, key=sum)
    out = {"static": float(static), "activations": float(activation), "transient": transient,
           "zero3_gathered": gathered, "reduce_scatter_buckets": buckets,
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
