"""The optimizer of a run: AdamW on everything (`--optimizer adamw`), or Muon on the hidden matrices with AdamW
on the rest (`--optimizer muon`); docs/optimizers.md states the update and how Muon is distributed."""
from __future__ import annotations

import torch

from ..config import TrainConfig
from ..config.schedule import parse_betas
from ..data_parallel import GradReducer
from ..rules.muon import is_hidden_matrix
from .muon import ns_dtype
from .qk_clip import QKClip
from .sharded import Muon


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """A hidden weight matrix, by the rule the planner counts from (`rules.muon.is_hidden_matrix`)."""
    return is_hidden_matrix(name, p.ndim)


def build_reducer(cfg: TrainConfig, model, mesh, rounds: int) -> GradReducer:
    """The gradient reducer with the run's optimizer(s) attached: `reducer.optimizer` (AdamW) and, under Muon,
    `reducer.muon`; `reducer.step()` steps both."""
    muon = cfg.optimizer == "muon"
    red = GradReducer(model, mesh, cfg.parallel.zero, lr=cfg.lr, weight_decay=cfg.weight_decay,
                      betas=parse_betas(cfg.adam_betas), eps=cfg.adam_eps,
                      reduce_dtype=torch.bfloat16 if cfg.grad_reduce_dtype == "bf16" else None,
                      rounds=rounds, overlap=cfg.overlap_grad_reduce, is_muon=is_muon_param if muon else None)
    if muon:
        red.muon = Muon(red, is_muon_param, cfg.lr, cfg.weight_decay, cfg.muon_momentum, cfg.muon_ns_steps,
                        ns_dtype(mesh.device, cfg.muon_ns_fp32))
        if cfg.muon_qk_clip:
            red.muon.clip = QKClip(model, red, cfg.muon_qk_clip)
    return red


def optimizers(reducer: GradReducer) -> list[torch.optim.Optimizer]:
    """Every optimizer the reducer steps, in step order (the LR schedule sets each one's groups)."""
    return [reducer.optimizer] + ([reducer.muon] if reducer.muon is not None else [])
