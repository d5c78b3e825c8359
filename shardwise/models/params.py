"""A parameter says, where it is created, how it starts and whether TP leaves its gradient partial.

Modules create their parameters from `shardwise.rules.inventory` entries (`create`, `linear_of`): name, shape,
init and head-partial are declared there once, and the planner counts from the same entries.

The declaration rides on the Parameter (`_sw_init`, `_sw_head_partial`), so materialising a layout reads it off
each tensor instead of matching names, and a plan that swaps a module for its sharded version carries it over
(`carry`). Initial values themselves are drawn by `shardwise.parallelize` (seeded by name, layout-independent).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..rules.inventory import INITS, Param

def declare(p: nn.Parameter, init: str = "normal", head_partial: bool = False) -> nn.Parameter:
    """Record `p`'s initial rule and whether it is a replicated weight each TP rank back-propagates through its
    own heads only (Qwen3's q/k norms, MLA's down-projections and latent norms): its gradient is a partial sum over
    TP even without SP."""
    if init not in INITS:
        raise ValueError(f"init {init!r}; valid: {', '.join(INITS)}")
    p._sw_init = init
    p._sw_head_partial = head_partial
    return p


def create(entry: Param, device=None, dtype=None) -> nn.Parameter:
    """The parameter an inventory entry declares, uninitialised (its values are drawn by the plan). Models pass no
    `device`: they are built under build_model's torch.device('meta') context and materialised on mesh.device."""
    return declare(nn.Parameter(torch.empty(entry.shape, device=device, dtype=dtype)), entry.init, entry.head_partial)


def linear_of(entries: dict[str, Param], name: str, device=None, dtype=None) -> nn.Linear:
    """nn.Linear `name` as the inventory's `name.weight` (and `name.bias`, if listed) declare it."""
    w, b = entries[f"{name}.weight"], entries.get(f"{name}.bias")
    layer = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=device, dtype=dtype)
    declare(layer.weight, w.init, w.head_partial)
    if b is not None:
        declare(layer.bias, b.init, b.head_partial)
    return layer


def carry(old: nn.Module, new: nn.Module) -> nn.Module:
    """Give `new`'s parameters the declarations of `old`'s parameters of the same name (a module swapped by a plan)."""
    for name, p in old.named_parameters(recurse=False):
        q = getattr(new, name, None)
        if isinstance(q, nn.Parameter) and hasattr(p, "_sw_init"):
            declare(q, p._sw_init, p._sw_head_partial)
    return new


def carry_param(old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    """`new` with `old`'s declaration (a bare parameter a plan replaced by its shard)."""
    return declare(new, old._sw_init, old._sw_head_partial)


def init_std(init: str, n_layers: int) -> float:
    """The standard deviation of a normal rule (0 for ones / zeros)."""
    if init == "residual":
        return 0.02 / math.sqrt(2 * n_layers)
    return 0.02 if init == "normal" else 0.0


def init_of(p: nn.Parameter, name: str) -> str:
    """`p`'s declared rule; a parameter nobody declared is a bug in the module that made it."""
    init = getattr(p, "_sw_init", None)
    if init is None:
        raise ValueError(f"parameter {name} was created without an init declaration (models/params.py)")
    return init


def head_partial(p: nn.Parameter) -> bool:
    return getattr(p, "_sw_head_partial", False)
