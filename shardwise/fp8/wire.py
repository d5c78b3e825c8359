"""`--fp8-all-gather`: ZeRO-3's parameter all-gathers and the SP all-gather of activations travel as FP8 bytes.

A gather carries exactly the FP8 operand the GEMM would have cast after a high-precision gather: each rank takes the
amax of its shard per scale block, the amaxes are max-reduced over the gather's axis and the axes the operand's scale
already spans (`scaling`'s `fp8_amax` all-reduce, one fp32 per scale block), every rank turns them into the same
scales, casts its shard with them, and the shards' FP8 bytes are all-gathered as uint8 (gloo has no float8 dtype)
under the tag `fp8`. Casting is elementwise once the scale is fixed, so the gathered bytes equal the cast of the
gathered tensor bit for bit. The receiver hangs the FP8 operand on the tensor (`_sw_fp8`); `linear.py` uses it instead
of casting, where the cast and layout are its own.

Exact only where one FP8 copy serves every GEMM reading the tensor:
* a weight feeds the forward (cast `w`) and the input gradient (`w_dgrad`): equal in tensorwise and blockwise
  (128×128 blocks serve W and Wᵀ), not in rowwise (per out row vs per in column) or mxfp8 (1×32 vs 32×1);
* a gathered activation feeds the forward (`x`) and the weight gradient (`x_wgrad`): equal in tensorwise only.
`TrainConfig` refuses the rest (`rules.validation.fp8_wire_problem`). The backward is unchanged: gradients
reduce-scatter in high precision. ZeRO-3 buckets whose every parameter is an FP8 linear's weight travel in FP8 (a
dense block's matrices); a bucket also holding a high-precision parameter (an MoE router) or expert weights travels
as before.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from . import scaling
from .recipes import Cast, Recipe
from .scaling import Layout, Quantized, as3d, local_amax, to_scale

WIRE_TAG = "fp8"
"""Ledger tag of an FP8 all-gather (`all_gather:fp8`): the FP8 bytes of this rank's shard."""


def weights_exact(r: Recipe) -> bool:
    """One FP8 copy of W feeds the forward and the input-gradient GEMM."""
    return r.w == r.w_dgrad


def activations_exact(r: Recipe) -> bool:
    """One FP8 copy of x feeds the forward and the weight-gradient GEMM."""
    return r.x == r.x_wgrad


def held(t: torch.Tensor, cast: Cast, layout: Layout) -> Quantized | None:
    """The FP8 form of `t` that came over the wire, when it is cast and scaled as `cast` under `layout`."""
    h = getattr(t, "_sw_fp8", None)
    return h[2] if h is not None and h[0] == cast and h[1] == layout else None


def _scale_axes(gather_axis, axes: list) -> list:
    """The axes a wire scale's amax reduces over: the gather's (the scale is the whole tensor's) and the operand's."""
    return [gather_axis, *axes]


def _cast(t: torch.Tensor, scale: torch.Tensor, cast: Cast) -> torch.Tensor:
    """`scaling.quantize_all`'s cast, element for element."""
    big = torch.finfo(cast.dtype).max
    return (t.float() * scale).clamp(-big, big).to(cast.dtype)


# ---------------------------------------------------------------- SP: the activations entering a column region
class _GatherFp8(torch.autograd.Function):
    """forward: all-gather of x along `dim` as FP8 bytes with one scale over the gathered tensor (tensorwise) /
    backward: reduce-scatter of dx along `dim` in high precision (the SP entry's)."""

    @staticmethod
    def forward(ctx, x, axis, dim, cast, layout, box):
        ctx.axis, ctx.dim = axis, dim
        t = as3d(x)
        br, bc, axes = scaling.block_plan(t, cast, layout)
        if br or bc:
            raise ValueError(f"an FP8 all-gather of activations needs one scale per tensor, not {cast.block}")
        [amax] = scaling.reduce_amaxes([local_amax(t, cast, 0, 0)], [_scale_axes(axis, axes)])
        scale = to_scale(amax, cast)
        part = _cast(t, scale, cast).view(torch.uint8).reshape(x.shape)
        full = comm.all_gather(part, axis, dim, tag=WIRE_TAG).view(cast.dtype)
        q = Quantized(as3d(full), scale, (0, 0))
        box.append(q)
        return q.dequantize().reshape(full.shape).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter(g, ctx.axis, ctx.dim), None, None, None, None, None


