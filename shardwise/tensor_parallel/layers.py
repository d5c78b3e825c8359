"""Megatron-style tensor-parallel layers.

Each layer holds only its shard and records, in a `ShardSpec` on every parameter, how that shard
sits in the global (unsharded) tensor. The spec drives layout-independent initialisation,
gradient reduction of replicated parameters, grad-norm counting and parity checks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm, host
from ..fp8.linear import fp8_linear
from ..fp8.wire import gather_sequence
from .grad_store import linear, weight_grads
from .fused import joined, split_weight_grads
from .overlap import gather_column, row_scatter


@dataclass(frozen=True)
class ShardSpec:
    """local = global.narrow(dim, start, valid), zero-padded to `length` rows along `dim`.

    dim None means the parameter is not split. `replicas` is how many TP ranks hold this same
    slice (so a global norm counts it once). `grad_reduce` names the TP reduction its gradient
    needs: None (complete already), "tp_sum" (partial sums: weights applied on SP shards), or
    "tp_kv" (a K/V head held by several TP ranks, each holding part of its gradient).
    """

    global_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    length: int = 0
    valid: int = 0
    replicas: int = 1
    grad_reduce: str | None = None

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """Cut this rank's shard out of a global tensor, zero-padding past the global edge."""
        if self.dim is None:
            return full
        part = full.narrow(self.dim, self.start, self.valid)
        if self.valid == self.length:
            return part
        shape = list(full.shape)
        shape[self.dim] = self.length
        out = full.new_zeros(shape)
        out.narrow(self.dim, 0, self.valid).copy_(part)
        return out

    def valid_part(self, local: torch.Tensor) -> torch.Tensor:
        return local if self.dim is None else local.narrow(self.dim, 0, self.valid)


