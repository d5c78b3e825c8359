"""Sequence-parallel TP regions with their communication under the GEMMs (`--tp-overlap`).

Under SP a column-parallel region starts with an all-gather of the sequence and a row-parallel one ends with a
reduce-scatter, each waiting for the whole tensor before (or after) its GEMM. Here both are cut into `tp` chunks of
this rank's sequence shard: while the GEMM of the chunk in hand runs, the next chunk's collective is in flight
(asynchronous, through `comm`), in the forward and in the backward. Chunk i gathers sub-slice i of every rank's
shard, so its rows sit rank-major in the sequence; a GEMM treats rows independently, so the chunked forward equals
the whole one. Each chunk moves 1/tp of the tensor: the ledger's bytes per axis equal the non-overlapped run's, in
tp times more messages. Weight gradients use the whole gathered tensors, as without overlap.

Under --fp8 each chunk's GEMM is the recipe's FP8 GEMM (`fp8.linear.gemm`) on its rows, each operand scaled as the
plain FP8 linear scales the whole (`fp8.scaling.quantize_all`, one call per linear as there). A chunk's rows are
cast with the scales of the whole tensor: the operands the chunks gather (the column region's x, the row region's
output gradient) are scaled per row in rowwise, blockwise and mxfp8 (a chunk's rows carry their own scales), and
in tensorwise by one scale over every row, which is fixed before the first chunk's gather: this rank's shard's amax
max-reduced over tp and the axes the whole's scale spans (the same `fp8_amax` all-reduce, over tp in addition).
The operands the chunks do not gather (W, the row region's x, the column region's g, every weight-gradient operand)
are cast whole, as without overlap, and sliced by rows. The wire stays high precision (as plain --fp8).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import comm
from ..fp8.linear import fp8_weight_grads, gemm, out_dtype
from ..fp8.scaling import Layout, Quantized, as3d, cast_with, quantize_all
from ..rules.fp8 import GRAD_TAG
from .grad_store import weight_grads
from .fused import joined, split_weight_grads


def chunk_bounds(local_len: int, steps: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a sequence shard of `local_len` rows cut into `steps` (empty ones dropped)."""
    steps = max(1, min(steps, local_len))
    base, extra = divmod(local_len, steps)
    out, off = [], 0
    for i in range(steps):
        n = base + (i < extra)
        out.append((off, n))
        off += n
    return out


