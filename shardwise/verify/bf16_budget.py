"""bf16 runs: a budget measured in fp32 (docs/verify.md, "bf16 bounds").

A fixed bf16 bound has to absorb bf16's own noise for the worst parameter, which leaves it nearly empty. Instead each
quantity is held to a multiple of the bf16 noise the single-device model itself shows against fp32, per parameter,
plus an absolute floor: relative for the loss and gradients; for parameters and updates counted in flipped signs —
bf16 flips the step-1 update lr·sign(g) of near-zero gradients at random, each flip moving a parameter by 2·lr, and a
96-element norm weight may flip one element in one run and none in the other — so floor·lr in norm per update,
floor·Σlr per parameter value.
"""
from __future__ import annotations

import torch

BF16_MULTIPLE = 4.0
BF16_FLOOR = dict(loss=2e-3, grad=2e-2, param=4.0, update=4.0)
FP8_FLOOR = dict(loss=1e-5, grad=1e-3, param=4.0, update=4.0)
"""fp32 runs with --fp8: the noise is the FP8 reference against its twin with weights moved one ulp (rounding flips,
docs/fp8.md), measured, so the floors only cover a quantity whose flips are zero by chance."""


class NoiseBudget:
    """bf16: the layout passes where its distance to the bf16 reference is within `BF16_MULTIPLE` times what bf16
    itself costs, measured on the single-device model (the bf16 reference against an fp32 one, same forced
    routing), plus an absolute floor for quantities whose bf16 noise is near zero by chance.

    Per parameter and step: rel(layout, ref16) ≤ BF16_MULTIPLE · rel(ref16, ref32) + floor, with rel the
    norm-wise relative difference and floor BF16_FLOOR[quantity] for gradients, BF16_FLOOR[quantity]·lr / ||ref16||
    for updates and values; for the loss, |Δ| ≤ BF16_MULTIPLE · |loss16 − loss32| + BF16_FLOOR["loss"] ·
    max(1, |loss16|). `ratios` holds the largest left/right side seen per quantity; the layout passes when all
    are ≤ 1. Two bf16 runs that round differently stand about √2 times as far apart as
    either stands from fp32, so the multiple leaves a ~3× margin; a parameter missing a quarter of its gradient
    scores 0.5 and an eighth 0.35 against a bf16 gradient floor of ~1e-2.
    """

    def __init__(self, floors: dict = BF16_FLOOR):
        self.floors = floors
        self.ratios = {q: 0.0 for q in ("loss", "grad", "param", "update")}
        self.noise = {q: 0.0 for q in self.ratios}
        self.lr_sum = 0.0  # the values' floor unit: Σ lr of the steps so far

    def add_gradients(self, loss: float, ref_losses: list[float], rel: torch.Tensor, ref16: dict, ref32: dict,
                      names) -> None:
        """After the backward: the loss and the gradients (`ref_losses`: the bf16 reference's, the fp32 one's)."""
        self.add_loss(loss, *ref_losses)
        self.add("grad", rel, ref16, ref32, names)

    def add_step(self, value_rel: torch.Tensor, update_rel: torch.Tensor, values: tuple[dict, dict],
                 updates: tuple[dict, dict], names, lr: float) -> None:
        """After an optimizer step of learning rate `lr`: the values and the updates, each (bf16 reference's, fp32
        reference's)."""
        self.lr_sum += lr
        self.add("param", value_rel, *values, names, self.lr_sum)
        self.add("update", update_rel, *updates, names, lr)

    def add(self, quantity: str, layout_rel: torch.Tensor, ref16: dict, ref32: dict, names, lr: float = 0.0) -> None:
        """`lr`: for parameters and updates, the absolute floor's unit (the step's lr, or the sum so far)."""
        ratio, noise = self.ratio(quantity, layout_rel, ref16, ref32, names, lr)
        self.ratios[quantity] = max(self.ratios[quantity], float(ratio.max()))
        self.noise[quantity] = max(self.noise[quantity], float(noise.max()))

    def ratio(self, quantity: str, layout_rel: torch.Tensor, ref16: dict, ref32: dict, names,
              lr: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """[parameters] each: left over right side of the bound, and the measured noise rel(ref16, ref32)."""
        norms = torch.stack([ref16[n].double().norm() for n in names]).clamp_min(1e-30)
        noise = torch.stack([(ref16[n].double() - ref32[n].double()).norm() for n in names]) / norms
        extra = self.floors[quantity] * (lr / norms if lr else 1.0)
        return layout_rel / (BF16_MULTIPLE * noise + extra).to(layout_rel.device), noise.to(layout_rel.device)

    def add_loss(self, loss: float, loss16: float, loss32: float) -> None:
        budget = BF16_MULTIPLE * abs(loss16 - loss32) + self.floors["loss"] * max(1.0, abs(loss16))
        self.ratios["loss"] = max(self.ratios["loss"], abs(loss - loss16) / budget)
        self.noise["loss"] = max(self.noise["loss"], abs(loss16 - loss32))

    @property
    def passed(self) -> bool:
        return all(r <= 1.0 for r in self.ratios.values())

    def tolerances(self) -> dict:
        """The bounds as the JSON verdict reports them."""
        return {"multiple": BF16_MULTIPLE, **self.floors}

    def result(self) -> dict:
        return {"multiple": BF16_MULTIPLE, "floors": self.floors, "ratios": self.ratios, "noise": self.noise}