def gather_sequence(x: torch.Tensor, axis, dim: int, cfg) -> torch.Tensor:
    """SP's region entry under --fp8-all-gather: the gathered x, dequantised (what autograd and any other reader
    see), carrying the FP8 operand the region's FP8 linears (`cfg`, an Fp8Config) read instead of casting it."""
    if not axis.active:
        return x
    cast, layout, box = cfg.recipe.x, cfg.layout.x(), []
    y = _GatherFp8.apply(x, axis, dim, cast, layout, box)
    y._sw_fp8 = (cast, layout, box[0])
    return y


def install_activations(blocks, sequence_parallel: bool) -> int:
    """Mark each block's SP regions (attention, a dense MLP) whose input feeds FP8 linears with the config it is
    gathered under (`fp8_wire`, read by the region's entry hook); returns how many."""
    if not sequence_parallel:
        return 0
    count = 0
    for block in blocks:
        for part in (block.attention, block.feed_forward):
            if hasattr(part, "router"):  # MoE: no SP entry, each rank routes its own tokens
                continue
            cfg = next((m.fp8 for m in part.modules() if getattr(m, "fp8", None) is not None
                        and not hasattr(m, "n_local") and not m.fp8.layout.in_), None)
            if cfg is not None and activations_exact(cfg.recipe):
                part.fp8_wire = cfg
                count += 1
    return count


