"""Memory per rank: parameters and optimizer state (static), and activations (per microbatch in flight).

Static: shardwise keeps fp32 parameters (they are the master copy; bf16 is autocast on the fly), fp32
gradients and two fp32 Adam moments, 16 bytes per parameter — the same total as the classic
"bf16 weights + bf16 grads + fp32 master + Adam" split of the ZeRO paper. ZeRO-1 shards the moments over
dp×cp (expert weights: over the expert-data-parallel group), ZeRO-2 also the grads, ZeRO-3 also the
weights. Shards are exactly shardwise's: `GradReducer` keeps one flat buffer per (expert?, matrix?)
group — dense matrices, dense 1-D tensors, expert matrices — each padded up to a multiple of its group;
under ZeRO-1 the parameters and .grad tensors are views of padded flat buffers, and the shard's gradient
and grad-norm weights are kept beside them (`grad_buffers`: 2·(padding + shard)), so ZeRO-1 saves
8·P·(1 − 1/g) − 8·P/g bytes: nothing at g = 2, more from g = 3 on.

Activations: `shardwise.planner.activations` (re-exported here).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.rules.buckets import bucket_key, cut_runs
from shardwise.rules import inventory
from shardwise.rules.fp8 import summed_before_cast
from shardwise.rules.inventory import Param, unit_params, zero_units
from shardwise.rules.partition import balanced_counts
from shardwise.planner.layout import Layout, Stage, chunk_owners
from shardwise.planner.models import (
    ModelSpec, Params, Tensor, embedding_tensors, head_tensors, layer_params, layer_tensors, tensors,
)
from shardwise.planner.mtp import embedding_copy, mtp_stage_tensors

BYTES_WEIGHT, BYTES_GRAD, BYTES_ADAM = 4, 4, 8


def stage_tensors(spec: ModelSpec, stage: Stage, lay: Layout) -> list[Tensor]:
    """The parameter tensors one rank of `stage` holds, in shardwise's named_parameters order."""
    t, ep = lay.tp, lay.ep
    out = embedding_tensors(spec, t) if stage.embedding else []
    kinds = stage.kinds or (False,) * stage.n_dense + (True,) * stage.n_moe
    for moe, linear in zip(kinds, stage.linear or (False,) * len(kinds)):
        out += layer_tensors(spec, moe, t, ep, linear)
    if stage.head:
        out += head_tensors(spec, t, separate_copy=not stage.embedding) + mtp_stage_tensors(spec, stage.embedding, t, ep)
    return out


def stage_params(spec: ModelSpec, stage: Stage, lay: Layout) -> Params:
    """Parameters one rank of this stage holds (tp shards, ep shards, padded vocab rows included)."""
    t, ep = lay.tp, lay.ep
    p = layer_params(spec, False, t, ep) * stage.n_dense + layer_params(spec, True, t, ep) * stage.n_moe
    for moe, linear in zip(stage.kinds, stage.linear):  # Gated DeltaNet layers: their mixer instead of attention's
        if linear:
            p = p + layer_params(spec, moe, t, ep, True) + layer_params(spec, moe, t, ep) * -1
    if stage.embedding:
        p = p + Params.of(embedding_tensors(spec, t))
    if stage.head:
        p = p + Params.of(head_tensors(spec, t, separate_copy=not stage.embedding)
                          + mtp_stage_tensors(spec, stage.embedding, t, ep))
    return p