def set_spec(p: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    p._sw_shard = spec
    return p


def get_spec(p: torch.Tensor) -> ShardSpec:
    return getattr(p, "_sw_shard", None) or ShardSpec(tuple(p.shape))


def split_range(total: int, axis) -> tuple[int, int]:
    """(start, length) of this rank's even shard of `total` (total padded up to a multiple of the size)."""
    per = math.ceil(total / axis.size)
    return axis.rank * per, per


def _sharded_param(global_shape, dim, start, length, replicas=1, grad_reduce=None, device=None, dtype=None):
    shape = list(global_shape)
    shape[dim] = length
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    valid = max(0, min(length, global_shape[dim] - start))
    return set_spec(p, ShardSpec(tuple(global_shape), dim, start, length, valid, replicas, grad_reduce))


def _replicated_param(shape, axis, grad_reduce=None, device=None, dtype=None):
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    return set_spec(p, ShardSpec(tuple(shape), None, 0, 0, 0, axis.size, grad_reduce))


def enter_region(x: torch.Tensor, axis, sequence_parallel: bool, fp8=None) -> torch.Tensor:
    """Input of a column-parallel region: SP all-gathers the sequence, plain TP is Megatron's f. `fp8`: the
    region's FP8 linears' config under --fp8-all-gather, whose SP gather travels in FP8 (`fp8/wire.py`)."""
    if sequence_parallel and fp8 is not None:
        return gather_sequence(x, axis, 1, fp8)
    return comm.gather_from_sequence(x, axis, 1) if sequence_parallel else comm.copy_to_region(x, axis)


def exit_region(y: torch.Tensor, axis, sequence_parallel: bool) -> torch.Tensor:
    """Output of a row-parallel region: SP reduce-scatters the sequence, plain TP is Megatron's g."""
    return comm.reduce_scatter_to_sequence(y, axis, 1) if sequence_parallel else comm.reduce_from_region(y, axis)


class ColumnParallelLinear(nn.Module):
    """Y = X Aᵀ with A split by output rows: each rank computes its slice of the features.

    `enter=False` when the parent module already applied the region entry once for several
    column-parallel layers sharing an input (q/k/v, w1/w3), so it is gathered or f-copied once.
    `rows=(start, length)` overrides the even split (a K/V head held by several ranks). `overlap` (set by the
    plan under SP with --tp-overlap): the entry all-gather runs in chunks under the GEMM (`overlap.py`).
    """

    def __init__(self, in_features, out_features, axis, bias=False, gather_output=False,
                 sequence_parallel=False, enter=True, rows=None, replicas=1, grad_reduce=None,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.axis, self.gather_output, self.sequence_parallel, self.enter = axis, gather_output, sequence_parallel, enter
        self.grad_store = None  # a WeightGradStore when a split-backward pipeline schedule defers dW
        self.region = None  # a ColumnRegion when siblings share this layer's input (see below)
        self.overlap = False
        self.fp8 = None  # an Fp8Config under --fp8 (shardwise/fp8/apply.py): the GEMMs run in FP8
        start, length = rows if rows is not None else split_range(out_features, axis)
        self.weight = _sharded_param((out_features, in_features), 0, start, length, replicas, grad_reduce, device, dtype)
        self.bias = (_sharded_param((out_features,), 0, start, length, replicas, grad_reduce, device, dtype)
                     if bias else None)
        if gather_output and out_features % axis.size:
            raise ValueError(f"gather_output needs out_features={out_features} divisible by tp={axis.size}")

    def forward(self, x):
        if self.region is not None:  # computed, together with its siblings, by the region's hook
            return self.region.take(self, x)
        if self.enter and self.overlap and self.sequence_parallel and self.axis.active:
            y = gather_column(x, self.axis, self.grad_store, [self.weight], [self.bias],
                              fp8=None if self.fp8 is None else [self.fp8])[0]
            return comm.gather_from_region(y, self.axis) if self.gather_output else y
        if self.enter:
            x = enter_region(x, self.axis, self.sequence_parallel)
        y = _linear(self, x, self.bias)
        return comm.gather_from_region(y, self.axis) if self.gather_output else y


def _linear(layer, x, bias):
    """The layer's GEMM: FP8 under --fp8, else F.linear (deferred-W in a split-backward pipeline stage)."""
    if layer.fp8 is not None:
        return fp8_linear(layer.fp8, x, layer.weight, bias, layer.grad_store)
    return linear(x, layer.weight, bias, layer.grad_store)


class _ColumnRegionFn(torch.autograd.Function):
    """forward: y_i = x W_iᵀ + b_i for every projection reading x, with `fused` as one GEMM on [W_1; W_2; ...] /
    backward: dx = Σ g_i W_i (all-reduced over TP *asynchronously* while the dW_i are computed, when `reduce`).

    One autograd node for the whole region lets the input-gradient all-reduce overlap the weight-gradient GEMMs
    (with separate nodes autograd finishes every dW before f runs), and lets the GEMMs fuse. Fused, the weights are
    one storage (`fused.py`) and the region runs one GEMM each for y, dx and dW; a fused GEMM sums over the same
    features but a BLAS may pick another kernel for the wider matrix, and dx sums over every projection's columns
    in one GEMM, so fusion is exact only up to rounding. Unfused, dx is summed in `order` (autograd's own order for
    separate layers is the reverse of the forward's) and dW per projection, as autograd computes them.
    """

    @staticmethod
    def forward(ctx, x, axis, store, reduce, order, fused, *params):
        ws, bs = params[0::2], params[1::2]
        ctx.save_for_backward(x)  # weights on ctx: a saved-tensor hook would hand the deferred W a copy (grad_store)
        ctx.axis, ctx.store, ctx.ws, ctx.bs, ctx.reduce, ctx.order = axis, store, ws, bs, reduce, order
        ctx.fused = fused and len(ws) > 1
        if not ctx.fused:
            return tuple(F.linear(x, w, b) for w, b in zip(ws, bs))
        b = None if bs[0] is None else joined(list(bs))
        return tuple(F.linear(x, joined(list(ws)), b).split([w.shape[0] for w in ws], dim=-1))

    @staticmethod
    def backward(ctx, *gs):
        if ctx.fused:
            return _ColumnRegionFn.fused_backward(ctx, gs)
        (x,), ws = ctx.saved_tensors, ctx.ws
        live = [(i, g.reshape(-1, g.shape[-1])) for i, g in enumerate(gs) if g is not None]
        dx = None
        for i, g in (live if ctx.order == "forward" else live[::-1]):
            part = (g @ ws[i].to(g.dtype)).to(x.dtype)
            dx = part if dx is None else dx.add_(part)
        work = comm.all_reduce_async(dx, ctx.axis) if ctx.reduce else None
        grads: list = [None] * (2 * len(ws))
        capture = ctx.store is not None and ctx.store.capturing
        for i, _ in live:
            if capture:  # zero-bubble: dW runs later, at this microbatch's W action
                ctx.store.put(ws[i], ctx.bs[i], x, gs[i])
            else:
                grads[2 * i], grads[2 * i + 1] = weight_grads(x, gs[i], ws[i], ctx.bs[i])
        if work is not None:
            comm.wait(work, ctx.axis, "all_reduce of a column region's input gradient")
        return (dx.view_as(x), None, None, None, None, None, *grads)

    @staticmethod
    def fused_backward(ctx, gs):
        """One GEMM for dx on the joined weight, then one for every dW (under the all-reduce when `reduce`)."""
        (x,), ws = ctx.saved_tensors, ctx.ws
        like = next(g for g in gs if g is not None)
        gs = [g if g is not None else like.new_zeros((*like.shape[:-1], w.shape[0])) for g, w in zip(gs, ws)]
        g = torch.cat(gs, dim=-1)
        dx = (g @ joined(list(ws)).to(g.dtype)).to(x.dtype)
        work = comm.all_reduce_async(dx, ctx.axis) if ctx.reduce else None
        if ctx.store is not None and ctx.store.capturing:  # zero-bubble: dW runs later, at this microbatch's W action
            for w, b, gi in zip(ws, ctx.bs, gs):
                ctx.store.put(w, b, x, gi)
            grads = [None] * (2 * len(ws))
        else:
            grads = split_weight_grads(x, g, ws, ctx.bs)
        if work is not None:
            comm.wait(work, ctx.axis, "all_reduce of a column region's input gradient")
        return (dx, None, None, None, None, None, *grads)


class ColumnRegion:
    """Column-parallel layers that read one input (q/k/v, or w1/w3), entered once as one TP region.

    Installed as the parent module's forward pre-hook: it runs all the projections in one `_ColumnRegionFn` (one
    GEMM with `fused`) and hands each layer its output when the layer is called. `reduce`: the region is
    Megatron's f (TP without SP), its input gradient all-reduced inside the region; under SP (or tp=1) the entry
    is the caller's, except with `overlap` (SP with --tp-overlap): the region takes the sequence shard and
    gathers it in chunks under the GEMMs. `own`: indices of outputs a fused GEMM hands back as copies, because a
    later op saves them past their siblings (attention's v, saved by SDPA after q and k are rotated) and a column
    block of the fused output would keep the whole output alive.
    """

    def __init__(self, layers: list[ColumnParallelLinear], axis, reduce: bool = True, overlap: bool = False,
                 fused: bool = False, own: tuple[int, ...] = ()):
        self.layers, self.axis, self.reduce, self.overlap, self.fused = layers, axis, reduce, overlap, fused
        self.own = own
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in layers:
            layer.region = self

    def __call__(self, module, args):
        x = args[0]
        if self.overlap:
            fp8 = None if self.layers[0].fp8 is None else [layer.fp8 for layer in self.layers]
            outs = gather_column(x, self.axis, self.layers[0].grad_store, [layer.weight for layer in self.layers],
                                 [layer.bias for layer in self.layers], self.fused, fp8)
            self.outputs = {id(layer): (x, y) for layer, y in zip(self.layers, outs)}
            return
        if self.layers[0].fp8 is not None:  # FP8: each projection its own GEMM, scales per weight as unfused
            entered = comm.copy_to_region(x, self.axis) if self.reduce else x
            self.outputs = {id(layer): (x, _linear(layer, entered, layer.bias)) for layer in self.layers}
            return
        params = [t for layer in self.layers for t in (layer.weight, layer.bias)]
        # TP without SP keeps the region's historical summation order; elsewhere the fused region replaces
        # separate layers and sums dx in autograd's order for them.
        order = "forward" if self.reduce else "reverse"
        outs = _ColumnRegionFn.apply(x, self.axis, self.layers[0].grad_store, self.reduce, order, self.fused, *params)
        if self.fused:
            outs = [y.clone() if i in self.own else y for i, y in enumerate(outs)]
        self.outputs = {id(layer): (x, y) for layer, y in zip(self.layers, outs)}

    def take(self, layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        seen, y = self.outputs.pop(id(layer))
        if seen is not x:
            raise RuntimeError("a column region's layer was called on another input than the region's")
        return y


class RowParallelLinear(nn.Module):
    """Y = X Aᵀ with A split by input columns: partial products summed across TP, bias added once after."""

    def __init__(self, in_features, out_features, axis, bias=False, input_is_parallel=True,
                 sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.axis, self.input_is_parallel, self.sequence_parallel = axis, input_is_parallel, sequence_parallel
        if in_features % axis.size:
            raise ValueError(f"RowParallelLinear: in_features={in_features} not divisible by tp={axis.size}")
        self.grad_store = None
        self.overlap = False  # under SP with --tp-overlap: the exit reduce-scatter runs in chunks under the GEMM
        self.fp8 = None  # an Fp8Config under --fp8
        start, length = split_range(in_features, axis)
        self.weight = _sharded_param((out_features, in_features), 1, start, length, device=device, dtype=dtype)
        # Under SP the bias is added on a sequence shard, so each rank holds part of its gradient.
        self.bias = (_replicated_param((out_features,), axis, "tp_sum" if sequence_parallel else None, device, dtype)
                     if bias else None)

    def forward(self, x):
        if not self.input_is_parallel:
            x = comm.scatter_to_region(x, self.axis)
        if self.overlap and self.sequence_parallel and self.axis.active:
            y = row_scatter(x, self.weight, self.axis, self.grad_store, self.fp8)
        else:
            y = exit_region(_linear(self, x, None), self.axis, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows (padded to a multiple of tp); out-of-shard ids give 0, summed over TP."""

    def __init__(self, num_embeddings, embedding_dim, axis, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.vocab_start, self.per_rank = split_range(num_embeddings, axis)
        self.weight = _sharded_param((num_embeddings, embedding_dim), 0, self.vocab_start, self.per_rank,
                                     device=device, dtype=dtype)
        self.out_dtype = None  # the residual stream's dtype (bf16 activations), cast before the TP reduction

    def forward(self, ids):
        if ids.device.type == "cpu":  # free on the host; on an accelerator it would sync every microbatch,
            check_token_ids(ids, self.num_embeddings)  # so the Trainer checks each batch before the copy
        if not self.axis.active:
            return F.embedding(ids, self.weight).to(self.out_dtype or self.weight.dtype)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        out = out.to(self.out_dtype or out.dtype)
        return exit_region(out, self.axis, self.sequence_parallel)


def check_token_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """A token id outside [0, V) would silently embed as a zero row on every shard: refuse it.

    Call it on host tensors (the Trainer checks each batch before the copy to the device): their values
    are in host memory, read without any device sync. Anywhere else (a device or fake tensor) it is a
    device→host read through `shardwise.host` — never per microbatch on an accelerator.
    """
    if not ids.numel():
        return
    if ids.device.type == "cpu" and type(ids) is torch.Tensor:
        lo, hi = (int(v) for v in (ids.numpy().min(), ids.numpy().max()))
    else:
        lo, hi = host.read(torch.stack(torch.aminmax(ids)), "token ids")
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
