"""How many times ZeRO-3 all-gathers each unit of a stage in one step, as shardwise/data_parallel/zero3.py runs it.

A unit is gathered when a hold or a prefetch finds its buffer freed; it is freed when its last hold goes. Without
MTP every unit is used once per forward and once per backward, so it is gathered twice per microbatch and chunk (a
prefetch only moves the gather earlier). DeepSeek-V3's MTP (planner/mtp.py) calls the LM head and an embedding once
more per depth, which changes three units:
* the head: freed between its 1 + D forward uses and between its 1 + D backward holds (its input has a gradient,
  so each backward releases it), so it is gathered 2(1 + D) times per microbatch, whoever prefetches it;
* the stage's own embedding (no pipeline): gathered for each of its 1 + D forward uses; in backward its first hold
  (depth D's) gathers it and it stays held until all its gradients are in (`grads_done`), so 2 + D;
* an embedding whose gradients all wait for the step's end (under PP: the first stage's embedding and the last
  stage's copy, summed over the "emb" group) has no hooked gradient, so `grads_done` never releases it: from its
  first backward hold it stays gathered until `free_all`, and only the forwards the rank runs before that first
  backward gather it (`forwards_before_backward`, from the executor's schedule) — the first stage's embedding
  once each (D more per MTP forward under dualpipev, where its rank runs the MTP too), plus once in that
  backward; the copy, prefetched by the head after each of the head's forward uses, 1 + D in the first forward
  and D in each later one, its first backward hold finding the last prefetch. Tied under PP the head is the
  copy (one bucket, two units): 1 + 2D gathers per forward before the first backward (the head's and the copy's
  uses alternate, each freeing it), then 2 in that backward (the head's hold, the copy's), held after; the same
  with the embedding and the head tied on one stage (no PP: 4 + 2D per microbatch; dualpipev: its chunk-0
  forwards before the MTP's first backward, once each, added).
The stale prefetches the extra uses leave (the embedding's of the first layer, the head's of the next unit, the
head's backward one of the final norm) are each consumed by that unit's next hold, so its count stays 2.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.planner.layout import Layout, Stage
from shardwise.planner.memory import stage_units, zero_buckets
from shardwise.planner.models import ModelSpec
from shardwise.planner.mtp import embedding_copy


def forwards_before_backward(lay: Layout, k: int, chunk: int, until: int | None = None) -> int:
    """Forwards rank k runs of its local `chunk` before the first backward of its chunk `until` (default the same
    chunk; without a pipeline: 1)."""
    if lay.pp == 1:
        return 1
    return _forwards_before(lay.schedule, lay.pp, lay.m, lay.vp, k, chunk, chunk if until is None else until)


@lru_cache(maxsize=1024)
def _forwards_before(schedule: str, p: int, m: int, v: int, k: int, chunk: int, until: int) -> int:
    try:
        from shardwise.pipeline.schedules import build_schedule

        actions = build_schedule(schedule, p, m, v).actions[k]
    except (ImportError, ValueError):
        return m
    first_b = next((i for i, a in enumerate(actions) if a.kind == "B" and a.chunk == until), len(actions))
    return sum(1 for a in actions[:first_b] if a.kind == "F" and a.chunk == chunk)


def unit_gathers(spec: ModelSpec, stage: Stage, lay: Layout) -> list[int]:
    """All-gathers per step of each unit of `stage_units`, in its order; a bucket tied to the head's unit is
    counted whole on the embedding's (with MTP; without, each unit gathers it 2·m times)."""
    units = stage_units(spec, stage, lay)
    out = [2 * lay.m] * len(units)
    d = spec.mtp_layers
    if not d:
        return out
    copy = embedding_copy(spec, stage.embedding)
    head = len(units) - d - copy - 1
    tied = spec.tie_embeddings and stage.head  # with the embedding here: one bucket for the embedding and the head
    if stage.embedding and lay.pp == 1:
        out[0] = lay.m * ((4 + 2 * d) if tied else (2 + d))
    elif stage.embedding:
        # its gradient waits for the emb sum: held from its first backward hold (in the backward of the last chunk
        # using it: the MTP's under dualpipev) to the step's end; each forward use before that gathers it
        last = units[head][0] if stage.head else 0
        first = forwards_before_backward(lay, stage.index, 0, last)
        mtp = forwards_before_backward(lay, stage.index, last) if stage.head else 0
        out[0] = first + (1 + 2 * d) * mtp + 2 if tied else first + 1 + d * mtp
    if stage.head and spec.tie_embeddings and not stage.embedding:
        # the head is the copy: one bucket held by the head's and the copy's units, freed between their alternating
        # forward uses (1 + 2D), gathered again by the head's first backward hold and the copy's, then held
        out[head] = (1 + 2 * d) * forwards_before_backward(lay, stage.index, units[head][0]) + 2
    elif stage.head:
        out[head] = lay.m * 2 * (1 + d)
        if copy:
            out[head + 1] = 1 + d * forwards_before_backward(lay, stage.index, units[head][0])
    return out


def bucket_gathers(spec: ModelSpec, stage: Stage, lay: Layout) -> list[int]:
    """All-gathers per step of each of `zero_buckets`' ZeRO-3 buckets: its unit's (one bucket per (expert?,
    matrix?) group of a unit, in unit order); without MTP twice that for a bucket tied to the head's unit."""
    buckets = zero_buckets(spec, stage, lay)
    if not spec.mtp_layers:
        return [2 * lay.m * b.uses for b in buckets]
    per_unit = unit_gathers(spec, stage, lay)  # with MTP a tied bucket's count is the embedding unit's
    return [n for (_, tensors), n in zip(stage_units(spec, stage, lay), per_unit)
            for _ in sorted({(x.expert, x.matrix) for x, _ in tensors})]
