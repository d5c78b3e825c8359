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

from shardwise.rules import inventory
from shardwise.rules.fp8 import AMAX_TAG, FP8_BLOCKS, Operand, amax_reductions
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
        x = Operand(1, rows, in_, seq=tokens, rows_all=tokens)
        w = Operand(1, out_, in_)
        g = Operand(1, rows, out_, seq=tokens, rows_all=tokens)
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


def linear_calls(p, lay: Layout, wl: Workload, spec, recipe: str) -> tuple[list, list]:
    """(forward, backward) `fp8_amax` all-reduces of one FP8 linear and microbatch: [(axis, size, bytes)]."""
    bx, bw, bgd, bwd, bgw, bxw = FP8_BLOCKS[recipe]
    xs, ws, gs = _operands(p, lay, wl, spec)
    fwd = amax_reductions([(x, bx) for x in xs] + [(w, bw) for w in ws])
    bwd_ = amax_reductions([(g, bgd) for g in gs] + [(w, bwd) for w in ws] + [(g, bgw) for g in gs]
                           + [(x, bxw) for x in xs])
    return fwd, bwd_


def fp8_microbatch(led, spec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """One microbatch's `all_reduce:fp8_amax` of every FP8 linear of `stage` (its forwards again where full
    recompute replays a block)."""
    kinds = stage.kinds or (False,) * stage.n_dense + (True,) * stage.n_moe
    linear = stage.linear or (False,) * len(kinds)
    if lay.recompute != "full":
        again = (False,) * len(kinds)
    else:
        again = stage.recomputed or (True,) * len(kinds)
    for moe, lin, rec in zip(kinds, linear, again):
        for p in block_linears(spec, moe, lin):
            fwd, bwd = linear_calls(p, lay, wl, spec, wl.fp8)
            for axis, size, nbytes in fwd:
                led.add(axis, f"all_reduce:{AMAX_TAG}", nbytes, size, 2 if rec else 1)
            for axis, size, nbytes in bwd:
                led.add(axis, f"all_reduce:{AMAX_TAG}", nbytes, size)


def amax_seconds(mb, rate: dict, links: dict) -> float:
    """Time one microbatch's `fp8_amax` all-reduces add to its critical path (a GEMM waits for its scales): their
    bytes on the axes the step time does not count per microbatch (dp_cp, edp), and each one's latency α on its
    link (tiny messages: latency-bound)."""
    op, t = f"all_reduce:{AMAX_TAG}", 0.0
    for axis, ops in mb.ops.items():
        if op in ops:
            count, _, wire = ops[op]
            t += (0.0 if axis in TIMED else wire / rate[axis]) + count * LATENCY_S[links.get(axis) or "nvlink"]
    return t
