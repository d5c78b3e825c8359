"""FP8 scale blocks and the amax reductions they cost, torch-free, so the planner counts what `shardwise.fp8` does.

A recipe casts six operands (`CASTS`: the forward's x and W, the input gradient's g and W, the weight gradient's g
and x), each with scale blocks (rows, cols) of its 2-D matrix: None spans the whole dimension, 1 one line
(`shardwise.fp8.recipes` builds its casts from the same blocks). `block_plan` is the one statement of which blocks
an operand's scales cover under a split, how many amaxes it takes and over which axes they are max-reduced: the
runtime's `fp8.scaling.block_plan` calls it, the planner counts from it (`scale_plan`); `amax_reductions` mirrors
`reduce_amaxes`: the amaxes of one `quantize_all` call that reduce over the same axes travel in one fp32
all-reduce per axis, tagged `fp8_amax`.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil, prod

CASTS = ("x", "w", "g_dgrad", "w_dgrad", "g_wgrad", "x_wgrad")
ROW, COL = (1, None), (None, 1)
FP8_BLOCKS: dict[str, tuple] = {
    "tensorwise": ((None, None),) * 6,
    "rowwise": (ROW, ROW, ROW, COL, COL, COL),
    "blockwise": ((1, 128), (128, 128), (1, 128), (128, 128), (128, 1), (128, 1)),
    "mxfp8": ((1, 32), (1, 32), (1, 32), (32, 1), (32, 1), (32, 1)),
}
"""Each recipe's scale block per operand, in `CASTS` order."""
AMAX_BYTES = 4
"""An amax travels as fp32."""
FP8_BYTES = 1
"""An FP8 element (e4m3 or e5m2), in memory and on the wire."""
AMAX_TAG = "fp8_amax"
GRAD_TAG = "fp8_grad"
"""Ledger tag of the tp all-reduce of a head-partial FP8 linear's output gradient before its backward casts."""


def summed_before_cast(p) -> bool:
    """An inventory entry (`rules.inventory.Param`) of a linear replicated over tp that feeds each rank's own heads
    (MLA's down-projections, KDA's gate down-projections): its weight or bias. Under --fp8 at tp > 1 its output
    gradient is all-reduced over tp before the backward casts (`GRAD_TAG`), so its gradient is whole on every rank,
    not TP-partial: it leaves the tp sum and ZeRO's deferred buckets (`shardwise.fp8.apply._sum_output_gradient`)."""
    return p.head_partial and p.tp == "rep" and not p.expert and (len(p.shape) == 2 or p.name.endswith(".bias"))


@dataclass(frozen=True)
class Operand:
    """An operand [B, S, C] on one rank and the axes splitting each dimension (`batch`, `seq`, `cols`), each axis a
    (key, size) pair — the key is the planner's axis name or the runtime's mesh Axis, passed through untouched.
    `seq_global` / `cols_global`: global lengths (None: local × the axes' sizes; 0: unknown, row tiles taken on the
    local part). `rows_all`: the axes a scale over every row reduces over, when one axis covers `batch` and `seq`
    together (dp_cp). `seq_chunks`: parts each rank holds along S (2 under CP's load-balanced order)."""

    B: int
    S: int
    C: int
    batch: tuple = ()
    seq: tuple = ()
    cols: tuple = ()
    seq_global: int | None = None
    cols_global: int | None = None
    rows_all: tuple | None = None
    seq_chunks: int = 1


@dataclass(frozen=True)
class BlockPlan:
    """How one operand's scales fall: row and column block lengths (0: the whole dimension; a whole-row block is one
    scale per sequence when `per_seq`, else one over every row), the (key, size) axes its amaxes are max-reduced
    over, and how many amaxes this rank takes."""

    rows: int
    cols: int
    axes: tuple
    amaxes: int
    per_seq: bool


def _active(axes) -> list:
    """The axes (key, size) that split anything (size > 1), as the runtime's `Axis.active`."""
    return [a for a in axes if a[1] > 1]


def _whole(block: int | None, local: int, axes, global_len: int | None) -> bool:
    """Whether a block of `block` spans the whole dimension (`local` long here, split over `axes`)."""
    if global_len is None:
        global_len = local * prod(a[1] for a in _active(axes))
    return block is None or (global_len > 0 and block >= global_len)


