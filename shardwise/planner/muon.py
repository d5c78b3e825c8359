"""Muon's terms (`--optimizer muon`): which matrices it steps, its one momentum buffer, and its collectives.

Mirrors shardwise/optim/sharded.py, dealing matrices to ranks by the rule both read (`rules.muon.deal`).
Per group of matrices (ZeRO ≥ 1: each Muon bucket; ZeRO-0: the dense ones, the expert ones), over the data
axis (dp_cp, or dp_shard under hybrid sharding; edp for experts) times tp, one step issues, tagged `muon`:
under ZeRO ≥ 1 an all-gather of the bucket's Nesterov shard over the data axis; one all-gather over tp of the
TP-split matrices' local pieces; and the all-gathers of the orthogonalised matrices, over tp and then over the
data axis, each rank's buffer padded to the busiest rank's load.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from shardwise.planner.layout import Layout, Stage
from shardwise.rules.buckets import bucket_key, cut_runs
from shardwise.rules.inventory import Param
from shardwise.rules.muon import busiest_numel, is_hidden_matrix
from shardwise.planner.memory import (
    BYTES_ADAM, BYTES_GRAD, ZeroBucket, ZeroBuckets, bucket_layout, stage_params,
    stage_unit_entries, static_bytes,
)
from shardwise.planner.models import ModelSpec

BYTES_MOMENTUM = 4
"""fp32 momentum per Muon element (AdamW keeps 8: exp_avg and exp_avg_sq)."""


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter as a rank holds it: the shape Newton–Schulz sees (rows, cols), how many (stacked
    experts), the local elements, and whether tp splits it."""

    rows: int
    cols: int
    local: int
    count: int = 1
    tp_split: bool = False
    expert: bool = False

    @classmethod
    def of(cls, p: Param, tp: int, ep: int) -> Matrix:
        """The inventory entry `p` as `optim.sharded.Muon` assembles it: a TP-split weight gathered whole (its
        global shape), a replicated one as held, a stacked expert weight [E/ep, r, c] as E/ep matrices, a 2-D expert
        tensor (gpt-oss's [E/ep, n] biases) as one."""
        local = p.local_shape(tp, ep)
        n = prod(local)
        if p.expert:
            return cls(*local[1:], n, local[0], expert=True) if len(local) == 3 else cls(*local, n, expert=True)
        return cls(*p.shape, n, tp_split=tp > 1 and p.tp != "rep")


def unit_matrices(spec: ModelSpec, stage: Stage, lay: Layout) -> list[list[Matrix]]:
    """The Muon parameters one rank of `stage` holds, per ZeRO-3 unit (`memory.stage_unit_entries`): the inventory
    entries `rules.muon.is_hidden_matrix` selects by their model-level name, as the runtime's `is_muon_param`."""
    return [[Matrix.of(p, lay.tp, lay.ep) for p, _, _ in rows if is_hidden_matrix(f"{name}.{p.name}", len(p.shape))]
            for _, name, rows in stage_unit_entries(spec, stage, lay)]


def stage_matrices(spec: ModelSpec, stage: Stage, lay: Layout) -> list[Matrix]:
    return [m for unit in unit_matrices(spec, stage, lay) for m in unit]


def muon_buckets(spec: ModelSpec, stage: Stage, lay: Layout, expert: bool) -> list[list[Matrix]]:
    """The Muon buckets of one kind (ZeRO ≥ 1) as `GradReducer` cuts them: per unit under ZeRO-3, else runs
    closed once they reach BUCKET_BYTES (pipeline chunks under ZeRO-2 with vp > 1 are not told apart)."""
    units = unit_matrices(spec, stage, lay)
    if lay.zero < 3:
        units = [[m for u in units for m in u]]
    out = []
    for unit in units:
        mats = [m for m in unit if m.expert == expert]
        if lay.zero >= 3:
            out += [mats] if mats else []
        else:
            out += list(cut_runs(mats, lambda m: 4 * m.local))  # fp32 gradients, as the reducer cuts them
    return out


def muon_numel(spec: ModelSpec, stage: Stage, lay: Layout) -> int:
    """Elements of the Muon parameters one rank of `stage` holds."""
    return sum(m.local for m in stage_matrices(spec, stage, lay))


