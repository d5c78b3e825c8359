"""`shardwise verify`: run a layout and the single-device model side by side and compare.

Every rank also builds the single-device model (same seed, same global batch) in-process, with a
disabled ledger. After each step's gradient finalisation it compares the gradient values it holds
with the matching slice of the reference gradients, and after the optimizer step its parameter
shards with the reference parameters. Per-parameter squared norms of (difference, reference) are
summed over all ranks — replicas inflate both equally, so ratios are exact — and the maximum
norm-wise relative difference is reported.
"""
from __future__ import annotations

import dataclasses

import torch

from . import comm
from .comm import Ledger
from .config import ConfigError, ParallelConfig, TrainConfig
from .mesh import Mesh
from .tensor_parallel.layers import get_spec
from .train import Trainer, make_mesh

# first_grad: gradients of step 1, computed from bit-identical weights — pure layout arithmetic.
# grad / param: every step; later steps start from weights that AdamW's g/sqrt(v) has already pulled
# apart wherever a gradient is near zero, so they get a drift bound (a real layout bug is O(1)).
TOLERANCE = {"fp32": dict(loss=1e-5, first_grad=1e-5, grad=1e-3, param=1e-3),
             "bf16": dict(loss=2e-3, first_grad=2e-2, grad=5e-1, param=1e-1)}


def check_verifiable(cfg: TrainConfig) -> None:
    m, p = cfg.model_config(), cfg.parallel
    if m.attn_dropout > 0 and p.tp > 1:
        raise ConfigError("verify needs --attn-dropout 0 when tp > 1: attention dropout masks differ per TP rank "
                          "by design, so no single-device run can match")
    if m.dropout > 0 and p.dp > 1:
        raise ConfigError("verify needs --dropout 0 when dp > 1: each dp rank draws its own residual-dropout masks")
    if m.moe_capacity_factor is not None and (p.dp * p.cp > 1 or p.sequence_parallel):
        raise ConfigError("verify needs dropless MoE (no --moe-capacity-factor) when tokens are split over dp×cp "
                          "or SP: expert capacity is per rank's tokens, so drops depend on the layout")


def _reference(cfg: TrainConfig, device) -> Trainer:
    """The single-device run. Its microbatch i is every dp rank's microbatch i together, so losses
    defined per global microbatch (the MoE aux loss) see the same tokens."""
    dp = cfg.parallel.dp
    ref_cfg = dataclasses.replace(cfg, parallel=ParallelConfig(), global_batch=cfg.global_batch or
                                  cfg.micro_batch * dp, micro_batch=cfg.micro_batch * dp)
    ref = Trainer(ref_cfg, Mesh.single(device, Ledger(enabled=False)))
    ref.group_dp = dp
    return ref


def _rel_diffs(pairs, names, world) -> float:
    """max over parameters of ||x - ref|| / ||ref||, with the squared norms summed over all ranks."""
    index = {n: i for i, n in enumerate(names)}
    acc = torch.zeros(len(names), 2, dtype=torch.float64, device=world.device)
    for name, mine, ref in pairs:
        acc[index[name], 0] += (mine.double() - ref.double()).pow(2).sum()
        acc[index[name], 1] += ref.double().pow(2).sum()
    comm.all_reduce(acc, world, tag="verify")
    rel = acc[:, 0].sqrt() / acc[:, 1].sqrt().clamp_min(1e-30)
    return float(rel.max())


def verify_main(cfg: TrainConfig, device: torch.device | None = None) -> dict:
    device = device or torch.device("cpu")
    check_verifiable(cfg)
    mesh = make_mesh(cfg, device)
    trainer = Trainer(cfg, mesh)
    ref = _reference(cfg, device)
    ref_params = dict(ref.model.named_parameters())
    names = sorted(ref_params)
    world = mesh["world"]
    loss_diff = grad_diff = param_diff = first_grad = 0.0
    losses = []
    for step in range(cfg.steps):
        loss = trainer.forward_backward(step)
        ref_loss = ref.forward_backward(step)
        trainer.finish_gradients()
        ref.finish_gradients()
        loss_diff = max(loss_diff, abs(loss - ref_loss))
        losses.append(loss)
        local = dict(trainer.model.named_parameters())
        grads = []
        for name, vals, lo, hi in trainer.reducer.grad_views():
            ref_g = get_spec(local[name]).local_slice(ref_params[name].grad).reshape(-1)[lo:hi]
            grads.append((name, vals, ref_g))
        step_grad = _rel_diffs(grads, names, world)
        first_grad = step_grad if step == 0 else first_grad
        grad_diff = max(grad_diff, step_grad)
        trainer.optimizer_step(step)
        ref.optimizer_step(step)
        if trainer.model_cfg.moe_experts:  # the loss-free bias moves the same way in both, or routing diverges
            trainer.moe_step()
            ref.moe_step()
        params = [(n, p.detach().reshape(-1), get_spec(p).local_slice(ref_params[n].detach()).reshape(-1))
                  for n, p in trainer.model.named_parameters()]
        param_diff = max(param_diff, _rel_diffs(params, names, world))
        mesh.ledger.end_step(step + 1)
    tol = TOLERANCE[cfg.dtype]
    passed = (loss_diff <= tol["loss"] * max(1.0, abs(losses[0])) and first_grad <= tol["first_grad"]
              and grad_diff <= tol["grad"] and param_diff <= tol["param"])
    return {"layout": cfg.parallel.as_dict(), "steps": cfg.steps, "max_loss_abs_diff": loss_diff,
            "max_grad_rel_diff": grad_diff, "max_param_rel_diff": param_diff, "passed": bool(passed),
            "first_step_grad_rel_diff": first_grad, "tolerances": tol, "losses": losses}
