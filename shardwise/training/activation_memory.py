"""Measured activation memory: the peak bytes autograd holds in saved tensors during a step (and, beside it,
the static bytes it is measured against: `static_storage_bytes`).

The planner's activation figure is a claim about exactly these tensors, so the trainer measures them
the same way the planner counts them: every tensor saved for backward (seen by a saved-tensor pack
hook), counted once per storage at the storage's full size, parameters (and the ZeRO flat buffers
they are views of) excluded, and released when autograd drops it (the graph frees a node's saved
tensors after its backward). Under activation recompute the hook sees what checkpoint keeps (each
recomputed region's inputs); the tensors a recomputation rebuilds during backward live in
checkpoint's own frame, outside any hook — the planner reports that one-layer transient separately.
"""
from __future__ import annotations

import torch

from ..optim import optimizers


class _Held:
    """A saved tensor on loan to autograd; its storage stops counting when autograd lets go of it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: "SavedActivationMeter", key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        self.meter._release(self.key)


class SavedActivationMeter:
    """Context manager: `peak` = max over time of the bytes of distinct saved storages alive."""

    def __init__(self, params):
        # Storages are keyed by identity (a fake tensor's storage has no address). ZeRO-1/2 parameters are
        # views of flat buffers and ZeRO-3 ones views of buffers gathered and freed per layer: their
        # storages are skipped, whichever view autograd saves.
        self.skip = {p.untyped_storage()._cdata for p in params}
        self.refs: dict[int, list[int]] = {}  # storage identity -> [saved tensors holding it, nbytes]
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        key = s._cdata
        if key in self.skip or not s.nbytes():
            return t
        ref = self.refs.setdefault(key, [0, s.nbytes()])
        if ref[0] == 0:
            self.live += ref[1]
            self.peak = max(self.peak, self.live)
        ref[0] += 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key: int) -> None:
        ref = self.refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]


def static_storage_bytes(trainer) -> int:
    """Bytes of the distinct storages behind this rank's parameters, gradients, optimizer state (AdamW moments,
    Muon momentum) and the reducer's flat buffers (the gradients' home under ZeRO 0/1), counted once per
    storage at its full size (padding included). Taken right after the optimizer step: the static peak.
    AdamW's per-tensor scalar step counters are left out, as the planner leaves them out."""
    opts = optimizers(trainer.reducer)
    tensors = list(trainer.model.parameters()) + [p for o in opts for g in o.param_groups for p in g["params"]]
    tensors += [p.grad for p in tensors if p.grad is not None]
    tensors += [t for o in opts for st in o.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    tensors += [t for b in trainer.reducer.buckets for t in vars(b).values() if torch.is_tensor(t)]
    sizes = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}  # by storage identity
    return sum(sizes.values())
