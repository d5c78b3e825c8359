"""`shardwise verify`: run a layout and the single-device model side by side and compare (docs/verify.md).

Every rank also builds the single-device model (same seed, same global batch) in-process, with a disabled ledger
(`SideBySide`). After each step's gradient finalisation it compares the gradient values it holds with the matching
slice of the reference gradients, and after the optimizer step its parameter shards and their updates (after − before
the step) with the reference's. Each comparison is one of verify's checks (checks.py), with its bound and the reason
for it; MoE layouts go through routing replay (routing_replay.py), and bf16 runs are held to a multiple of the bf16
noise the single-device model shows against fp32 (`NoiseBudget`).
"""
from __future__ import annotations

import torch

from ..config import ConfigError, TrainConfig
from ..fp8.scaling import AMAX_TAG
from ..training.assemble import assembled
from .bf16_budget import FP8_FLOOR, NoiseBudget
from .checks import Coverage, FirstStepGradients, LaterGradients, Loss, Updates, Values, tolerances
from .side_by_side import SideBySide

AMAX_OP = f"all_reduce:{AMAX_TAG}"  # the ledger's name of an FP8 scale's amax reduction


def check_verifiable(cfg: TrainConfig) -> None:
    m, p = cfg.model_config(), cfg.parallel
    if m.attn_dropout > 0 and p.tp > 1:
        raise ConfigError("verify needs --attn-dropout 0 when tp > 1: attention dropout masks differ per TP rank "
                          "by design, so no single-device run can match")
    if m.dropout > 0 and p.dp > 1:
        raise ConfigError("verify needs --dropout 0 when dp > 1: each dp rank draws its own residual-dropout masks")
    if cfg.fp8 is not None and p.tp_overlap and p.sequence_parallel and p.tp > 1:
        raise ConfigError(f"verify --fp8 {cfg.fp8} with --tp-overlap: the casts inside the overlapped chunks are not "
                          "replayed, so their FP8 rounding flips cannot be told from a layout error (fresh seeds "
                          "failed correct runs); verify the layout without --tp-overlap, whose FP8 run it equals bit "
                          "for bit (tests/test_fp8_overlap.py)")
    if m.moe_capacity_factor is not None and (p.dp * p.cp > 1 or p.sequence_parallel):
        raise ConfigError("verify needs dropless MoE (no --moe-capacity-factor) when tokens are split over dp×cp "
                          "or SP: expert capacity is per rank's tokens, so drops depend on the layout")


def verify_main(cfg: TrainConfig, device: torch.device | None = None, tokens: torch.Tensor | None = None) -> dict:
    """`tokens`: a token stream to train on instead of cfg.data (tests build documents of known lengths)."""
    cfg = assembled(cfg)
    check_verifiable(cfg)
    runs = SideBySide(cfg, device or torch.device("cpu"), tokens)
    loss, first_grads, later_grads = Loss(), FirstStepGradients(), LaterGradients()
    updates, values, coverage = Updates(runs), Values(len(runs.names)), Coverage()
    budget = NoiseBudget(FP8_FLOOR) if runs.fp8 else NoiseBudget() if runs.bf16 else None
    amax = {}  # --fp8: step 1's amax all-reduces per axis, as the ledger counts them
    for step in range(cfg.steps):
        layout_loss, ref_losses = runs.backward(step)
        loss.add(layout_loss, ref_losses[0])
        grad_views = runs.grad_views()
        grads = runs.rel(grad_views, runs.ref_grads())
        if step == 0:
            first_grads.add(runs, grads, grad_views)
        else:
            later_grads.add(runs, step, grads, grad_views)
        if budget is not None:
            ref16, ref32 = runs.ref_grads(), runs.ref_grads(fp32=True)
            if step and runs.bf16 and cfg.fp8 is None and not runs.dropout:  # drift: judged at the layout's weights
                over = budget.ratio("grad", grads, ref16, ref32, runs.names)[0] > 1.0
                if bool(over.any()):
                    grads = later_grads.again(runs, step, grads, grad_views, over)
            budget.add_gradients(layout_loss, ref_losses, grads, ref16, ref32, runs.names)
        updates.collect(step, grad_views, runs.lr(step))
        before = runs.snapshot()
        runs.optimizer_step(step)
        param_views = runs.param_views()
        coverage.add(runs, [grad_views, param_views])
        ref_values = runs.ref_values()
        value_rel = runs.rel(param_views, ref_values)
        update_views, ref_updates, ref32_updates = runs.updates(param_views, before)
        update_rel = runs.rel(update_views, ref_updates)
        values.add(value_rel, ref_values, runs.names, updates.add(runs, step, update_rel, ref_updates))
        if budget is not None:
            budget.add_step(value_rel, update_rel, (ref_values, runs.ref_values(fp32=True)),
                            (ref_updates, ref32_updates), runs.names, runs.lr(step))
        if step == 0:
            amax = {axis: ops[AMAX_OP] for axis, ops in runs.mesh.ledger.snapshot().items() if AMAX_OP in ops}
        runs.mesh.ledger.end_step(step + 1)
    fp32 = (loss, first_grads, later_grads, updates, values)
    passed = (budget.passed if budget is not None else all(c.passed for c in fp32)) and coverage.passed
    passed = passed and (runs.replay is None or runs.replay.passed)
    passed = passed and (runs.fp8_replay is None or runs.fp8_replay.passed)
    out = {"layout": cfg.parallel.as_dict(), "steps": cfg.steps, "max_loss_abs_diff": loss.diff,
           "max_grad_rel_diff": max(0.0, first_grads.rel, later_grads.rel), "max_param_rel_diff": values.rel,
           "max_update_rel_diff": max(updates.first, updates.later), "coverage": coverage.fraction,
           "passed": bool(passed), "first_step_grad_rel_diff": first_grads.rel,
           "first_step_update_rel_diff": updates.first, "later_update_rel_diff": updates.later,
           "tolerances": budget.tolerances() if budget is not None else tolerances(), "losses": loss.losses}
    if budget is None:
        out |= {"later_update_ratio": updates.ratio, "param_ratio": values.ratio, "first_grad_ratio": first_grads.ratio,
                "first_grad_budget": first_grads.budget}
    if budget is None or runs.bf16:
        out["later_grad_at_layout_weights"] = later_grads.at_layout_weights
    if cfg.fp8 is not None:
        out["fp8_amax"] = amax
    if runs.replay is not None:
        out["routing"] = runs.replay.result()
    if runs.fp8_replay is not None:
        out["fp8_replay"] = runs.fp8_replay.result()
    if budget is not None:
        out["fp8_budget" if runs.fp8 else "bf16_budget"] = budget.result()
    return out