def _rows(full: torch.Tensor, t: int, off: int, n: int) -> torch.Tensor:
    """Rows of sub-slice [off, off+n) of every rank's shard of `full` [b, t·L, d], as one contiguous [t, b, n, d]."""
    b, s, d = full.shape
    return full.view(b, t, s // t, d)[:, :, off:off + n].permute(1, 0, 2, 3).contiguous()


def _put(full: torch.Tensor, t: int, off: int, rows: torch.Tensor) -> None:
    """Inverse of `_rows`: write rows [t, b, n, d] into `full` [b, t, L, d]."""
    full[:, :, off:off + rows.shape[2]] = rows.permute(1, 0, 2, 3)


def _gathered(x: torch.Tensor, axis, bounds):
    """Yield (offset, rows [t, b, n, d]) per chunk of `x` [b, L, d] gathered over `axis`, the next chunk's
    all-gather in flight while the caller computes on this one."""
    def start(off, n):
        piece = x[:, off:off + n].contiguous()
        out = piece.new_empty((axis.size, *piece.shape))
        return out, comm.all_gather_into_async(out.view(-1), piece.view(-1), axis)

    pending = start(*bounds[0])
    for i, (off, _) in enumerate(bounds):
        out, work = pending
        if i + 1 < len(bounds):
            pending = start(*bounds[i + 1])
        comm.wait(work, axis, "all_gather of an overlapped TP chunk")
        yield off, out


class _ReduceScatterChunks:
    """Reduce-scatters of row chunks [t, b, n, d], each started as soon as its GEMM is done; `finish` places
    this rank's sums into a [b, L, d] shard."""

    def __init__(self, axis):
        self.axis, self.pending = axis, []

    def start(self, off: int, rows: torch.Tensor) -> None:
        out = rows.new_empty(rows.shape[1:])
        self.pending.append((off, out, comm.reduce_scatter_into_async(out.view(-1), rows.view(-1), self.axis)))

    def finish(self, local_len: int) -> torch.Tensor:
        shard = None
        for off, out, work in self.pending:
            comm.wait(work, self.axis, "reduce_scatter of an overlapped TP chunk")
            if shard is None:
                shard = out.new_empty((out.shape[0], local_len, out.shape[2]))
            shard[:, off:off + out.shape[1]] = out
        return shard


def _column_gemm(rows: torch.Tensor, ws, bs, fused: bool) -> list[torch.Tensor]:
    """y_1, y_2, ... for one chunk: one GEMM on the joined weights (`fused`, the outputs its column blocks) or one
    per weight."""
    if fused and len(ws) > 1:
        y = F.linear(rows, joined(list(ws)), None if bs[0] is None else joined(list(bs)))
        return list(y.split([w.shape[0] for w in ws], dim=-1))
    return [F.linear(rows, w, b) for w, b in zip(ws, bs)]


class _GatherColumnFn(torch.autograd.Function):
    """forward: all-gather the sequence in tp chunks, each chunk's column GEMM(s) under the next chunk's
    gather / backward: dx = Σ dY_i W_i reduce-scattered in tp chunks, each chunk's reduce-scatter under the next
    chunk's GEMM, then the dW GEMMs (on the whole gathered input) under the last reduce-scatters."""

    @staticmethod
    def forward(ctx, x, axis, store, fused, *params):
        ws, bs = params[0::2], params[1::2]
        t, (bsz, local_len, h) = axis.size, x.shape
        bounds = chunk_bounds(local_len, t)
        x_full = x.new_empty((bsz, t, local_len, h))
        ys = None  # one tensor per projection, so an output kept by a later op (attention's v) keeps only itself
        for off, rows in _gathered(x, axis, bounds):
            _put(x_full, t, off, rows)
            outs = _column_gemm(rows, ws, bs, fused)
            if ys is None:
                ys = [o.new_empty((bsz, t, local_len, o.shape[-1])) for o in outs]
            for y, out in zip(ys, outs):
                _put(y, t, off, out)
        x_full = x_full.view(bsz, t * local_len, h)
        ctx.save_for_backward(x_full)
        ctx.axis, ctx.store, ctx.ws, ctx.bs, ctx.x_dtype, ctx.local_len = axis, store, ws, bs, x.dtype, local_len
        ctx.fused = fused and len(ws) > 1
        return tuple(y.view(bsz, t * local_len, -1) for y in ys)

    @staticmethod
    def backward(ctx, *gs):
        (x_full,), ws, axis = ctx.saved_tensors, ctx.ws, ctx.axis
        like = next(g for g in gs if g is not None)
        gs = [g if g is not None else like.new_zeros((*like.shape[:-1], w.shape[0])) for g, w in zip(gs, ws)]
        if ctx.fused:
            gs_, ws_ = [torch.cat(gs, dim=-1)], [joined(list(ws))]
        else:  # autograd's order for separate layers: the last projection's dx first
            gs_, ws_ = gs[::-1], ws[::-1]
        scatter = _ReduceScatterChunks(axis)
        for off, n in chunk_bounds(ctx.local_len, axis.size):
            dx = None
            for g, w in zip(gs_, ws_):
                part = (_rows(g, axis.size, off, n) @ w.to(g.dtype)).to(ctx.x_dtype)
                dx = part if dx is None else dx.add_(part)
            scatter.start(off, dx)
        grads: list = [None] * (2 * len(ws))
        capture = ctx.store is not None and ctx.store.capturing
        if ctx.fused and not capture:  # one dW GEMM for every projection
            grads = split_weight_grads(x_full, gs_[0], ws, ctx.bs)
        for i, gi in enumerate(gs):
            if capture:  # zero-bubble: dW runs later, at this microbatch's W action
                ctx.store.put(ws[i], ctx.bs[i], x_full, gi)
            elif not ctx.fused:
                grads[2 * i], grads[2 * i + 1] = weight_grads(x_full, gi, ws[i], ctx.bs[i])
        return (scatter.finish(ctx.local_len), None, None, None, *grads)


class _RowScatterFn(torch.autograd.Function):
    """forward: y = x Wᵀ reduce-scattered over the sequence in tp chunks, each chunk's reduce-scatter under the
    next chunk's GEMM / backward: dY all-gathered in tp chunks, each chunk's dx GEMM under the next chunk's
    gather, then dW on the whole gathered dY."""

    @staticmethod
    def forward(ctx, x, weight, axis, store):
        t, (bsz, s, _) = axis.size, x.shape
        local_len = s // t
        scatter = _ReduceScatterChunks(axis)
        for off, n in chunk_bounds(local_len, t):
            scatter.start(off, F.linear(_rows(x, t, off, n), weight).contiguous())
        ctx.save_for_backward(x)
        ctx.weight, ctx.axis, ctx.store, ctx.local_len = weight, axis, store, local_len
        return scatter.finish(local_len)

    @staticmethod
    def backward(ctx, g):
        (x,), w, axis = ctx.saved_tensors, ctx.weight, ctx.axis
        t, (bsz, s, k) = axis.size, x.shape
        g = g.contiguous()
        wg = w.to(g.dtype)
        dx = x.new_empty((bsz, t, ctx.local_len, k))
        g_full = g.new_empty((bsz, t, ctx.local_len, g.shape[-1]))
        for off, rows in _gathered(g, axis, chunk_bounds(ctx.local_len, t)):
            _put(g_full, t, off, rows)
            _put(dx, t, off, (rows @ wg).to(x.dtype))
        g_full = g_full.view(bsz, s, -1)
        if ctx.store is not None and ctx.store.capturing:
            ctx.store.put(w, None, x, g_full)
            return dx.view_as(x), None, None, None
        dw, _ = weight_grads(x, g_full, w, None)
        return dx.view_as(x), dw, None, None


# ---------------------------------------------------------------- --fp8: the chunks' GEMMs in FP8
def shard_layout(lay: Layout, axis) -> Layout:
    """The layout of this rank's SP shard of an operand whose rows a region gathers over `axis`: its rows split over
    `axis` as well, so a scale over every row max-reduces over it too (the gathered tensor's scale)."""
    rows = lay.rows_all if lay.rows_all is not None else (*lay.batch, *lay.seq)
    return dataclasses.replace(lay, seq=(*lay.seq, axis), rows_all=(*rows, axis), seq_global=None)


def _whole_scale(x: torch.Tensor, cast, lay: Layout, axis, others: list) -> tuple[Quantized | None, list]:
    """One linear's `quantize_all` call before its chunks: `others` (operands cast whole) and, where `cast` scales
    every row of the gathered operand with one scale (tensorwise), this rank's shard `x` under `shard_layout`, whose
    scale is then the whole's. (the shard's Quantized or None, the others' Quantized)."""
    if cast.block[0] is not None:  # per row: each chunk's rows carry their own scales
        return None, quantize_all(others)
    q, *rest = quantize_all([(as3d(x), cast, shard_layout(lay, axis)), *others])
    return q, rest


def _cast_rows(rows: torch.Tensor, cast, lay: Layout, whole: Quantized | None) -> Quantized:
    """A chunk's rows [t·b, n, d] cast as the whole operand is: with the whole's scale (`whole`), else per row."""
    if whole is not None:
        return cast_with(rows, whole.scale, whole.blocks, cast)
    return quantize_all([(rows, cast, Layout(cols=lay.cols, cols_global=lay.cols_global, seq_global=0))])[0]


def _rows_q(q: Quantized, t: int, off: int, n: int) -> Quantized:
    """`_rows` of a quantised [b, t·L, d] with its scales, as [t·b, n, d] (scales per row, or one for every row)."""
    B, S, _ = q.data.shape
    data = _rows(q.data, t, off, n)
    s = q.scale
    if s.shape[:2] == (B, S):
        s = _rows(s, t, off, n).reshape(-1, n, s.shape[-1])
    elif s.shape[:2] != (1, 1):
        raise ValueError(f"an overlapped FP8 chunk needs scales per row or over all rows, not blocks {q.blocks}")
    return Quantized(data.reshape(-1, n, data.shape[-1]), s, q.blocks)


def _zero_bubble(store) -> bool:
    return store is not None and store.capturing


class _GatherColumnFp8Fn(torch.autograd.Function):
    """`_GatherColumnFn` in FP8: each projection's forward GEMM per gathered chunk on the chunk's FP8 rows / backward:
    the plain FP8 linear's casts of the whole g, W and gathered x, dx per chunk from g's rows (reduce-scattered as
    they are done), dW whole. Each projection is its own FP8 linear (scales per weight), fused or not, as the plain
    FP8 region runs them."""

    @staticmethod
    def forward(ctx, x, axis, store, cfgs, dtype, *params):
        ws, bs = params[0::2], params[1::2]
        t, (bsz, local_len, h) = axis.size, x.shape
        with torch.autocast(x.device.type, enabled=False):
            wholes, qws = [], []
            for cfg, w in zip(cfgs, ws):  # one quantize_all per linear, as the plain FP8 linears
                r, lay = cfg.recipe, cfg.layout
                whole, (qw,) = _whole_scale(x, r.x, lay.x(), axis, [(as3d(w), r.w, lay.w())])
                wholes.append(whole)
                qws.append(qw)
            x_full = x.new_empty((bsz, t, local_len, h))
            ys = None
            for off, rows in _gathered(x, axis, chunk_bounds(local_len, t)):
                _put(x_full, t, off, rows)
                n, flat, cast_of = rows.shape[2], rows.reshape(-1, rows.shape[2], h), []
                outs = []
                for cfg, w, b, whole, qw in zip(cfgs, ws, bs, wholes, qws):
                    r, lay = cfg.recipe, cfg.layout.x()
                    key = (r.x, lay, whole)
                    qx = next((q for k, q in cast_of if k[0] == r.x and k[1] == lay and k[2] is whole), None)
                    if qx is None:  # projections casting their common x alike: once per chunk
                        qx = _cast_rows(flat, r.x, lay, whole)
                        cast_of.append((key, qx))
                    y = gemm(qx, False, r.x, qw, False, r.w)
                    if b is not None:
                        y = y + b.float()
                    outs.append(y.view(t, bsz, n, -1).to(dtype))
                if ys is None:
                    ys = [o.new_empty((bsz, t, local_len, o.shape[-1])) for o in outs]
                for y, out in zip(ys, outs):
                    _put(y, t, off, out)
        ctx.save_for_backward(x_full.view(bsz, t * local_len, h))
        ctx.axis, ctx.store, ctx.cfgs, ctx.ws, ctx.bs, ctx.local_len = axis, store, cfgs, ws, bs, local_len
        return tuple(y.view(bsz, t * local_len, -1) for y in ys)

    @staticmethod
    def backward(ctx, *gs):
        (x_full,), ws, bs, axis, cfgs = ctx.saved_tensors, ctx.ws, ctx.bs, ctx.axis, ctx.cfgs
        t, (bsz, _, h) = axis.size, x_full.shape
        like = next(g for g in gs if g is not None)
        gs = [g if g is not None else like.new_zeros((*like.shape[:-1], w.shape[0])) for g, w in zip(gs, ws)]
        # a head-partial projection (MLA's down-projections): its g summed over tp before the casts, its dx handed
        # back by the axis' first rank only (`fp8.linear`'s `grad_sum`)
        gs = [g if c.grad_sum is None else comm.all_reduce(g.clone(memory_format=torch.contiguous_format),
                                                           c.grad_sum, tag=GRAD_TAG) for g, c in zip(gs, cfgs)]
        defer = _zero_bubble(ctx.store)
        with torch.autocast(x_full.device.type, enabled=False):
            casts = []
            for cfg, g, w in zip(cfgs, gs, ws):
                r, lay, g3 = cfg.recipe, cfg.layout, as3d(g)
                items = [(g3, r.g_dgrad, lay.g()), (as3d(w), r.w_dgrad, lay.w())]
                if not defer:
                    items += [(g3, r.g_wgrad, lay.g()), (as3d(x_full), r.x_wgrad, lay.x())]
                casts.append(quantize_all(items))
            scatter = _ReduceScatterChunks(axis)
            for off, n in chunk_bounds(ctx.local_len, t):
                dx = None
                for i in reversed(range(len(ws))):  # autograd's order for separate layers: the last one's dx first
                    c = cfgs[i]
                    if c.grad_sum is not None and c.grad_sum.rank:
                        continue
                    r = c.recipe
                    part = gemm(_rows_q(casts[i][0], t, off, n), False, r.g_dgrad, casts[i][1], True, r.w_dgrad)
                    part = part.view(t, bsz, n, h).to(x_full.dtype)
                    dx = part if dx is None else dx.add_(part)
                scatter.start(off, dx if dx is not None else x_full.new_zeros((t, bsz, n, h)))
            grads: list = []
            for i, (cfg, g, w, b) in enumerate(zip(cfgs, gs, ws, bs)):
                if defer:  # zero-bubble: the casts and the dW GEMM run at this microbatch's W action
                    ctx.store.defer([w, b], _deferred(cfg, x_full, g, w, b))
                    grads += [None, None]
                else:
                    grads += fp8_weight_grads(cfg.recipe, [casts[i][2]], [casts[i][3]], [w], [b], [g])
        return (scatter.finish(ctx.local_len), None, None, None, None, *grads)


def _deferred(cfg, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, b):
    """The weight-gradient casts and GEMM of one FP8 linear, run later (zero-bubble's W): [dW, db]."""
    def compute() -> list:
        r, lay = cfg.recipe, cfg.layout
        with torch.autocast(g.device.type, enabled=False):
            qg, qx = quantize_all([(as3d(g), r.g_wgrad, lay.g()), (as3d(x), r.x_wgrad, lay.x())])
            return fp8_weight_grads(r, [qg], [qx], [w], [b], [g])
    return compute


class _RowScatterFp8Fn(torch.autograd.Function):
    """`_RowScatterFn` in FP8: x and W cast whole (the plain FP8 linear's call), each chunk's GEMM on x's FP8 rows /
    backward: W cast whole and the output gradient's scale fixed before its chunks are gathered, dx per chunk, then
    the weight-gradient casts of the whole gathered g and x (a second call) and dW."""

    @staticmethod
    def forward(ctx, x, weight, axis, store, cfg, dtype):
        t, (bsz, s, _) = axis.size, x.shape
        local_len, r, lay = s // t, cfg.recipe, cfg.layout
        scatter = _ReduceScatterChunks(axis)
        with torch.autocast(x.device.type, enabled=False):
            qx, qw = quantize_all([(as3d(x), r.x, lay.x()), (as3d(weight), r.w, lay.w())])
            for off, n in chunk_bounds(local_len, t):
                y = gemm(_rows_q(qx, t, off, n), False, r.x, qw, False, r.w)
                scatter.start(off, y.view(t, bsz, n, -1).to(dtype))
        ctx.save_for_backward(x)
        ctx.weight, ctx.axis, ctx.store, ctx.local_len, ctx.cfg = weight, axis, store, local_len, cfg
        return scatter.finish(local_len)

    @staticmethod
    def backward(ctx, g):
        (x,), w, axis, cfg = ctx.saved_tensors, ctx.weight, ctx.axis, ctx.cfg
        t, (bsz, s, k), r, lay = axis.size, x.shape, cfg.recipe, cfg.layout
        g = g.contiguous()
        with torch.autocast(x.device.type, enabled=False):
            whole, (qw,) = _whole_scale(g, r.g_dgrad, lay.g(), axis, [(as3d(w), r.w_dgrad, lay.w())])
            dx = x.new_empty((bsz, t, ctx.local_len, k))
            g_full = g.new_empty((bsz, t, ctx.local_len, g.shape[-1]))
            for off, rows in _gathered(g, axis, chunk_bounds(ctx.local_len, t)):
                _put(g_full, t, off, rows)
                n = rows.shape[2]
                qg = _cast_rows(rows.reshape(-1, n, rows.shape[-1]), r.g_dgrad, lay.g(), whole)
                _put(dx, t, off, gemm(qg, False, r.g_dgrad, qw, True, r.w_dgrad).view(t, bsz, n, k).to(x.dtype))
            g_full = g_full.view(bsz, s, -1)
            if _zero_bubble(ctx.store):
                ctx.store.defer([w, None], _deferred(cfg, x, g_full, w, None))
                return dx.view_as(x), None, None, None, None, None
            dw, _ = _deferred(cfg, x, g_full, w, None)()
        return dx.view_as(x), dw, None, None, None, None


def gather_column(x: torch.Tensor, axis, store, weights, biases, fused: bool = False,
                  fp8: list | None = None) -> tuple[torch.Tensor, ...]:
    """SP column region, overlapped: x [b, s/tp, h] → one [b, s, n_i] output per weight (`fused`: one GEMM per
    chunk for all of them). `fp8`: each weight's Fp8Config under --fp8 (the GEMMs in FP8, one per weight)."""
    params = [t for pair in zip(weights, biases) for t in pair]
    if fp8 is not None:
        return _GatherColumnFp8Fn.apply(x, axis, store, list(fp8), out_dtype(x), *params)
    return _GatherColumnFn.apply(x, axis, store, fused, *params)


def row_scatter(x: torch.Tensor, weight: torch.Tensor, axis, store, fp8=None) -> torch.Tensor:
    """SP row-parallel GEMM, overlapped: x [b, s, k/tp] → this rank's reduce-scattered [b, s/tp, out]. `fp8`: the
    layer's Fp8Config under --fp8."""
    if fp8 is not None:
        return _RowScatterFp8Fn.apply(x, weight, axis, store, fp8, out_dtype(x))
    return _RowScatterFn.apply(x, weight, axis, store)
