"""Model shapes the planner understands, and how many parameters each rank holds of them.

One preset table: `shardwise.config.MODEL_PRESETS`, the trainer's own. A `ModelSpec` *is* a trainer
`ModelConfig` (a subclass: every field the trainer knows, under the same name and meaning — Qwen3's q/k norms
and explicit head_dim, DeepSeek's Multi-head Latent Attention, dense layers among MoE ones) plus the
architecture variants only the planner models — GPT-2's GELU MLP, LayerNorm, linear biases and learned
positions — so a plan for a trainer preset or a trainer-readable Hugging Face config is a plan of exactly the
model `shardwise train` builds; `untrainable` says why train cannot build a spec. Hugging Face `config.json`
files of the llama, mistral, mixtral, qwen2, qwen3, qwen3_moe and deepseek_v3 families are read by the trainer's
reader (`shardwise.hf.config`); shapes it refuses, and gpt2, are read leniently (`shardwise.hf.shapes`).

Parameters are counted from `shardwise.rules.inventory`, the list the runtime's modules create theirs from: each
entry's shape as one rank holds it under tp and ep (vocabulary padded to a multiple of tp; heads split whole, one
whole K/V head per rank when n_kv_heads < tp; an MoE block replicated over tp with its routed experts split over ep),
and the flags that decide its optimizer group and its gradient's reductions. MoE layers are those with
i >= n_dense_layers and i % moe_every == 0 (shardwise's `moe_every`, Megatron's moe_layer_freq; DeepSeek-V3's
first-k-dense).

For FLOPs and context-parallel traffic DeepSeek-V3's Multi-head Latent Attention is treated as multi-head attention
with n_heads K/V heads of qk_nope+qk_rope (K) and v_head_dim (V) — the decompressed tensors training materialises;
its activations are counted term by term (latents, padded core: `planner.activations`). Its multi-token-prediction
modules (`--mtp-layers`) are counted on the last stage (planner/mtp.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from pathlib import Path

from shardwise.config import MODEL_PRESETS, ConfigError, ModelConfig
from shardwise.hf.shapes import model_fields_from_hf
from shardwise.planner import gpt_oss
from shardwise.planner.errors import PlanError
from shardwise.rules import flops, inventory

INT64, BOOL = 8, 1
"""Bytes per element of the token ids and targets (int64) and of the masks (bool) the loss and embedding keep."""


@dataclass(frozen=True)
class ModelSpec(ModelConfig):
    """A trainer ModelConfig plus the architecture variants only the planner models (defaults: the trainer's)."""

    mlp: str = "swiglu"
    """'swiglu' (w1, w3, w2) or 'gelu' (fc1, fc2)."""
    norm: str = "rmsnorm"
    """'rmsnorm' (weight) or 'layernorm' (weight and bias)."""
    linear_bias: bool = False
    """Biases on every linear layer (GPT-2)."""
    learned_pos: bool = False
    n_dense_layers: int = 0
    """Leading layers with a dense MLP in an MoE model (DeepSeek-V3: 3)."""
    untrainable: str = ""
    """Why `shardwise train` cannot build this model; '' = it can (the spec is a trainer ModelConfig)."""
    fp8_summed_heads: bool = False
    """An --fp8 run's gradients of head-partial down-projections are whole, not TP-partial
    (`rules.fp8.summed_before_cast`). A run property, kept here because the caches key on the spec:
    `planner.fp8_grad.fp8_spec` sets it from the workload."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelSpec:
        """The planner's view of a trainer ModelConfig: the same fields, planner-only ones at their defaults."""
        if isinstance(cfg, cls):
            return cfg
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)})

    @property
    def expert_ffn_dim(self) -> int:
        return flops.expert_ffn_dim(self)

    @property
    def aux_loss(self) -> bool:
        """Router aux/z loss on: shardwise all-reduces the (E+1) routing counts of every MoE forward."""
        return bool(self.moe_aux_loss_coef or self.moe_z_loss_coef)

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def k_dim(self) -> int:
        """Per-head query/key width (MLA: nope + rope part)."""
        return flops.k_dim(self)

    @property
    def v_dim(self) -> int:
        return flops.v_dim(self)

    @property
    def attn_kv_heads(self) -> int:
        """K/V heads attention actually sees (MLA decompresses to one per query head)."""
        return self.n_heads if self.is_mla else self.n_kv_heads

    @cached_property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def is_moe_layer(self, i: int) -> bool:
        """The trainer's rule (every moe_every-th layer, not in moe_dense_layers) after the first n_dense_layers."""
        return super().is_moe_layer(i) and i >= self.n_dense_layers

    def __hash__(self) -> int:  # specs key the planner's caches: hash the ~40 fields once, not per lookup
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def mlp_mats(self) -> int:
        return flops.mlp_mats(self)


