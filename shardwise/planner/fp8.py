"""`--fp8 RECIPE` in the plan: which GEMMs run at the FP8 peak, and the `fp8_amax` all-reduces each FP8 linear issues.

The FP8 linears are those `shardwise.fp8.apply` marks, read from the block's inventory (`rules.inventory.block`):
every 2-D weight of the mixer and the feed-forward (MLA's replicated down-projections and the MoE's shared experts
included) and the routed experts' group, but not the router or Qwen3-Next's shared-expert gate. Per linear (an
expert group counts once) and microbatch, the forward's `quantize_all` casts x and W, the backward's g twice, W and
x (`rules.fp8.CASTS`); each call's amaxes reduce as `rules.fp8.amax_reductions` says. Full recompute re-runs the
recomputed blocks' forwards. The operands' splits are `fp8.apply.layer_layout`'s: a column-parallel W's rows and
g's columns over tp, a row-parallel x's and W's columns over tp, the tokens of a block's sequence over dp and cp
(a scale over all of them: dp_cp); the MoE's rows over dp_cp (shared experts) or edp (routed), and tp under SP.
"""
from __future__ import annotations

from dataclasses import replace

from shardwise.rules import inventory
from shardwise.rules.fp8 import (AMAX_TAG, FP8_BLOCKS, TILE_AMAX_TAG, TILES_TAG, Operand, amax_reductions,
                                  planned_token_tiles, scale_plan)
from shardwise.rules.validation import FP8_TOKEN_TILE, fp8_expert_tiles_split
from shardwise.planner import moe_skew
from shardwise.planner.layout import Layout, Stage, Workload
from shardwise.planner.tp_overlap import LATENCY_S

TIMED = ("tp", "pp", "ep", "cp")
"""Axes whose microbatch traffic the step time already counts by its bytes."""

HIGH_PRECISION = ("feed_forward.router.", "feed_forward.shared_gate.")
"""Linears of a block that stay in high precision (the router, Qwen3-Next's shared-expert gate)."""


def block_linears(spec, moe: bool, linear_layer: bool) -> list:
    """The FP8 weights of one block ([out, in] Params; the routed experts as their stacked [E, ...] Params)."""
    out = []
    for p in inventory.block(spec, moe, linear_layer):
        if not p.name.startswith(("attention.", "feed_forward.")) or p.name.startswith(HIGH_PRECISION):
            continue
        if p.expert and len(p.shape) == 3 or len(p.shape) == 2 and p.name.endswith(".weight"):
            out.append(p)
    return out


