"""Model shapes the planner understands, and how many parameters each rank holds of them.

One preset table: `shardwise.config.MODEL_PRESETS`, the trainer's own. A `ModelSpec` *is* a trainer
`ModelConfig` (a subclass: every field the trainer knows, under the same name and meaning — Qwen3's q/k norms
and explicit head_dim, DeepSeek's Multi-head Latent Attention, dense layers among MoE ones) plus the
architecture variants only the planner models — GPT-2's GELU MLP, LayerNorm, linear biases and learned
positions — so a plan for a trainer preset or a trainer-readable Hugging Face config is a plan of exactly the
model `shardwise train` builds; `untrainable` says why train cannot build a spec. Hugging Face `config.json`
files of the llama, mistral, mixtral, qwen2, qwen3, qwen3_moe and deepseek_v3 families are read by the trainer's
reader (`shardwise.hf.config`); shapes it refuses, and gpt2, are read leniently (`shardwise.hf.shapes`).

Counting follows shardwise's TP plan: the vocabulary is padded to a
multiple of tp and sharded, wq/wk/wv/w1/w3 are split by output rows, wo/w2 by input columns, norms are
replicated, and when n_kv_heads < tp every rank keeps one full K/V head. An MoE block is shardwise's
(`parallelize.apply_expert_parallel`): routed experts are split over ep by expert — each rank holds
one stacked [E/ep, ...] tensor per projection — and the whole block (router, routed and shared
experts) is replicated over tp, not tensor-sharded; routers and shared experts are dense weights
(replicated over ep). MoE layers are those with i >= n_dense_layers and i % moe_every == 0
(shardwise's `moe_every`, Megatron's moe_layer_freq; DeepSeek-V3's first-k-dense).

DeepSeek-V3's Multi-head Latent Attention is modelled by its real projection shapes (q_a, q_b, kv_a,
kv_b, o), with the down-projections and their norms replicated over tp (as shardwise's plan and Megatron do) and
the up-projections and o sharded by heads. For FLOPs and context-parallel traffic it is treated
as multi-head attention with n_heads K/V heads of qk_nope+qk_rope (K) and v_head_dim (V) — the
decompressed tensors training materialises; its activations are counted term by term (latents, padded
core: `planner.activations`). Its multi-token-prediction modules (`--mtp-layers`) are counted on the last stage
(planner/mtp.py).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from pathlib import Path

from shardwise.config import MODEL_PRESETS, ConfigError, ModelConfig
from shardwise.hf.shapes import model_fields_from_hf
from shardwise.planner import gpt_oss
from shardwise.planner.errors import PlanError
from shardwise.planner.linear_attention import linear_attention_tensors

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

    @classmethod
    def of(cls, cfg: ModelConfig) -> ModelSpec:
        """The planner's view of a trainer ModelConfig: the same fields, planner-only ones at their defaults."""
        if isinstance(cfg, cls):
            return cfg
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)})

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim

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
        return self.head_dim + self.qk_rope_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

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
        return 3 if self.mlp == "swiglu" else 2

    @property
    def norm_params(self) -> int:
        return self.dim * (2 if self.norm == "layernorm" else 1)


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor as a rank holds it, with what decides its optimizer group and reductions."""

    numel: int
    matrix: bool = True
    """ndim >= 2: shardwise's weight-decayed optimizer group (norms and biases form the other)."""
    expert: bool = False
    """Routed-expert weight: its grad is reduced over the expert-data-parallel group, not dp×cp."""
    sp_replicated: bool = False
    """Replicated over tp but fed sequence shards under SP, so its grad needs a tp all-reduce."""


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
    return -(-spec.vocab_size // tp) * tp


def local_kv_heads(spec: ModelSpec, tp: int) -> int:
    """K/V heads on one tp rank: a 1/tp share, or one whole replicated head when n_kv_heads < tp."""
    return max(spec.attn_kv_heads // tp, 1)


def _norm(spec: ModelSpec) -> list[Tensor]:
    n = [Tensor(spec.dim, matrix=False, sp_replicated=True)]
    return n * 2 if spec.norm == "layernorm" else n


def attention_tensors(spec: ModelSpec, tp: int) -> list[Tensor]:
    """Norm, then wq, wk, wv, wo (MLA: q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o), shardwise's order."""
    h, hq = spec.dim, spec.n_heads // tp
    out = _norm(spec)
    if spec.is_mla:
        rep = dict(sp_replicated=True)
        if spec.q_lora_rank:
            out += [Tensor(h * spec.q_lora_rank, **rep), Tensor(spec.q_lora_rank, matrix=False, **rep),
                    Tensor(spec.q_lora_rank * hq * spec.k_dim)]
        else:
            out.append(Tensor(h * hq * spec.k_dim))
        out += [Tensor(h * (spec.kv_lora_rank + spec.qk_rope_dim), **rep),
                Tensor(spec.kv_lora_rank, matrix=False, **rep),
                Tensor(spec.kv_lora_rank * hq * (spec.head_dim + spec.v_dim)), Tensor(hq * spec.v_dim * h)]
        return out
    q, kv = hq * spec.head_dim, local_kv_heads(spec, tp) * spec.head_dim
    bias = spec.attention_bias or spec.linear_bias
    out += [Tensor(n, **kw) for n, kw in gpt_oss.attention_sinks(spec, tp)]  # gpt-oss: its sinks, wo's bias below
    for rows in (q * (2 if spec.attn_output_gate else 1), kv, kv):  # gated attention: wq also yields the gate
        out += [Tensor(rows * h)] + ([Tensor(rows, matrix=False)] if bias else [])
    out.append(Tensor(q * h))
    out += [Tensor(n, **kw) for n, kw in gpt_oss.out_bias(spec)]
    if spec.linear_bias:
        out.append(Tensor(h, matrix=False, sp_replicated=True))
    if spec.qk_norm:  # Qwen3's per-head q/k norms (after wo, as in shardwise's module): partial grads under any tp
        out += [Tensor(spec.head_dim, matrix=False, sp_replicated=True)] * 2
    return out


def mlp_tensors(spec: ModelSpec, moe: bool, tp: int, ep: int) -> list[Tensor]:
    """Norm, then w1, w3, w2 (GELU: fc1, fc2 with biases); MoE (shardwise's order): router, the local routed
    experts as one stacked tensor per projection, the shared experts as one MLP of n_shared·expert_ffn_dim.

    The MoE block is replicated over tp: under SP each tp rank routes its own sequence shard, so every
    MoE gradient is partial and summed over tp (`sp_replicated`).
    """
    h, out = spec.dim, _norm(spec)
    if not moe:
        f = spec.ffn_dim // tp
        if spec.mlp == "gelu":
            out += [Tensor(h * f)] + ([Tensor(f, matrix=False)] if spec.linear_bias else []) + [Tensor(f * h)]
            return out + ([Tensor(h, matrix=False, sp_replicated=True)] if spec.linear_bias else [])
        return out + [Tensor(h * f)] * 3
    rep = dict(sp_replicated=True)
    routed = [Tensor(spec.moe_experts // ep * h * spec.expert_ffn_dim, expert=True, **rep)] * spec.mlp_mats
    shared = [Tensor(h * spec.moe_shared_experts * spec.expert_ffn_dim, **rep)] * spec.mlp_mats \
        if spec.moe_shared_experts else []
    router = [Tensor(h * spec.moe_experts, **rep)] + [Tensor(n, **kw) for n, kw in gpt_oss.router_extras(spec)]
    biases = [Tensor(n, **kw) for n, kw in gpt_oss.expert_extras(spec, ep)]  # gpt-oss's expert biases
    gate = [Tensor(h, **rep)] if spec.moe_shared_gate and spec.moe_shared_experts else []  # Qwen3-Next
    return out + router + routed + biases + shared + gate


@lru_cache(maxsize=4096)
def layer_tensors(spec: ModelSpec, moe: bool, tp: int = 1, ep: int = 1, linear: bool = False) -> tuple[Tensor, ...]:
    """`linear`: a Gated DeltaNet layer (Qwen3-Next), its mixer's tensors from planner/linear_attention.py."""
    mixer = linear_attention_tensors(spec, tp, Tensor, _norm(spec)) if linear else attention_tensors(spec, tp)
    return tuple(mixer + mlp_tensors(spec, moe, tp, ep))


@lru_cache(maxsize=4096)
def layer_params(spec: ModelSpec, moe: bool, tp: int = 1, ep: int = 1, linear: bool = False) -> Params:
    return Params.of(layer_tensors(spec, moe, tp, ep, linear))


def embedding_tensors(spec: ModelSpec, tp: int = 1) -> list[Tensor]:
    pos = [Tensor(spec.max_seq_len * spec.dim)] if spec.learned_pos else []
    return [Tensor(padded_vocab(spec, tp) // tp * spec.dim)] + pos


def head_tensors(spec: ModelSpec, tp: int = 1, separate_copy: bool = False) -> list[Tensor]:
    """Final norm plus LM head; a tied head costs nothing unless it sits on another stage than the embedding."""
    tied = spec.tie_embeddings and not separate_copy
    return _norm(spec) + ([] if tied else [Tensor(padded_vocab(spec, tp) // tp * spec.dim)])


def mtp_module_tensors(spec: ModelSpec, k: int, tp: int = 1, ep: int = 1) -> list[Tensor]:
    """Module k's tensors in shardwise's named_parameters order: enorm, hnorm, eh_proj, block, shared_head.norm."""
    norm = Tensor(spec.dim, matrix=False, sp_replicated=True)
    block = list(layer_tensors(spec, spec.is_moe_layer(spec.n_layers + k), tp, ep))
    return [norm, norm, Tensor(2 * spec.dim * spec.dim, sp_replicated=True)] + block + [norm]


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