@dataclass(frozen=True)
class Tensor:
    """One inventory parameter as a rank holds it, with what decides its optimizer group and reductions."""

    numel: int
    matrix: bool = True
    """shardwise's weight-decayed optimizer group (norms and biases form the other)."""
    expert: bool = False
    """Routed-expert weight: its grad is reduced over the expert-data-parallel group, not dp×cp."""
    sp_replicated: bool = False
    """Replicated over tp but fed sequence shards under SP, so its grad needs a tp all-reduce."""
    whole_head: bool = False
    """A whole K/V head several tp ranks keep (n_kv_heads < tp): its grad is partial over tp."""

    @classmethod
    def of(cls, p: inventory.Param, tp: int = 1, ep: int = 1) -> Tensor:
        return cls(p.local_numel(tp, ep), p.matrix, p.expert, p.sp_replicated, p.whole_heads(tp))


def tensors(params, tp: int = 1, ep: int = 1) -> list[Tensor]:
    return [Tensor.of(p, tp, ep) for p in params]


@dataclass(frozen=True)
class Params:
    """Parameter elements one rank holds of some part of the model, split by how their grads are reduced."""

    dense: int = 0
    """Reduced over dp×cp (includes `sp_replicated` and `vectors`)."""
    expert: int = 0
    sp_replicated: int = 0
    vectors: int = 0
    """Dense 1-D tensors (norms, biases): shardwise's second ZeRO-1 flat buffer."""

    def __add__(self, o: Params) -> Params:
        return Params(self.dense + o.dense, self.expert + o.expert, self.sp_replicated + o.sp_replicated,
                      self.vectors + o.vectors)

    def __mul__(self, k: int) -> Params:
        return Params(self.dense * k, self.expert * k, self.sp_replicated * k, self.vectors * k)

    @property
    def total(self) -> int:
        return self.dense + self.expert

    @classmethod
    def of(cls, tensors) -> Params:
        out = [0, 0, 0, 0]
        for t in tensors:
            out[1 if t.expert else 0] += t.numel
            out[2] += t.numel if t.sp_replicated else 0
            out[3] += t.numel if not t.matrix and not t.expert else 0
        return cls(*out)


def padded_vocab(spec: ModelSpec, tp: int) -> int:
    """The vocabulary rows over all tp ranks: each rank's shard of the vocabulary-parallel embedding, tp times."""
    return inventory.embedding(spec)[0].local_shape(tp)[0] * tp


local_kv_heads = flops.local_kv_heads


def attention_tensors(spec: ModelSpec, tp: int) -> list[Tensor]:
    """A block's attention half (its norm, then attention or MLA) on one tp rank, in the runtime's order."""
    return [x for p, x in zip(inventory.block(spec, False), layer_tensors(spec, False, tp)) if p.name.startswith("attention")]


def mlp_tensors(spec: ModelSpec, moe: bool, tp: int, ep: int) -> list[Tensor]:
    """A block's MLP half (its norm, then the dense or MoE MLP) on one rank, in the runtime's order."""
    block = inventory.block(spec, moe)
    return [x for p, x in zip(block, layer_tensors(spec, moe, tp, ep)) if not p.name.startswith("attention")]


