"""One autograd Function per differentiable collective pattern: Megatron's f/g operators and the
sequence-parallel gathers/scatters, each with a "forward: X / backward: Y" docstring."""
from __future__ import annotations

import torch

from . import collectives as C


class _CopyToRegion(torch.autograd.Function):
    """f: forward identity / backward all-reduce over the axis (input of a column-parallel region)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, g):
        return C.all_reduce(g.contiguous(), ctx.axis), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: forward all-reduce over the axis / backward identity (output of a row-parallel region)."""

    @staticmethod
    def forward(ctx, x, axis):
        return C.all_reduce(x.contiguous(), axis)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSequence(torch.autograd.Function):
    """SP entry: forward all-gather along `dim` / backward reduce-scatter along `dim`."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return C.all_gather(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return C.reduce_scatter(g, ctx.axis, ctx.dim), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """SP exit: forward reduce-scatter along `dim` / backward all-gather along `dim`."""

    @staticmethod
    def forward(ctx, x, axis, dim):
        ctx.axis, ctx.dim = axis, dim
        return C.reduce_scatter(x, axis, dim)

    @staticmethod
    def backward(ctx, g):
        return C.all_gather(g, ctx.axis, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    """Column-parallel `gather_output`: forward all-gather along the last dim / backward keep own slice."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return C.all_gather(x, axis, x.dim() - 1)

    @staticmethod
    def backward(ctx, g):
        return g.chunk(ctx.axis.size, dim=-1)[ctx.axis.rank].contiguous(), None


class _ScatterToRegion(torch.autograd.Function):
    """Row-parallel input that is not yet split: forward keep own last-dim slice / backward all-gather."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.chunk(axis.size, dim=-1)[axis.rank].contiguous()

    @staticmethod
    def backward(ctx, g):
        return C.all_gather(g, ctx.axis, g.dim() - 1), None


def _apply(fn, x, axis, *args):
    return fn.apply(x, axis, *args) if axis.active else x


def copy_to_region(x, axis):
    return _apply(_CopyToRegion, x, axis)


def reduce_from_region(x, axis):
    return _apply(_ReduceFromRegion, x, axis)


def gather_from_sequence(x, axis, dim: int = 1):
    return _apply(_GatherFromSequence, x, axis, dim)


def reduce_scatter_to_sequence(x, axis, dim: int = 1):
    return _apply(_ReduceScatterToSequence, x, axis, dim)


def gather_from_region(x, axis):
    return _apply(_GatherFromRegion, x, axis)


def scatter_to_region(x, axis):
    return _apply(_ScatterToRegion, x, axis)