def optimizer_bytes(total_local: int, spec: ModelSpec, stage: Stage, lay: Layout) -> int:
    """ZeRO-0 optimizer state of one rank under Muon: 4 bytes of momentum per Muon element, AdamW's 8 per other."""
    n = muon_numel(spec, stage, lay)
    return BYTES_MOMENTUM * n + BYTES_ADAM * (total_local - n)


def muon_static(static: dict, spec: ModelSpec, stage: Stage, lay: Layout) -> dict:
    """`memory.static_bytes` under Muon: each Muon element keeps 4 bytes of momentum instead of AdamW's 8. At
    ZeRO ≥ 1 with the buckets `GradReducer` cuts under Muon (`split_zero_buckets`): Muon's and AdamW's parameters
    in buckets of their own, each padded to its group, so the shard, its padding and the momentum are exact."""
    if lay.zero:
        adam, muon = split_zero_buckets(spec, stage, lay)
        static = static_bytes(stage_params(spec, stage, lay), lay, ZeroBuckets(adam + muon))
        n = sum(b.shard for b in muon)
    else:
        n = muon_numel(spec, stage, lay)
    out = dict(static, optimizer=static["optimizer"] - (BYTES_ADAM - BYTES_MOMENTUM) * n)
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def split_zero_buckets(spec: ModelSpec, stage: Stage, lay: Layout) -> tuple[list, list]:
    """(AdamW's, Muon's) ZeRO buckets of one rank of `stage`: `memory.zero_buckets` with the runtime's extra key,
    whether Muon steps the tensor (`rules.muon.is_hidden_matrix` of its name)."""
    lay_b = bucket_layout(lay)
    g = lay_b.dp
    dense, gd = ("dp_shard", lay_b.dp_shard) if lay_b.hsdp else ("dp_cp", g)
    groups: dict[tuple, list] = {}
    tied = spec.tie_embeddings and stage.embedding and stage.head
    for u, (chunk, name, rows) in enumerate(stage_unit_entries(spec, stage, lay_b)):
        for p, x, partial in rows:
            muon = is_hidden_matrix(f"{name}.{p.name}", len(p.shape))
            key = bucket_key(lay.zero, chunk, u, x.expert, x.matrix) + (muon,)
            groups.setdefault(key, []).append((x, partial, u == 0 and tied))
    out: tuple[list, list] = ([], [])
    for key, items in sorted(groups.items()):
        for r in [items] if lay.zero == 3 else cut_runs(items, lambda item: BYTES_GRAD * item[0].numel):
            expert = r[0][0].expert
            out[key[-1]].append(ZeroBucket("edp" if expert else dense, sum(x.numel for x, _, _ in r),
                                           max(1, g // lay.ep) if expert else gd, any(p for _, p, _ in r),
                                           2 if any(tie for *_, tie in r) else 1))
    return out


def muon_comm(led, spec: ModelSpec, stage: Stage, lay: Layout) -> None:
    """Muon's collectives of one step on one rank of `stage` (see the module docstring), into a CommLedger."""
    g = lay.dp * lay.cp
    dense, gd = ("dp_shard", lay.shard * lay.cp) if lay.hsdp else ("dp_cp", g)
    mats = stage_matrices(spec, stage, lay)
    for axis, size, expert in ((dense, gd, False), ("edp", max(1, g // lay.ep), True)):
        groups = (muon_buckets(spec, stage, lay, expert) if lay.zero else
                  [[m for m in mats if m.expert == expert]])
        for group in groups:
            if group:
                _group_comm(led, group, axis, size, lay)


def qk_clip_comm(led, spec: ModelSpec, attention_layers: int, lay: Layout) -> None:
    """MuonClip's collectives of one step (optim/qk_clip.py): the fp32 largest logit of each local query head
    (n_heads / tp per attention layer this rank holds, MTP blocks included), all-reduced (MAX) over dp×cp, then
    all-gathered over tp when a GQA group spans TP ranks (n_kv_heads < tp; never for MLA)."""
    flat = 4 * attention_layers * (spec.n_heads // lay.tp)
    if not flat:
        return
    led.add("dp_cp", "all_reduce:qk_clip", flat, lay.dp * lay.cp)
    if not spec.is_mla and spec.n_kv_heads < lay.tp:
        led.add("tp", "all_gather:qk_clip", flat, lay.tp)


def _group_comm(led, group: list[Matrix], axis: str, size: int, lay: Layout) -> None:
    """One group's gathers: (ZeRO ≥ 1) the bucket's Nesterov shard over the data axis, the TP-split pieces over
    tp, the orthogonalised results over tp and the data axis."""
    if lay.zero:
        led.add(axis, "all_gather:muon", 4 * -(-sum(m.local for m in group) // size), size)
    split = sum(m.local for m in group if m.tp_split)
    if split:
        led.add("tp", "all_gather:muon", 4 * split, lay.tp)
    shapes = [(m.rows, m.cols) for m in group for _ in range(m.count)]
    width = busiest_numel(shapes, size * lay.tp)
    if size * lay.tp > 1:
        led.add("tp", "all_gather:muon", 4 * width, lay.tp)
        led.add(axis, "all_gather:muon", 4 * lay.tp * width, size)


def _ns_work(rows: int, cols: int) -> int:
    """Elements Newton–Schulz holds for one matrix (m = min side, M = max): X, and within an iteration
    X ← aX + (bA + cA²)X either aX, (bA + cA²)X and the sum beside X and A (4mM + m²), or A, A², cA², bA and
    their sum beside X and aX (2mM + 4m²)."""
    m, big = min(rows, cols), max(rows, cols)
    return max(4 * m * big + m * m, 2 * m * big + 4 * m * m)


def _group_step_numel(group: list[Matrix], size: int, lay: Layout) -> int:
    """Elements one group's step holds at its worst moment on one rank (`optim/sharded.py`, fp32): under ZeRO ≥ 1
    the bucket's gathered Nesterov buffer P; the TP-split pieces gathered (tp·S) and their whole matrices (G);
    then the result buffer W (the busiest rank's), one matrix's Newton–Schulz work and the results gathered over
    tp and the group (tp·W, R·W; one rank alone keeps every update instead); then, applying, the bucket's flat
    update (P) and two consecutive stacked expert updates."""
    zero = bool(lay.zero)
    numel = sum(m.local for m in group)
    p = -(-numel // size) * size if zero else 0
    split = sum(m.local for m in group if m.tp_split)
    whole = sum(m.rows * m.cols for m in group if m.tp_split)
    ranks = size * lay.tp
    shapes = [(m.rows, m.cols) for m in group for _ in range(m.count)]
    width = busiest_numel(shapes, ranks)
    ns = max(_ns_work(r, c) for r, c in shapes)
    results = ranks * width if ranks > 1 else sum(r * c for r, c in shapes)
    gathered = width + lay.tp * width + ranks * width if ranks > 1 else results + ns
    stacks = sorted((m.local for m in group if m.count > 1), reverse=True)[:2]
    moments = [split + lay.tp * split, lay.tp * split + whole,
               whole + (width + ns if ranks > 1 else results + ns), whole + gathered,
               whole + results + (p if zero else 0) + sum(stacks)]
    return p + max(moments)


def step_transient_bytes(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """Muon's step on one rank of `stage` beyond its static state: every held Nesterov gradient (one per
    momentum element) and the worst group's buffers (`_group_step_numel`), one group at a time, fp32 (the
    Newton–Schulz dtype on CPU, or with --muon-ns-fp32)."""
    g = lay.dp * lay.cp
    gd = lay.shard * lay.cp if lay.hsdp else g
    mats = stage_matrices(spec, stage, lay)
    held, worst = 0, 0
    for size, expert in ((gd, False), (max(1, g // lay.ep), True)):
        groups = (muon_buckets(spec, stage, lay, expert) if lay.zero else [[m for m in mats if m.expert == expert]])
        for group in groups:
            if group:
                n = sum(m.local for m in group)
                held += -(-n // size) if lay.zero else n
                worst = max(worst, _group_step_numel(group, size, lay))
    return float(BYTES_MOMENTUM * (held + worst))
