"""The FP8 linear layer: one autograd Function for the forward GEMM and the two backward GEMMs, each operand cast
as the recipe states, its scales over the logical tensor (`scaling`).

forward: y = x Wᵀ (+ b) on FP8 x and W / backward: dx = g W and dW = gᵀ x on FP8 operands (recast from the
high-precision x, W and g saved or received, as torchao's Float8Linear does), db = Σ g in high precision.

A GEMM whose operands are both tensorwise- or rowwise-scaled along the contraction runs `torch._scaled_mm` where it
runs (CPU in torch ≥ 2.10, CUDA sm89+); every other GEMM (blockwise, MX) is emulated: dequantise, fp32 matmul.
Several linears that share a layout (a MoE block's local experts) run as one group, so their amax reductions travel
in one all-reduce per cast.

A projection replicated over tp that feeds per-rank heads (`Fp8Config.grad_sum`) receives a partial output gradient
on each rank; its g is all-reduced over tp before the backward casts (`fp8_grad`), so each rank computes the whole dW
(no later tp sum) and the whole dx, which only the axis' first rank hands back: the region entry (f, or SP's
reduce-scatter) sums the input gradients over tp, and the others' zeros add nothing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import comm
from ..rules.fp8 import GRAD_TAG
from .recipes import Cast, Recipe, scaled_mm_kind
from .scaling import Layout, Quantized, as3d, quantize_all
from .wire import held


@dataclass(frozen=True)
class LinearLayout:
    """How a linear's x [tokens, in], W [out, in] and g [tokens, out] are split over ranks: the tokens (sequences over
    `batch`, rows within one over `seq`), W's out rows over `out` and its in columns over `in_`."""

    batch: tuple = ()
    seq: tuple = ()
    seq_global: int | None = None
    seq_chunks: int = 1
    in_: tuple = ()
    in_global: int | None = None
    out: tuple = ()
    out_global: int | None = None
    rows_all: tuple | None = None

    def x(self) -> Layout:
        return Layout(self.batch, self.seq, self.in_, self.seq_global, self.in_global, self.seq_chunks, self.rows_all)

    def w(self) -> Layout:
        return Layout((), self.out, self.in_, self.out_global, self.in_global)

    def g(self) -> Layout:
        return Layout(self.batch, self.seq, self.out, self.seq_global, self.out_global, self.seq_chunks, self.rows_all)


@dataclass(frozen=True)
class Fp8Config:
    """What an FP8 layer needs: the recipe and its operands' layout. `grad_sum`: the axis over which the layer's
    output gradient arrives as per-rank partial sums (a projection replicated over tp whose output feeds each rank's
    own heads: MLA's down-projections, KDA's gate down-projections), summed before the backward GEMMs cast it."""

    recipe: Recipe
    layout: LinearLayout = LinearLayout()
    grad_sum: object = None
    rows: object = None
    """Routed experts: their rows' single-device positions (`expert_parallel.positions.ExpertRows`), where asked."""
    tiles: object = None
    """Routed experts whose token tiles span ranks: their `scaling.TokenTiles`, which the weight gradient's
    token-tiled casts of g and x take (`fp8.experts`)."""


def _tiled(lay: Layout, cfg: Fp8Config, j: int, role: str) -> Layout:
    """`lay` of linear j's operand `role` in a weight-gradient cast: at its rows' global tiles where `cfg` has them."""
    return lay if cfg.tiles is None else dataclasses.replace(lay, tiles=(cfg.tiles, j, role))


