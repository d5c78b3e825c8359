"""fp32 first-step gradients over the flat bound: a budget measured in float64 (docs/verify.md).

The layout and the fp32 reference are two fp32 roundings of the same exact gradient, which the reference run in
float64 stands in for. noise = the largest distance to it of five fp32 roundings (the reference and FP32_SAMPLES runs
with weights moved one ulp): one alone ranged 1.8e-6 to 1.1e-4 on one seed (the hybrid's layer-1 A_log).
|L − R| ≤ |L − E| + |R − E|, so a correct layout fails only when its own rounding error exceeds (FP64_MULTIPLE − 1)·
the largest of five others; the multiple is bf16's (equal roundings stand √2 apart, the rest is margin). A parameter
whose gradient cancels (the hybrid's A_log / dt_bias at initialisation) gets the room its conditioning costs fp32;
every other parameter stays at the flat bound.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import TrainConfig
from ..training.trainer import Trainer
from .compare import against, per_param_rel
from .reference import reference, step_grads
from .routing_replay import RoutingReplay

FP64_MULTIPLE = 4.0
FP32_SAMPLES = 4


class Float64(TorchDispatchMode):
    """Everything run inside computes in float64: the default dtype, and every float32 an operation names (`.float()`,
    `.to(torch.float32)`, `dtype=torch.float32`) — the model's explicit fp32 casts (norms, rotary tables, the router,
    the loss, the linear layers' state, the attention kernels' backward) included, so no fp32 rounding is left. A
    dispatch mode, not a function mode: autograd runs custom backwards under dispatch modes, not function modes."""

    def __enter__(self):
        self.default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self.default)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def first_grad_samples(cfg: TrainConfig, ref: Trainer, replay: RoutingReplay | None,
                       tokens=None) -> tuple[dict, list[dict]]:
    """The reference's first-step gradients from the same weights and tokens with every operation in float64
    (`Float64`), and FP32_SAMPLES more fp32 roundings of them: fp32 runs whose weights each moved one ulp up or down
    at random (an fp32 result is the exact one of inputs perturbed by about an ulp). Call it before the first
    optimizer step; single-device work on each rank, the same on every rank (seeded by cfg.seed), no collective."""
    device = ref.mesh.device
    weights = ref.model.state_dict()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with Float64():
            ref64 = reference(cfg, device, tokens)
            ref64.model.load_state_dict(weights)
            exact = step_grads(ref64, replay)
        del ref64
        run = reference(cfg, device, tokens)
        gen = torch.Generator().manual_seed(cfg.seed)
        samples = []
        for _ in range(FP32_SAMPLES):
            with torch.no_grad():
                for n, p in run.model.named_parameters():
                    up = (torch.rand(p.shape, generator=gen) < 0.5).to(device)
                    p.copy_(torch.nextafter(weights[n], torch.where(up, torch.inf, -torch.inf)))
            samples.append(step_grads(run, replay))
    return exact, samples


def first_grad_budget(runs, rel: torch.Tensor, grad_views, flat: float) -> tuple[float, dict]:
    """fp32 first-step gradients of `runs` (a `SideBySide`): (largest ratio to the bound, the report: the multiple,
    whether the float64 reference ran, and each parameter over the flat bound with its distance, its fp32 noise, the
    layout's own distance to float64 and its bound). A parameter passes within max(flat, FP64_MULTIPLE · noise), noise
    the largest distance to the float64 gradient of the reference and its FP32_SAMPLES perturbed runs; all that runs
    only when some parameter is over the flat bound (`rel` is the same on every rank, so every rank decides alike)."""
    rel = rel.cpu()
    report = {"multiple": FP64_MULTIPLE, "fp32_samples": FP32_SAMPLES, "fp64_run": False, "params": {}}
    if not bool((rel > flat).any()) or runs.dropout:
        return float(rel.max()) / flat, report  # dropout: other runs draw other masks, so no budget
    names = runs.names
    g32 = {n: p.grad for n, p in runs.ref.model.named_parameters(remove_duplicate=False)}
    exact, samples = first_grad_samples(runs.cfg, runs.ref, runs.replay, runs.tokens)
    noise = torch.stack([max((g[n].double() - exact[n]).norm() for g in [g32, *samples])
                         / g32[n].double().norm().clamp_min(1e-30) for n in names]).cpu()
    bound = (FP64_MULTIPLE * noise).clamp_min(flat)
    ratio = rel / bound
    to_exact = per_param_rel(against(grad_views, exact), names, runs.world).cpu()  # collective: every rank is here
    over = {names[i]: {"rel": float(rel[i]), "fp32_noise": float(noise[i]), "layout_vs_fp64": float(to_exact[i]),
                       "bound": float(bound[i])}
            for i in (rel > flat).nonzero().flatten().tolist()}
    return float(ratio.max()), report | {"fp64_run": True, "params": over}
