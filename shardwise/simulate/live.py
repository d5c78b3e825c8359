"""Live memory of one simulated rank: every fake storage from its creation until Python frees it.

A TorchDispatchMode above FakeTensorMode sees every op's outputs; each new storage is weakly referenced and
counted until it dies, so `peak` is what a caching-free allocator would hold at its worst moment (no
fragmentation, no allocator rounding). At each new peak the live bytes are grouped by where they came from
(parameters, gradients, optimizer state, or the op and dtype that made an activation) and the phase of the
step (forward, backward, optimizer, other), which is what `shardwise simulate` reports beside the planner.
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEVICE = torch.ops.prim.device.default


class LiveMemory(TorchDispatchMode):
    """`live`, `peak` (bytes), `peak_phase` and `peak_groups` ({group: bytes} at the peak)."""

    def __init__(self, answer_device: bool = True):
        """`answer_device`: answer device queries here (the fast path) rather than through FakeTensorMode."""
        super().__init__()
        self.answer_device = answer_device
        self.storages: dict[int, tuple[int, str, weakref.ref]] = {}  # storage key -> (bytes, group, ref)
        self.groups: Counter[str] = Counter()
        self.live = self.peak = 0
        self.peak_phase, self.peak_groups = "", {}
        self.phase = "forward"
        self.labels: dict[int, str] = {}  # storage key -> static label (parameters, gradients, ...)
        self.names: dict[tuple, str] = {}  # (phase, op, dtype) -> the group an op's output is counted in

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: no Dynamo-disabling wrapper around `__torch_dispatch__` (torch adds one per mode by default, a few
        percent of a simulated step). A simulation compiles nothing: simulate refuses --compile."""
        return False

    def label(self, tensors, name: str) -> None:
        """Name the storages behind `tensors` (statics) so the report groups them by what they are."""
        for t in tensors:
            if isinstance(t, FakeTensor):
                key = t.untyped_storage()._cdata
                self.labels[key] = name
                if key in self.storages:
                    n, old, ref = self.storages[key]
                    self.groups[old] -= n
                    self.groups[name] += n
                    self.storages[key] = (n, name, ref)

    def watch(self, tensors) -> None:
        """Count the storages behind `tensors` (ZeRO-3 unit buffers), whose size changes by
        `UntypedStorage.resize_` — which dispatches no op: their owner reports each resize (`resized`)."""
        self.track(tensors, "ZeRO flat buffers")
        for t in tensors:  # resized to their shard since they were made
            self.resized(t)

    def resized(self, t: torch.Tensor) -> None:
        """`t`'s storage was resized in place: count its new size."""
        key = t.untyped_storage()._cdata
        entry = self.storages.get(key)
        if entry is None:
            return
        n = t.untyped_storage().nbytes()
        if n != entry[0]:
            self.storages[key] = (n, entry[1], entry[2])
            self.groups[entry[1]] += n - entry[0]
            self.live += n - entry[0]
            self._check_peak()

    def _check_peak(self) -> None:
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self._phase()
            self.peak_groups = dict(self.groups)

    def reset_peak(self) -> int:
        """Start a new peak from what is live now; returns the old peak (e.g. the model build's)."""
        old = self.peak
        self.peak, self.peak_phase, self.peak_groups = self.live, self._phase(), dict(self.groups)
        return old

    def _phase(self) -> str:
        return "backward" if torch._C._current_graph_task_id() != -1 else self.phase

    def _add(self, t: torch.Tensor, group: str) -> None:
        s = t.untyped_storage()
        key = s._cdata
        if key in self.storages:
            return
        n = s.nbytes()
        group = self.labels.get(key, group)
        self.storages[key] = (n, group, weakref.ref(s, lambda _, k=key: self._free(k)))
        self.groups[group] += n
        self.live += n
        self._check_peak()

    def _free(self, key: int) -> None:
        entry = self.storages.pop(key, None)
        if entry is not None:
            self.live -= entry[0]
            self.groups[entry[1]] -= entry[0]
            self.labels.pop(key, None)

    def track(self, tensors, group: str) -> None:
        """Count tensors created before the mode was entered (or outside it)."""
        for t in tensors:
            if isinstance(t, FakeTensor) and t.device.type != "meta":
                self._add(t, group)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE and self.answer_device and isinstance(args[0], FakeTensor):
            # autograd's engine asks every tensor it touches for its device (over half of all dispatches): answered
            # here as FakeTensorMode answers it, without the descent through its dispatch
            t = args[0]
            return torch.device("meta") if t.fake_mode.in_kernel_invocation else t.fake_device
        out = func(*args, **(kwargs or {}))
        made = (out,) if isinstance(out, FakeTensor) else tree_leaves(out) if isinstance(out, (tuple, list)) else ()
        group = None
        for t in made:
            if isinstance(t, FakeTensor) and t.device.type != "meta":  # a model built on meta holds nothing
                if group is None:  # the op's outputs count under its first output's dtype
                    key = (self._phase(), func, t.dtype)
                    group = self.names.get(key)
                    if group is None:
                        group = self.names[key] = \
                            f"{key[0]} {func.__name__.split('.')[0]} {str(t.dtype).removeprefix('torch.')}"
                self._add(t, group)
        return out

    def top(self, k: int = 5) -> list[dict]:
        """The k largest groups at the peak."""
        items = sorted(((n, g) for g, n in self.peak_groups.items() if n > 0), reverse=True)[:k]
        return [{"group": g, "bytes": n} for n, g in items]
