"""Flat gradient buckets and their reduction, started from backward as soon as a bucket is complete.

A bucket is a run of parameters of one group — same reduction axis (dp×cp, or edp for experts), same
weight decay (ZeRO ≥ 1), same pipeline chunk (ZeRO ≥ 2), same layer (ZeRO-3) — laid out in one flat
buffer padded to a multiple of the axis size, so rank r's ZeRO shard of it is elements
[r·per, (r+1)·per). Buckets are cut in parameter order at `bucket_bytes` and reduced in reverse order
(the order backward completes them).

Overlap (DDP's and Megatron's scheme): every parameter's post-accumulate-grad hook (and the deferred-W
store of zero-bubble schedules, which accumulates outside autograd) counts its bucket down; a complete
bucket's all-reduce (ZeRO-0) or reduce-scatter (ZeRO ≥ 1) starts asynchronously, in bucket order per
chunk so every rank issues the same collectives in the same order, and `finish` waits only for what is
still in flight.
* ZeRO 0/1 reduce once per step: a bucket is complete when each of its parameters has accumulated all
  `rounds` (micro-batch) gradients. A step starts with no `.grad`s (the buffer is not zeroed); the hook
  copies a parameter's first gradient into the bucket's persistent buffer and makes `.grad` a view of it,
  so later micro-batches accumulate straight into the collective's input. A parameter that got no
  gradient has its slice zeroed at launch.
* ZeRO 2/3 reduce-scatter every micro-batch: the hook adds the fresh gradient into the bucket's buffer
  (allocated on first use) and drops `.grad`; a complete bucket is reduce-scattered and its buffer
  freed, the result added into the rank's fp32 shard gradient — no full-size gradient persists.
* Buckets holding a TP-partial gradient (norms and biases under SP, experts under SP, K/V heads shared
  by TP ranks) are "deferred": the TP sum must come first, so they are reduced in `finish`, after it.
"""
from __future__ import annotations

import math

import torch

from .. import comm
from ..tensor_parallel.layers import get_spec


def is_expert(p: torch.Tensor) -> bool:
    return getattr(p, "_sw_expert", False)


def tp_partial(p: torch.Tensor, tp) -> bool:
    return tp.active and get_spec(p).grad_reduce is not None


class Bucket:
    """One flat run of parameters; `offsets` are (name, param, offset, numel) within the flat buffer."""

    def __init__(self, named, axis, expert: bool, wd: float, chunk: int, deferred: bool, pad: bool, device):
        self.axis, self.expert, self.wd, self.chunk, self.deferred = axis, expert, wd, chunk, deferred
        self.offsets, off = [], 0
        for n, p in named:
            self.offsets.append((n, p, off, p.numel()))
            off += p.numel()
        self.numel = off
        self.padded = math.ceil(off / axis.size) * axis.size if pad else off
        self.per = self.padded // axis.size
        self.device, self.dtype = device, named[0][1].dtype
        self.flat = self.shard = self.norm_weight = None  # ZeRO ≥ 1 (see GradReducer._build_zero)
        self.grad_full = None  # the reduction's input: persistent (ZeRO 0/1), per micro-batch (ZeRO 2/3)
        self.fired = 0  # gradients accumulated since the last launch
        self.ready = False
        self.launched = False  # reduced this step (ZeRO 0/1): a later gradient would be lost
        self.unit = None  # ZeRO-3: the layer whose parameters this bucket holds

    def __getitem__(self, key):  # checkpoint.py and tests read buckets like the dicts they replaced
        return getattr(self, key)

    def new_grad_buffer(self) -> torch.Tensor:
        return torch.zeros(self.padded, device=self.device, dtype=self.dtype)


def adopt_grad(full: torch.Tensor, p: torch.Tensor, off: int, k: int) -> None:
    """Make p.grad the view [off, off+k) of `full`: the first gradient of a step arrives as autograd's own
    fresh tensor and is copied in (cheaper than zeroing the buffer every step and adding into it); later
    micro-batches then accumulate into the view in place."""
    view = full[off:off + k]
    if p.grad is not None and (p.grad.untyped_storage()._cdata, p.grad.storage_offset()) != \
            (view.untyped_storage()._cdata, view.storage_offset()):  # storage identity: fake tensors have no address
        view.copy_(p.grad.reshape(-1))
        p.grad = view.view_as(p)