def block_plan(op: Operand, block: tuple, strict: bool = False) -> BlockPlan:
    """The scale blocks of `op` cast in `block` (rows, cols). A block spans, along each dimension, the whole of it
    (None, or a block at least as long as the global dimension) — reduced over the axes splitting it — or tiles,
    which must lie within one rank's part (`strict`: else a ValueError, the runtime's check) and need no reduction."""
    br, bc = block
    axes: list = []
    per_seq = br is not None  # tiles or lines of rows: each sequence its own
    if br is None:  # one scale over every row of every sequence
        br = 0
        axes += _active(op.rows_all) if op.rows_all is not None else [*_active(op.batch), *_active(op.seq)]
    elif _whole(br, op.S, op.seq, op.seq_global):  # a tile as long as the sequence: one scale per sequence
        br = 0
        axes += _active(op.seq)
    elif strict and br > 1 and _active(op.seq) and op.seq_global != 0 and (op.S // op.seq_chunks) % br:
        raise ValueError(f"FP8 {br}-row tiles cut across ranks: each rank's {op.S} rows (in {op.seq_chunks} part(s)) "
                         f"are not a multiple of {br}")
    if _whole(bc, op.C, op.cols, op.cols_global):
        bc = 0
        axes += _active(op.cols)
    elif strict and _active(op.cols) and op.C % bc:
        raise ValueError(f"FP8 {bc}-column tiles cut across ranks: each rank holds {op.C} columns, not a multiple "
                         f"of {bc}")
    rows = op.B * ceil(op.S / br) if br else op.B if per_seq else 1
    return BlockPlan(br, bc, tuple(axes), rows * (ceil(op.C / bc) if bc else 1), per_seq)


def scale_plan(op: Operand, block: tuple) -> tuple[int, list]:
    """(amaxes this rank takes, [(axis, size)] they are max-reduced over) for `op` cast in `block`."""
    plan = block_plan(op, block)
    return plan.amaxes, list(plan.axes)


def amax_reductions(items: list[tuple[Operand, tuple]],
                    tiles: list[tuple[int, list]] = ()) -> list[tuple[str, int, int]]:
    """The all-reduces one `quantize_all` call of (operand, block) items issues: [(axis, group size, bytes)].
    Or, given `tiles` instead: the call's routed-expert token-tile buffers (`fp8.scaling.TokenTiles`), (amaxes,
    [(axis, size)]) each, which travel together in their own all-reduce (`TILE_AMAX_TAG`)."""
    groups: dict[tuple, list] = {}
    for n, axes in [scale_plan(op, block) for op, block in items] + [(n, _active(axes)) for n, axes in tiles]:
        if axes:
            g = groups.setdefault(tuple(axes), [0])
            g[0] += n
    return [(name, size, n * AMAX_BYTES) for axes, (n,) in groups.items() for name, size in axes]


TILES_TAG = "fp8_positions"
"""Ledger tag of the routed experts' position exchange in training (`expert_parallel.positions`), where their token
tiles span ranks (`rules.validation.fp8_expert_tiles_split`)."""


TILE_AMAX_TAG = "fp8_tiles"
"""Ledger tag of the routed experts' token-tile amax all-reduces (`fp8.scaling.TokenTiles`): their size follows the
routing (Σ_e ⌈t_e / tile⌉ rows), so they travel apart from the fixed-size `fp8_amax` ones."""


def planned_token_tiles(rows: int, dp: int, cp: int, ep: int, sp: int, micro_batch: int, seq_len: int, topk: int,
                        experts: int, tile: int) -> int:
    """Tiles the plan (and `simulate`) counts in a routed-expert group's buffer (`fp8.scaling.TokenTiles.count`):
    `rows`, the rows one rank's `experts` receive per MoE layer and microbatch, over the ranks its all-reduce spans
    (dp·cp/ep of edp, × `sp`: tp under SP), each expert's last tile part-filled (Σ_e ⌈t_e/tile⌉ < rows/tile +
    experts), at most `token_tile_bound` of the single device's microbatch."""
    group_rows = rows * dp * cp // ep * sp
    bound = token_tile_bound(micro_batch * dp * seq_len, topk, experts, tile)
    return min(bound, -(-group_rows // tile) + experts)


def token_tile_bound(tokens: int, topk: int, experts: int, tile: int) -> int:
    """The most `tile`-row tiles `experts` routed experts' rows can fill in the single device's microbatch of `tokens`
    tokens routed top-`topk` (dropless): Σ_e ⌈t_e / tile⌉ with every t_e ≤ tokens (a token picks an expert once) and
    Σ_e t_e ≤ tokens · min(topk, experts). Since ⌈t/tile⌉ ≤ (t + tile − 1) / tile, the sum is at most
    ⌊(tokens · min(topk, experts) + experts · (tile − 1)) / tile⌋, and at most experts · ⌈tokens / tile⌉: the
    runtime's buffer never needs more rows (it takes the routing's own count, `TokenTiles.count`)."""
    rows = tokens * min(topk, experts)
    return min(experts * ceil(tokens / tile), (rows + experts * (tile - 1)) // tile)
