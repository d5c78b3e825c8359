"""Dynamic FP8 scales of sharded tensors: each scale is the one the single device computes on the logical tensor.

An operand is held as [B, S, C]: B sequences (1 for a weight or an expert's rows), S rows per sequence (tokens, or a
weight's `out` rows), C columns. A scale block spans, along each dimension, either the whole dimension (block None,
or a block at least as long as the global dimension) or tiles of a fixed length. Where a whole dimension is split
over ranks (TP's features, SP/CP's sequence, dp's batch, edp's expert rows) no rank holds the rows the scale covers:
each rank takes the amax of its part and the parts are max-reduced over the axes that split the dimension — an
extra all-reduce, tagged `fp8_amax` in the ledger, one per GEMM operand group (the amaxes of several tensors that
reduce over the same axes travel together). Tiles must lie within one rank's part (checked), so they need none —
but for the routed experts' token tiles where an expert's rows span ranks: those are taken at the rows' single-device
positions, their amaxes max-reduced in a fixed-size buffer (`TokenTiles`).

The casts follow torchao 0.18 (`torchao.float8.float8_utils`): scale = finfo.max / clamp(amax, 1e-12) computed in
float64 then fp32, optionally rounded down to a power of two; x·scale saturated to ±finfo.max, then cast. MX scales
are e8m0 powers of two 2^⌈log2(amax / max)⌉ (torchao's RCEIL, cuBLAS's rule: OCP's FLOOR rule saturates a block whose
top passes 1.75·2^k at 448·2^(k−8)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import comm, host
from ..rules import fp8 as fp8_rules
from .recipes import Cast

EPS = 1e-12
AMAX_TAG = fp8_rules.AMAX_TAG


@dataclass(frozen=True)
class Layout:
    """How an operand [B, S, C] is split over ranks. `batch`, `seq`, `cols`: the axes splitting each dimension.
    `seq_global`, `cols_global`: global lengths (None: the local length times the splitting axes' sizes; 0: unknown,
    then row tiles are taken on the local part as they are).
    `seq_chunks`: parts each rank holds along S (2 under CP's load-balanced order), for the tile alignment check."""

    batch: tuple = ()
    seq: tuple = ()
    cols: tuple = ()
    seq_global: int | None = None
    cols_global: int | None = None
    seq_chunks: int = 1
    rows_all: tuple | None = None
    """The axes a scale over every row reduces over, when one axis covers `batch` and `seq` together (dp_cp)."""
    tiles: tuple | None = None
    """Routed experts whose token tiles span ranks: (`TokenTiles`, local expert j, operand role 'x' or 'g'); a cast
    tiling rows takes its tiles at the rows' single-device positions (`quantize_all`)."""


class TokenTiles:
    """A routed expert group's rows tiled at their single-device positions: where an expert's rows lie on several
    ranks (SP's tp, cp, ep < dp) or in another order, a cast in (tile × 1) blocks along the tokens (blockwise's and
    MX's weight-gradient operands) takes each row's tile as `position // tile` within its logical expert. Every
    local expert's tiles are numbered in one buffer (expert j's from Σ_{j'<j} ⌈totals/tile⌉), whose per-(tile,
    column) amaxes are max-reduced over `axes` (the ranks holding rows of the same experts: edp, and tp under SP), in
    their own all-reduce (tag `fp8_tiles`). The buffer has the routing's Σ_e ⌈totals/tile⌉ rows (`count`, one host
    read: `totals` are global, so every rank of the group agrees). A fixed size would have to be the bound
    (`rules.fp8.token_tile_bound`: every token on the local experts), E / min(k, E_local) times the mean: 32× for
    DeepSeek-V3 at ep256 (its best 2,048-GPU plan: 223 GB of edp traffic a step and 13.7 s, against 19.3 GB and
    4.8 s with the routing's count; tensorwise 12.8 GB and 4.5 s)."""

    def __init__(self, position: torch.Tensor, counts: list[int], totals: torch.Tensor, tokens: int, topk: int,
                 axes: tuple):
        self.counts, self.totals, self.tokens, self.topk, self.axes = list(counts), totals, tokens, topk, tuple(axes)
        self.position = list(position.split(self.counts))
        self._ids: dict[int, list] = {}
        self._count: dict[int, int] = {}

    def count(self, tile: int) -> int:
        """Rows of the group's buffer: its local experts' tiles, Σ_e ⌈totals_e / tile⌉ (a host read, once per tile)."""
        if tile not in self._count:
            n = int(host.read(((self.totals + tile - 1) // tile).sum(), "fp8 token tiles"))
            bound = fp8_rules.token_tile_bound(self.tokens, self.topk, len(self.counts), tile)
            if n > bound:
                raise RuntimeError(f"fp8 token tiles: {n} tiles of {tile} rows for {len(self.counts)} experts, past "
                                   f"the bound {bound} of {self.tokens} tokens routed top-{self.topk}")
            self._count[tile] = n
        return self._count[tile]

    def ids(self, tile: int, j: int) -> torch.Tensor:
        """Local expert j's rows' tile indices in the group's buffer."""
        if tile not in self._ids:
            n = (self.totals + tile - 1) // tile
            first = torch.cumsum(n, 0) - n
            self._ids[tile] = [first[i] + p // tile for i, p in enumerate(self.position)]
        return self._ids[tile][j]


@dataclass
class Quantized:
    """An FP8 operand [B, S, C] and its fp32 scale in compact block form [B', nS, nC] (dequantised = data / scale)."""

    data: torch.Tensor
    scale: torch.Tensor
    blocks: tuple[int, int] = field(default=(0, 0))
    rows: torch.Tensor | None = None
    """Token tiles at the rows' single-device positions (`TokenTiles`): each row's tile, `scale` being [tiles, C] —
    held compact, not per element (a full fp32 copy of the operand per tiled cast until its GEMM)."""

    def scale_full(self) -> torch.Tensor:
        """The scale of every element, [B, S, C]."""
        if self.rows is not None:
            return self.scale.index_select(0, self.rows).view(self.data.shape)
        B, S, C = self.data.shape
        bs, bc = self.blocks
        s = self.scale.expand(B, -1, -1) if self.scale.shape[0] == 1 else self.scale
        s = s.repeat_interleave(bs, 1)[:, :S] if bs > 1 else s.expand(-1, S, -1)
        return s.repeat_interleave(bc, 2)[:, :, :C] if bc > 1 else s.expand(-1, -1, C)

    def scale_bcast(self) -> torch.Tensor:
        """The scale in a shape that broadcasts over the data [B, S, C] (`scale_full` without materialising tiles
        where every block is a line or whole)."""
        bs, bc = self.blocks
        return self.scale_full() if bs > 1 or bc > 1 or self.rows is not None else self.scale

    def dequantize(self) -> torch.Tensor:
        return self.data.float() / self.scale_full()


def _pairs(axes) -> tuple:
    """Mesh axes as `rules.fp8`'s (key, size) pairs, the Axis itself the key."""
    return tuple((a, a.size) for a in axes if a is not None)


def block_plan(t: torch.Tensor, cast: Cast, lay: Layout):
    """(row block, col block, axes to reduce over) of casting `t` [B, S, C] as `cast` under `lay`: block 0 = whole.
    The plan is `rules.fp8.block_plan`'s (the planner counts the same), tiles checked to lie within a rank's part."""
    op = fp8_rules.Operand(*t.shape, _pairs(lay.batch), _pairs(lay.seq), _pairs(lay.cols), lay.seq_global,
                           lay.cols_global, None if lay.rows_all is None else _pairs(lay.rows_all), lay.seq_chunks)
    plan = fp8_rules.block_plan(op, cast.block, strict=True)
    return plan.rows, plan.cols, [a for a, _ in plan.axes]


def local_amax(t: torch.Tensor, cast: Cast, br: int, bc: int) -> torch.Tensor:
    """amax of |t| [B, S, C] per scale block: [1 or B, nS, nC] (a whole-dim block is 1 long; B is kept only when
    the rows are tiled or per row, i.e. a scale never spans two sequences unless it spans all rows)."""
    a = t.detach().abs().float()
    B, S, C = a.shape
    per_seq = cast.block[0] is not None  # tiles or lines of rows: each sequence its own
    if not br and not bc and not per_seq:  # one scale over the tensor: one reduction
        return a.amax((0, 1, 2), keepdim=True) if a.numel() else a.new_zeros(1, 1, 1)
    if bc > 1:  # (a 1-wide block's amax is the element itself)
        pad = -C % bc
        a = torch.nn.functional.pad(a, (0, pad)) if pad else a
        a = a.view(B, S, -1, bc).amax(-1) if a.numel() else a.new_zeros(B, S, (C + pad) // bc)
    elif not bc:
        a = a.amax(-1, keepdim=True) if a.numel() else a.new_zeros(B, S, 1)
    if br > 1:
        pad = -S % br
        a = torch.nn.functional.pad(a, (0, 0, 0, pad)) if pad else a
        a = a.view(B, -1, br, a.shape[-1]).amax(2) if a.numel() else a.new_zeros(B, (S + pad) // br, a.shape[-1])
    elif not br and per_seq:  # a whole-sequence block (br ≥ the sequence): one per sequence
        a = a.amax(1, keepdim=True) if a.numel() else a.new_zeros(B, 1, a.shape[-1])
    elif not br:
        a = a.amax((0, 1), keepdim=True) if a.numel() else a.new_zeros(1, 1, a.shape[-1])
    return a


def to_scale(amax: torch.Tensor, cast: Cast) -> torch.Tensor:
    """The multiplier that maps a block of absolute maximum `amax` into `cast.dtype`'s range.

    MX (e8m0) is torchao 0.18's RCEIL (`mx_tensor._to_mx_rceil`, cuBLAS's rule): the e8m0 exponent
    e = clamp(⌈log2(amax / max)⌉, −127, 127) in fp32, the multiplier 2^−e, so the block's top lands in (max/2, max]
    and nothing saturates. As torchao: e = −127 (zero or tiny amax, the codes all flush to 0) multiplies by 1,
    an infinite amax by 2^−127, a NaN amax gives NaN."""
    if cast.e8m0:
        descale = amax.float() / torch.finfo(cast.dtype).max
        exp = torch.ceil(torch.log2(descale)).clamp(-127, 127)
        scale = torch.where(exp == -127, 1.0, torch.exp2(-exp))
        return torch.where(descale.isinf(), 2.0 ** -127, torch.where(descale.isnan(), descale, scale))
    scale = (torch.finfo(cast.dtype).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if cast.pow2 else scale


def reduce_amaxes(amaxes: list[torch.Tensor], axes_per: list[list]) -> list[torch.Tensor]:
    """Max-reduce each amax over its axes; amaxes reducing over the same axes share one all-reduce per axis."""
    return _max_reduce(amaxes, axes_per, AMAX_TAG)


def _max_reduce(amaxes: list[torch.Tensor], axes_per: list[list], tag: str) -> list[torch.Tensor]:
    """`reduce_amaxes` under ledger tag `tag` (the token tiles' buffers: `fp8_tiles`)."""
    out = list(amaxes)
    groups: dict[tuple, list[int]] = {}
    for i, axes in enumerate(axes_per):
        if axes:
            groups.setdefault(tuple(a.name for a in axes), []).append(i)
    for names, idx in groups.items():
        flat = torch.cat([out[i].reshape(-1) for i in idx])
        for axis in axes_per[idx[0]]:
            flat = comm.all_reduce(flat, axis, "max", tag=tag)
        for i, part in zip(idx, flat.split([out[i].numel() for i in idx])):
            out[i] = part.view_as(out[i])
    return out


def _firsts(items: list) -> list[int]:
    """For each item, the index of the first item casting the same tensor object as the same cast under an equal
    layout (its own index where none did)."""
    seen: dict = {}
    out = []
    for i, (t, cast, lay) in enumerate(items):
        earlier = seen.setdefault((id(t), cast), [])
        j = next((j for j in earlier if items[j][2] == lay), None)
        if j is None:
            earlier.append(i)
        out.append(i if j is None else j)
    return out


def quantize_all(items: list[tuple[torch.Tensor, Cast, Layout]]) -> list[Quantized]:
    """Cast every (tensor [B, S, C], cast, layout) to FP8, the amax reductions batched (`reduce_amaxes`). An item
    repeating an earlier one (tensorwise's g for dx and for dW) shares its cast; its amax still travels, so the
    all-reduces are the ones `rules.fp8` counts."""
    firsts = _firsts(items)
    tiled = [_token_tiled(c, lay) for _, c, lay in items]
    plans = [(0, 0, []) if tiled[i] else block_plan(t, c, lay) for i, (t, c, lay) in enumerate(items)]
    local = {j: None if tiled[j] else local_amax(items[j][0], items[j][1], *plans[j][:2]) for j in set(firsts)}
    buffers, buffer_axes = _tile_buffers(items, firsts, tiled)
    reduced = reduce_amaxes([local[j] for j in firsts if not tiled[j]],
                            [plans[i][2] for i, j in enumerate(firsts) if not tiled[j]])
    amaxes = iter(reduced)
    amax_of = [None if tiled[j] else next(amaxes) for j in firsts]
    buffers = dict(zip(buffers, _max_reduce(list(buffers.values()), buffer_axes, fp8_rules.TILE_AMAX_TAG)))
    out: list[Quantized] = []
    for i, ((t, cast, lay), (br, bc, _), amax) in enumerate(zip(items, plans, amax_of)):
        if firsts[i] != i:
            out.append(out[firsts[i]])
        elif tiled[i]:  # each row scaled by its global tile's amax: a scale per element
            tt, j, role = lay.tiles
            out.append(cast_with(t, to_scale(buffers[(id(tt), role, cast)], cast), (1, 1), cast,
                                 tt.ids(cast.block[0], j)))
        else:
            out.append(cast_with(t, to_scale(amax, cast), (br, bc), cast))
    return out


def _token_tiled(cast: Cast, lay: Layout) -> bool:
    """Whether `cast` of an operand under `lay` takes tiles at its rows' single-device positions (`TokenTiles`)."""
    br, bc = cast.block
    return lay.tiles is not None and br is not None and br > 1 and bc == 1


def _tile_buffers(items: list, firsts: list[int], tiled: list[bool]) -> tuple[dict, list]:
    """The local per-(global tile, column) amaxes of the token-tiled items, one fixed-size buffer per expert group,
    operand role and cast, and the axes each is max-reduced over."""
    buffers: dict[tuple, torch.Tensor] = {}
    axes: list = []
    for i, (t, cast, lay) in enumerate(items):
        if firsts[i] != i or not tiled[i]:
            continue
        tt, j, role = lay.tiles
        key = (id(tt), role, cast)
        if key not in buffers:
            buffers[key] = t.new_zeros((tt.count(cast.block[0]), t.shape[-1]), dtype=torch.float32)
            axes.append([a for a in tt.axes if a.active])
        a = t.detach().abs().float().reshape(-1, t.shape[-1])
        buffers[key].scatter_reduce_(0, tt.ids(cast.block[0], j)[:, None].expand_as(a), a, "amax")
    return buffers, axes


def cast_with(t: torch.Tensor, scale: torch.Tensor, blocks: tuple[int, int], cast: Cast,
              rows: torch.Tensor | None = None) -> Quantized:
    """`t` [B, S, C] cast to FP8 with scales fixed beforehand (compact, blocks (rows, cols); or `rows`: each row's
    tile of [tiles, C] scales): `quantize_all`'s cast, also what casts part of a tensor with the whole tensor's scale
    (`tensor_parallel/overlap.py`'s chunks)."""
    q = Quantized(t, scale, blocks, rows)
    big = torch.finfo(cast.dtype).max
    q.data = torch.mul(t.detach(), q.scale_bcast()).clamp_(-big, big).to(cast.dtype)
    return q


def as3d(t: torch.Tensor) -> torch.Tensor:
    """[..., S, C] as [B, S, C] (a 2-D matrix is one sequence)."""
    return t.unsqueeze(0) if t.dim() == 2 else t.reshape(math.prod(t.shape[:-2]), *t.shape[-2:])
