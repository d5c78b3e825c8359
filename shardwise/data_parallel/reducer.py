"""Gradient finalisation and the optimizer: TP reductions, dp×cp reduction (ZeRO 0–3), global clipping.

Order of a step's gradient work:
1. During backward, each complete bucket's dp×cp reduction starts asynchronously (buckets.py): an
   all-reduce (ZeRO-0) or a reduce-scatter into the rank's shard (ZeRO ≥ 1). The loss is divided by the
   *global* token count, so gradients are summed (not averaged) across dp×cp.
2. TP: gradients that are partial per TP rank — norm weights under SP ("tp_sum") and K/V heads held by
   several TP ranks ("tp_kv") — are summed across TP in one flat buffer each, and a tied embedding's two
   pipeline copies over the emb group; only then are the buckets holding them reduced over dp×cp (so
   those sums always precede the dp one).
3. The global grad norm counts every parameter once: local squares are divided by the number of TP
   ranks holding the same slice, then summed over TP and PP (and over dp×cp under ZeRO ≥ 1).
4. AdamW on the full parameters (ZeRO-0) or on the rank's shard of every bucket (ZeRO ≥ 1); ZeRO 1/2
   then all-gather the updated parameters, ZeRO-3 keeps only the shard (zero3.py gathers per layer).
Expert parameters (`_sw_expert`) are split over ep and replicated over its complement edp: their
gradients are summed over edp instead of dp×cp, their shards live on edp, and their share of the
norm is also summed over ep.
Hybrid sharding (`--dp-shard S`, ZeRO 2/3): dense buckets shard over dp_shard (S·cp ranks) instead of
dp×cp; after the step's last reduce-scatter each shard gradient is all-reduced once over dp_replicate
(the dp/S ranks holding the same shard), and the norm is summed over dp_shard only (replicas hold
equal shards: summing over them would count each dp/S times). Experts keep edp.
"""
from __future__ import annotations

import torch

from .. import comm, host
from ..rules.buckets import BUCKET_BYTES, MAX_INFLIGHT, bucket_key, cut_runs
from ..rules.inventory import zero_units
from ..mesh import Mesh
from ..pipeline.tied_embedding import tied_partial
from ..tensor_parallel.layers import get_spec
from .buckets import Bucket, OverlappedReduction, adopt_grad, is_expert, tp_partial
from .zero3 import ParamUnits, Unit

NORM_ROW = 1024  # grad norm: short fp32 accumulations, summed in fp64 (see GradReducer._sq_sum)


