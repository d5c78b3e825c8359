"""verify's checks, one per quantity, each with its bound and why the bound is what it is (docs/verify.md).

A check reads one step's per-parameter norm-wise relative differences (`compare.per_param_rel`: squared norms summed
over all ranks, so replicas cancel), keeps the worst it has seen, and says whether the run stayed within its bound.
The bounds are fp32's: in bf16, `NoiseBudget` holds the loss, gradients, values and updates to a multiple of bf16's
own noise instead, and only coverage and routing are judged alike. A parameter the layout never updates scores 1.0,
one TP half of it 0.71 and a quarter 0.5: every bound past step 1 is far below all three.
"""
from __future__ import annotations

import torch

from .adam_response import AdamResponse
from .compare import coverage, norms
from .fp64_budget import first_grad_budget


class Loss:
    """|loss − reference loss| ≤ 1e-5 · max(1, |first loss|): the same tokens and weights, so only the order of the
    reductions differs."""
    bound = 1e-5

    def __init__(self):
        self.diff, self.losses = 0.0, []

    def add(self, loss: float, ref_loss: float) -> None:
        self.diff = max(self.diff, abs(loss - ref_loss))
        self.losses.append(loss)

    @property
    def passed(self) -> bool:
        return self.diff <= self.bound * max(1.0, abs(self.losses[0]))


class FirstStepGradients:
    """Step 1's gradients ≤ 1e-5: computed from bit-identical weights, they differ by pure layout arithmetic. A
    parameter over the flat bound is held instead to FP64_MULTIPLE times the fp32 noise measured against the reference
    run in float64 (`fp64_budget`): where a gradient is a sum that cancels (the hybrid's A_log / dt_bias at
    initialisation, 100–175-fold) fp32 itself cannot pin it to 1e-5. `ratio` is the largest ratio to the bound."""
    bound = 1e-5

    def __init__(self):
        self.rel, self.ratio, self.budget = 0.0, 0.0, None

    def add(self, runs, rel: torch.Tensor, grad_views) -> None:
        self.rel = float(rel.max())
        if not runs.budgeted:
            self.ratio, self.budget = first_grad_budget(runs, rel, grad_views, self.bound)

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0


class LaterGradients:
    """Gradients of the later steps ≤ 1e-3: they start from weights that AdamW's g/√v has already pulled apart
    wherever a gradient is near zero (a drift of ~lr), so this is a drift bound (a real layout bug is O(1)). A
    parameter over it is judged again at the layout's own weights, where the drift is gone and only this step's
    arithmetic is left (hybrid dp2×tp2×SP seed 9837: wq 2.2e-3 at step 3, 3.8e-7 at its own weights) — not under
    dropout, where that extra run would draw other masks, nor in bf16, where `NoiseBudget` judges. `at_layout_weights`
    names each parameter judged again, with its step and both distances."""
    bound = 1e-3

    def __init__(self):
        self.rel, self.worst, self.at_layout_weights = 0.0, 0.0, {}

    def add(self, runs, step: int, rel: torch.Tensor, grad_views) -> None:
        worst = float(rel.max())
        self.rel = max(self.rel, worst)
        if worst > self.bound and not runs.budgeted and not runs.dropout:
            worst = float(self.again(runs, step, rel, grad_views, rel > self.bound).max())
        self.worst = max(self.worst, worst)

    def again(self, runs, step: int, rel: torch.Tensor, grad_views, over: torch.Tensor) -> torch.Tensor:
        """`rel` with each parameter in `over` (a mask equal on every rank) judged again at the layout's own weights
        (a collective). bf16 uses it too, for the parameters over its noise budget: a step-1 update whose sign bf16
        flipped differently moves a cancelling later gradient far more than that step's own arithmetic does
        (DeepSeek-tiny tp2×SP seed 553752802: a router's step-2 gradient 0.366 off, 0.0053 at its own weights)."""
        again = runs.rel(grad_views, runs.grads_at_layout_weights(step))
        over = over.to(rel.device)
        self.at_layout_weights.update({runs.names[i]: {"step": step + 1, "rel": float(rel[i]),
                                                       "at_layout_weights": float(again[i])}
                                       for i in over.nonzero().flatten().tolist()})
        return torch.where(over, again, rel)

    @property
    def passed(self) -> bool:
        return self.worst <= self.bound


