"""One rank's training state as one uint8 tensor, and back: what a memory copy holds.

Exactly what a resume from disk restores, for this rank's own layout: every local tensor `load_checkpoint`
reads into (parameters or their ZeRO shards, AdamW moments / Muon momentum, persistent buffers — the views
`checkpoint.boxes.state_entries` lists), the optimizer's step count, the bad-step count, the host RNG and the
dropout tracker's streams, and the step, which is the data position (batch N is a pure function of (seed, N)).
The layout is recorded as each tensor's key, shape and dtype: `restore` loads a copy only into the layout that made
it; each tensor's global offsets and the grid are recorded too, so `elastic` can re-cut copies for another dp.
"""
from __future__ import annotations

import json
import struct

import torch

from .. import host
from ..checkpoint.boxes import ensure_state, state_entries


def state_boxes(trainer) -> list[tuple[str, tuple, torch.Tensor]]:
    """(key, global offsets, live view) of every local tensor of the training state, in a fixed order."""
    entries = state_entries(trainer, save=False)
    return [(f"{key}@{i}", off, t) for key, (_, boxes) in sorted(entries.items()) for i, (off, t) in enumerate(boxes)]


def _views(trainer) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for k, _, t in state_boxes(trainer)]


def _layout(views) -> list:
    return [[k, list(t.shape), str(t.dtype)] for k, t in views]


def state_bytes(trainer) -> int:
    """The tensor bytes of this rank's copy (its metadata, a few kB, aside): what one copy holds in host memory."""
    ensure_state(trainer.reducer)
    return sum(t.numel() * t.element_size() for _, t in _views(trainer))


def snapshot(trainer, step: int) -> torch.Tensor:
    """This rank's state after `step` completed optimizer steps, as one host uint8 tensor."""
    ensure_state(trainer.reducer)
    boxes = state_boxes(trainer)
    views = [(k, t) for k, _, t in boxes]
    state = next(iter(trainer.reducer.optimizer.state.values()))
    tracker = trainer.model.rng_tracker
    meta = {"step": step, "optimizer_step": int(host.read(state["step"], "memory copy step")),
            "bad_steps": trainer.bad_steps, "lr_decay_steps": trainer.cfg.lr_decay_steps, "layout": _layout(views),
            "offsets": [list(off) for _, off, _ in boxes], "world": trainer.mesh.dims.world_size,
            "dims": {a: getattr(trainer.mesh.dims, a) for a in ("dp", "pp", "cp", "tp")},
            "torch_rng": torch.get_rng_state().tolist(),
            "tracker_rng": {k: g.get_state().tolist() for k, g in tracker.generators.items()}}
    head = json.dumps(meta).encode()
    parts = [torch.tensor(list(struct.pack("<Q", len(head)) + head), dtype=torch.uint8, device="cpu")]
    parts += [t.detach().to("cpu").contiguous().view(-1).view(torch.uint8) for _, t in views]
    return torch.cat(parts)


def read_meta(blob: torch.Tensor) -> tuple[dict, int]:
    """The copy's metadata and where its tensor bytes start."""
    n = struct.unpack("<Q", blob[:8].numpy().tobytes())[0]
    return json.loads(blob[8:8 + n].numpy().tobytes()), 8 + n


def restore(trainer, blob: torch.Tensor) -> int:
    """Load a copy made by `snapshot` under this layout into `trainer`; returns its step."""
    meta, at = read_meta(blob)
    ensure_state(trainer.reducer, meta["optimizer_step"])
    views = _views(trainer)
    if _layout(views) != meta["layout"]:
        raise ValueError("memory copy was made under another layout; resume from a disk checkpoint instead")
    with torch.no_grad():
        for _, t in views:
            n = t.numel() * t.element_size()
            t.copy_(blob[at:at + n].clone().view(t.dtype).view(t.shape))  # clone: aligned for the dtype
            at += n
    torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8, device="cpu"))
    for k, g in trainer.model.rng_tracker.generators.items():
        g.set_state(torch.tensor(meta["tracker_rng"][k], dtype=torch.uint8, device="cpu"))
    trainer.step = meta["step"]
    trainer.bad_steps = meta["bad_steps"]
    return meta["step"]