def _unique_params(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def model_units(model) -> list[tuple[int, torch.nn.Module]]:
    """(pipeline chunk, module) of every ZeRO-3 unit in forward order: embedding, blocks, final norm, head, and
    the MTP modules (with the last stage's embedding copy under PP)."""
    if not hasattr(model, "layers"):
        return [(0, model)]
    chunks = model.chunks or [None]
    mtp, copy = len(getattr(model, "mtp", None) or {}), getattr(model, "mtp_embed", None) is not None
    out = []
    for c, ch in enumerate(chunks):
        ids = ch.layer_ids if ch is not None else [int(i) for i in model.layers]
        first, last = (ch.first, ch.last) if ch is not None else (True, True)
        out += [(c, model.get_submodule(name)) for name in zero_units(ids, first, last, mtp, copy)]
    return out


class GradReducer:
    """Steps 1–4 above for zero ∈ {0, 1, 2, 3}: data-parallel gradient reduction, clipping and AdamW.

    Per step a caller must: run exactly `rounds` backward passes (one per micro-batch; each parameter
    accumulates that many gradients — with `overlap` a bucket is reduced as soon as its last one
    arrives), then `reduce_and_clip(max_norm)` (TP/dp reductions, the global norm), then `step()` (AdamW,
    ZeRO all-gathers, and `zero_grad()`), or `zero_grad()` alone to drop the step. A gradient arriving
    for a bucket already reduced — more backward passes than `rounds`, or one after `reduce_and_clip` —
    raises instead of being lost. `overlap=False` reduces every bucket after backward."""

    def __init__(self, model, mesh: Mesh, zero: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas=(0.9, 0.95), eps: float = 1e-8, reduce_dtype: torch.dtype | None = None,
                 rounds: int = 1, overlap: bool = True, bucket_bytes: int | None = None, is_muon=None):
        """`is_muon(name, param)`: the parameters another optimizer (`shardwise.optim`) steps; AdamW skips
        them and ZeRO gives them buckets of their own, so that optimizer sees whole buckets."""
        self.mesh, self.zero = mesh, zero
        self.is_muon = is_muon or (lambda n, p: False)
        self.muon_buckets = is_muon is not None and zero > 0
        self.muon = None  # set by shardwise.optim when is_muon selects parameters
        self.reduce_dtype = reduce_dtype  # --grad-reduce-dtype bf16: halve the dp×cp / edp gradient bytes
        self.named = _unique_params(model)
        self.tp = mesh["tp"]
        self.replicate = mesh["dp_replicate"]  # active only under hybrid sharding (ZeRO 2/3)
        self.dense_axis = mesh["dp_shard"] if self.replicate.active else mesh["dp_cp"]
        self.buckets = self._make_buckets(model, weight_decay, bucket_bytes or BUCKET_BYTES)
        self.flat = self.buckets if zero else []
        self.units = None
        self._scratch = None
        if zero == 0:
            groups: dict[tuple[bool, bool], list] = {}
            for n, p in self.named:  # no weight decay on norms and biases
                if self.is_muon(n, p):
                    continue
                groups.setdefault((is_expert(p), p.ndim >= 2), []).append(p)
            self.optimizer = torch.optim.AdamW(
                [{"params": ps, "weight_decay": weight_decay if decay else 0.0} for (_, decay), ps in sorted(groups.items())],
                lr=lr, betas=betas, eps=eps, fused=True)
            for b in self.buckets:
                b.grad_full = torch.zeros(b.padded, device=mesh.device, dtype=b.dtype)
        else:
            self._build_zero(lr, betas, eps)
        # zb/dualpipev: a linear's B hands its dW to the store, and autograd still calls the hook (with
        # nothing accumulated); the W action's accumulation calls _on_grad itself.
        self.store = getattr(model, "grad_store", None)
        self._deferred_w = {id(p) for m in model.modules() if getattr(m, "grad_store", None) is not None
                            for p in m.parameters(recurse=False)}
        self.reduction = OverlappedReduction(self.buckets, zero, reduce_dtype,
                                             max_inflight=MAX_INFLIGHT if zero >= 2 else None,
                                             late=frozenset(self._deferred_w))
        self.reduction.rounds = rounds
        self._bucket_of = {id(p): (b, off, k) for b in self.buckets for _, p, off, k in b.offsets}
        if zero >= 3:
            self._build_units(model)
        for b in self.buckets:
            for _, p, _, _ in b.offsets:
                if (overlap or zero >= 2) and not b.deferred:
                    p.register_post_accumulate_grad_hook(self._on_autograd_grad)
                    p._sw_on_grad = self._on_grad
                elif zero < 2:  # no launch from backward, but no twin of the gradient either
                    p.register_post_accumulate_grad_hook(self._adopt_grad)
                    p._sw_on_grad = self._adopt_grad
        earlier = [(p, p.grad) for _, p in self.named if p.grad is not None and zero == 0]
        self.zero_grad()
        for p, g in earlier:  # keep gradients computed before the reducer existed (launch copies them in)
            p.grad = g

    # ------------------------------------------------------------ layout
    def _make_buckets(self, model, weight_decay: float, bucket_bytes: int) -> list[Bucket]:
        """Group parameters (see buckets.py for the keys per stage) and cut each group into buckets."""
        place = {}
        for u, (chunk, mod) in enumerate(model_units(model)):
            for p in mod.parameters():
                place.setdefault(id(p), (chunk, u))
        groups: dict[tuple, list] = {}
        for n, p in self.named:
            chunk, unit = place.get(id(p), (0, 0))
            key = bucket_key(self.zero, chunk, unit, is_expert(p), p.ndim >= 2)
            if self.muon_buckets:
                key += (self.is_muon(n, p),)
            groups.setdefault(key, []).append((n, p))
        out = []
        for key, named in sorted(groups.items()):
            expert, decay = is_expert(named[0][1]), named[0][1].ndim >= 2
            axis = self.mesh["edp"] if expert else self.dense_axis
            runs = [named] if self.zero == 3 else cut_runs(named, lambda item: item[1].numel() * item[1].element_size(),
                                                           bucket_bytes)
            for run in runs:
                b = Bucket(run, axis, expert, weight_decay if decay else 0.0, key[0] if self.zero >= 2 else 0,
                           any(tp_partial(p, self.tp) or tied_partial(p, self.mesh)
                               or getattr(p, "_sw_multi_use", False) for _, p in run), self.zero > 0,
                           self.mesh.device)
                b.unit = key[1] if self.zero == 3 else None
                b.muon = self.muon_buckets and key[-1]
                out.append(b)
        return out

    def _build_zero(self, lr, betas, eps):
        """Each bucket's params become views of one flat buffer; this rank owns a contiguous 1/n of it."""
        opt_groups = []
        for b in self.buckets:
            r, per = b.axis.rank, b.per
            flat = torch.zeros(b.padded, device=self.mesh.device, dtype=b.dtype)
            weights = torch.zeros(b.padded, device=self.mesh.device)
            for n, p, off, k in b.offsets:
                flat[off:off + k].copy_(p.detach().reshape(-1))
                p.data = flat[off:off + k].view_as(p)
                weights[off:off + k] = 1.0 / get_spec(p).replicas
                if _extra_copies(p) is not None:  # a replicated expert counts once: its first copy
                    weights[off:off + k].view(p.shape)[_extra_copies(p)] = 0.0
            b.flat = flat
            # ZeRO-3: the shard is the parameters' only persistent copy; the full buffer is transient
            b.shard = torch.nn.Parameter(flat[r * per:(r + 1) * per].clone() if self.zero >= 3 else
                                         flat[r * per:(r + 1) * per])
            b.shard.grad = torch.zeros_like(b.shard)
            b.norm_weight = weights[r * per:(r + 1) * per].clone()
            if self.zero == 1:
                b.grad_full = torch.zeros_like(flat)
            if self.zero >= 3:
                flat.untyped_storage().resize_(0)
            if not b.muon:
                opt_groups.append({"params": [b.shard], "weight_decay": b.wd})
        self.optimizer = torch.optim.AdamW(opt_groups, lr=lr, betas=betas, eps=eps, fused=True)

    def _build_units(self, model) -> None:
        by_unit: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            by_unit.setdefault(b.unit, []).append(b)
        units = []
        for u, (chunk, mod) in enumerate(model_units(model)):
            used = {id(p) for p in mod.parameters()}  # a tied weight: its bucket is held by both units
            bs = by_unit.get(u, []) + [b for v, bl in by_unit.items() if v != u for b in bl
                                       if any(id(p) in used for _, p, _, _ in b.offsets)]
            unit = Unit(mod, bs, chunk)
            mod._sw_unit = unit
            units.append(unit)
        self.units = ParamUnits(units)

    # ------------------------------------------------------------ backward hooks
    def poison(self) -> None:
        """Fault injection: this step's gradients of this rank enter their reductions as NaN (so every rank
        sharing them sees NaN, as after a real overflow)."""
        self.reduction.poisoned = True

    def _on_autograd_grad(self, p: torch.Tensor) -> None:
        if self.store is not None and self.store.capturing and id(p) in self._deferred_w:
            return
        self._on_grad(p)

    def _adopt_grad(self, p: torch.Tensor) -> None:
        b, off, k = self._bucket_of[id(p)]
        self.reduction.refuse_late(b, p)
        adopt_grad(b.grad_full, p, off, k)

    def _on_grad(self, p: torch.Tensor) -> None:
        b, off, k = self._bucket_of[id(p)]
        self.reduction.on_grad(b, p, off, k)

    # ------------------------------------------------------------ step 2: TP
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

    def _reduce_tied(self):
        """Sum a tied embedding's two pipeline copies' gradients over the emb group (ledger axis "emb")."""
        axis = self.mesh["emb"]
        if axis.active:
            for _, p in self.named:
                if getattr(p, "_sw_tied", None) is not None:
                    comm.all_reduce(_grad(p), axis)

    def _reduce_replicas(self):
        """Hybrid sharding: sum each dense shard gradient over the dp/S replicas holding the same shard —
        once per step, after the micro-batches' reduce-scatters have accumulated into it (all launched,
        then waited, so NCCL can pipeline them)."""
        if not self.replicate.active:
            return
        works = [(comm.all_reduce_async(b.shard.grad, self.replicate), b) for b in self.buckets if not b.expert]
        for w, _ in works:
            comm.wait(w, self.replicate, "all_reduce of a sharded gradient over the replicas")

    # ------------------------------------------------------------ step 3: norm and clip
    def _grad_norm_sq(self) -> torch.Tensor:
        dense = torch.zeros(1, device=self.mesh.device)
        expert = torch.zeros(1, device=self.mesh.device)
        # A dense model (or stage) has no expert norm to reduce: no edp/ep collective, none in its comm ledger.
        # Every rank of an edp or ep group holds the same stage, so all of them skip it alike.
        experts = any(b.expert for b in self.buckets)
        if self.zero:  # shards are disjoint over each group's axis: one reduce per axis (dp×cp, edp)
            for b in self.buckets:
                (expert if b.expert else dense).add_(self._sq_sum(b.shard.grad, b.norm_weight))
            comm.all_reduce(dense, self.dense_axis, tag="grad_norm")
            if experts:
                comm.all_reduce(expert, self.mesh["edp"], tag="grad_norm")
        else:  # .grads are views of the bucket buffers: one norm kernel per bucket (per parameter under TP)
            for b in self.buckets:
                reps = {get_spec(p).replicas for _, p, _, _ in b.offsets}
                copies = [p for _, p, _, _ in b.offsets if _extra_copies(p) is not None]
                if len(reps) == 1:
                    (expert if b.expert else dense).add_(self._sq_sum(b.grad_full) / reps.pop())
                else:
                    for _, p, _, _ in b.offsets:
                        (expert if b.expert else dense).add_(self._sq_sum(_grad(p).reshape(-1)) / get_spec(p).replicas)
                for p in copies:  # a replicated expert counts once: its other copies leave the norm
                    expert.sub_(self._sq_sum(_grad(p)[_extra_copies(p)].reshape(-1)) / get_spec(p).replicas)
        if experts:
            comm.all_reduce(expert, self.mesh["ep"], tag="grad_norm")  # each ep rank holds different experts
        self._scratch = None  # transient: not part of the static footprint
        sq = dense + expert
        comm.all_reduce(sq, self.tp, tag="grad_norm")
        comm.all_reduce(sq, self.mesh["pp"], tag="grad_norm")  # stages hold disjoint parameters
        return sq

    def _sq_sum(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Σ weight·g² of a flat fp32 buffer.
        Unweighted: the norms of NORM_ROW-element rows (one read, no temporary), squared and summed in
        fp64 — on 8M elements 3× faster than g·g summed and more exact (2e-9 against 6e-8 relative); one
        vector_norm of the whole buffer is as fast but loses 3e-3 to its long fp32 accumulation.
        Weighted (ZeRO shards, 1/replicas per element): in a scratch reused over the step's buckets — a
        fresh bucket-sized temporary each costs more (page faults) than the arithmetic."""
        if weight is None:
            m = g.numel() // NORM_ROW * NORM_ROW
            rows = torch.linalg.vector_norm(g[:m].view(-1, NORM_ROW), dim=1).double().square().sum()
            return (rows + g[m:].double().square().sum()).float()
        if self._scratch is None or self._scratch.numel() < g.numel():
            self._scratch = torch.empty(max(b.per if self.zero else b.padded for b in self.buckets),
                                        device=g.device, dtype=torch.float32)
        return torch.mul(g, g, out=self._scratch[:g.numel()]).mul_(weight).sum()

    def reduce_and_clip(self, max_norm: float) -> float:
        """Finish the gradients of this step; returns the global grad norm (before clipping)."""
        return host.read(self.reduce_and_clip_queued(max_norm), "grad norm")[0]

    def reduce_and_clip_queued(self, max_norm: float) -> torch.Tensor:
        """`reduce_and_clip` without reading the norm back: it stays on the device ([1], fp32) and the
        clipping is queued there — scale max_norm / (norm + 1e-6), in fp64 as a host float would be, where
        the norm is finite and above max_norm, else 1 (an exact no-op) — so the host can read the norm
        together with the loss, once per step (`shardwise.host`)."""
        if self.units is not None:
            self.units.free_all()
        self._reduce_tp()
        self._reduce_tied()  # before dp×cp: ZeRO shards differ per stage
        self.reduction.finish()
        self._reduce_replicas()
        norm = self._grad_norm_sq().sqrt()
        if max_norm > 0:
            n64 = norm.double()
            coef = torch.where(torch.isfinite(n64) & (n64 > max_norm), max_norm / (n64 + 1e-6), 1.0)
            coef = coef.to(torch.float32).reshape(())
            for g in self._final_grads():
                g.mul_(coef)
        return norm

    def _final_grads(self):
        if self.zero:
            return [b.shard.grad for b in self.buckets]
        return [b.grad_full for b in self.buckets]  # every .grad is a view of one of these

    def step(self) -> None:
        self.optimizer.step()
        if self.muon is not None:
            self.muon.step()
        if self.zero in (1, 2):
            for b in self.buckets:
                comm.all_gather_into(b.flat, b.shard.detach().clone(), b.axis)
        self.zero_grad()

    def zero_grad(self) -> None:
        """Drop gradients. ZeRO 0/1: .grads become None and the flat buffers keep their storage; each
        parameter's first gradient of the next step is copied in and its .grad viewed there (buckets.py),
        so backward accumulates straight into the collective's input. ZeRO 2/3: no .grad outlives its
        hook (TP-partial ones wait for the end of the step), the shard gradients are zeroed."""
        self.reduction.wait_all()
        self.reduction.reset()
        self.reduction.poisoned = False
        if self.units is not None:
            self.units.free_all()
        for b in self.buckets:
            if self.zero >= 1:
                b.shard.grad.zero_()
            if self.zero >= 2:
                b.grad_full = None
            for _, p, _, _ in b.offsets:
                p.grad = None

    def grad_views(self):
        """(name, reduced gradient values this rank holds, start, end within the flattened local param)."""
        if not self.zero:
            for n, p in self.named:
                yield n, _grad(p).reshape(-1), 0, p.numel()
            return
        yield from self._shard_views(lambda b: b.shard.grad)

    def param_views(self):
        """(name, parameter values this rank holds, start, end): whole parameters, or ZeRO-3 shards."""
        if self.zero < 3:
            for n, p in self.named:
                yield n, p.detach().reshape(-1), 0, p.numel()
            return
        yield from self._shard_views(lambda b: b.shard.detach())

    def _shard_views(self, of):
        for b in self.buckets:
            lo_s = b.axis.rank * b.per
            hi_s = lo_s + b.per
            for n, p, off, k in b.offsets:
                lo, hi = max(off, lo_s), min(off + k, hi_s)
                if lo < hi:
                    yield n, of(b)[lo - lo_s:hi - lo_s], lo - off, hi - off


def _extra_copies(p: torch.Tensor) -> torch.Tensor | None:
    """Under `--expert-replicas`: the local slots of a stacked expert parameter that are not their expert's first copy
    (an `ExpertShard`'s `primary`), which the grad norm must not count again; None where there are none."""
    primary = getattr(get_spec(p), "primary", ())
    if all(primary):
        return None
    return torch.tensor([not x for x in primary], device=p.device)


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