def _matrix(q: Quantized, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, compact scale) of a quantised [B, S, C] as a 2-D [B·S, C] matrix (or its transpose); the compact scale
    is what `torch._scaled_mm` takes where the blocks are lines or whole (one per row, one per sequence's rows)."""
    B, S, C = q.data.shape
    data = q.data.reshape(B * S, C)
    scale = q.scale.expand(B, -1, -1) if q.blocks[0] == 1 else q.scale  # per row: one scale per row of every sequence
    compact = scale.reshape(-1, q.scale.shape[-1])
    return (data.t(), compact.t()) if transpose else (data, compact)


def _dequantized(q: Quantized, transpose: bool = False) -> torch.Tensor:
    """The fp32 values of a quantised [B, S, C] as a 2-D [B·S, C] matrix (or its transpose): data / scale."""
    B, S, C = q.data.shape
    m = (q.data.float() / q.scale_bcast()).reshape(B * S, C)
    return m.t() if transpose else m


def use_scaled_mm(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 GEMMs on `device`."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def gemm(a: Quantized, ta: bool, ca: Cast, b: Quantized, tb: bool, cb: Cast) -> torch.Tensor:
    """A Bᵀ in fp32, A and B the quantised operands as 2-D matrices (transposed where asked), both scaled along
    their columns (the contraction)."""
    kind = scaled_mm_kind(ca, cb, ta, tb)
    if kind is not None and use_scaled_mm(a.data.device):
        da, sa = _matrix(a, ta)
        db, sb = _matrix(b, tb)
        if da.shape[0] and db.shape[0] and da.shape[1] and (
                da.device.type == "cpu" or all(n % 16 == 0 for n in (*da.shape, db.shape[0]))):
            if kind == "tensor":
                ia, ib = sa.reshape(()).reciprocal(), sb.reshape(()).reciprocal()
            else:
                ia, ib = sa.reshape(-1, 1).reciprocal(), sb.reshape(1, -1).reciprocal()
            return torch._scaled_mm(da.contiguous(), db.contiguous().t(), scale_a=ia, scale_b=ib,
                                    out_dtype=torch.float32)
    return emulated_gemm(a, ta, b, tb)


def emulated_gemm(a: Quantized, ta: bool, b: Quantized, tb: bool) -> torch.Tensor:
    """`gemm` without `torch._scaled_mm`: dequantise both, fp32 matmul (what the tests hold `gemm` equal to)."""
    return _dequantized(a, ta) @ _dequantized(b, tb).t()


def fp8_weight_grads(r: Recipe, qg_w, qx_w, ws, bs, gs) -> list:
    """dW_i = g_iᵀ x_i over the tokens in FP8, db_i = Σ g_i: [dW_1, …, db_1, …] (the overlapped TP regions' too)."""
    dws = [gemm(qg, True, r.g_wgrad, qx, True, r.x_wgrad).to(w.dtype) for qg, qx, w in zip(qg_w, qx_w, ws)]
    return dws + [None if b is None else g.reshape(-1, g.shape[-1]).float().sum(0).to(b.dtype)
                  for b, g in zip(bs, gs)]


class _Fp8Linears(torch.autograd.Function):
    """forward: y_i = x_i W_iᵀ + b_i in FP8 for every i / backward: dx_i = g_i W_i and dW_i = g_iᵀ x_i in FP8, db_i
    = Σ g_i; all the group's amax reductions of one cast in one all-reduce."""

    @staticmethod
    def forward(ctx, cfg: Fp8Config, out_dtype, n: int, pre_x, store, *args):
        xs, ws, bs = args[:n], args[n:2 * n], args[2 * n:]
        r, lay = cfg.recipe, cfg.layout
        # an FP8 x that came over the wire (`wire.py`) also feeds dW where the recipe casts x alike there
        reuse = [q if q is not None and r.x_wgrad == r.x else None for q in pre_x]
        ctx.save_for_backward(*(x if q is None else q.data for x, q in zip(xs, reuse)))
        ctx.cfg, ctx.ws, ctx.bs, ctx.n, ctx.store = cfg, ws, bs, n, store
        ctx.xq = [None if q is None else (q.scale, q.blocks) for q in reuse]
        ctx.x_meta = [(x.shape, x.dtype) for x in xs]
        with torch.autocast(xs[0].device.type, enabled=False):
            pre_w = [held(w, r.w, lay.w()) for w in ws]
            qs = iter(quantize_all([(as3d(x), r.x, lay.x()) for x, q in zip(xs, pre_x) if q is None]
                                   + [(as3d(w), r.w, lay.w()) for w, q in zip(ws, pre_w) if q is None]))
            qxs = [q if q is not None else next(qs) for q in pre_x]
            qws = [q if q is not None else next(qs) for q in pre_w]
            ys = []
            for x, w, b, qx, qw in zip(xs, ws, bs, qxs, qws):
                y = gemm(qx, False, r.x, qw, False, r.w)
                if b is not None:
                    y = y + b.float()
                ys.append(y.reshape(*x.shape[:-1], w.shape[0]).to(out_dtype))
        return tuple(ys)

    @staticmethod
    def backward(ctx, *gs):
        saved, ws, bs, n, r, lay = ctx.saved_tensors, ctx.ws, ctx.bs, ctx.n, ctx.cfg.recipe, ctx.cfg.layout
        pre_x = [None if m is None else Quantized(d, *m) for d, m in zip(saved, ctx.xq)]
        gs = [g if g is not None else torch.zeros((*shape[:-1], w.shape[0]), dtype=dtype, device=w.device)
              for g, (shape, dtype), w in zip(gs, ctx.x_meta, ws)]
        axis = ctx.cfg.grad_sum
        if axis is not None:  # an FP8 cast of a partial sum is not the cast of the sum: cast the whole gradient
            gs = [comm.all_reduce(g.clone(memory_format=torch.contiguous_format), axis, tag=GRAD_TAG) for g in gs]
        pre_w = [held(w, r.w_dgrad, lay.w()) for w in ws]  # ZeRO-3's backward gather, in FP8
        defer = ctx.store is not None and ctx.store.capturing  # zero-bubble: dW runs at this microbatch's W action

        def cast(dgrad: bool, wgrad: bool) -> list:
            """The operands of dx = g W (dgrad) and dW = gᵀ x (wgrad), their amax reductions batched together."""
            items, g3 = [], [as3d(g) for g in gs]  # one view of g: where both casts are alike, one cast serves both
            if dgrad:
                items += [(g, r.g_dgrad, lay.g()) for g in g3]
                items += [(as3d(w), r.w_dgrad, lay.w()) for w, q in zip(ws, pre_w) if q is None]
            if wgrad:
                items += [(g, r.g_wgrad, _tiled(lay.g(), ctx.cfg, j, "g")) for j, g in enumerate(g3)]
                items += [(as3d(x), r.x_wgrad, _tiled(lay.x(), ctx.cfg, j, "x"))
                          for j, (x, q) in enumerate(zip(saved, pre_x)) if q is None]
            qs = iter(quantize_all(items))
            out = []
            if dgrad:
                out += [[next(qs) for _ in gs], [q if q is not None else next(qs) for q in pre_w]]
            if wgrad:
                out += [[next(qs) for _ in gs], [q if q is not None else next(qs) for q in pre_x]]
            return out

        def deferred() -> list:
            with torch.autocast(gs[0].device.type, enabled=False):
                return fp8_weight_grads(r, *cast(False, True), ws, bs, gs)

        with torch.autocast(gs[0].device.type, enabled=False):
            qg_d, qw_d, *wgrad = cast(True, not defer)
            if axis is not None and axis.rank:  # dx would be whole on every rank: the axis' first hands it back
                dxs = [torch.zeros(shape, dtype=dtype, device=w.device) for (shape, dtype), w in zip(ctx.x_meta, ws)]
            else:
                dxs = [gemm(qg, False, r.g_dgrad, qw, True, r.w_dgrad).reshape(shape).to(dtype)  # g W: over out
                       for qg, qw, (shape, dtype) in zip(qg_d, qw_d, ctx.x_meta)]
            if defer:
                ctx.store.defer([*ws, *bs], deferred)
                return (None, None, None, None, None, *dxs, *[None] * (2 * n))
            return (None, None, None, None, None, *dxs, *fp8_weight_grads(r, *wgrad, ws, bs, gs))


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an FP8 linear returns for input `x`: autocast's where it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def fp8_linears(cfg: Fp8Config, xs, ws, bs, store=None) -> tuple[torch.Tensor, ...]:
    """y_i = x_i W_iᵀ + b_i for a group of linears sharing `cfg`'s layout, in FP8. `store`: a split-backward
    pipeline stage's WeightGradStore, to which the backward hands the dW GEMMs while it captures."""
    pre_x = [held(x, cfg.recipe.x, cfg.layout.x()) for x in xs]  # gathered in FP8 (`wire.py`)
    return _Fp8Linears.apply(cfg, out_dtype(xs[0]), len(xs), pre_x, store, *xs, *ws, *bs)


def fp8_linear(cfg: Fp8Config, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               store=None) -> torch.Tensor:
    """F.linear(x, w, b) in FP8 under `cfg`."""
    return fp8_linears(cfg, [x], [w], [b], store)[0]


Fp8Linears = _Fp8Linears
"""The autograd Function, by a public name: verify's FP8 replay wraps its forward and backward (verify/fp8_replay.py)."""
