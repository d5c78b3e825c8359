"""Gradient finalisation and the optimizer: TP reductions, dp×cp reduction, ZeRO-1, global clipping.

Order after the last microbatch's backward:
1. TP: gradients that are partial per TP rank — norm weights under SP ("tp_sum") and K/V heads held
   by several TP ranks ("tp_kv") — are summed across TP in one flat buffer each.
2. dp×cp: the loss is already divided by the *global* token count, so gradients are summed (not
   averaged) across dp×cp: a bucketed all-reduce, or under ZeRO-1 a reduce-scatter into the rank's
   shard of a flat buffer (AdamW states live only for that shard, params are all-gathered after).
3. The global grad norm counts every parameter once: local squares are divided by the number of
   TP ranks holding the same slice, then summed over TP and PP (and over dp×cp under ZeRO-1).
Expert parameters (`_sw_expert`) are split over ep and replicated over its complement edp: their
gradients are summed over edp instead of dp×cp, their ZeRO-1 shards live on edp, and their share
of the norm is also summed over ep.
"""
from __future__ import annotations

import math

import torch

from . import comm
from .mesh import Mesh
from .pipeline.tied_embedding import reduce_tied_embedding_grads
from .tensor_parallel.layers import get_spec

BUCKET_BYTES = 25 * 2**20


