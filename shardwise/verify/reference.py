"""The single-device reference: the same model, seed and global batch on one device, built in-process on every rank
(with a disabled ledger), and the extra reference steps verify takes at given weights."""
from __future__ import annotations

import dataclasses

import torch

from ..comm import Ledger
from ..config import ParallelConfig, TrainConfig
from ..mesh import Mesh
from ..training.trainer import Trainer
from .compare import layout_values
from .routing_replay import RoutingReplay, routers


def reference(cfg: TrainConfig, device, tokens=None) -> Trainer:
    """The single-device run. Its microbatch i is every dp rank's microbatch i together, so losses
    defined per global microbatch (the MoE aux loss) see the same tokens."""
    dp = cfg.parallel.dp
    ref_cfg = dataclasses.replace(cfg, parallel=ParallelConfig(), global_batch=cfg.global_batch or
                                  cfg.micro_batch * dp, micro_batch=cfg.micro_batch * dp)
    ref = Trainer(ref_cfg, Mesh.single(device, Ledger(enabled=False)), tokens)
    ref.batches.reorder_rows = lambda t: dp_grouped_rows(t, dp, cfg.micro_batch)
    return ref


def dp_grouped_rows(t: torch.Tensor, dp: int, micro_batch: int) -> torch.Tensor:
    """The reference's batch rows regrouped so that its microbatch i holds every dp rank's microbatch i:
    rows [rank 0's microbatches | rank 1's | ...] become [every rank's microbatch 0 | microbatch 1 | ...]."""
    if dp == 1:
        return t
    return t.reshape(dp, -1, micro_batch, t.shape[-1]).transpose(0, 1).reshape(t.shape)


def step_grads(run: Trainer, replay: RoutingReplay | None, step: int = 0) -> dict[str, torch.Tensor]:
    """`run`'s gradients of `step` (after `finish_gradients`: clipped as the reference's), MoE layers taking the
    layout's choices of that step (`RoutingReplay.queue`, for one more reference)."""
    if replay is not None:
        replay.queue(routers(run.model))
    run.forward_backward(step)
    run.finish_gradients()
    grads = {n: p.grad.clone() for n, p in run.model.named_parameters(remove_duplicate=False)}
    run.reducer.zero_grad()
    return grads


def grads_at_layout_weights(cfg, step: int, param_views, ref_params, replay, tokens, world) -> dict:
    """The reference's gradients of `step` at the layout's own weights (every rank assembles them; single-device work
    after that): a later step compared there carries no drift from earlier steps, only this step's arithmetic."""
    values = layout_values(param_views, ref_params, world)
    probe = reference(cfg, world.device, tokens)
    with torch.no_grad():
        for n, p in probe.model.named_parameters(remove_duplicate=False):
            p.copy_(values[n])
    return step_grads(probe, replay, step)
