"""The layout and its single-device reference(s), stepped together on every rank, and what verify reads off them."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..config import TrainConfig
from ..training.trainer import Trainer, lr_at, make_mesh
from . import compare
from .fp8_replay import Fp8Replay
from .reference import grads_at_layout_weights, reference
from .routing_replay import RoutingReplay


def fp8_twin(cfg: TrainConfig, device, tokens=None):
    """The FP8 reference with every weight moved one ulp up or down at random (seeded by cfg.seed): how far FP8's
    rounding flips alone carry a run, the noise an FP8 layout is held to (`NoiseBudget`, docs/fp8.md)."""
    twin = reference(cfg, device, tokens)
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for p in twin.model.parameters():
            up = (torch.rand(p.shape, generator=gen, device="cpu") < 0.5).to(p.device)  # CPU generator
            p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf)))
    return twin


class SideBySide:
    """The layout's run and the single-device reference (same seed, same global batch), built in-process on every
    rank. In bf16 an fp32 reference too, which measures bf16's own noise (`NoiseBudget`) in one place; in fp32 with
    --fp8 the FP8 reference's one-ulp twin (`fp8_twin`), which measures FP8's rounding flips. MoE layers of
    every reference take the layout's expert choices (`RoutingReplay`)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, tokens: torch.Tensor | None = None):
        self.cfg, self.tokens = cfg, tokens
        self.mesh = make_mesh(cfg, device)
        self.layout = Trainer(cfg, self.mesh, tokens)
        self.ref = reference(cfg, device, tokens)
        self.bf16 = cfg.dtype == "bf16"
        self.fp8 = cfg.fp8 is not None and not self.bf16  # fp32 with FP8 GEMMs: the budget's twin is FP8's own
        fp32 = dataclasses.replace(cfg, dtype="fp32", grad_reduce_dtype="fp32")
        self.ref32 = reference(fp32, device, tokens) if self.bf16 else (fp8_twin(cfg, device, tokens) if self.fp8
                                                                        else None)
        self.refs = [self.ref] + ([self.ref32] if self.ref32 is not None else [])
        self.budgeted = self.ref32 is not None  # judged by `NoiseBudget` against the second reference's noise
        self.ref_params = dict(self.ref.model.named_parameters(remove_duplicate=False))  # tied: output.weight too
        self.ref32_params = (dict(self.ref32.model.named_parameters(remove_duplicate=False))
                             if self.ref32 is not None else {})
        self.names = sorted(self.ref_params)
        self.world = self.mesh["world"]
        model = cfg.model_config()
        self.dropout = model.dropout > 0 or model.attn_dropout > 0
        moe = bool(self.layout.model_cfg.moe_experts)
        self.replay = RoutingReplay(self.layout, self.refs, self.world, cfg.dtype) if moe else None
        # --fp8 with --tp-overlap is refused (`check_verifiable`): its chunks' casts are not recorded
        replayable = self.fp8 and not cfg.fp8_all_gather
        self.fp8_replay = Fp8Replay(self.layout, self.refs, self.world) if replayable else None

    def backward(self, step: int) -> tuple[float, list[float]]:
        """Forward and backward of `step` on the layout and every reference, gradients finished (reduced, clipped):
        (the layout's loss, the references' losses)."""
        fp8 = self.fp8_replay
        with fp8.active() if fp8 is not None else contextlib.nullcontext():
            loss = self.layout.forward_backward(step)
            if self.replay is not None:
                self.replay.force(step)
            if fp8 is not None:
                fp8.exchange(step)
            ref_losses = [r.forward_backward(step) for r in self.refs]
        if fp8 is not None:
            fp8.end_step()
        if self.replay is not None:
            self.replay.check(step)
        self.layout.finish_gradients()
        for r in self.refs:
            r.finish_gradients()
        return loss, ref_losses

    def optimizer_step(self, step: int) -> None:
        self.layout.optimizer_step(step)
        for r in self.refs:
            r.optimizer_step(step)
        if self.replay is not None:  # the loss-free bias moves the same way in both, or routing diverges
            self.layout.moe_step()
            for r in self.refs:
                r.moe_step()
            self.replay.check_bias()

    def lr(self, step: int) -> float:
        return lr_at(step, self.cfg)

    def grad_views(self) -> list:
        return list(compare.grad_views(self.layout))

    def param_views(self) -> list:
        return list(compare.param_views(self.layout))

    def ref_grads(self, fp32: bool = False) -> dict:
        """The (bf16 run: fp32) reference's finished gradients."""
        return {n: p.grad for n, p in (self.ref32_params if fp32 else self.ref_params).items()}

    def ref_values(self, fp32: bool = False) -> dict:
        return {n: p.detach() for n, p in (self.ref32_params if fp32 else self.ref_params).items()}

    def snapshot(self) -> tuple[list, list[dict]]:
        """Before the optimizer step: the values the layout's views hold, and both references' parameters."""
        return ([v[2].clone() for v in compare.param_views(self.layout)],
                [{n: p.detach().clone() for n, p in params.items()} for params in (self.ref_params, self.ref32_params)])

    def updates(self, param_views, before) -> tuple[list, dict, dict]:
        """After the optimizer step: (the layout's updates as views, the reference's, the fp32 reference's), an update
        being after − before the step."""
        mine, refs = before
        updates = [(n, spec, p - b, lo, hi) for (n, spec, p, lo, hi), b in zip(param_views, mine)]
        return (updates, {n: p.detach() - refs[0][n] for n, p in self.ref_params.items()},
                {n: p.detach() - refs[1][n] for n, p in self.ref32_params.items()})

    def rel(self, views, ref: dict) -> torch.Tensor:
        """[parameters]: the views' norm-wise relative difference to `ref`, summed over all ranks (a collective)."""
        return compare.per_param_rel(compare.against(views, ref), self.names, self.world)

    def grads_at_layout_weights(self, step: int) -> dict:
        """The reference's gradients of `step` at the weights the layout holds now (before its optimizer step)."""
        return grads_at_layout_weights(self.cfg, step, self.param_views(), self.ref_params, self.replay, self.tokens,
                                       self.world)