class OverlappedReduction:
    """Starts each bucket's collective from backward, in order, and finishes them on demand."""

    def __init__(self, buckets: list[Bucket], zero: int, reduce_dtype, max_inflight: int | None = None,
                 late: frozenset = frozenset()):
        self.zero, self.reduce_dtype = zero, reduce_dtype
        self.buckets = buckets
        # (chunk, late) -> its hooked buckets in launch (reverse) order. Under split backward (zb, dualpipev)
        # a bucket holding a `late` parameter (its dW comes from the W action) is complete only at W, the
        # others already at B: each kind cycles on its own, so a vector bucket launches at its B every
        # micro-batch instead of waiting behind a matrix bucket (and merging with a later B's gradients).
        self.order: dict[tuple[int, bool], list[Bucket]] = {}
        for b in reversed(buckets):
            if not b.deferred:
                b.queue = (b.chunk, any(id(p) in late for _, p, _, _ in b.offsets))
                self.order.setdefault(b.queue, []).append(b)
        self.max_inflight = max_inflight
        self.rounds = 1
        self.poisoned = False
        self.reset()

    def reset(self) -> None:
        self.ptr = {c: 0 for c in self.order}
        self.inflight: list[tuple] = []  # (work, axis, what, finalize)
        self.finished = False  # `finish` ran: every bucket is reduced until the next `reset`
        for b in self.buckets:
            b.fired, b.ready, b.received, b.launched = 0, False, 0, False

    def refuse_late(self, b: Bucket, p: torch.Tensor) -> None:
        """A gradient for a bucket already reduced this step would be silently lost (or reduce a partial
        sum): raise, naming the parameter and `rounds`."""
        if not (self.finished or (b.launched and self.zero < 2)):
            return
        name = next((n for n, q, _, _ in b.offsets if q is p), "?")
        when = "after reduce_and_clip()" if self.finished else f"after its bucket was reduced (rounds={self.rounds})"
        raise RuntimeError(
            f"GradReducer: a gradient for {name!r} arrived {when}; each step must run exactly rounds={self.rounds} "
            f"backward passes between zero_grad()/step() and reduce_and_clip() (build the reducer with rounds = "
            f"the micro-batches per step)")

    # ------------------------------------------------------------ from backward
    def on_grad(self, b: Bucket, p: torch.Tensor, off: int, k: int) -> None:
        """A gradient of `p` was accumulated: ZeRO ≥ 2 moves it into the bucket buffer; launch if complete."""
        self.refuse_late(b, p)
        if self.zero >= 2:
            if p.grad is None:  # nothing was accumulated (an unused parameter): nothing to count
                return
            if b.grad_full is None:
                b.grad_full = b.new_grad_buffer()
            b.grad_full[off:off + k].add_(p.grad.reshape(-1))
            p.grad = None
        else:
            adopt_grad(b.grad_full, p, off, k)
        b.fired += 1
        need = len(b.offsets) * (1 if self.zero >= 2 else self.rounds)
        if b.fired >= need:
            b.fired, b.ready = 0, True
            self._advance(b.queue)

    def _advance(self, queue: tuple[int, bool]) -> None:
        """Launch the queue's ready buckets in order; ZeRO ≥ 2 cycles through them once per micro-batch."""
        seq = self.order[queue]
        while self.ptr[queue] < len(seq) and seq[self.ptr[queue]].ready:
            b = seq[self.ptr[queue]]
            b.ready = False
            self.launch(b)
            self.ptr[queue] += 1
            if self.zero >= 2 and self.ptr[queue] == len(seq):
                self.ptr[queue] = 0

    # ------------------------------------------------------------ the collectives
    def launch(self, b: Bucket) -> None:
        b.launched = True
        full = b.grad_full
        if full is None:
            return
        if self.poisoned:
            full.fill_(float("nan"))
        if self.zero < 2:
            for _, p, off, k in b.offsets:  # a gradient set outside the hooks is copied in; a parameter
                if p.grad is None:          # that got none this step reduces zeros
                    full[off:off + k].zero_()
                    p.grad = full[off:off + k].view_as(p)
                else:
                    adopt_grad(full, p, off, k)
        else:
            b.grad_full = None  # in flight now; the next micro-batch gets a fresh buffer
        src = full if self.reduce_dtype is None else full.to(self.reduce_dtype)
        if self.zero == 0:
            work = comm.all_reduce_async(src, b.axis)

            def finalize(src=src, full=full):
                if src is not full:
                    full.copy_(src)
            self._push(work, b.axis, "all_reduce", finalize)
            return
        direct = self.zero == 1 and src is full
        out = b.shard.grad if direct else torch.empty(b.per, device=full.device, dtype=src.dtype)
        work = comm.reduce_scatter_into_async(out, src, b.axis)

        def finalize(b=b, out=out, direct=direct, keep=(src, full)):
            if direct:
                return
            if self.zero == 1 or b.received == 0:
                b.shard.grad.copy_(out)
            else:
                b.shard.grad.add_(out)
            b.received += 1
        self._push(work, b.axis, "reduce_scatter", finalize)

    def _push(self, work, axis, what, finalize) -> None:
        self.inflight.append((work, axis, what, finalize))
        if self.max_inflight is not None:
            while len(self.inflight) > self.max_inflight:  # bound the buffers held by collectives in flight
                self._wait_one()

    def _wait_one(self) -> None:
        work, axis, what, finalize = self.inflight.pop(0)
        comm.wait(work, axis, f"{what} of a gradient bucket")
        finalize()

    def finish(self) -> None:
        """Launch, in order, whatever backward did not complete (a parameter without a gradient), then the
        deferred buckets (their TP sums are done by now); wait for everything in flight."""
        for queue, seq in sorted(self.order.items()):
            start = self.ptr[queue]
            for b in seq[start:] + (seq[:start] if self.zero >= 2 else []):
                self.launch(b)  # ZeRO ≥ 2: a bucket without pending gradients has no buffer, launch skips it
                b.fired, b.ready = 0, False
        for b in self.buckets:
            if b.deferred:
                if self.zero >= 2:
                    b.grad_full = b.new_grad_buffer()
                    for _, p, off, k in b.offsets:
                        if p.grad is not None:
                            b.grad_full[off:off + k].copy_(p.grad.reshape(-1))
                            p.grad = None
                self.launch(b)
        self.wait_all()
        self.finished = True

    def wait_all(self) -> None:
        while self.inflight:
            self._wait_one()
