"""The update difference a gradient difference explains: the reference's AdamW step given the layout's gradient."""
from __future__ import annotations

import torch

from .. import comm
from ..optim import optimizers
from ..training.trainer import Trainer


class AdamResponse:
    """What the reference's AdamW step does with the layout's gradient instead of its own: per element,
    F(g) = lr·m̂/(√v̂ + ε) from the reference's moments before the step, and `allowance` gives, per parameter and
    relative to the reference update's norm, ||F(g_layout) − F(g_ref)||. The gradient difference is checked on its
    own; this is the update difference it explains, computed rather than guessed: a first-touched element's first
    AdamW step (zero moments: a rounding-sensitive sign near ε), or the response to a later gradient's drift."""

    def __init__(self, ref: Trainer, ref_params: dict[str, torch.Tensor]):
        self.adam = {}  # id(param) -> (optimizer, beta1, beta2, eps)
        for opt in optimizers(ref.reducer):
            if isinstance(opt, torch.optim.AdamW):
                for group in opt.param_groups:
                    for p in group["params"]:
                        self.adam[id(p)] = (opt, *group["betas"], group["eps"])
        self.ref_params = ref_params
        self.pairs = []

    def collect(self, step: int, grad_views, lr: float) -> None:
        """Before the optimizer step: F(g_layout) − F(g_ref) over this rank's views, kept for `allowance`."""
        self.pairs = []
        for n, spec, mine, lo, hi in grad_views:
            p = self.ref_params[n]
            if id(p) not in self.adam:
                continue
            opt, beta1, beta2, eps = self.adam[id(p)]
            state = opt.state.get(p, {})

            def local(t):
                return spec.local_slice(t).reshape(-1)[lo:hi].double()
            m, v = ((local(state[k]) if k in state else torch.zeros_like(mine, dtype=torch.float64))
                    for k in ("exp_avg", "exp_avg_sq"))
            b1, b2 = 1 - beta1 ** (step + 1), (1 - beta2 ** (step + 1)) ** 0.5

            def update(g):
                g = g.double()
                return lr * ((beta1 * m + (1 - beta1) * g) / b1) / ((beta2 * v + (1 - beta2) * g * g).sqrt() / b2 + eps)
            self.pairs.append((n, spec, lo, hi, update(mine) - update(local(p.grad))))

    def allowance(self, ref_updates: dict, names, world) -> torch.Tensor:
        """[parameters]: ||allowed|| / ||reference update||, squared norms summed over ranks like `per_param_rel`
        (a replicated view counts in both sums alike)."""
        index = {n: i for i, n in enumerate(names)}
        acc = torch.zeros(len(names), 2, dtype=torch.float64, device=world.device)
        for n, spec, lo, hi, allowed in self.pairs:
            acc[index[n], 0] += allowed.pow(2).sum()
            acc[index[n], 1] += spec.local_slice(ref_updates[n]).reshape(-1)[lo:hi].double().pow(2).sum()
        comm.all_reduce(acc, world, tag="verify")
        return torch.where(acc[:, 1] > 0, acc[:, 0].sqrt() / acc[:, 1].sqrt().clamp_min(1e-30), 0.0)
