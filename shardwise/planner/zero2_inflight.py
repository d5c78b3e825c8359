"""ZeRO-2's gradient buckets beside a backward, walked unit by unit as `OverlappedReduction` runs them.

Under ZeRO-2 a bucket's full fp32 buffer is allocated at its first gradient (the bucket's last unit in
model order, as backward runs in reverse), filled until its first unit's gradients are in, then
reduce-scattered and held by the collective (fp32 input, reduce-dtype copy, 1/g output) until a launch
beyond `bucket_plan.MAX_INFLIGHT` makes the reducer wait for the oldest. Buckets of different groups
(dense matrices, dense vectors, experts) fill side by side, and launch strictly in the reducer's order. A
backward after an earlier one of the step starts with the two that earlier backward launched last still in flight — e.g. microbatch 2's
whole-chunk bucket filling beside microbatch 1's in flight: twice the stage's gradient. Under zb and
dualpipev a chunk's first bucket is allocated in B and fills until its W, through other forwards.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.rules.buckets import MAX_INFLIGHT, bucket_key, cut_runs
from shardwise.planner.layout import Layout, Stage, Workload
from shardwise.planner.memory import BYTES_GRAD, shard_size, stage_unit_names, stage_units
from shardwise.planner.models import ModelSpec


@lru_cache(maxsize=4096)
def chunk_buckets(spec: ModelSpec, stage: Stage, lay: Layout) -> tuple:
    """Per chunk, (units, [(fp32 bytes, group, first unit, last unit)] in launch order) of its non-deferred
    ZeRO-2 buckets: `GradReducer._make_buckets`' runs (key (chunk, expert, matrix), cut by
    `bucket_plan.cut_runs`), reversed. `lay` as `zero_buckets` keys it (dp = dp·cp, dp_shard = S·cp)."""
    gd = lay.dp_shard if lay.hsdp else lay.dp
    groups: dict[tuple, list] = {}
    counts: dict[int, int] = {}
    for u, (chunk, tensors) in enumerate(stage_units(spec, stage, lay)):
        j = counts.get(chunk, 0)
        counts[chunk] = j + 1
        for x, partial in tensors:
            groups.setdefault(bucket_key(2, chunk, u, x.expert, x.matrix), []).append((x, partial, j))
    out: dict[int, list] = {c: [] for c in counts}
    for key, items in sorted(groups.items()):
        for r in cut_runs(items, lambda item: BYTES_GRAD * item[0].numel):
            if any(p for _, p, _ in r):
                continue  # deferred: reduced after the TP sum, once the activations are gone
            g = max(1, lay.dp // lay.ep) if key[1] else gd
            out[key[0]].append((4 * g * shard_size(sum(x.numel for x, _, _ in r), g), g, min(j for *_, j in r),
                                max(j for *_, j in r)))
    return tuple((counts[c], tuple(reversed(bs))) for c, bs in sorted(out.items()))


def _walk(units: int, buckets: tuple, flight: list[float], wl: Workload, per_unit: list[float]):
    """One backward of a chunk: the worst (filling + in flight − activations freed) at any unit, and the
    in-flight list it leaves."""
    r = wl.grad_reduce_bytes
    size = {i: b + (r * b / 4 if r != 4 else 0) + r * b / 4 / g for i, (b, g, _, _) in enumerate(buckets)}
    filling: set[int] = set()
    ready: set[int] = set()
    nxt, best, freed = 0, 0.0, 0.0
    flight = list(flight)
    for j in reversed(range(units)):
        filling |= {i for i, (_, _, _, last) in enumerate(buckets) if last == j}
        best = max(best, sum(buckets[i][0] for i in filling) + sum(flight) - freed)
        ready |= {i for i, (_, _, first, _) in enumerate(buckets) if first == j}
        while nxt in ready:
            filling.discard(nxt)
            flight.append(size[nxt])
            flight = flight[-MAX_INFLIGHT:]  # a further launch waits for the oldest
            nxt += 1
        freed += per_unit[j]
    return best, flight


def zero2_bucket_moments(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, per_layer: float,
                         again: bool, before_forward: int) -> tuple[float, float]:
    """(worst moment of a backward, what stays in flight through a forward) of ZeRO-2's buckets on one rank
    of `stage`; `again`: the rank runs a backward after another one in the step (the second starts with
    the first's last two in flight); `before_forward`: backwards the rank runs before its last forward
    (what they launched last is still in flight then). `per_layer`: one microbatch's saved tensors of a
    layer, freed once its backward is over."""
    key = Layout(dp=lay.dp * lay.cp, pp=lay.pp, tp=lay.tp, ep=lay.ep, vp=lay.vp, schedule=lay.schedule,
                 zero=2, sequence_parallel=lay.sp, dp_shard=lay.shard * lay.cp if lay.hsdp else None)
    layers: dict[int, list[float]] = {}  # per chunk, what each unit's backward frees (a block's saved tensors)
    for chunk, name in stage_unit_names(spec, stage, key):
        layers.setdefault(chunk, []).append(per_layer if name.startswith(("layers.", "mtp.")) else 0.0)
    best = after = 0.0
    chunks = chunk_buckets(spec, stage, key)
    for (units, buckets), per_unit in zip(chunks, layers.values()):
        tails, tail = [[]], []
        for _ in range(2 if again else 1):
            peak, tail = _walk(units, buckets, tail, wl, per_unit)
            best = max(best, peak)
            tails.append(tail)
        after = max(after, sum(tails[min(before_forward, len(tails) - 1)]))
    if lay.schedule in ("zb", "dualpipev") and lay.pp > 1:  # every chunk between its B and W: its first bucket
        after += sum(buckets[0][0] for _, buckets in chunks if buckets)  # (allocated at B) fills until W
    return best, after
