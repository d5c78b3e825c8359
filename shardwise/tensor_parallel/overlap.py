"""Sequence-parallel TP regions with their communication under the GEMMs (`--tp-overlap`).

Under SP a column-parallel region starts with an all-gather of the sequence and a row-parallel one ends with a
reduce-scatter, each waiting for the whole tensor before (or after) its GEMM. Here both are cut into `tp` chunks of
this rank's sequence shard: while the GEMM of the chunk in hand runs, the next chunk's collective is in flight
(asynchronous, through `comm`), in the forward and in the backward. Chunk i gathers sub-slice i of every rank's
shard, so its rows sit rank-major in the sequence; a GEMM treats rows independently, so the chunked forward equals
the whole one. Each chunk moves 1/tp of the tensor: the ledger's bytes per axis equal the non-overlapped run's, in
tp times more messages. Weight gradients use the whole gathered tensors, as without overlap.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
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


def gather_column(x: torch.Tensor, axis, store, weights, biases, fused: bool = False) -> tuple[torch.Tensor, ...]:
    """SP column region, overlapped: x [b, s/tp, h] → one [b, s, n_i] output per weight (`fused`: one GEMM per
    chunk for all of them)."""
    params = [t for pair in zip(weights, biases) for t in pair]
    return _GatherColumnFn.apply(x, axis, store, fused, *params)


def row_scatter(x: torch.Tensor, weight: torch.Tensor, axis, store) -> torch.Tensor:
    """SP row-parallel GEMM, overlapped: x [b, s, k/tp] → this rank's reduce-scattered [b, s/tp, out]."""
    return _RowScatterFn.apply(x, weight, axis, store)