# ---------------------------------------------------------------- ZeRO-3: the weights of FP8 linears
def segment_amax(seg: torch.Tensor, lo: int, shape: tuple[int, int], cast: Cast, br: int, bc: int) -> torch.Tensor:
    """`local_amax` of a [rows, cols] weight of which this rank holds only the flat elements [lo, lo + len(seg)):
    [1, nS, nC], zero for the blocks it holds nothing of (a ZeRO shard cuts a weight anywhere)."""
    rows, cols = shape
    out = seg.new_zeros(1, -(-rows // br) if br else 1, -(-cols // bc) if bc else 1, dtype=torch.float32)
    n = seg.numel()
    if not n:
        return out
    if not br and not bc:
        return seg.detach().abs().amax().float().view(1, 1, 1)
    rb = br or rows
    r0 = lo // cols // rb * rb
    r1 = min(rows, -(-(-(-(lo + n) // cols)) // rb) * rb)
    buf = seg.new_zeros((r1 - r0) * cols, dtype=torch.float32)
    buf[lo - r0 * cols:lo - r0 * cols + n] = seg.detach().float()
    part = local_amax(buf.view(1, r1 - r0, cols), cast, br, bc)
    first = r0 // br if br else 0
    out[:, first:first + part.shape[1]] = part
    return out


def _segment_scales(scale: torch.Tensor, shape: tuple[int, int], br: int, bc: int, lo: int, n: int) -> torch.Tensor:
    """The scale of each flat element [lo, lo + n) of a [rows, cols] weight, from its compact [1, nS, nC] scales."""
    rows, cols = shape
    r0, r1 = lo // cols, -(-(lo + n) // cols)
    rows_idx = torch.arange(r0, r1, device=scale.device)
    s = scale[0][rows_idx // br if br else torch.zeros_like(rows_idx)]
    s = s.repeat_interleave(bc, 1)[:, :cols] if bc else s.expand(-1, cols)
    return s.reshape(-1)[lo - r0 * cols:lo - r0 * cols + n]


class WeightWire:
    """One ZeRO-3 bucket of FP8 linears' weights gathered as FP8: `items` are (param, offset, numel, cast, layout)
    of each weight in the bucket's flat buffer; `buf` the gathered bytes (0 bytes between uses, as the bucket's own
    buffer, which stays empty: the weights' high-precision values live only in the shards)."""

    def __init__(self, bucket, items: list[tuple]):
        self.items = items
        self.buf = torch.empty(bucket.padded, dtype=torch.uint8, device=bucket.flat.device)
        self.buf.untyped_storage().resize_(0)
        self.plans: list[tuple] = []

    def gathered(self) -> bool:
        return bool(self.buf.untyped_storage().nbytes())

    def start(self, b):
        """Scales of the whole weights (an amax all-reduce), this rank's shard cast with them, the async all-gather
        of its bytes: the work to wait on."""
        lo_s, per = b.axis.rank * b.per, b.per
        shard = b.shard.detach()
        amaxes, axes, self.plans = [], [], []
        for p, off, k, cast, layout in self.items:
            br, bc, tp_axes = scaling.block_plan(torch.empty(1, *p.shape, device="meta"), cast, layout)  # p: no storage
            lo, hi = max(off, lo_s), min(off + k, lo_s + per)
            seg = shard[lo - lo_s:max(lo, hi) - lo_s]
            amaxes.append(segment_amax(seg, lo - off, tuple(p.shape), cast, br, bc))
            axes.append(_scale_axes(b.axis, tp_axes))
            self.plans.append((br, bc, lo, max(lo, hi)))
        amaxes = scaling.reduce_amaxes(amaxes, axes)
        mine = torch.zeros(per, dtype=torch.uint8, device=shard.device)
        scales = []
        for (p, off, k, cast, _), (br, bc, lo, hi), amax in zip(self.items, self.plans, amaxes):
            scales.append(to_scale(amax, cast))
            if hi > lo:
                s = _segment_scales(scales[-1], tuple(p.shape), br, bc, lo - off, hi - lo)
                mine[lo - lo_s:hi - lo_s] = _cast(shard[lo - lo_s:hi - lo_s], s, cast).view(torch.uint8)
        self.scales = scales
        self.buf.untyped_storage().resize_(b.padded)
        return comm.all_gather_into_async(self.buf, mine, b.axis, tag=WIRE_TAG)

    def attach(self) -> None:
        """Hang each weight's FP8 operand on its parameter (what `linear.py` reads while the unit is held)."""
        for (p, off, k, cast, layout), (br, bc, _, _), scale in zip(self.items, self.plans, self.scales):
            data = self.buf[off:off + k].view(cast.dtype).view(1, *p.shape)
            p._sw_fp8 = (cast, layout, Quantized(data, scale, (br, bc)))

    def free(self) -> None:
        for p, *_ in self.items:
            p.__dict__.pop("_sw_fp8", None)
        self.buf.untyped_storage().resize_(0)


def install_weights(units, model) -> int:
    """Give every ZeRO-3 bucket (of `units`, a ParamUnits) that holds only FP8 linears' 2-D weights a `WeightWire`;
    returns how many buckets travel in FP8."""
    weights = {}
    for m in model.modules():
        cfg = getattr(m, "fp8", None)
        w = getattr(m, "weight", None)
        if cfg is not None and not hasattr(m, "n_local") and w is not None and w.dim() == 2 \
                and weights_exact(cfg.recipe):
            weights[id(w)] = (cfg.recipe.w, cfg.layout.w())
    count, seen = 0, set()
    for u in units.units:
        for b in u.buckets:
            if id(b) in seen:
                continue
            seen.add(id(b))
            if b.offsets and all(id(p) in weights for _, p, _, _ in b.offsets) and math.prod(b.flat.shape):
                b.fp8 = WeightWire(b, [(p, off, k, *weights[id(p)]) for _, p, off, k in b.offsets])
                count += 1
    return count
