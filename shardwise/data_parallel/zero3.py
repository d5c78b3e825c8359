"""ZeRO-3: parameters live only as each rank's 1/n shard; a layer is all-gathered just before it runs.

Each unit (the embedding, every transformer block, the final norm, the LM head) owns flat buckets whose
full buffers are the parameters' storage (`.data` views). Between uses the storage is resized to 0
bytes (the views, and the autograd graph's references to the parameters, stay valid); gathering
resizes it back and all-gathers the shards into it. Hooks on the unit's module:
* forward pre-hook: hold the unit (gather, waiting only for its own prefetch), prefetch the next unit
  of the chunk asynchronously, and wrap the unit's input in `_ReleaseAfterBackward`;
* forward hook: a tensor hook on the output (its gradient arriving means the unit's backward is next:
  hold it again, prefetch the previous unit), then release the forward's hold;
* `_ReleaseAfterBackward.backward` (the unit's input gradient is done, so is every use of its
  weights) releases the backward's hold — a unit whose input needs no gradient (the embedding) is
  released once autograd has accumulated the gradients of all its parameters in that backward (a
  post-accumulate-grad hook of its own on each, whether the reducer reduces that gradient per
  microbatch or only at the step's end, as a tied or MTP embedding's). Deferred weight gradients
  (zb's W) need only the saved inputs and output gradients, so W runs on a released unit.
A buffer is freed when its last hold is released (a tied weight is held by both units using it). So
every unit is gathered twice per micro-batch and chunk (forward and backward), under every schedule.
Under --fp8-all-gather a bucket of FP8 linears' weights (`b.fp8`, a `fp8.wire.WeightWire`) is gathered as FP8 bytes
with the whole weights' scales instead, which its linears read; its high-precision buffer stays empty.
"""
from __future__ import annotations

import torch

from .. import comm


class _ReleaseAfterBackward(torch.autograd.Function):
    """forward: identity / backward: identity, after releasing the unit's backward hold (its backward is done)."""

    @staticmethod
    def forward(ctx, x, units, unit):
        ctx.units, ctx.unit = units, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.units.release(ctx.unit)
        return g, None, None


class Unit:
    def __init__(self, module, buckets, chunk: int):
        self.module, self.buckets, self.chunk = module, buckets, chunk
        self.next = self.prev = None
        self.release_on_grads = False  # no input gradient to hook (the embedding): released by its grads
        self.backward_holds = 0  # holds its output hooks took in this backward (one per use: MTP reuses the embedding)
        self.params = list({id(p): p for p in module.parameters() if p.requires_grad}.values())
        self.fired = 0  # of `params`, those whose gradient this backward accumulated


class ParamUnits:
    """Gather / free / prefetch of ZeRO-3 units; `holds` count per bucket."""

    def __init__(self, units: list[Unit]):
        self.units = units
        self.on_resize = None  # called with a bucket's flat buffer after it is gathered or freed (simulate's
        #                        memory trace: `UntypedStorage.resize_` dispatches no op it could see)
        for a, b in zip(units, units[1:]):
            if a.chunk == b.chunk:  # prefetch within a pipeline chunk only: the next chunk may run much later
                a.next, b.prev = b, a
        users: dict[int, tuple[torch.Tensor, list[Unit]]] = {}  # a tied weight: both units using it
        for u in units:
            for b in u.buckets:
                b.holds, b.works, b.fp8 = 0, None, None
            u.module.register_forward_pre_hook(self._pre_forward)
            u.module.register_forward_hook(self._post_forward)
            for p in u.params:
                users.setdefault(id(p), (p, []))[1].append(u)
        for p, us in users.values():
            p.register_post_accumulate_grad_hook(lambda p, us=us: self._grad_accumulated(us))

    # ------------------------------------------------------------ gather and free
    def _start(self, u: Unit) -> None:
        for b in u.buckets:
            if b.works is None and b.fp8 is not None and not b.fp8.gathered():
                b.works = [b.fp8.start(b)]
                if self.on_resize is not None:
                    self.on_resize(b.fp8.buf)
            elif b.works is None and b.fp8 is None and not b.flat.untyped_storage().nbytes():
                self._resize(b, b.padded * b.flat.element_size())
                b.works = [comm.all_gather_into_async(b.flat, b.shard.detach(), b.axis)]

    def _wait(self, u: Unit) -> None:
        for b in u.buckets:
            if b.works is not None:
                for w in b.works:
                    comm.wait(w, b.axis, "all_gather of ZeRO-3 parameters")
                b.works = None
                if b.fp8 is not None:
                    b.fp8.attach()

    def hold(self, u: Unit) -> None:
        self._start(u)
        self._wait(u)
        for b in u.buckets:
            b.holds += 1

    def release(self, u: Unit) -> None:
        for b in u.buckets:
            b.holds -= 1
            if b.holds == 0:
                self._free(b)

    def _free(self, b) -> None:
        if b.works is not None:  # a prefetch nobody used: finish it before its buffer goes
            for w in b.works:
                comm.wait(w, b.axis, "all_gather of ZeRO-3 parameters")
            b.works = None
        if b.fp8 is not None:
            b.fp8.free()
            if self.on_resize is not None:
                self.on_resize(b.fp8.buf)
        else:
            self._resize(b, 0)

    def _resize(self, b, nbytes: int) -> None:
        b.flat.untyped_storage().resize_(nbytes)
        if self.on_resize is not None:
            self.on_resize(b.flat)

    def free_all(self) -> None:
        """End of step: every buffer back to its shard (holds left by parameters without a gradient)."""
        for u in self.units:
            u.fired = u.backward_holds = 0
            for b in u.buckets:
                b.holds = 0
                self._free(b)

    # ------------------------------------------------------------ module hooks
    def _pre_forward(self, module, args):
        u = module._sw_unit
        self.hold(u)
        if u.next is not None:
            self._start(u.next)
        x = args[0] if args else None
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            return (_ReleaseAfterBackward.apply(x, self, u), *args[1:])
        if torch.is_grad_enabled():
            u.release_on_grads = True
        return None

    def _post_forward(self, module, args, out):
        u = module._sw_unit
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, u=u: self._pre_backward(u))
        self.release(u)

    def _pre_backward(self, u: Unit) -> None:
        self.hold(u)
        u.backward_holds += 1
        if u.prev is not None:
            self._start(u.prev)

    def _grad_accumulated(self, users: list[Unit]) -> None:
        """Autograd accumulated a parameter's gradient of this backward (once per backward, however many uses)."""
        for u in users:
            u.fired += 1
            if u.fired == len(u.params):
                u.fired = 0
                self._grads_done(u)

    def _grads_done(self, u: Unit) -> None:
        """Every gradient of a unit without an input gradient arrived: its backward is over, so every hold its
        uses took in it goes (a unit called D + 1 times, as MTP's depths call the embedding, took D + 1)."""
        if u.release_on_grads:
            for _ in range(u.backward_holds):
                self.release(u)
        u.backward_holds = 0
