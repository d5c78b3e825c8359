"""A parameter says, where it is created, how it starts and whether TP leaves its gradient partial.

The declaration rides on the Parameter (`_sw_init`, `_sw_head_partial`), so materialising a layout reads it off
each tensor instead of matching names, and a plan that swaps a module for its sharded version carries it over
(`carry`). Initial values themselves are drawn by `shardwise.parallelize` (seeded by name, layout-independent).
"""
from __future__ import annotations

import math

from torch import nn

INITS = ("normal", "residual", "ones", "zeros", "conv", "a_log")
"""normal: N(0, 0.02); residual: a residual branch's output projection, N(0, 0.02/√(2·layers)) (GPT-2's scaling,
so the stream's variance does not grow with depth); ones / zeros: norm scales and biases; conv: a depthwise
convolution [channels, kernel], N(0, 1/√kernel) (PyTorch's Conv1d scale); a_log: Gated DeltaNet's log decay
rates, log U(1, 16) (Mamba-2's and Megatron's range)."""


def declare(p: nn.Parameter, init: str = "normal", head_partial: bool = False) -> nn.Parameter:
    """Record `p`'s initial rule and whether it is a replicated weight each TP rank back-propagates through its
    own heads only (Qwen3's q/k norms, MLA's down-projections and latent norms): its gradient is a partial sum over
    TP even without SP."""
    if init not in INITS:
        raise ValueError(f"init {init!r}; valid: {', '.join(INITS)}")
    p._sw_init = init
    p._sw_head_partial = head_partial
    return p


def linear(in_features: int, out_features: int, bias: bool = False, init: str = "normal",
           head_partial: bool = False, device=None, dtype=None) -> nn.Linear:
    """nn.Linear with its weight declared (`init`) and its bias, if any, starting at zero."""
    layer = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
    declare(layer.weight, init, head_partial)
    if bias:
        declare(layer.bias, "zeros", head_partial)
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
