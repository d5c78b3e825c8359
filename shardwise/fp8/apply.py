"""`--fp8 RECIPE`: which linear layers run in FP8, and how each one's operands are split over the mesh.

FP8: every linear of attention (GQA, gated, MLA, Gated DeltaNet projections), of dense MLPs and of the MoE's shared
and routed experts, in every transformer block (MTP modules' too). High precision: the embedding, the LM head, the
norms, the router (and Qwen3-Next's shared-expert gate), attention's core and MTP's projection.

A layer's `LinearLayout` names the axes that split its logical x, W and g, so each scale is taken over the tensor the
single device scales. The single device's microbatch holds every dp rank's microbatch (verify's reference), so a
scale over the tokens spans dp×cp (`dp_cp`); a column-parallel layer's input is whole over TP after its region entry
(the SP all-gather), its W rows and g columns split over tp; a row-parallel layer's x and W columns split over tp.
A replicated projection feeding per-rank heads (MLA's down-projections) sums its output gradient over tp before the
backward casts (`linear.py`), so its gradients are whole on every rank.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from ..rules.fp8 import TILES_TAG
from ..rules.validation import fp8_expert_tiles_split
from .linear import Fp8Config, LinearLayout, fp8_linear
from .recipes import recipe

# The layers are told apart by what they declare, not imported (the TP layers and the experts import this package):
# a layer with an `fp8` attribute runs its GEMMs through it — the TP linears, and the expert group (`n_local`).


def _global_shape(p) -> tuple[int, int]:
    spec = getattr(p, "_sw_shard", None)  # tensor_parallel.layers.ShardSpec
    return tuple(spec.global_shape) if spec is not None else tuple(p.shape)


def _split_dim(p) -> int | None:
    spec = getattr(p, "_sw_shard", None)
    return None if spec is None else spec.dim


class Float8Linear(nn.Linear):
    """An nn.Linear (a replicated projection: MLA's down-projections, the shared experts) whose GEMMs run in FP8;
    its parameters and state dict are the nn.Linear's."""

    fp8: Fp8Config

    def forward(self, x):
        return fp8_linear(self.fp8, x, self.weight, self.bias)


def _tokens(mesh, parallel, own_tokens: bool) -> dict:
    """The token split of a block's linears: sequences over dp, rows over cp (and over tp under SP where the layer
    reads this rank's own sequence shard, `own_tokens`: the MoE's flattened rows)."""
    sp = parallel.sequence_parallel and mesh["tp"].active
    if own_tokens:  # rows [tokens, f] flattened by the MoE: one "sequence" of every rank's tokens
        axes = (mesh["dp_cp"], mesh["tp"]) if sp else (mesh["dp_cp"],)
        return dict(seq=axes, rows_all=axes, seq_global=0)
    return dict(batch=(mesh["dp"],), seq=(mesh["cp"],), rows_all=(mesh["dp_cp"],),
                seq_chunks=2 if mesh["cp"].active and parallel.cp_order == "balanced" else 1)


def layer_layout(layer: nn.Module, mesh, parallel, own_tokens: bool = False) -> LinearLayout:
    """The split of `layer`'s x, W and g, read from its weight's ShardSpec."""
    out_g, in_g = _global_shape(layer.weight)
    dim, tp = _split_dim(layer.weight), (mesh["tp"],)
    return LinearLayout(**_tokens(mesh, parallel, own_tokens), in_=tp if dim == 1 else (), in_global=in_g,
                        out=tp if dim == 0 else (), out_global=out_g)


def _heads_partial(layer: nn.Module) -> bool:
    """A projection replicated over tp whose output each rank back-propagates through its own heads only (MLA's
    down-projections, KDA's gate down-projections: declared head-partial, models/params.py)."""
    return getattr(layer.weight, "_sw_head_partial", False) and _split_dim(layer.weight) is None


def _sum_output_gradient(layer: nn.Module, tp) -> None:
    """Sum `layer`'s output gradient over tp before its FP8 backward GEMMs (`Fp8Config.grad_sum`): its weight
    gradient is then whole on every rank, so it drops the tp sum its partial gradient needed."""
    layer.fp8 = dataclasses.replace(layer.fp8, grad_sum=tp)
    for p in (layer.weight, layer.bias):
        if p is not None:
            p._sw_shard = dataclasses.replace(p._sw_shard, grad_reduce=None)


def check_tiles(name: str, layer: nn.Module, cfg: Fp8Config) -> None:
    """A recipe's feature tiles must lie within one TP rank's part of a split dimension, or span the whole of it."""
    from ..config import ConfigError

    dim = _split_dim(layer.weight)
    if dim is None:
        return
    n, total = layer.weight.shape[dim], _global_shape(layer.weight)[dim]
    if n == total:  # not split here (tp 1, or a replicated K/V head)
        return
    for cast in cfg.recipe.casts:
        for block in cast.block:
            if block not in (None, 1) and block < total and n % block:
                raise ConfigError(f"--fp8 {cfg.recipe.name}: {name} holds {n} of its {total} "
                                  f"{'rows' if dim == 0 else 'columns'} per TP rank, which cuts its "
                                  f"{block}-element scale blocks; use tensorwise or rowwise, or a TP degree that "
                                  f"keeps whole blocks")


def global_tiles(mesh, parallel, name: str) -> bool:
    """Whether recipe `name` tiles the routed experts' rows at their single-device positions on this mesh: its token
    tiles of an expert's rows span ranks (`rules.validation.fp8_expert_tiles_split`)."""
    sp_tp = mesh["tp"].size if parallel.sequence_parallel else 1
    d = mesh.dims
    return fp8_expert_tiles_split(name, sp_tp, d.cp, d.dp, d.ep)


def apply_fp8(blocks: list[nn.Module], mesh, parallel, name: str, seq_len: int = 0) -> int:
    """Mark every FP8 linear of the transformer `blocks` (parallelize's `all_blocks`) with its `Fp8Config`; returns
    how many layers (an expert group counts once). `seq_len`: the training sequence length, where the routed
    experts' token tiles span ranks (`global_tiles`): their MoE then computes each row's single-device position
    (`expert_parallel.positions`, tagged `fp8_positions`)."""
    rec, count = recipe(name), 0
    for b, block in enumerate(blocks):
        ffn = block.feed_forward
        moe = ffn if hasattr(ffn, "router") else None
        high = {id(getattr(moe, "router", None)), id(getattr(moe, "shared_gate", None))}
        for part in (block.attention, ffn):
            names = {id(m): n for n, m in part.named_modules()}
            for m in part.modules():
                if id(m) in high or (type(m) is not nn.Linear and not hasattr(m, "fp8")):
                    continue
                if hasattr(m, "n_local"):  # the routed experts: rows of each expert over edp (and tp under SP)
                    axes = (mesh["edp"], mesh["tp"]) if parallel.sequence_parallel and mesh["tp"].active \
                        else (mesh["edp"],)
                    m.fp8 = Fp8Config(rec, LinearLayout(seq=axes, rows_all=axes, seq_global=0))
                    if seq_len and global_tiles(mesh, parallel, name) and moe.dispatcher.capacity_factor is None:
                        m.fp8_tiles = axes  # token tiles at the rows' single-device positions, amaxes over axes
                        moe.track_positions(mesh, seq_len, parallel.cp_order, parallel.sequence_parallel, TILES_TAG)
                else:
                    if type(m) is nn.Linear:
                        m.__class__ = Float8Linear
                    m.fp8 = Fp8Config(rec, layer_layout(m, mesh, parallel, own_tokens=part is moe))
                    if mesh["tp"].active and _heads_partial(m):
                        _sum_output_gradient(m, mesh["tp"])
                    check_tiles(f"block {b}'s {names[id(m)]}", m, m.fp8)
                count += 1
    return count