def _unique_params(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class GradReducer:
    """Steps 1–3 above plus the AdamW update, for zero=0 or zero=1."""

    def __init__(self, model, mesh: Mesh, zero: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas=(0.9, 0.95), eps: float = 1e-8, reduce_dtype: torch.dtype | None = None):
        self.mesh, self.zero = mesh, zero
        self.reduce_dtype = reduce_dtype  # --grad-reduce-dtype bf16: halve the dp×cp / edp gradient bytes
        self.named = _unique_params(model)
        self.tp = mesh["tp"]
        groups: dict[tuple[bool, bool], list] = {}
        for n, p in self.named:
            # no weight decay on norms and biases; experts reduce over edp
            groups.setdefault((is_expert(p), p.ndim >= 2), []).append((n, p))
        self.groups = [(named, weight_decay if decay else 0.0, mesh["edp"] if expert else mesh["dp_cp"], expert)
                       for (expert, decay), named in sorted(groups.items())]
        if zero == 0:
            self.optimizer = torch.optim.AdamW(
                [{"params": [p for _, p in g], "weight_decay": wd} for g, wd, _, _ in self.groups],
                lr=lr, betas=betas, eps=eps, fused=mesh.device.type == "cuda")
        else:
            self._build_zero(lr, betas, eps)

    # ------------------------------------------------------------ ZeRO-1 layout
    def _build_zero(self, lr, betas, eps):
        """Each group's params become views of one flat buffer; this rank owns a contiguous 1/dp of it."""
        self.flat = []
        opt_groups = []
        for named, wd, axis, expert in self.groups:
            n_dp, r = axis.size, axis.rank
            total = sum(p.numel() for _, p in named)
            padded = math.ceil(total / n_dp) * n_dp
            flat = torch.zeros(padded, device=self.mesh.device, dtype=named[0][1].dtype)
            offsets, off = [], 0
            weights = torch.zeros(padded, device=self.mesh.device)
            for n, p in named:
                k = p.numel()
                flat[off:off + k].copy_(p.detach().reshape(-1))
                p.data = flat[off:off + k].view_as(p)
                weights[off:off + k] = 1.0 / get_spec(p).replicas
                offsets.append((n, p, off, k))
                off += k
            per = padded // n_dp
            shard = torch.nn.Parameter(flat[r * per:(r + 1) * per])
            shard.grad = torch.zeros_like(shard)
            self.flat.append(dict(flat=flat, offsets=offsets, per=per, shard=shard, grad_full=torch.zeros_like(flat),
                                  norm_weight=weights[r * per:(r + 1) * per].clone(), axis=axis, expert=expert))
            opt_groups.append({"params": [shard], "weight_decay": wd})
        self.optimizer = torch.optim.AdamW(opt_groups, lr=lr, betas=betas, eps=eps, fused=self.mesh.device.type == "cuda")
        self.zero_grad()

    # ------------------------------------------------------------ step 1: TP
    def _reduce_tp(self):
        if not self.tp.active:
            return
        partial = [p for _, p in self.named if get_spec(p).grad_reduce == "tp_sum"]
        if partial:
            flat = torch.cat([_grad(p).reshape(-1) for p in partial])
            comm.all_reduce(flat, self.tp)
            _unflatten_into(flat, partial)
        kv = [p for _, p in self.named if get_spec(p).grad_reduce == "tp_kv"]
        if kv:
            spec0 = get_spec(kv[0])
            n_slots = spec0.global_shape[0] // spec0.length
            slot = spec0.start // spec0.length
            cols = sum(p.numel() for p in kv)
            buf = torch.zeros(n_slots, cols, device=kv[0].device, dtype=kv[0].dtype)
            buf[slot] = torch.cat([_grad(p).reshape(-1) for p in kv])
            comm.all_reduce(buf, self.tp)
            _unflatten_into(buf[slot], kv)

    # ------------------------------------------------------------ step 2: dp×cp
    def _reduce_dp(self):
        if self.zero:
            for g in self.flat:
                full = g["grad_full"]
                for _, p, off, k in g["offsets"]:
                    if p.grad is None or p.grad.data_ptr() != full[off:off + k].data_ptr():
                        full[off:off + k].copy_(_grad(p).reshape(-1))  # someone replaced the view
                if self.reduce_dtype is None or not g["axis"].active:
                    comm.reduce_scatter_into(g["shard"].grad, full, g["axis"])
                else:  # the collective in bf16, its result accumulated back into the fp32 shard grad
                    low = torch.empty(g["per"], device=full.device, dtype=self.reduce_dtype)
                    comm.reduce_scatter_into(low, full.to(self.reduce_dtype), g["axis"])
                    g["shard"].grad.copy_(low)
            return
        for axis, expert in ((self.mesh["dp_cp"], False), (self.mesh["edp"], True)):
            if not axis.active:
                continue
            for bucket in _buckets([p for _, p in self.named if is_expert(p) == expert]):
                flat = torch.cat([_grad(p).reshape(-1) for p in bucket])
                if self.reduce_dtype is not None:
                    flat = flat.to(self.reduce_dtype)
                comm.all_reduce(flat, axis)
                _unflatten_into(flat, bucket)

    # ------------------------------------------------------------ step 3: norm and clip
    def _grad_norm_sq(self) -> torch.Tensor:
        dense = torch.zeros(1, device=self.mesh.device)
        expert = torch.zeros(1, device=self.mesh.device)
        if self.zero:  # shards are disjoint over each group's axis: one reduce per axis (dp×cp, edp)
            for g in self.flat:
                (expert if g["expert"] else dense).add_((g["shard"].grad.float().pow(2) * g["norm_weight"]).sum())
            comm.all_reduce(dense, self.mesh["dp_cp"], tag="grad_norm")
            comm.all_reduce(expert, self.mesh["edp"], tag="grad_norm")
        else:
            for _, p in self.named:
                (expert if is_expert(p) else dense).add_(_grad(p).float().pow(2).sum() / get_spec(p).replicas)
        comm.all_reduce(expert, self.mesh["ep"], tag="grad_norm")  # each ep rank holds different experts
        sq = dense + expert
        comm.all_reduce(sq, self.tp, tag="grad_norm")
        comm.all_reduce(sq, self.mesh["pp"], tag="grad_norm")  # stages hold disjoint parameters
        return sq

    def reduce_and_clip(self, max_norm: float) -> float:
        """Finish the gradients of this step; returns the global grad norm (before clipping)."""
        self._reduce_tp()
        reduce_tied_embedding_grads(self.named, self.mesh)  # before dp×cp: ZeRO shards differ per stage
        self._reduce_dp()
        norm = float(self._grad_norm_sq().sqrt())
        if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for g in self._final_grads():
                g.mul_(coef)
        return norm

    def _final_grads(self):
        if self.zero:
            return [g["shard"].grad for g in self.flat]
        return [_grad(p) for _, p in self.named]

    def step(self) -> None:
        self.optimizer.step()
        if self.zero:
            for g in self.flat:
                comm.all_gather_into(g["flat"], g["shard"].detach().clone(), g["axis"])
        self.zero_grad()

    def zero_grad(self) -> None:
        """Drop gradients; under ZeRO-1 every .grad is a zeroed view of its group's flat gradient
        buffer, so backward accumulates straight into the reduce-scatter input (no copy, no twin)."""
        if not self.zero:
            for _, p in self.named:
                p.grad = None
            return
        for g in self.flat:
            g["grad_full"].zero_()
            for _, p, off, k in g["offsets"]:
                p.grad = g["grad_full"][off:off + k].view_as(p)

    def grad_views(self):
        """(name, reduced gradient values this rank holds, start, end within the flattened local param)."""
        if not self.zero:
            for n, p in self.named:
                yield n, _grad(p).reshape(-1), 0, p.numel()
            return
        for g in self.flat:
            lo_s = g["axis"].rank * g["per"]
            hi_s = lo_s + g["per"]
            for n, p, off, k in g["offsets"]:
                lo, hi = max(off, lo_s), min(off + k, hi_s)
                if lo < hi:
                    yield n, g["shard"].grad[lo - lo_s:hi - lo_s], lo - off, hi - off


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, "_sw_expert", False)


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _unflatten_into(flat: torch.Tensor, params) -> None:
    off = 0
    for p in params:
        k = p.numel()
        p.grad.copy_(flat[off:off + k].view_as(p))
        off += k


def _buckets(params):
    bucket, size = [], 0
    for p in params:
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
