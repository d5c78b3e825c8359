"""How many times ZeRO-3 all-gathers each unit of a stage in one step, as shardwise/data_parallel/zero3.py runs it.

A unit is gathered when a hold or a prefetch finds its buffer freed; it is freed when its last hold goes, and every
hold a backward takes is gone by the end of that backward (a unit whose input has a gradient releases it there; an
embedding once autograd has accumulated its gradient, whether it is reduced per microbatch or at the step's end).
So every count is per microbatch, whatever the schedule. Without MTP every unit is used once per forward and once
per backward: 2 gathers per microbatch and chunk (a prefetch only moves the gather earlier). DeepSeek-V3's MTP
(planner/mtp.py) calls the LM head and an embedding once more per depth, which changes three units:
* the head: freed between its 1 + D forward uses and between its 1 + D backward holds (its input has a gradient,
  so each backward releases it): 2(1 + D) per microbatch, whoever prefetches it;
* the embedding the MTP reads on its own rank (no pipeline, or dualpipev's V): gathered for each of its D forward
  uses by the MTP; in the MTP's backward its first hold gathers it and it stays held until its gradient is in:
  1 + D per microbatch beyond its own 2 (no pipeline: the two backwards are one, so 2 + D in all);
* the last stage's embedding copy (untied, under PP): 1 + D. Each forward's head uses prefetch it 1 + D times and
  its D uses free it after each; the last prefetch is left gathered and the next F or B of the chunk finds it, so
  of a run of forwards only the first gathers at its first prefetch, and of a run of backwards only the first
  finds it: over the step one gather per microbatch beyond the D, on every schedule.
Tied, the head and the embedding (or, under PP, the head and the copy, two units) are one bucket: per forward the
head's 1 + D uses and the embedding's D alternate, each freeing it (2 + 2D with the main embedding, 1 + 2D without),
and per backward the head's first hold gathers it, its release frees it, and the embedding's first hold gathers it
again until the gradient is in (2). The stale prefetches the extra uses leave (the embedding's of the first layer,
the head's of the next unit, the head's backward one of the final norm) are each consumed by that unit's next
hold, so its count stays 2.
"""
from __future__ import annotations

from shardwise.planner.layout import Layout, Stage
from shardwise.planner.memory import stage_units, unit_index, zero_buckets
from shardwise.planner.models import ModelSpec


def unit_gathers(spec: ModelSpec, stage: Stage, lay: Layout) -> list[int]:
    """All-gathers per step of each unit of `stage_units`, in its order; a bucket tied to the head's unit is
    counted whole on the embedding's unit (with MTP; without, each unit gathers it 2·m times), or under PP on the
    head's."""
    at = unit_index(spec, stage, lay)
    out = [2 * lay.m] * len(at)
    d = spec.mtp_layers
    if not d or not stage.head:
        return out
    head = at["output"]
    if stage.embedding:  # the MTP reads this rank's embedding (no PP, or dualpipev's V)
        tied = spec.tie_embeddings  # the head's 1 + D forward uses alternate with the MTP's D embedding uses
        forward = 1 + (1 + 2 * d if tied else d)  # the main embedding's use, then the MTP chunk's
        backward = (2 if tied else 1) + (lay.pp > 1)  # the MTP chunk's (under PP chunk 0's is another backward)
        out[at["tok_embeddings"]] = lay.m * (forward + backward)
        out[head] = lay.m * 2 * (1 + d)  # tied: an empty unit (the bucket is counted on the embedding's)
    elif spec.tie_embeddings:  # the head is the copy: one bucket for the head's and the copy's units
        out[head] = lay.m * (1 + 2 * d + 2)
    else:
        out[head] = lay.m * 2 * (1 + d)
        if "mtp_embed" in at:
            out[at["mtp_embed"]] = lay.m * (1 + d)
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
