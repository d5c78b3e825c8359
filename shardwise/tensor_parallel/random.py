"""RNG tracker: dropout that is right in both replicated and TP-sharded regions.

Two streams, as in Megatron's `CudaRNGStatesTracker`:
* "replicated": the same seed on every TP rank, so dropout on replicated tensors (and on
  sequence-parallel shards, which cut one global mask) agrees with the single-device model;
* "tp": seeded with the TP rank, so attention heads on different ranks draw independent masks.
"""
from __future__ import annotations

import contextlib

import torch

TP_SEED_OFFSET = 2718


class RNGTracker:
    def __init__(self, seed: int, tp_rank: int = 0, pp_rank: int = 0, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.device = device
        base = seed + 100 * pp_rank
        self.generators = {
            "replicated": torch.Generator(device=device).manual_seed(base),
            "tp": torch.Generator(device=device).manual_seed(base + TP_SEED_OFFSET + tp_rank),
        }

    def generator(self, name: str) -> torch.Generator:
        return self.generators[name]

    def get_states(self) -> dict[str, torch.Tensor]:
        """Every stream's state: activation recompute restores these so dropout masks replay identically."""
        return {name: gen.get_state() for name, gen in self.generators.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        for name, state in states.items():
            self.generators[name].set_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = "tp"):
        """Run code that draws from torch's default generator (e.g. SDPA dropout) on stream `name`."""
        gen = self.generators[name]
        if self.device.type == "cuda":
            saved = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(gen.get_state(), self.device)
        else:
            saved = torch.get_rng_state()
            torch.set_rng_state(gen.get_state())
        try:
            yield
        finally:
            if self.device.type == "cuda":
                gen.set_state(torch.cuda.get_rng_state(self.device))
                torch.cuda.set_rng_state(saved, self.device)
            else:
                gen.set_state(torch.get_rng_state())
                torch.set_rng_state(saved)


def replicated_dropout(x: torch.Tensor, p: float, tracker: RNGTracker, sp_axis=None) -> torch.Tensor:
    """Dropout (training) on a tensor replicated over TP, or sequence-sharded under SP (`sp_axis` active).

    Under SP the mask for the full sequence is drawn on every rank and each keeps its slice, so
    the result equals single-device dropout with the same seed.
    """
    shape = list(x.shape)
    sp = sp_axis is not None and sp_axis.active
    if sp:
        shape[1] *= sp_axis.size
    keep = torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(1 - p, generator=tracker.generator("replicated"))
    if sp:
        keep = keep.chunk(sp_axis.size, dim=1)[sp_axis.rank]
    return x * keep / (1 - p)
