"""FP8 scale blocks and the amax reductions they cost, torch-free, so the planner counts what `shardwise.fp8` does.

A recipe casts six operands (`CASTS`: the forward's x and W, the input gradient's g and W, the weight gradient's g
and x), each with scale blocks (rows, cols) of its 2-D matrix: None spans the whole dimension, 1 one line
(`shardwise.fp8.recipes` builds its casts from the same blocks). `scale_plan` mirrors `fp8.scaling._plan` and
`local_amax`: how many amaxes an operand takes and over which axes they are max-reduced; `amax_reductions` mirrors
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
AMAX_TAG = "fp8_amax"


@dataclass(frozen=True)
class Operand:
    """An operand [B, S, C] on one rank and the axes splitting it: each axis a (name, size), as `fp8.scaling.Layout`
    (`seq_global` / `cols_global` None: local × the axes' sizes; `seq_global` 0: row tiles taken locally)."""

    B: int
    S: int
    C: int
    batch: tuple = ()
    seq: tuple = ()
    cols: tuple = ()
    seq_global: int | None = None
    cols_global: int | None = None
    rows_all: tuple | None = None


def _active(axes) -> list:
    """The axes (name, size) that split anything (size > 1), as the runtime's `Axis.active`."""
    return [a for a in axes if a[1] > 1]


def _whole(block: int | None, local: int, axes, global_len: int | None) -> bool:
    if global_len is None:
        global_len = local * prod(a[1] for a in _active(axes))
    return block is None or (global_len > 0 and block >= global_len)


def scale_plan(op: Operand, block: tuple) -> tuple[int, list]:
    """(amaxes this rank takes, [(axis, size)] they are max-reduced over) for `op` cast in `block`."""
    br, bc = block
    axes: list = []
    per_seq = br is not None
    if br is None:
        br = 0
        axes += _active(op.rows_all) if op.rows_all is not None else [*_active(op.batch), *_active(op.seq)]
    elif _whole(br, op.S, op.seq, op.seq_global):
        br = 0
        axes += _active(op.seq)
    if _whole(bc, op.C, op.cols, op.cols_global):
        n_cols = 1
        axes += _active(op.cols)
    else:
        n_cols = ceil(op.C / bc)
    rows = op.B * ceil(op.S / br) if br else op.B if per_seq else 1
    return rows * n_cols, axes


def amax_reductions(items: list[tuple[Operand, tuple]]) -> list[tuple[str, int, int]]:
    """The all-reduces one `quantize_all` call of (operand, block) items issues: [(axis, group size, bytes)]."""
    groups: dict[tuple, list] = {}
    for op, block in items:
        n, axes = scale_plan(op, block)
        if axes:
            g = groups.setdefault(tuple(axes), [0])
            g[0] += n
    return [(name, size, n * AMAX_BYTES) for axes, (n,) in groups.items() for name, size in axes]
