"""ZeRO-3's gathered units and in-flight reduce-scatters beside a backward, unit by unit as `OverlappedReduction`
runs them.

Under ZeRO-3 every unit (the embedding, a layer, the final norm, the LM head) is gathered in full (fp32) before
its forward and again before its backward, with the next one prefetched beside it; its buckets (one per
(expert?, matrix?) group, padded to the reduction group) are filled by its backward and reduce-scattered at
once, in reverse model order, with at most `bucket_plan.MAX_INFLIGHT` in flight: a further launch waits for
the oldest. Buckets holding a TP-partial gradient wait for the TP sum at the end of the step.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.rules.buckets import MAX_INFLIGHT, bucket_key
from shardwise.planner.activations import layer_activation_bytes
from shardwise.planner.fp8 import fp8_bucket, wire_weights
from shardwise.rules.fp8 import FP8_BYTES
from shardwise.planner.layout import Layout, Stage, Workload
from shardwise.planner.memory import BYTES_WEIGHT, bucket_layout, stage_unit_names, stage_units
from shardwise.planner.models import ModelSpec
from shardwise.planner.rank_actions import backward_then_forward


def unit_bytes(spec: ModelSpec, stage: Stage, lay: Layout,
               wl: Workload | None = None) -> list[tuple[int, int, int, tuple]]:
    """(chunk, bytes of its gathered flat buffers, elements of its cast weights, its buckets as (fp32
    bytes, reduction group, deferred?) in `GradReducer`'s order) of every ZeRO-3 unit of the stage, in model order: a unit
    has one bucket per (expert?, matrix?) group, padded to its reduction group, deferred when it holds a
    TP-partial gradient; its layers' matrices are what autocast copies (the embedding table is not). A unit is
    gathered in fp32, but under --fp8-all-gather (`wl`, `fp8.wire_weights`) its FP8 buckets (`fp8.fp8_bucket`)
    arrive as one byte per element, and their flat buffers stay empty."""
    return _units(spec, stage, bucket_layout(lay), bool(wl is not None and wire_weights(lay, wl)))


@lru_cache(maxsize=4096)
def _units(spec: ModelSpec, stage: Stage, lay: Layout, fp8_wire: bool = False) -> tuple:
    g = lay.dp
    gd = lay.dp_shard if lay.hsdp else g  # hybrid sharding: dense buckets pad to the shard group
    out = []
    for u, ((chunk, tensors), (_, name)) in enumerate(zip(stage_units(spec, stage, lay),
                                                          stage_unit_names(spec, stage, lay))):
        groups: dict[tuple, list[int]] = {}
        for x, partial in tensors:
            acc = groups.setdefault(bucket_key(3, chunk, u, x.expert, x.matrix), [0, 0])
            acc[0] += x.numel
            acc[1] |= partial
        keys = sorted(groups.items())
        buckets = tuple((4 * _pad(n, grp), grp, bool(d))
                        for key, (n, d) in keys for grp in [max(1, g // lay.ep) if key[-2] else gd])
        layer = name.startswith(("layers.", "mtp."))  # a block (an MTP module's too): its matrices are cast
        cast = sum(x.numel for x, _ in tensors if x.matrix) if layer else 0
        full = sum(b // BYTES_WEIGHT * FP8_BYTES if fp8_wire and fp8_bucket(spec, name, key, n) else b
                   for (key, (n, _)), (b, _, _) in zip(keys, buckets))
        out.append((chunk, full, cast, buckets))
    return tuple(out)


def _launch_order(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> list[list[tuple[int, int, int, int]]]:
    return _launch_order_of(tuple(unit_bytes(spec, stage, lay, wl)))


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
    return last_launched(spec, stage, lay, wl)


def _last_launched_at_w(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """ZeRO-3 under split backward: the matrix buckets of a layer or the head (their linears' dW comes at W)
    launch in a queue of their own (`OverlappedReduction`), so a chunk's W leaves its first two such buckets
    in flight — two matrix buckets, where a joint backward ends on a matrix and a vector bucket."""
    key = bucket_layout(lay)
    gd = key.dp_shard if key.hsdp else key.dp
    late: dict[int, list[float]] = {}
    for (chunk, tensors), (_, name) in zip(stage_units(spec, stage, key), stage_unit_names(spec, stage, key)):
        if name == "tok_embeddings":
            continue
        n = sum(x.numel for x, _ in tensors if x.matrix and not x.expert)
        if n and not any(d for x, d in tensors if x.matrix and not x.expert):
            late.setdefault(chunk, []).append(_in_flight(4 * _pad(n, gd), gd, wl))
    return float(max((sum(seq[:MAX_INFLIGHT]) for seq in late.values()), default=0))


def last_launched(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """ZeRO-3: the two reduce-scatters a chunk's backward launched last, in flight (the worst chunk)."""
    return float(max((sum(_in_flight(b, g, wl) for b, g, *_ in seq[-MAX_INFLIGHT:])
                      for seq in _launch_order(spec, stage, lay, wl)),
                     default=0))


def backward_inflight_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload,
                            prior: bool | None = None) -> tuple[float, float]:
    """ZeRO-3, during a unit's backward: its bucket filling (fp32, allocated at its first gradient) beside
    the two launched before it — the previous units' of the chunk, or at the chunk's first unit those a
    former backward left in flight — less what the layers already backwarded have freed (one microbatch's
    saved tensors of each): the worst unit, as (units gathered then, reduce-scatter buffers)."""
    if lay.zero < 3:
        return 0.0, 0.0
    per_layer = freed_per_layer(spec, stage, lay, wl)
    seqs = [[(b, _in_flight(b, g, wl), done, at) for b, g, done, at in seq]
            for seq in _launch_order(spec, stage, lay, wl)]
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


def freed_per_layer(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """What a layer's finished backward has freed: one microbatch's saved tensors of its smallest kind."""
    return min((layer_activation_bytes(spec, moe, lay, wl) for moe, n in ((False, stage.n_dense),
                                                                           (True, stage.n_moe)) if n), default=0)


def _pad(n: int, g: int) -> int:
    return -(-n // g) * g


def layer_backward_moment(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> tuple[float, float]:
    """ZeRO-3 under bf16 full recompute (no forward moment outweighs it), (in-flight buckets less the
    activations already freed, gathered units) at the worst unit's backward, taken together: the unit
    running and the one before it in its chunk (prefetched by backward) gathered, beside its bucket filling
    and the two launched before it (`backward_inflight_bytes`), less one microbatch's saved tensors of each
    layer already backwarded."""
    per_layer = min((layer_activation_bytes(spec, moe, lay, wl) for moe, n in ((False, stage.n_dense),
                                                                                (True, stage.n_moe)) if n), default=0)
    units = unit_bytes(spec, stage, lay, wl)
    seqs = [[_in_flight(b, g, wl) for b, g, *_ in seq] for seq in _launch_order(spec, stage, lay, wl)]
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


def zero3_gathered_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload | None = None) -> float:
    """ZeRO-3, outside a chunk's forward: the unit running and the one prefetched beside it are gathered in
    full (fp32; FP8 buckets under --fp8-all-gather: `unit_bytes`), the largest adjacent pair of the stage's units."""
    if lay.zero < 3:
        return 0.0
    sizes = [(c, full) for c, full, _, _ in unit_bytes(spec, stage, lay, wl)]
    pairs = [a[1] + b[1] for a, b in zip(sizes, sizes[1:]) if a[0] == b[0]]
    return float(max(pairs + [n for _, n in sizes] + [0]))
