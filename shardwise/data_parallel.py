"""Gradient finalisation and the optimizer: TP reductions, dp×cp reduction, ZeRO-1, global clipping.

Order after the last microbatch's backward:
1. TP: gradients that are partial per TP rank — norm weights under SP ("tp_sum") and K/V heads held
   by several TP ranks ("tp_kv") — are summed across TP in one flat buffer each.
2. dp×cp: the loss is already divided by the *global* token count, so gradients are summed (not
   averaged) across dp×cp: a bucketed all-reduce, or under ZeRO-1 a reduce-scatter into the rank's
   shard of a flat buffer (AdamW states live only for that shard, params are all-gathered after).
3. The global grad norm counts every parameter once: local squares are divided by the number of
   TP ranks holding the same slice, then summed over TP (and over dp×cp under ZeRO-1).
"""
from __future__ import annotations

import math

import torch

from . import comm
from .mesh import Mesh
from .tensor_parallel.layers import get_spec

BUCKET_BYTES = 25 * 2**20


def _unique_params(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class GradReducer:
    """Steps 1–3 above plus the AdamW update, for zero=0 or zero=1."""

    def __init__(self, model, mesh: Mesh, zero: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas=(0.9, 0.95), eps: float = 1e-8):
        self.mesh, self.zero = mesh, zero
        self.named = _unique_params(model)
        self.dp = mesh["dp_cp"]
        self.tp = mesh["tp"]
        groups = {True: [], False: []}
        for n, p in self.named:
            groups[p.ndim >= 2].append((n, p))  # no weight decay on norms and biases
        self.groups = [(groups[True], weight_decay), (groups[False], 0.0)]
        if zero == 0:
            self.optimizer = torch.optim.AdamW(
                [{"params": [p for _, p in g], "weight_decay": wd} for g, wd in self.groups if g],
                lr=lr, betas=betas, eps=eps)
        else:
            self._build_zero(lr, betas, eps)

    # ------------------------------------------------------------ ZeRO-1 layout
    def _build_zero(self, lr, betas, eps):
        """Each group's params become views of one flat buffer; this rank owns a contiguous 1/dp of it."""
        n_dp, r = self.dp.size, self.dp.rank
        self.flat = []
        opt_groups = []
        for named, wd in self.groups:
            if not named:
                continue
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
                                  norm_weight=weights[r * per:(r + 1) * per].clone()))
            opt_groups.append({"params": [shard], "weight_decay": wd})
        self.optimizer = torch.optim.AdamW(opt_groups, lr=lr, betas=betas, eps=eps)

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
                    full[off:off + k].copy_(_grad(p).reshape(-1))
                comm.reduce_scatter_into(g["shard"].grad, full, self.dp)
            return
        if not self.dp.active:
            return
        for bucket in _buckets([p for _, p in self.named]):
            flat = torch.cat([_grad(p).reshape(-1) for p in bucket])
            comm.all_reduce(flat, self.dp)
            _unflatten_into(flat, bucket)

    # ------------------------------------------------------------ step 3: norm and clip
    def _grad_norm_sq(self) -> torch.Tensor:
        if self.zero:
            sq = sum((g["shard"].grad.float().pow(2) * g["norm_weight"]).sum() for g in self.flat)
            sq = torch.as_tensor(sq, device=self.mesh.device, dtype=torch.float32).reshape(1)
            comm.all_reduce(sq, self.dp, tag="grad_norm")
        else:
            sq = torch.zeros(1, device=self.mesh.device)
            for _, p in self.named:
                sq += _grad(p).float().pow(2).sum() / get_spec(p).replicas
        comm.all_reduce(sq, self.tp, tag="grad_norm")
        comm.all_reduce(sq, self.mesh["pp"], tag="grad_norm")  # stages hold disjoint parameters
        return sq

    def reduce_and_clip(self, max_norm: float) -> float:
        """Finish the gradients of this step; returns the global grad norm (before clipping)."""
        self._reduce_tp()
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
                comm.all_gather_into(g["flat"], g["shard"].detach().clone(), self.dp)
                for _, p, _, _ in g["offsets"]:
                    p.grad = None
        self.zero_grad()

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def grad_views(self):
        """(name, reduced gradient values this rank holds, start, end within the flattened local param)."""
        if not self.zero:
            for n, p in self.named:
                yield n, _grad(p).reshape(-1), 0, p.numel()
            return
        for g in self.flat:
            lo_s = self.dp.rank * g["per"]
            hi_s = lo_s + g["per"]
            for n, p, off, k in g["offsets"]:
                lo, hi = max(off, lo_s), min(off + k, hi_s)
                if lo < hi:
                    yield n, g["shard"].grad[lo - lo_s:hi - lo_s], lo - off, hi - off


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