class Updates:
    """||u − u_ref|| / ||u_ref||, u = after − before the optimizer step. Updates, not values, catch a parameter the
    layout never trains: it scores exactly 1.0, while its value after a few warm-up steps is ~1e-3 off.

    Step 1: ≤ 5e-2. Its AdamW update is lr·sign(g), so rounding that flips the sign of a near-zero gradient moves it
    most: fp32 usually < 3.6e-4, but seed 1061424824 at tp4+SP scores 2.9e-3 from first-step gradients within 8e-7.

    Later steps: what the gradient difference does not explain (`AdamResponse`: the reference's AdamW step given the
    layout's gradient instead of its own) ≤ 1e-3 + floor·lr / ||u_ref||. The response covers an element first touched
    at a later step, which takes AdamW's first step there, rounding-sensitive near ε (qwen3-moe-tiny dp2×ep2 seed
    2358380713: one element 0.5·lr off at step 2), and a drifted later gradient (tiny dp2×cp2 seed 2215398245). The
    floor, lr/16 in norm, covers one element whose gradient nearly cancels its AdamW momentum (m ≈ 0, v > 0), where a
    1e-7 gradient difference moves its update by a visible fraction of lr (DeepSeek-tiny dp4×ep4 ZeRO-1 seed
    1629419864: lr/190; qwen3-moe-tiny tp2+SP seed 2758942747: lr/21, 0.86 of a lr/64 floor), against an update norm
    of ~lr·√numel. Muon-updated matrices get no response (their update is not elementwise)."""
    first_bound = 5e-2
    bound = 1e-3
    floor = 2**-4

    def __init__(self, runs):
        self.first, self.later, self.ratio = 0.0, 0.0, 0.0
        self.response = None if runs.budgeted else AdamResponse(runs.ref, runs.ref_params)

    def collect(self, step: int, grad_views, lr: float) -> None:
        """Before the optimizer step: what the reference's AdamW step would do with the layout's gradients."""
        if self.response is not None:
            self.response.collect(step, grad_views, lr)

    def add(self, runs, step: int, rel: torch.Tensor, ref_updates: dict) -> torch.Tensor | None:
        """After the optimizer step; returns (fp32) this step's bound per parameter in norm, for `Values`."""
        worst = float(rel.max())
        if step == 0:
            self.first = worst
        else:
            self.later = max(self.later, worst)
        if self.response is None:
            return None
        response = self.response.allowance(ref_updates, runs.names, runs.world).cpu()
        u = norms(ref_updates, runs.names)
        if step == 0:
            return self.first_bound * u
        lr = runs.lr(step)
        unexplained = (rel - response.to(rel.device)).clamp_min(0.0)
        room = self.bound + self.floor * lr / u.to(rel.device).clamp_min(1e-30)
        self.ratio = max(self.ratio, float((unexplained / room).max()))
        return (self.bound + response) * u + self.floor * lr

    @property
    def passed(self) -> bool:
        return self.first <= self.first_bound and self.ratio <= 1.0


class Values:
    """||p − p_ref|| ≤ 1e-3·||p_ref|| + every update bound passed so far (5e-2·||u_1|| + Σ later ((1e-3 + response)·
    ||u_t|| + lr_t/16)): an update within its bound moved the value by at most that bound. With lr 3e-3 on a 0.02-std
    weight, step 1's allowed sign flips alone are 1.3e-3 of the value's norm (qwen3-tiny tp2+SP seed 889595099: wo's
    step-1 update 3.3e-3 off, within 5e-2)."""
    bound = 1e-3

    def __init__(self, n_params: int):
        self.rel, self.ratio = 0.0, 0.0
        self.allowance = torch.zeros(n_params, dtype=torch.float64)  # per parameter: Σ of its update bounds so far

    def add(self, rel: torch.Tensor, ref_values: dict, names, update_bound: torch.Tensor | None) -> None:
        self.rel = max(self.rel, float(rel.max()))
        if update_bound is None:
            return
        self.allowance += update_bound
        p = norms(ref_values, names)
        self.ratio = max(self.ratio, float((rel.cpu() * p / (self.bound * p + self.allowance).clamp_min(1e-30)).max()))

    @property
    def passed(self) -> bool:
        return self.ratio <= 1.0


class Coverage:
    """The fraction of reference elements that both the gradient and the value comparisons reached, which must be
    exactly 1: every number above is a maximum over what was compared, so a parameter a layout's views leave out
    would pass unseen."""

    def __init__(self):
        self.fraction = None

    def add(self, runs, view_lists) -> None:
        if self.fraction is None:
            self.fraction = coverage(view_lists, runs.ref_params, runs.world)

    @property
    def passed(self) -> bool:
        return self.fraction == 1.0


def tolerances() -> dict:
    """The fp32 bounds as the JSON verdict reports them."""
    return dict(loss=Loss.bound, first_grad=FirstStepGradients.bound, grad=LaterGradients.bound, param=Values.bound,
                first_update=Updates.first_bound, update=Updates.bound, update_floor=Updates.floor)