@lru_cache(maxsize=4096)
def layer_tensors(spec: ModelSpec, moe: bool, tp: int = 1, ep: int = 1, linear: bool = False) -> tuple[Tensor, ...]:
    """One block on one rank; `linear`: a Gated DeltaNet layer (Qwen3-Next)."""
    return tuple(tensors(inventory.block(spec, moe, linear), tp, ep))


@lru_cache(maxsize=4096)
def layer_params(spec: ModelSpec, moe: bool, tp: int = 1, ep: int = 1, linear: bool = False) -> Params:
    return Params.of(layer_tensors(spec, moe, tp, ep, linear))


def embedding_tensors(spec: ModelSpec, tp: int = 1) -> list[Tensor]:
    return tensors(inventory.embedding(spec), tp)


def head_tensors(spec: ModelSpec, tp: int = 1, separate_copy: bool = False) -> list[Tensor]:
    """Final norm plus LM head; a tied head costs nothing unless it sits on another stage than the embedding."""
    return tensors(inventory.head(spec, tied=spec.tie_embeddings and not separate_copy), tp)


def mtp_module_tensors(spec: ModelSpec, k: int, tp: int = 1, ep: int = 1) -> list[Tensor]:
    """Module k's tensors in the runtime's order: enorm, hnorm, eh_proj, block, shared_head.norm."""
    return tensors(inventory.mtp_module(spec, k), tp, ep)


def mtp_params(spec: ModelSpec) -> tuple[int, int]:
    """(total, idle routed-expert) unsharded parameters of the D modules (embedding and head shared: not counted)."""
    total = sum(Params.of(mtp_module_tensors(spec, k)).total for k in range(spec.mtp_layers))
    moe = sum(spec.is_moe_layer(spec.n_layers + k) for k in range(spec.mtp_layers))
    idle = moe * spec.mlp_mats * spec.dim * spec.expert_ffn_dim * (spec.moe_experts - spec.moe_topk)
    return total, idle


@lru_cache(maxsize=256)
def total_params(spec: ModelSpec) -> int:
    """Unsharded parameter count (no vocab padding), comparable to `ModelConfig.num_params()`."""
    layers = sum(layer_params(spec, spec.is_moe_layer(i), linear=spec.is_linear_layer(i)).total
                 for i in range(spec.n_layers))
    return Params.of(embedding_tensors(spec) + head_tensors(spec)).total + layers + mtp_params(spec)[0]


@lru_cache(maxsize=256)
def active_params(spec: ModelSpec) -> int:
    """Parameters one token uses: `total_params` less the routed experts it is not sent to (E − k per MoE layer)."""
    idle = spec.n_moe_layers * spec.mlp_mats * spec.dim * spec.expert_ffn_dim * (spec.moe_experts - spec.moe_topk)
    idle += spec.n_moe_layers * gpt_oss.idle_expert_bias(spec)
    return total_params(spec) - idle - mtp_params(spec)[1]


PRESETS: dict[str, ModelSpec] = {name: ModelSpec.of(cfg) for name, cfg in MODEL_PRESETS.items()}


def get_model(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise PlanError(f"unknown model {name!r}; valid presets: {', '.join(PRESETS)} (or --model-config PATH)")
    return PRESETS[name]


def load_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face config.json of a supported family; anything else is a `PlanError` naming why.

    The one reader (`shardwise.hf.config`), lenient: what train accepts is planned as exactly the model
    `shardwise train --model-config` builds; what it refuses (and gpt2) is read for its shapes, marked `untrainable`.
    """
    try:
        model, refusal = model_fields_from_hf(str(path), lenient=True)
    except ConfigError as e:
        raise PlanError(f"--model-config {path}: {e}") from None
    return ModelSpec(**model, untrainable=refusal)