def _axes(lay: Layout) -> dict:
    return {"dp": ("dp", lay.dp), "cp": ("cp", lay.cp), "tp": ("tp", lay.tp), "dp_cp": ("dp_cp", lay.dp * lay.cp),
            "edp": ("edp", lay.dp * lay.cp // lay.ep)}


def _operands(p, lay: Layout, wl: Workload, spec) -> tuple[list, list, list]:
    """([x_i], [W_i], [g_i]) Operands of one FP8 linear (or of each local expert) for one microbatch."""
    ax = _axes(lay)
    n = lay.mb * wl.seq_len // lay.cp
    tp = (ax["tp"],)
    if p.expert:  # one linear per local expert, over its received rows
        e_l = spec.moe_experts // lay.ep
        routed = n // lay.tp if lay.sp else n
        rows = moe_skew.busiest_rows(spec, lay, wl, routed) // e_l
        tokens = (ax["edp"], ax["tp"]) if lay.sp else (ax["edp"],)
        out_, in_ = p.shape[1], p.shape[2]
        x = Operand(1, rows, in_, seq=tokens, rows_all=tokens, seq_global=0)
        w = Operand(1, out_, in_)
        g = Operand(1, rows, out_, seq=tokens, rows_all=tokens, seq_global=0)
        return [x] * e_l, [w] * e_l, [g] * e_l
    out_l, in_l = p.local_shape(lay.tp)
    out_g, in_g = p.shape
    col, row = p.tp == "col", p.tp == "row"
    if p.name.startswith("feed_forward.shared."):  # the MoE's flattened rows: this rank's sequence shard under SP
        rows = n // lay.tp if lay.sp else n
        tokens = (ax["dp_cp"], ax["tp"]) if lay.sp else (ax["dp_cp"],)
        tok = dict(seq=tokens, rows_all=tokens, seq_global=0)
        B, S = 1, rows
    else:
        tok = dict(batch=(ax["dp"],), seq=(ax["cp"],), rows_all=(ax["dp_cp"],))
        B, S = lay.mb, wl.seq_len // lay.cp
    x = Operand(B, S, in_l, cols=tp if row else (), cols_global=in_g, **tok)
    w = Operand(1, out_l, in_l, seq=tp if col else (), cols=tp if row else (), seq_global=out_g, cols_global=in_g)
    g = Operand(B, S, out_l, cols=tp if col else (), cols_global=out_g, **tok)
    return [x], [w], [g]


def _sp_shard(op: Operand, tp: int) -> Operand:
    """This rank's SP shard of an operand whose rows an overlapped region gathers over tp
    (`tensor_parallel.overlap.shard_layout`): its rows split over tp too, a scale over every row reduced over it."""
    rows = op.rows_all if op.rows_all is not None else (*op.batch, *op.seq)
    return replace(op, S=op.S // tp, seq=(*op.seq, ("tp", tp)), rows_all=(*rows, ("tp", tp)), seq_global=None)


def overlapped(p, lay: Layout, spec, linear_layer: bool) -> str | None:
    """How --tp-overlap runs FP8 linear `p` (`tensor_parallel.overlap`): "column" (it reads an overlapped region's
    entry: attention's, a Gated DeltaNet's or a dense MLP's column projections; Kimi Delta Attention enters its
    region whole), "row" (a row-parallel linear), else None."""
    if not lay.tp_overlap or p.expert:
        return None
    if p.tp == "row":
        return "row"
    kda = getattr(spec, "kda", False) and linear_layer and p.name.startswith("attention.")
    return "column" if reads_region_input(p, spec) and not kda else None


def linear_calls(p, lay: Layout, wl: Workload, spec, recipe: str, x_held: bool = False,
                 w_held: bool = False, overlap: str | None = None) -> tuple[list, list]:
    """(forward, backward) `fp8_amax` all-reduces of one FP8 linear and microbatch, and its routed experts'
    `fp8_tiles` ones (the token-tile buffers, `tile_rows`): [(axis, size, bytes)] each.
    `x_held` / `w_held`: its x (an SP gather's) or W (a ZeRO-3 gather's) came over the wire in FP8, so the linear
    casts neither (`--fp8-all-gather`: only where one cast serves both GEMMs reading it). Under a split backward
    (zb, dualpipev) the dx casts and the deferred dW casts are two calls. `overlap` (`overlapped`): the forward of an
    overlapped column linear scales x on this rank's shard; an overlapped row linear's backward scales g on its shard
    for dx, then casts for dW in a second call."""
    bx, bw, bgd, bwd, bgw, bxw = FP8_BLOCKS[recipe]
    xs, ws, gs = _operands(p, lay, wl, spec)
    xs_c, ws_c = ([] if x_held else xs), ([] if w_held else ws)
    xs_f = [_sp_shard(x, lay.tp) for x in xs_c] if overlap == "column" else xs_c
    fwd = amax_reductions([(x, bx) for x in xs_f] + [(w, bw) for w in ws_c])
    gs_d = [_sp_shard(g, lay.tp) for g in gs] if overlap == "row" else gs
    dgrad = [(g, bgd) for g in gs_d] + [(w, bwd) for w in ws_c]
    wgrad = [(g, bgw) for g in gs] + [(x, bxw) for x in xs_c]
    tiles = []
    if p.expert and expert_tiles(lay, wl):  # the token-tiled casts take global tiles: one buffer per operand role
        wgrad = [(g, bgw) for g in gs if not _row_tiled(bgw)] + [(x, bxw) for x in xs_c if not _row_tiled(bxw)]
        n = tile_rows(spec, lay, wl)
        axes = xs[0].seq
        tiles = [(n * op.C, axes) for op, b in ((gs[0], bgw), (xs[0], bxw)) if _row_tiled(b) and (op is gs[0] or xs_c)]
    split = lay.pp > 1 and lay.schedule in ("zb", "dualpipev") or overlap == "row"
    bwd_ = amax_reductions(dgrad) + amax_reductions(wgrad) if split else amax_reductions(dgrad + wgrad)
    return fwd, bwd_, amax_reductions([], tiles)


def _row_tiled(block: tuple) -> bool:
    """A block tiling the rows (tokens) and single columns: the casts `fp8.scaling.TokenTiles` takes."""
    return block[0] is not None and block[0] > 1 and block[1] == 1


def expert_tiles(lay: Layout, wl: Workload) -> bool:
    """Whether the routed experts take their token tiles at their rows' single-device positions
    (`fp8.apply.global_tiles`)."""
    return bool(wl.fp8) and fp8_expert_tiles_split(wl.fp8, lay.tp if lay.sp else 1, lay.cp, lay.dp, lay.ep)


def tile_rows(spec, lay: Layout, wl: Workload) -> int:
    """Rows of a rank's routed-expert tile buffer (`rules.fp8.planned_token_tiles`), from the busiest rank's expert
    rows (`moe_skew`)."""
    sp = lay.tp if lay.sp else 1
    rows = moe_skew.busiest_rows(spec, lay, wl, lay.mb * wl.seq_len // lay.cp // sp)
    return planned_token_tiles(rows, lay.dp, lay.cp, lay.ep, sp, lay.mb, wl.seq_len, spec.moe_topk,
                               spec.moe_experts // lay.ep, FP8_TOKEN_TILE[wl.fp8])


def positions_microbatch(led, spec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Per MoE layer forward (again under full recompute), where the experts' token tiles span ranks: the position
    exchange (`expert_parallel.positions`, tag `fp8_positions`): an all-gather of this rank's [runs, 1 + E] int64
    (run start, per-expert counts) over dp_cp, then of the gathered table over tp under SP; and an all-to-all over
    ep of each sent row's position, one int64."""
    if not stage.n_moe or not expert_tiles(lay, wl):
        return
    fwd = stage.n_moe + (stage.recompute_split(lay)[0][1] if lay.recompute == "full" else 0)
    runs = lay.mb * (2 if lay.cp > 1 else 1)  # `TokenLayout.max_runs`: two per sequence under any cp order
    table = runs * (1 + spec.moe_experts) * 8
    led.add("dp_cp", f"all_gather:{TILES_TAG}", table, lay.dp * lay.cp, fwd)
    if lay.sp:
        led.add("tp", f"all_gather:{TILES_TAG}", table * lay.dp * lay.cp, lay.tp, fwd)
    tokens = lay.mb * wl.seq_len // lay.cp // (lay.tp if lay.sp else 1)
    led.add("ep", f"all_to_all:{TILES_TAG}", moe_skew.kept_rows(spec, lay, wl, tokens) * 8, lay.ep, fwd)


def wire_activations(lay: Layout, wl: Workload) -> bool:
    """`--fp8-all-gather` under SP: every region entry (attention's, a dense MLP's) gathers x in FP8 — exact only
    where x is cast alike for y and dW (tensorwise; `TrainConfig` refuses the rest)."""
    if not (wl.fp8 and wl.fp8_all_gather and lay.sp and lay.tp > 1):
        return False
    return FP8_BLOCKS[wl.fp8][0] == FP8_BLOCKS[wl.fp8][5]


def wire_weights(lay: Layout, wl: Workload) -> bool:
    """`--fp8-all-gather` under ZeRO-3: buckets of FP8 linears' weights gather in FP8 — exact where W is cast alike
    for y and dx (tensorwise, blockwise)."""
    return bool(wl.fp8 and wl.fp8_all_gather and lay.zero == 3 and FP8_BLOCKS[wl.fp8][1] == FP8_BLOCKS[wl.fp8][3])


def reads_region_input(p, spec) -> bool:
    """Whether FP8 linear `p` reads its region's entry (the SP gather's output): a mixer's or dense MLP's linear that
    is not row-parallel and takes the model width (not one fed by another projection: MLA's up-projections, KDA's
    gates' second halves), outside the indexer (no gradient)."""
    return not p.expert and p.tp != "row" and p.shape[1] == spec.dim and \
        not p.name.startswith(("feed_forward.shared.", "attention.indexer."))


def fp8_microbatch(led, spec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """One microbatch's `all_reduce:fp8_amax` of every FP8 linear of `stage` (its forwards again where full
    recompute replays a block)."""
    kinds = stage.kinds or (False,) * stage.n_dense + (True,) * stage.n_moe
    linear = stage.linear or (False,) * len(kinds)
    if lay.recompute != "full":
        again = (False,) * len(kinds)
    else:
        again = stage.recomputed or (True,) * len(kinds)
    x_wire, w_wire = wire_activations(lay, wl), wire_weights(lay, wl)
    positions_microbatch(led, spec, stage, lay, wl)
    for moe, lin, rec in zip(kinds, linear, again):
        fp8_bucket = w_wire and weights_bucket_fp8(spec, moe, lin)
        for p in block_linears(spec, moe, lin):
            fwd, bwd, tiles = linear_calls(p, lay, wl, spec, wl.fp8, x_wire and reads_region_input(p, spec),
                                           fp8_bucket and not p.expert, overlapped(p, lay, spec, lin))
            for axis, size, nbytes in fwd:
                led.add(axis, f"all_reduce:{AMAX_TAG}", nbytes, size, 2 if rec else 1)
            for axis, size, nbytes in bwd:
                led.add(axis, f"all_reduce:{AMAX_TAG}", nbytes, size)
            for axis, size, nbytes in tiles:
                led.add(axis, f"all_reduce:{TILE_AMAX_TAG}", nbytes, size)


def amax_seconds(mb, rate: dict, links: dict) -> float:
    """Time one microbatch's `fp8_amax` all-reduces (and the routed experts' `fp8_tiles` all-reduces and
    `fp8_positions` all-gathers, which the experts wait for) add to its critical path (a GEMM waits for its scales): their bytes on the axes the step time
    does not count per microbatch (dp_cp, edp), and each one's latency α on its link (tiny messages:
    latency-bound)."""
    t = 0.0
    for op in (f"all_reduce:{AMAX_TAG}", f"all_reduce:{TILE_AMAX_TAG}", f"all_gather:{TILES_TAG}"):
        for axis, ops in mb.ops.items():
            if op in ops:
                count, _, wire = ops[op]
                t += (0.0 if axis in TIMED else wire / rate[axis]) + count * LATENCY_S[links.get(axis) or "nvlink"]
    return t


def weights_bucket_fp8(spec, moe: bool, linear_layer: bool) -> bool:
    """Whether a block's ZeRO-3 matrix bucket (its non-expert 2-D weights) holds only FP8 linears' weights, so it
    gathers in FP8: a dense block's (an MoE block's holds the router; a Gated DeltaNet's its conv kernels)."""
    fp8 = {p.name for p in block_linears(spec, moe, linear_layer) if not p.expert}
    return all(p.name in fp8 for p in inventory.block(spec, moe, linear_layer) if p.matrix and not p.expert)


def fp8_bucket(spec, unit: str, key: tuple, numel: int) -> bool:
    """Whether ZeRO-3 bucket `key` (`rules.buckets.bucket_key`: (..., expert?, matrix?)) of `unit` gathers in FP8
    under `wire_weights`: the non-expert matrices of a block whose matrix bucket holds only FP8 linears' weights."""
    if not (unit.startswith("layers.") and key[-1] and not key[-2] and numel):
        return False
    layer = int(unit.split(".")[1])
    return weights_bucket_fp8(spec, spec.is_moe_layer(layer), spec.is_linear_layer(layer))


def wire_gathers(led, spec, stage: Stage, lay: Layout, wl: Workload, buckets, gathers) -> list[bool]:
    """Book `--fp8-all-gather`'s ZeRO-3 weight gathers of `stage` (`buckets`, `gathers`: `zero_buckets` and
    `bucket_gathers`): each FP8 bucket's `all_gather:fp8` of its shard bytes, and before it the `fp8_amax`
    all-reduce of every weight's scale blocks over the gather's axis (and tp where the scale spans it). Returns which
    buckets went FP8 (the caller books the rest as before)."""
    from shardwise.planner.memory import stage_unit_entries
    from shardwise.rules.buckets import bucket_key
    from shardwise.rules.wire import fp8_all_gather

    fp8 = [False] * len(buckets)
    if not wire_weights(lay, wl):
        return fp8
    keys: dict[tuple, list] = {}
    for u, (chunk, name, rows) in enumerate(stage_unit_entries(spec, stage, lay)):
        for p, x, _ in rows:
            keys.setdefault(bucket_key(3, chunk, u, x.expert, x.matrix), []).append((name, p))
    _, bw, *_ = FP8_BLOCKS[wl.fp8]
    for i, ((key, items), b, n) in enumerate(zip(sorted(keys.items()), buckets, gathers)):
        if not fp8_bucket(spec, items[0][0], key, b.numel):
            continue
        fp8[i] = True
        ops = []
        for _, p in items:
            (w,) = _operands(p, lay, wl, spec)[1]
            ops.append((w, bw))
        gather_axis = (b.axis, b.group)
        scale_blocks = {}
        for w, block in ops:
            k, axes = scale_plan(w, block)
            scale_blocks.setdefault((gather_axis, *axes), [0])[0] += k
        nbytes, _ = fp8_all_gather(b.shard, 0)
        led.add(b.axis, "all_gather:fp8", nbytes, b.group, n)
        for axes, (k,) in scale_blocks.items():
            _, amax = fp8_all_gather(0, k)
            for axis, size in axes:
                led.add(axis, f"all_reduce:{AMAX_TAG}", amax, size, n)
    return fp8


def sp_wire_gathers(led, spec, lay: Layout, wl: Workload, count: int) -> None:
    """`count` SP region entries gathered in FP8 (`wire_activations`): each an `all_gather:fp8` of this rank's
    sequence shard at one byte per element, after the `fp8_amax` all-reduce of its one scale over tp and the axes
    the x cast's scale spans (the tokens: dp_cp)."""
    from shardwise.rules.wire import fp8_all_gather

    n = lay.mb * wl.seq_len // lay.cp
    shard = Operand(lay.mb, n // lay.mb // lay.tp, spec.dim, batch=(("dp", lay.dp),), seq=(("cp", lay.cp),),
                    rows_all=(("dp_cp", lay.dp * lay.cp),), cols_global=spec.dim)
    k, axes = scale_plan(shard, FP8_BLOCKS[wl.fp8][0])
    nbytes, amax = fp8_all_gather(n // lay.tp * spec.dim, k)
    led.add("tp", "all_gather:fp8", nbytes, lay.tp, count)
    for axis, size in [("tp", lay.tp), *axes]:
        led.add(axis, f"all_reduce:{AMAX_TAG}", amax, size, count)
