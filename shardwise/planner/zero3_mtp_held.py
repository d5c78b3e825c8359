"""ZeRO-3 units that MTP's extra uses keep gathered during a backward, beside the unit running and the one it
prefetched (`zero3_inflight`), read off data_parallel/zero3.py's holds and prefetches.

The D modules call the LM head and an embedding once more per depth, and every call runs the unit's hooks:
* the head's first backward hold (depth D's) prefetches the unit before it, the final norm, whose own backward
  comes only after every MTP module's: the norm stays gathered through the MTP blocks' backward;
* when the MTP reads this rank's own embedding, each of its embedding calls prefetches the unit after the
  embedding, the chunk's first layer, whose forward is long over: without a pipeline that layer stays gathered
  until its own backward, through the whole backward. (Under dualpipev's V chunk 0's next forward consumes it,
  in the steady state before the last chunk's backward: only the first microbatch's backward has it beside, not
  at the traced peak, and it is not counted);
* the embedding the MTP reads is held from depth k + 1's embedding backward until autograd has accumulated its
  gradient, so it is gathered beside the blocks of depths ≤ k. A last stage's untied copy is also the head's
  next unit: the head's last forward use leaves it prefetched, so it is gathered beside every MTP block's
  backward. Without a pipeline the embedding's gradient is complete only after its main use's backward, at the
  very end: it is gathered beside every main layer's backward too. Elsewhere the MTP's gradient contributions
  complete before the main layers' backward, which frees it.
"""
from __future__ import annotations

from shardwise.planner.layout import Layout, Stage
from shardwise.planner.memory import stage_unit_names
from shardwise.planner.models import ModelSpec
from shardwise.planner.zero3_inflight import unit_bytes


def held_beside_backward(spec: ModelSpec, stage: Stage, lay: Layout) -> dict[int, set[int]]:
    """{unit: units MTP keeps gathered while it runs backward} (indexes into `stage_units`), for the MTP blocks
    and the main layers of the chunk holding them."""
    d = spec.mtp_layers
    if lay.zero < 3 or not d or not stage.head:
        return {}
    names = stage_unit_names(spec, stage, lay)
    at = {name: i for i, (_, name) in enumerate(names)}
    head, norm, copy = at["output"], at["norm"], "mtp_embed" in at
    own = stage.embedding  # the MTP reads this rank's embedding
    emb, first = at.get("tok_embeddings"), at.get("layers.0")  # without PP: units 0 and 1
    read = emb if own else at["mtp_embed"] if copy else head  # the unit whose buffer the MTP's embedding calls gather
    out = {}
    for k in range(d):
        held = {norm} | ({first} if own and lay.pp == 1 and stage.n_layers else set())
        if copy or k < d - 1:
            held.add(read)
        out[at[f"mtp.{k}"]] = held
    for i, (chunk, name) in enumerate(names):  # the main layers of the MTP's chunk
        if chunk == names[head][0] and name.startswith("layers."):
            out[i] = {emb, first} if own and lay.pp == 1 else set()
    return out


def mtp_held_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """What MTP's held units add to the largest set a backward gathers: the most, over the units' backwards, of
    the unit, the one before it in its chunk (prefetched) and the units held beside it, less the largest such
    pair without them (the planner's `zero3_inflight` pair)."""
    held = held_beside_backward(spec, stage, lay)
    if not held:
        return 0.0
    units = unit_bytes(spec, stage, lay)

    def pair(i: int) -> set[int]:
        return {i, i - 1} if i and units[i - 1][0] == units[i][0] else {i}

    plain = max(sum(units[j][1] for j in pair(i)) for i in range(len(units)))
    worst = max(sum(units[j][1] for j in pair(i) | held.get(i, set())) for i in range(len(units)))
    return float(max(0, worst - plain))


def head_backward_units(spec: ModelSpec, stage: Stage, lay: Layout) -> tuple[int, int]:
    """(the final norm, the LM head) as indexes into `stage_units`: with MTP the head is not the last unit."""
    at = {name: i for i, (_, name) in enumerate(stage_unit_names(spec, stage, lay))}
    return at["norm"], at["output"]


def head_held_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """fp32 bytes MTP keeps gathered beside the LM head's backward (its running unit and the final norm it
    prefetched), the worst of its 1 + D backwards. Depth k's (k = D … 1, then 0, the main head's) finds: the
    unit after the head its last forward use prefetched — a last stage's copy (then held by the copy's own
    backward until its gradient is complete, after depth 1's) or the first MTP module (until its backward, after
    depth 1's head) — while k ≥ 1, with (D > 1) the first MTP module the copy's later calls prefetched; without PP
    the first layer the embedding's MTP calls prefetched; and the embedding the MTP reads on its rank, held from
    depth k + 1's embedding backward (under dualpipev only until the MTP's uses are back-propagated, before the
    main head's)."""
    d = spec.mtp_layers
    if lay.zero < 3 or not d or not stage.head:
        return 0.0
    units = [full for _, full, _, _ in unit_bytes(spec, stage, lay)]
    at = {name: i for i, (_, name) in enumerate(stage_unit_names(spec, stage, lay))}
    head, copy = at["output"], "mtp_embed" in at
    own = stage.embedding
    # the unit after the head: under PP with tied embeddings the copy's unit shares the head's bucket (nothing more)
    after = None if spec.tie_embeddings and not own else head + 1
    worst = 0.0
    for k in range(d + 1):
        held = ({after} if k >= 1 and after is not None else set()) | ({at["layers.0"]} if own and lay.pp == 1 else set())
        if copy and d > 1 and k >= 1:  # the copy's later calls prefetch its next unit, the first MTP module, again
            held.add(at["mtp.0"])
        if own and k < d and (lay.pp == 1 or k >= 1) and not spec.tie_embeddings:
            held.add(at["tok_embeddings"])
        worst = max(worst, float(sum(units[i] for i in held)))
    return worst