def shard_size(n: int, group: int) -> int:
    """Elements per rank of `n` sharded over `group` ranks (the last shard padded)."""
    return -(-n // group)


@dataclass(frozen=True)
class ZeroBucket:
    """One of `GradReducer`'s flat buckets on one rank: `numel` elements padded to a multiple of `group`.

    `deferred`: it holds a TP-partial gradient, so it is reduced once, after the TP sum (not per
    micro-batch under ZeRO 2/3); `uses`: ZeRO-3 units that gather it (2 for an embedding tied to the head)."""

    axis: str
    numel: int
    group: int
    deferred: bool = False
    uses: int = 1

    @property
    def padded(self) -> int:
        return shard_size(self.numel, self.group) * self.group

    @property
    def shard(self) -> int:
        return shard_size(self.numel, self.group)


class ZeroBuckets(tuple):
    """`zero_buckets`' result, with the sums `static_bytes` needs computed once (the search asks often)."""

    def __new__(cls, items):
        self = super().__new__(cls, items)
        self.shard = sum(b.shard for b in self if b.numel)
        self.deferred = sum(b.numel for b in self if b.deferred)
        self.padding = sum(b.padded - b.numel for b in self)
        return self


def stage_unit_names(spec: ModelSpec, stage: Stage, lay: Layout) -> list[tuple[int, str]]:
    """(chunk, unit name) of every ZeRO-3 unit of a stage in model order: `inventory.zero_units` of each of its
    chunks, the units the runtime's `model_units` gathers."""
    owner = chunk_owners(lay)
    out, start, chunk = [], 0, 0
    for j, size in enumerate(balanced_counts(spec.n_layers, len(owner))):
        ids = range(start, start + size)
        start += size
        if owner[j] != stage.index:
            continue
        names = zero_units(ids, j == 0, j == len(owner) - 1, spec.mtp_layers, embedding_copy(spec, stage.embedding))
        out += [(chunk, name) for name in names]
        chunk += 1
    return out


def unit_index(spec: ModelSpec, stage: Stage, lay: Layout) -> dict[str, int]:
    """Each ZeRO-3 unit's index into `stage_units`, by name ('output', 'mtp.0', ...)."""
    return {name: i for i, (_, name) in enumerate(stage_unit_names(spec, stage, lay))}


@lru_cache(maxsize=4096)
def _unit_entries(spec: ModelSpec, unit: str, tied_head: bool, tp: int, ep: int) -> tuple[tuple[Param, Tensor], ...]:
    """Each inventory entry of a ZeRO-3 unit with the tensor one rank holds of it (a block's by its kind, so the
    cache holds one per kind of layer)."""
    kind, _, i = unit.partition(".")
    params = (inventory.block(spec, spec.is_moe_layer(int(i)), spec.is_linear_layer(int(i))) if kind == "layers"
              else unit_params(spec, unit, tied_head=tied_head))
    return tuple(zip(params, tensors(params, tp, ep)))


def unit_key(spec: ModelSpec, unit: str) -> str:
    """`_unit_entries`' cache key of a unit: a block by its kind (MoE?, Gated DeltaNet?), others by name."""
    kind, _, i = unit.partition(".")
    if kind != "layers":
        return unit
    return f"layers.{_kind_layer(spec, spec.is_moe_layer(int(i)), spec.is_linear_layer(int(i)), int(i))}"


def _kind_layer(spec: ModelSpec, moe: bool, linear: bool, i: int) -> int:
    """The first layer of the same kind as layer i (its entries are the same)."""
    return next(j for j in range(i + 1) if spec.is_moe_layer(j) == moe and spec.is_linear_layer(j) == linear)


def stage_unit_entries(spec: ModelSpec, stage: Stage, lay: Layout) -> list[tuple[int, str, list[tuple[Param, Tensor, bool]]]]:
    """(chunk, unit name, [(inventory entry, tensor one rank holds, TP-partial gradient?)]) of every ZeRO-3 unit of
    `stage_unit_names`. A gradient is TP-partial as the runtime's `parallelize` marks it: a replicated weight fed
    sequence shards under SP, a whole K/V head several tp ranks keep, and under any tp a head-partial weight (Qwen3's
    q/k norms, MLA's down-projections and latent norms, the gated norm), which sees this rank's heads only — but
    not, under --fp8, a down-projection whose output gradient is summed before its casts (`fp8_summed_heads`)."""
    t, ep, sp = lay.tp, lay.ep, lay.sp and lay.tp > 1
    whole = summed_before_cast if spec.fp8_summed_heads else (lambda p: False)  # --fp8: summed before the cast
    # under PP the embedding is reduced at the end when summed over emb with the last stage's copy (MTP's, or the
    # tied head's on another rank) or (MTP under dualpipev) accumulated by two chunks: `tied_partial`
    late = lay.pp > 1 and (bool(spec.mtp_layers) or (spec.tie_embeddings and not stage.head))
    copy = spec.tie_embeddings and not stage.embedding  # a tied head's copy: summed over emb, then reduced
    tied = spec.tie_embeddings and stage.embedding
    out = []
    for chunk, name in stage_unit_names(spec, stage, lay):
        kind = name.partition(".")[0]
        entries = _unit_entries(spec, unit_key(spec, name), tied, t, ep)
        if kind in ("layers", "mtp"):
            rows = [(p, x, ((sp and p.sp_replicated) or x.whole_head or (t > 1 and p.head_partial)) and not whole(p))
                    for p, x in entries]
        else:
            partial = {"norm": sp, "output": copy, "tok_embeddings": late, "mtp_embed": True}[kind]
            rows = [(p, x, partial) for p, x in entries]
        out.append((chunk, name, rows))
    return out


def stage_units(spec: ModelSpec, stage: Stage, lay: Layout) -> list[tuple[int, list[tuple[Tensor, bool]]]]:
    """(chunk, [(tensor, TP-partial gradient?)]) of every ZeRO-3 unit of `stage_unit_names`."""
    return [(chunk, [(x, partial) for _, x, partial in rows]) for chunk, _, rows in stage_unit_entries(spec, stage, lay)]


def zero_buckets(spec: ModelSpec, stage: Stage, lay: Layout) -> ZeroBuckets:
    """`GradReducer`'s buckets (ZeRO ≥ 1) of one rank of `stage`: parameters grouped by (expert?, matrix?)
    — and by pipeline chunk under ZeRO-2, by unit under ZeRO-3 — in parameter order, cut by
    `bucket_plan.cut_runs` (not under ZeRO-3: one bucket per unit and group)."""
    return _zero_buckets(spec, stage, bucket_layout(lay))


def bucket_layout(lay: Layout) -> Layout:
    """Only what ZeRO's buckets and units depend on (dp·cp as one group, the hybrid shard group): the search's
    many layouts share their cached buckets through it."""
    return Layout(dp=lay.dp * lay.cp, pp=lay.pp, tp=lay.tp, ep=lay.ep, vp=lay.vp, schedule=lay.schedule,
                  zero=lay.zero, sequence_parallel=lay.sp, dp_shard=lay.shard * lay.cp if lay.hsdp else None)


@lru_cache(maxsize=4096)
def _zero_buckets(spec: ModelSpec, stage: Stage, lay: Layout) -> ZeroBuckets:
    g = lay.dp
    dense, gd = ("dp_shard", lay.dp_shard) if lay.hsdp else ("dp_cp", g)  # hybrid sharding: dense over S·cp
    groups: dict[tuple, list] = {}
    tied = spec.tie_embeddings and stage.embedding and stage.head
    for u, (chunk, tensors) in enumerate(stage_units(spec, stage, lay)):
        for x, partial in tensors:
            key = bucket_key(lay.zero, chunk, u, x.expert, x.matrix)
            groups.setdefault(key, []).append((x, partial, u == 0 and tied))
    out = []
    for key, items in sorted(groups.items()):
        for r in [items] if lay.zero == 3 else cut_runs(items, lambda item: BYTES_GRAD * item[0].numel):
            expert = r[0][0].expert
            out.append(ZeroBucket("edp" if expert else dense, sum(x.numel for x, _, _ in r),
                                  max(1, g // lay.ep) if expert else gd, any(p for _, p, _ in r),
                                  2 if any(tie for *_, tie in r) else 1))
    return ZeroBuckets(out)


def zero_groups(local: Params, lay: Layout) -> list[tuple[str, int, int]]:
    """shardwise's flat ZeRO buffers of one rank: (axis, numel, group size) for dense matrices, dense 1-D
    tensors (no weight decay) and expert matrices, as `GradReducer` groups them by (expert?, ndim >= 2)."""
    g = lay.dp * lay.cp
    dense, gd = ("dp_shard", lay.shard * lay.cp) if lay.hsdp else ("dp_cp", g)
    return [(dense, local.dense - local.vectors, gd), (dense, local.vectors, gd),
            ("edp", local.expert, max(1, g // lay.ep))]


def zero_shard_numel(local: Params, lay: Layout) -> int:
    """Elements of this rank's ZeRO shard: every flat buffer padded to a multiple of its group, then split."""
    return sum(shard_size(n, g) for _, n, g in zero_groups(local, lay) if n)


def static_bytes(local: Params, lay: Layout, buckets: ZeroBuckets | None = None) -> dict:
    """Weights, grads and optimizer state of one rank, as ZeRO stage `lay.zero` divides them.

    `buckets` (`zero_buckets`) are shardwise's exact flat buffers; without them, one per group.
    `grad_buffers`: what shardwise's `GradReducer` holds beyond the weights and gradients — every ZeRO
    stage keeps the grad-norm weights of the rank's shard (1/replicas per element, fp32); ZeRO 1/2 make
    every parameter a view of its bucket's padded flat fp32 buffer (its padding); ZeRO-1 also makes every
    .grad a view of a padded flat fp32 gradient buffer (the reduce-scatter input) and keeps the fp32
    gradient of the rank's shard. ZeRO 2/3 count the shard's gradient (and the whole gradients of
    TP-partial buckets, held until the step's TP sum) under `grads`; the bucket buffers in flight during
    backward are transient. The total is what the trainer's storages hold (summary.json
    `static_bytes_measured`).
    """
    if buckets is None:
        buckets = ZeroBuckets(ZeroBucket(a, n, g) for a, n, g in zero_groups(local, lay) if n)
    shard, held = buckets.shard, buckets.shard + buckets.deferred

    def part(bytes_per: int, sharded: bool, n: int = shard) -> int:
        return bytes_per * (n if sharded else local.total)

    out = {
        "weights": part(BYTES_WEIGHT, lay.zero >= 3),
        "grads": part(BYTES_GRAD, lay.zero >= 2, held),
        "optimizer": part(BYTES_ADAM, lay.zero >= 1),
        "grad_buffers": BYTES_GRAD * ({1: 2 * buckets.padding + 2 * shard, 2: buckets.padding + shard,
                                       3: shard}.get(lay.zero, 0)),
    }
    out["total"] = sum(out.values())
    return out
