"""Model shapes: `ModelConfig` (a Llama-style decoder and its MoE, attention and embedding variants) and the
named presets that train, verify and the planner share. Torch-free."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP)."""

    name: str = "tiny"
    vocab_size: int = 257
    """Number of real token ids. Byte-level tokenizer: 256 bytes + 1 end-of-document id."""
    dim: int = 96
    """Hidden size h."""
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 4
    """Key/value heads (GQA). Must divide n_heads."""
    head_dim: int = 0
    """Per-head width of q, k and v; 0 = dim // n_heads. Qwen3 sets it explicitly (n_heads·head_dim may differ from
    dim). Kept as 0-means-derived through `with_overrides`, so --dim on a preset re-derives it."""
    ffn_dim: int = 256
    """SwiGLU inner size (w1/w3 output features)."""
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    rope_scaling: tuple[float, float, float, int] | None = None
    """Llama-3.1 RoPE frequency scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), as HF's rope_type "llama3"; None = plain RoPE."""
    rope_yarn: tuple[float, int, float, float, float, bool] | None = None
    """YaRN RoPE (factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor, truncate), as
    HF's rope_type "yarn" (DeepSeek-V3): blended frequencies, cos/sin times attention_factor; None = off."""
    mla_mscale: float = 1.0
    """MLA's softmax-scale multiplier: HF DeepSeek's yarn_get_mscale(factor, mscale_all_dim)² under YaRN, else 1."""
    norm_eps: float = 1e-5
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2); wo and the MLP stay bias-free."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each head's head_dim on q and on k (weights shared by all heads), before RoPE."""
    q_lora_rank: int = 0
    """Multi-head Latent Attention (DeepSeek-V2/V3, on when kv_lora_rank > 0): rank of the query down-projection
    (0 = a full q projection, V2-Lite). Under MLA head_dim is the non-rotary part of q/k (qk_nope_head_dim)."""
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    """MLA: rotary part of each q/k head (one shared rotary key for all heads)."""
    v_head_dim: int = 0
    """MLA: value head size (may differ from the q/k head size head_dim + qk_rope_dim)."""
    mla_norm_eps: float = 1e-6
    """MLA's latent norms (HF's DeepseekV3RMSNorm keeps its default eps there, not rms_norm_eps)."""
    tie_embeddings: bool = False
    """Share the token-embedding matrix with the LM head."""
    dropout: float = 0.0
    """Residual dropout after attention and MLP outputs (replicated / SP region)."""
    attn_dropout: float = 0.0
    """Dropout on attention probabilities (TP-sharded region: per-TP-rank masks)."""
    moe_experts: int = 0
    """Routed experts per MoE layer; 0 = dense model."""
    moe_topk: int = 2
    moe_every: int = 1
    """Every N-th block (layer i with i % N == 0, as Megatron's moe_layer_freq) is an MoE block."""
    moe_ffn_dim: int | None = None
    """Inner size of each routed expert (default ffn_dim)."""
    moe_shared_experts: int = 0
    """Dense experts applied to every token (DeepSeek-V3), as one SwiGLU of S × expert size."""
    moe_capacity_factor: float | None = None
    """Tokens per expert per rank capped at ceil(F·N·k/E); None = dropless."""
    moe_aux_loss_coef: float = 0.0
    """Switch/GShard load-balancing loss E·Σ fᵢ·Pᵢ, with fᵢ over the global microbatch."""
    moe_aux_loss_scope: str = "layer"
    """"layer": the aux loss above per MoE layer, summed (Switch, Megatron). "model": Hugging Face's
    load_balancing_loss_func (Mixtral, Qwen3-MoE): assignment shares and mean probabilities pooled over all MoE
    layers first, aux = E · Σᵢ (Cᵢ / (L·N)) · (Sᵢ / (L·N)) with Cᵢ the top-k picks and Sᵢ the probabilities of
    expert i summed over L layers and N tokens (k times the per-layer normalisation)."""
    moe_z_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0
    """DeepSeek auxiliary-loss-free balancing: per-expert selection bias step size (0 = off)."""
    moe_score: str = "softmax"
    """Router scores: softmax or sigmoid (DeepSeek-V3)."""
    moe_softmax_before_topk: bool = True
    moe_n_group: int = 1
    moe_topk_group: int = 1
    """DeepSeek-V3 group-limited routing: experts in n_group groups, a group scored by its top-2 selection scores,
    tokens pick their top-k among the experts of their topk_group best groups (1, 1 = no grouping)."""
    moe_group_topk: int = 2
    """A group's score is the sum of its top-n selection scores (DeepSeek-V3: 2; V2's group_limited_greedy: 1)."""
    moe_norm_topk: bool = True
    """sigmoid scores: renormalise the chosen k weights to sum 1 (HF norm_topk_prob)."""
    moe_routed_scaling: float = 1.0
    """Routed experts' weights times this (DeepSeek-V3's routed_scaling_factor 2.5)."""
    moe_dense_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP of ffn_dim although `moe_every` makes them MoE (Qwen3-MoE's mlp_only_layers
    and decoder_sparse_step, DeepSeek's first_k_dense_replace)."""
    mtp_layers: int = 0
    """DeepSeek-V3 multi-token prediction depth D (`--mtp-layers`): D extra modules, module k predicting token i+k+1
    (docs/mtp.md). 0 = off, also when a config.json has num_nextn_predict_layers."""
    # gpt-oss (OpenAI's open-weight MoE): attention sinks, sliding windows, output bias, biased router and experts.
    attention_sinks: bool = False
    """A learned logit per query head in every softmax's denominator (gpt-oss's sinks): a head may attend to nothing."""
    sliding_window: int = 0
    """Keys a query of a `sliding_layers` layer sees, itself included (key k visible from query q iff q − W < k ≤ q,
    transformers' sliding_window); 0 = no windowed layer."""
    sliding_layers: tuple[int, ...] = ()
    """Layers that attend within `sliding_window` (gpt-oss: the even ones); the others see every earlier token."""
    attention_out_bias: bool = False
    """A bias on the output projection wo too (gpt-oss's attention_bias covers q, k, v and o)."""
    moe_router_bias: bool = False
    """A learned bias on the router logits, in the selection and in the weights alike (gpt-oss)."""
    moe_expert_bias: bool = False
    """Biases on every routed expert's three projections (gpt-oss)."""
    moe_swiglu_limit: float = 0.0
    """> 0: gpt-oss's clamped expert SwiGLU, (min(up, ±limit) + 1) · g·σ(α·g) with g = min(gate, limit); 0: silu SwiGLU."""
    moe_swiglu_alpha: float = 1.702
    """α of the clamped SwiGLU's gate (gpt-oss: 1.702, the sigmoid approximation of GELU)."""
    # Qwen3-Next / Qwen3.5 hybrids: Gated DeltaNet layers between gated full-attention ones (models/gated_deltanet.py).
    linear_layers: tuple[int, ...] = ()
    """Layers whose token mixer is Gated DeltaNet linear attention instead of softmax attention (HF layer_types
    "linear_attention"; Qwen3-Next: three of every four)."""
    linear_k_heads: int = 0
    """Gated DeltaNet query/key heads (linear_num_key_heads); each serves linear_v_heads / linear_k_heads value heads."""
    linear_v_heads: int = 0
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    linear_conv_kernel: int = 4
    """Width of the causal depthwise convolution on q/k/v (linear_conv_kernel_dim)."""
    attn_output_gate: bool = False
    """Qwen3-Next's gated attention: q_proj also yields a per-head gate, the attention output times sigmoid(gate)
    before wo; its RMSNorms are HF's zero-centred (1 + w) kind (stored here as 1 + w)."""
    partial_rotary: float = 1.0
    """Fraction of each head RoPE rotates (HF partial_rotary_factor; Qwen3-Next 0.25); the rest passes unrotated."""
    moe_shared_gate: bool = False
    """The shared expert's output times sigmoid(w·x), one scalar gate per token (Qwen3-Next's shared_expert_gate)."""
    # MiniMax-M2 (docs/families-2026.md).
    qk_norm_full: bool = False
    """With qk_norm: one RMSNorm over all heads' width of q (weight n_heads·head_dim) and one over k's
    (n_kv_heads·head_dim), MiniMax-M2's, instead of a head_dim norm per head; under TP its statistics cross ranks."""
    # Kimi-Linear: Kimi Delta Attention layers between MLA ones without RoPE (models/kimi_delta.py).
    kda: bool = False
    """The `linear_layers` are Kimi Delta Attention (a per-channel decay gate; linear_v_heads heads of linear_v_dim,
    keys as wide) instead of Gated DeltaNet; the other layers may be MLA."""
    mla_nope: bool = False
    """MLA without RoPE (Kimi-Linear): the shared key part of qk_rope_dim is kept but not rotated."""
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks each query's top-k keys for MLA.
    index_topk: int = 0
    """Keys each query's sparse MLA attends (HF index_topk: the indexer's top-k over the causal keys); 0 = dense MLA."""
    index_n_heads: int = 0
    """Lightning-indexer heads (index_n_heads): ReLU(q_h·k) summed over heads with per-token weights."""
    index_head_dim: int = 0
    """Lightning-indexer head size (index_head_dim); its first qk_rope_dim dimensions are rotated."""
    index_rope_interleave: bool = False
    """The indexer's RoPE rotates interleaved pairs (GLM-5) instead of halves (DeepSeek-V3.2)."""

    def __post_init__(self):
        # head_dim 0 means "derived": resolve it, and remember so overrides of dim / n_heads re-derive it.
        derived = not self.head_dim
        object.__setattr__(self, "_head_dim_derived", derived)
        if derived and isinstance(self.dim, int) and isinstance(self.n_heads, int) and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if isinstance(self.moe_dense_layers, list):
            object.__setattr__(self, "moe_dense_layers", tuple(self.moe_dense_layers))
        if isinstance(self.sliding_layers, list):
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        if isinstance(self.linear_layers, list):
            object.__setattr__(self, "linear_layers", tuple(self.linear_layers))

    def with_overrides(self, **changes) -> ModelConfig:
        """dataclasses.replace that re-derives a derived head_dim (so `--dim` on a preset keeps dim // n_heads)."""
        if self.__dict__.get("_head_dim_derived", False) and "head_dim" not in changes:
            changes["head_dim"] = 0
        return dataclasses.replace(self, **changes)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_experts > 0 and i % self.moe_every == 0 and i not in self.moe_dense_layers

    def window(self, i: int) -> int:
        """Layer i's sliding window (0: it sees every earlier token)."""
        return self.sliding_window if i in self.sliding_layers else 0

    def is_linear_layer(self, i: int) -> bool:
        """Layer i mixes tokens with Gated DeltaNet (an MTP block, i >= n_layers, keeps attention)."""
        return i in self.linear_layers

    @property
    def has_mtp_architecture(self) -> bool:
        """Sigmoid-routed experts with MLA (DeepSeek-V3, Kimi K2) or with a shared expert (GLM-4.5's GQA): the
        families whose checkpoints hold their MTP modules as layers n_layers + k."""
        return self.moe_experts > 0 and self.moe_score == "sigmoid" and (self.is_mla or self.moe_shared_experts > 0)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head: MLA's rotary part, else the head's rotary fraction (whole by default)."""
        return self.qk_rope_dim if self.is_mla else int(self.head_dim * self.partial_rotary)

    def validate(self) -> None:
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model {self.name!r}: {f}={v!r} must be a positive integer")
        if not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ConfigError(f"model {self.name!r}: head_dim={self.head_dim!r} must be a positive integer (or 0 = "
                              "dim // n_heads)")
        if self.__dict__.get("_head_dim_derived", False) and self.dim % self.n_heads:
            raise ConfigError(f"model {self.name!r}: dim={self.dim} is not divisible by n_heads={self.n_heads} "
                              "(or give head_dim explicitly)")
        if self.rope_dim % 2:
            raise ConfigError(f"model {self.name!r}: the RoPE dimension {self.rope_dim} must be even")
        if self.is_mla and (self.qk_rope_dim <= 0 or self.v_head_dim <= 0 or self.q_lora_rank < 0):
            raise ConfigError(f"model {self.name!r}: MLA (kv_lora_rank={self.kv_lora_rank}) needs qk_rope_dim > 0 and "
                              f"v_head_dim > 0, got {self.qk_rope_dim}, {self.v_head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model {self.name!r}: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.rope_yarn is not None and (self.rope_scaling is not None or len(self.rope_yarn) != 6
                                           or self.rope_yarn[0] <= 0 or self.rope_yarn[1] <= 0):
            raise ConfigError(f"model {self.name!r}: rope_yarn={self.rope_yarn!r} must be (factor > 0, "
                              "original_max_position_embeddings > 0, beta_fast, beta_slow, attention_factor, truncate) "
                              "and excludes rope_scaling")
        for f in ("moe_topk", "moe_every"):  # refused even on a dense model: a typo should not pass silently
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ConfigError(f"--{f.replace('_', '-')} {getattr(self, f)!r} must be a positive integer")
        if self.moe_experts < 0:
            raise ConfigError(f"--moe-experts {self.moe_experts} must be >= 0 (0 = dense)")
        if self.moe_experts:
            if not 1 <= self.moe_topk <= self.moe_experts:
                raise ConfigError(f"model {self.name!r}: moe_topk={self.moe_topk} must be in [1, moe_experts="
                                  f"{self.moe_experts}]")
            if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
                raise ConfigError(f"--moe-capacity-factor {self.moe_capacity_factor} must be positive")
            bad = [i for i in self.moe_dense_layers if not isinstance(i, int) or not 0 <= i < self.n_layers]
            if bad:
                raise ConfigError(f"model {self.name!r}: moe_dense_layers entry {bad[0]!r} is not a layer index in "
                                  f"[0, {self.n_layers})")
            if self.moe_aux_loss_scope not in ("layer", "model"):
                raise ConfigError(f"model {self.name!r}: moe_aux_loss_scope={self.moe_aux_loss_scope!r}; valid: layer, "
                                  "model")
            if self.moe_n_group < 1 or self.moe_experts % self.moe_n_group or not 1 <= self.moe_topk_group <= self.moe_n_group:
                raise ConfigError(f"model {self.name!r}: moe_n_group={self.moe_n_group} must divide moe_experts="
                                  f"{self.moe_experts} and moe_topk_group={self.moe_topk_group} be in [1, n_group]")
            if self.moe_score not in ("softmax", "sigmoid"):
                raise ConfigError(f"--moe-score {self.moe_score!r}: valid: softmax, sigmoid")
        if not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise ConfigError(f"--mtp-layers {self.mtp_layers!r} must be an integer >= 0 (0 = no multi-token prediction)")
        if self.mtp_layers and not self.has_mtp_architecture:
            raise ConfigError(f"--mtp-layers {self.mtp_layers}: model {self.name!r} has no multi-token prediction; valid "
                              "only on DeepSeek-V3-architecture models (MLA with sigmoid-routed experts: the deepseek-v3 "
                              "preset or a deepseek_v3 config.json) and GLM-4.5 ones (glm-4.5 presets, glm4_moe)")
        if self.mtp_layers and self.moe_aux_loss_scope == "model" and self.moe_aux_loss_coef:
            raise ConfigError(f"--mtp-layers {self.mtp_layers} with model {self.name!r}'s aux loss pooled over all layers "
                              "(moe_aux_loss_scope='model') is not supported; valid: moe_aux_loss_scope='layer'")
        for f in ("dropout", "attn_dropout"):
            v = getattr(self, f)
            if not 0.0 <= v < 1.0:
                raise ConfigError(f"model {self.name!r}: {f}={v} must be in [0, 1)")
        self._validate_gpt_oss()
        self._validate_linear()
        if self.qk_norm_full and (not self.qk_norm or self.is_mla):
            raise ConfigError(f"model {self.name!r}: qk_norm_full needs qk_norm on a GQA model (MiniMax-M2's norms "
                              "over all heads' width)")
        self._validate_dsa()

    def _validate_gpt_oss(self) -> None:
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ConfigError(f"model {self.name!r}: sliding_window={self.sliding_window!r} must be an integer >= 0 "
                              "(0 = no sliding window)")
        bad = [i for i in self.sliding_layers if not isinstance(i, int) or not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"model {self.name!r}: sliding_layers entry {bad[0]!r} is not a layer index in "
                              f"[0, {self.n_layers})")
        if self.sliding_layers and not self.sliding_window:
            raise ConfigError(f"model {self.name!r}: sliding_layers={self.sliding_layers} need sliding_window > 0")
        if self.attn_dropout and (self.attention_sinks or self.sliding_layers):
            raise ConfigError(f"model {self.name!r}: attn_dropout={self.attn_dropout} with attention sinks or sliding "
                              "windows is not supported (their kernels run without dropout); valid: attn_dropout=0")
        if self.attention_sinks and self.is_mla:
            raise ConfigError(f"model {self.name!r}: attention_sinks with MLA is not supported")
        if not self.moe_swiglu_limit >= 0:
            raise ConfigError(f"model {self.name!r}: moe_swiglu_limit={self.moe_swiglu_limit} must be >= 0 (0 = silu "
                              "SwiGLU)")

    def _validate_linear(self) -> None:
        if not 0.0 < self.partial_rotary <= 1.0:
            raise ConfigError(f"model {self.name!r}: partial_rotary={self.partial_rotary} must be in (0, 1]")
        if not self.linear_layers:
            return
        bad = [i for i in self.linear_layers if not isinstance(i, int) or not 0 <= i < self.n_layers]
        if bad:
            raise ConfigError(f"model {self.name!r}: linear_layers entry {bad[0]!r} is not a layer index in "
                              f"[0, {self.n_layers})")
        for f in ("linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim", "linear_conv_kernel"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ConfigError(f"model {self.name!r}: {f}={getattr(self, f)!r} must be a positive integer "
                                  "(the Gated DeltaNet layers need it)")
        if self.linear_v_heads % self.linear_k_heads:
            raise ConfigError(f"model {self.name!r}: linear_v_heads={self.linear_v_heads} is not divisible by "
                              f"linear_k_heads={self.linear_k_heads}")
        if self.kda and (self.linear_k_heads != self.linear_v_heads or self.linear_k_dim != self.linear_v_dim):
            raise ConfigError(f"model {self.name!r}: Kimi Delta Attention has as many key heads as value heads, as wide "
                              f"(linear_k_heads={self.linear_k_heads}, linear_v_heads={self.linear_v_heads}, "
                              f"linear_k_dim={self.linear_k_dim}, linear_v_dim={self.linear_v_dim})")
        if self.is_mla and not self.kda:
            raise ConfigError(f"model {self.name!r}: Gated DeltaNet layers with MLA are not supported")

    @property
    def is_dsa(self) -> bool:
        """MLA with DeepSeek Sparse Attention (a lightning indexer in every attention layer)."""
        return self.index_topk > 0

    def _validate_dsa(self) -> None:
        if not self.is_dsa and not (self.index_n_heads or self.index_head_dim):
            return
        if not self.is_mla or not self.q_lora_rank:
            raise ConfigError(f"model {self.name!r}: index_topk={self.index_topk} (DeepSeek Sparse Attention) needs "
                              "MLA with a query latent (kv_lora_rank > 0, q_lora_rank > 0): its indexer reads it")
        for f in ("index_topk", "index_n_heads", "index_head_dim"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ConfigError(f"model {self.name!r}: {f}={getattr(self, f)!r} must be a positive integer (the "
                                  "lightning indexer needs it)")
        if self.attn_dropout:
            raise ConfigError(f"model {self.name!r}: attn_dropout={self.attn_dropout} with DeepSeek Sparse Attention "
                              "is not supported (the sparse kernel runs without dropout); valid: attn_dropout=0")
        if self.index_head_dim < self.qk_rope_dim:
            raise ConfigError(f"model {self.name!r}: index_head_dim={self.index_head_dim} must be >= qk_rope_dim="
                              f"{self.qk_rope_dim} (the indexer rotates its first qk_rope_dim dimensions)")

    def indexer_params(self) -> int:
        """Parameters of one lightning indexer: wq_b, wk, k_norm (LayerNorm: weight and bias), weights_proj."""
        if not self.is_dsa:
            return 0
        n, d = self.index_n_heads, self.index_head_dim
        return self.q_lora_rank * n * d + self.dim * d + 2 * d + self.dim * n

    def num_params(self) -> int:
        """Total parameter count (embedding and LM head counted once each unless tied)."""
        h, q, kv = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = h * q * 2 + h * kv * 2 + ((q + 2 * kv) if self.attention_bias else 0)
        attn += ((self.n_heads + self.n_kv_heads) if self.qk_norm_full else 2) * self.head_dim if self.qk_norm else 0
        attn += (h if self.attention_out_bias else 0) + (self.n_heads if self.attention_sinks else 0)
        attn += h * q if self.attn_output_gate else 0
        if self.is_mla:
            qk, r = self.head_dim + self.qk_rope_dim, self.q_lora_rank
            q_proj = (h * r + r + r * self.n_heads * qk) if r else h * self.n_heads * qk
            attn = q_proj + h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank
            attn += self.kv_lora_rank * self.n_heads * (self.head_dim + self.v_head_dim) + self.n_heads * self.v_head_dim * h
        dense_mlp = 3 * h * self.ffn_dim
        moe_ffn = self.moe_ffn_dim or self.ffn_dim
        moe_mlp = 3 * h * moe_ffn * (self.moe_experts + self.moe_shared_experts) + self.moe_experts * h
        moe_mlp += self.moe_experts * (self.moe_expert_bias * (2 * moe_ffn + h) + self.moe_router_bias)
        moe_mlp += h if self.moe_shared_gate else 0
        blocks = range(self.n_layers + self.mtp_layers)  # MTP module k's block is layer n_layers + k (DeepSeek's)
        mlps = sum(moe_mlp if self.is_moe_layer(i) else dense_mlp for i in blocks)
        mlps += len(self.linear_layers) * (self.linear_params() - attn)
        emb = self.vocab_size * h
        mtp = self.mtp_layers * (3 * h + 2 * h * h)  # enorm, hnorm, shared_head.norm, eh_proj; embedding/head shared
        attn += self.indexer_params()  # DeepSeek Sparse Attention: every MLA layer's lightning indexer
        return len(blocks) * (attn + 2 * h) + mlps + mtp + h + emb * (1 if self.tie_embeddings else 2)

    def linear_params(self) -> int:
        """Parameters of one Gated DeltaNet mixer: q/k/v/z/b/a projections, the conv kernels, A_log and dt_bias,
        the gated norm and wo."""
        nk, nv, dk, dv = self.linear_k_heads, self.linear_v_heads, self.linear_k_dim, self.linear_v_dim
        if self.kda:  # q/k/v, their kernels, the gate's and the output gate's low-rank pairs, dt_bias, A_log, β, norm
            c = nv * dv
            return (3 * self.dim * c + 3 * c * self.linear_conv_kernel + 2 * (dv * self.dim + c * dv) + c + nv
                    + nv * self.dim + dv + c * self.dim)
        channels = 2 * nk * dk + nv * dv
        return (self.dim * (channels + nv * dv + 2 * nv) + channels * self.linear_conv_kernel + 2 * nv + dv
                + nv * dv * self.dim)

    def num_active_params(self) -> int:
        """Parameters one token uses: embedding and head, attention, dense MLPs, shared experts, the router and its
        top-k routed experts (the "active" size MoE model cards quote)."""
        moe_ffn = self.moe_ffn_dim or self.ffn_dim
        n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers + self.mtp_layers))
        expert = 3 * self.dim * moe_ffn + self.moe_expert_bias * (2 * moe_ffn + self.dim)
        return self.num_params() - n_moe * expert * (self.moe_experts - self.moe_topk)


def _qwen_hybrid(name: str, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int,
                 linear_v_heads: int, experts: int = 0, topk: int = 0, expert_ffn: int = 0) -> ModelConfig:
    """A Qwen3-Next / Qwen3.5 hybrid preset: three Gated DeltaNet layers (16 key heads of 128) to one gated
    full-attention layer (every 4th; head_dim 256, a quarter rotary, q/k norms); MoE ones every layer MoE, top-k
    renormalised, with one gated shared expert of the expert size."""
    moe = dict(moe_experts=experts, moe_topk=topk, moe_ffn_dim=expert_ffn, moe_shared_experts=1, moe_shared_gate=True,
               moe_softmax_before_topk=False, moe_aux_loss_coef=0.001) if experts else {}
    return ModelConfig(name=name, vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=256, ffn_dim=ffn, max_seq_len=262144, rope_theta=1e7, norm_eps=1e-6, qk_norm=True,
                       attn_output_gate=True, partial_rotary=0.25,
                       linear_layers=tuple(i for i in range(n_layers) if (i + 1) % 4), linear_k_heads=16,
                       linear_v_heads=linear_v_heads, **moe)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # CPU-sized models for tests and the embedded default run.
    "tiny": ModelConfig(),
    "small": ModelConfig(name="small", dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_dim=704, max_seq_len=1024),
    "tiny-moe": ModelConfig(name="tiny-moe", moe_experts=8, moe_topk=2, moe_every=2, moe_ffn_dim=128,
                            moe_shared_experts=1, moe_aux_loss_coef=0.01),
    # Real shapes (Meta Llama-3 model cards / HF config.json) for the planner.
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
        ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0,
    ),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
        ffn_dim=28672, max_seq_len=8192, rope_theta=500000.0,
    ),
    "llama3-405b": ModelConfig(
        name="llama3-405b", vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
        ffn_dim=53248, max_seq_len=8192, rope_theta=500000.0,
    ),
    # Mistral AI's Mixtral-8x7B config.json: 8 experts, top-2, softmax over the chosen two.
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        max_seq_len=32768, rope_theta=1e6, moe_experts=8, moe_topk=2, moe_every=1, moe_softmax_before_topk=False,
        moe_aux_loss_coef=0.02,
    ),
    # Qwen/Qwen3-*/config.json: explicit head_dim 128 (Qwen3-0.6B: 16·128 = 2048 > hidden 1024), q/k norms, no
    # biases, rope_theta 1e6; 0.6B ties its embeddings.
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
        ffn_dim=3072, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
    ),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
        ffn_dim=12288, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
    ),
    "qwen3-32b": ModelConfig(
        name="qwen3-32b", vocab_size=151936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
        ffn_dim=25600, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
    ),
    # Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json: 128 experts of moe_intermediate_size, top-8, renormalised
    # (norm_topk_prob), every layer MoE, no shared experts. Aux loss per layer here (works under PP); a config.json
    # read with output_router_logits gets HF's pooled one.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        ffn_dim=6144, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, moe_experts=128, moe_topk=8,
        moe_ffn_dim=768, moe_softmax_before_topk=False, moe_aux_loss_coef=0.001,
    ),
    "qwen3-235b-a22b": ModelConfig(
        name="qwen3-235b-a22b", vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
        ffn_dim=12288, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, moe_experts=128, moe_topk=8,
        moe_ffn_dim=1536, moe_softmax_before_topk=False, moe_aux_loss_coef=0.001,
    ),
    # deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite config.json: MLA, first-k dense layers, shared experts. V3:
    # sigmoid scores, 8 groups (top-4), renormalised top-8 × 2.5, loss-free bias step 0.001, and its YaRN context
    # extension (163840 tokens: factor 40 over 4096, beta 32/1, mscale = mscale_all_dim = 1, so cos/sin unscaled and
    # the softmax scale × (1 + 0.1 ln 40)²). V2-Lite: no query latent, softmax top-6 probabilities unnormalised, at
    # its original 4096-token context (its YaRN settings are not carried over here).
    "deepseek-v3": ModelConfig(
        name="deepseek-v3", vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=128,
        ffn_dim=18432, max_seq_len=163840, norm_eps=1e-6, q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64,
        v_head_dim=128, moe_experts=256, moe_topk=8, moe_ffn_dim=2048, moe_shared_experts=1, moe_dense_layers=(0, 1, 2),
        moe_score="sigmoid", moe_n_group=8, moe_topk_group=4, moe_routed_scaling=2.5, moe_bias_update_rate=0.001,
        rope_yarn=(40.0, 4096, 32.0, 1.0, 1.0, True), mla_mscale=(0.1 * math.log(40.0) + 1.0) ** 2,
    ),
    "deepseek-v2-lite": ModelConfig(
        name="deepseek-v2-lite", vocab_size=102400, dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, head_dim=128,
        ffn_dim=10944, max_seq_len=4096, norm_eps=1e-6, kv_lora_rank=512, qk_rope_dim=64, v_head_dim=128,
        moe_experts=64, moe_topk=6, moe_ffn_dim=1408, moe_shared_experts=2, moe_dense_layers=(0,),
    ),
    # openai/gpt-oss-20b and gpt-oss-120b config.json: head_dim 64 (64·64 = 4096 > hidden 2880), q/k/v/o biases,
    # sinks, 128-token windows on the even layers, every layer MoE (top-4, softmax over the chosen four biased
    # logits) with biased experts and the clamped SwiGLU, YaRN 32× over 4096 tokens (truncate false, cos/sin ×
    # 0.1 ln 32 + 1). The released weights' experts are MXFP4 (dequantised on import, hf_mxfp4.py).
    "gpt-oss-20b": ModelConfig(
        name="gpt-oss-20b", vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64,
        ffn_dim=2880, max_seq_len=131072, rope_theta=150000.0,
        rope_yarn=(32.0, 4096, 32.0, 1.0, 0.1 * math.log(32.0) + 1.0, False), attention_bias=True,
        attention_out_bias=True, attention_sinks=True, sliding_window=128, sliding_layers=tuple(range(0, 24, 2)),
        moe_experts=32, moe_topk=4, moe_ffn_dim=2880, moe_softmax_before_topk=False, moe_router_bias=True,
        moe_expert_bias=True, moe_swiglu_limit=7.0, moe_aux_loss_coef=0.001,
    ),
    "gpt-oss-120b": ModelConfig(
        name="gpt-oss-120b", vocab_size=201088, dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64,
        ffn_dim=2880, max_seq_len=131072, rope_theta=150000.0,
        rope_yarn=(32.0, 4096, 32.0, 1.0, 0.1 * math.log(32.0) + 1.0, False), attention_bias=True,
        attention_out_bias=True, attention_sinks=True, sliding_window=128, sliding_layers=tuple(range(0, 36, 2)),
        moe_experts=128, moe_topk=4, moe_ffn_dim=2880, moe_softmax_before_topk=False, moe_router_bias=True,
        moe_expert_bias=True, moe_swiglu_limit=7.0, moe_aux_loss_coef=0.001,
    ),
    # Qwen/Qwen3-Next-80B-A3B config.json: 3 Gated DeltaNet layers to 1 gated full-attention layer (full every 4th),
    # head_dim 256 with a quarter rotary, 512 experts top-10 renormalised plus one gated shared expert of the expert
    # size, every layer MoE. Its MTP layer is not modelled. Qwen3.5-35B-A3B (text part): the same mixer with 256
    # experts top-8 and the 248320-token vocabulary.
    "qwen3-next-80b-a3b": _qwen_hybrid("qwen3-next-80b-a3b", 151936, 2048, 48, 16, 2, 5120,
                                       linear_v_heads=32, experts=512, topk=10, expert_ffn=512),
    "qwen3.5-35b-a3b": _qwen_hybrid("qwen3.5-35b-a3b", 248320, 2048, 40, 16, 2, 512,
                                    linear_v_heads=32, experts=256, topk=8, expert_ffn=512),
    # The other published Qwen3.5 sizes (text model; the checkpoints' vision tower and MTP drafter are not modelled).
    # Values from their config.json text_config as quoted by THUDM/slime scripts/models/qwen3.5-27B.sh and
    # qwen3.5-397B-A17B.sh (sizes, heads, experts) and Megatron-Bridge's / vLLM's Qwen3.5 test configs (the linear
    # heads: 16 key heads of 128; 48 value heads for 27B, 64 for 122B and 397B). Dense 27B.
    "qwen3.5-27b": _qwen_hybrid("qwen3.5-27b", 248320, 5120, 64, 24, 4, 17408,
                                linear_v_heads=48),
    "qwen3.5-122b-a10b": _qwen_hybrid("qwen3.5-122b-a10b", 248320, 3072, 48, 32, 2, 1024,
                                      linear_v_heads=64, experts=256, topk=8, expert_ffn=1024),
    "qwen3.5-397b-a17b": _qwen_hybrid("qwen3.5-397b-a17b", 248320, 4096, 60, 32, 2, 1024,
                                      linear_v_heads=64, experts=512, topk=10, expert_ffn=1024),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json: 27 layers, Kimi Delta Attention (32 heads of 128, kernel
    # 4) except MLA at its full_attn_layers 4, 8, …, 24 and 27 (1-based; no RoPE, no query latent), a dense first
    # layer, then 256 sigmoid-routed experts of 1024 (top-8 renormalised, × 2.446, one group) and one shared expert.
    "kimi-linear-48b-a3b": ModelConfig(
        name="kimi-linear-48b-a3b", vocab_size=163840, dim=2304, n_layers=27, n_heads=32, n_kv_heads=32, head_dim=128,
        ffn_dim=9216, max_seq_len=1048576, norm_eps=1e-5, kv_lora_rank=512, qk_rope_dim=64, v_head_dim=128,
        mla_nope=True, kda=True, linear_layers=tuple(i for i in range(27) if i not in (3, 7, 11, 15, 19, 23, 26)),
        linear_k_heads=32, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, moe_experts=256, moe_topk=8,
        moe_ffn_dim=1024, moe_shared_experts=1, moe_dense_layers=(0,), moe_score="sigmoid", moe_routed_scaling=2.446,
    ),
}

# DeepSeek Sparse Attention presets (models/sparse_attention.py). deepseek-ai/DeepSeek-V3.2 config.json: DeepSeek-V3's
# shapes (and YaRN) plus a lightning indexer per layer: 64 heads of 128, top-2048 keys, half-split indexer RoPE.
# zai-org/GLM-5 config.json: 78 layers of width 6144, MLA with 64 heads (q/k 192 + 64 rotary, v 256, query latent
# 2048), 3 dense layers then 256 sigmoid-routed experts top-8 (one group, renormalised, × 2.5) with one shared
# expert, vocabulary 154880, plain RoPE θ 1e6, rms_norm_eps 1e-5; indexer 32 heads of 128, top-2048, interleaved RoPE.
MODEL_PRESETS.update({
    "deepseek-v3.2": dataclasses.replace(MODEL_PRESETS["deepseek-v3"], name="deepseek-v3.2", index_topk=2048,
                                         index_n_heads=64, index_head_dim=128),
    "glm-5": ModelConfig(
        name="glm-5", vocab_size=154880, dim=6144, n_layers=78, n_heads=64, n_kv_heads=64, head_dim=192,
        ffn_dim=12288, max_seq_len=202752, rope_theta=1e6, norm_eps=1e-5, q_lora_rank=2048, kv_lora_rank=512,
        qk_rope_dim=64, v_head_dim=256, moe_experts=256, moe_topk=8, moe_ffn_dim=2048, moe_shared_experts=1,
        moe_dense_layers=(0, 1, 2), moe_score="sigmoid", moe_n_group=1, moe_topk_group=1, moe_routed_scaling=2.5,
        moe_bias_update_rate=0.001, index_topk=2048, index_n_heads=32, index_head_dim=128, index_rope_interleave=True,
    ),
})



def _glm45(name: str, dim: int, n_layers: int, ffn: int, experts: int, expert_ffn: int, dense: int, qk_norm: bool,
           scaling: float, max_seq_len: int = 131072) -> ModelConfig:
    """A GLM-4.5-family preset (zai-org/GLM-4.5*/config.json, transformers' glm4_moe): 96 query heads of 128 over
    8 K/V heads with q/k/v biases, half of each head rotary (θ 1e6), the first `dense` layers dense, then sigmoid
    routing with the loss-free selection bias, top-8 renormalised × `scaling`, one shared expert, no groups; its one
    MTP layer is in the checkpoint (`--mtp-layers 1` trains it)."""
    return ModelConfig(name=name, vocab_size=151552, dim=dim, n_layers=n_layers, n_heads=96, n_kv_heads=8, head_dim=128,
                       ffn_dim=ffn, max_seq_len=max_seq_len, rope_theta=1e6, norm_eps=1e-5, attention_bias=True,
                       qk_norm=qk_norm, partial_rotary=0.5, moe_experts=experts, moe_topk=8, moe_ffn_dim=expert_ffn,
                       moe_shared_experts=1, moe_dense_layers=tuple(range(dense)), moe_score="sigmoid",
                       moe_routed_scaling=scaling, moe_bias_update_rate=0.001)


# The 2025/2026 open flagships (docs/families-2026.md). GLM-4.6 and GLM-4.7 keep GLM-4.5's shapes with a 200K
# context (max_position_embeddings 202752). Kimi K2 is DeepSeek-V3's architecture (moonshotai/Kimi-K2-Instruct
# config.json: 384 experts, 64 heads, one dense layer, no groups, scaling 2.827, YaRN 32× over 4096 tokens with
# mscale = mscale_all_dim = 1, θ 50000). MiniMax-M2 (MiniMaxAI/MiniMax-M2, transformers' minimax_m2): 62 layers
# all MoE (256 experts of 1536, sigmoid with the selection bias, top-8 renormalised, no shared expert), q/k norms
# over all heads' width, half-rotary heads of 128 (θ 5e6); its MTP modules are not in transformers' model.
MODEL_PRESETS.update({
    "glm-4.5": _glm45("glm-4.5", 5120, 92, 12288, 160, 1536, 3, True, 2.5),
    "glm-4.5-air": _glm45("glm-4.5-air", 4096, 46, 10944, 128, 1408, 1, False, 1.0),
    "glm-4.6": _glm45("glm-4.6", 5120, 92, 12288, 160, 1536, 3, True, 2.5, max_seq_len=202752),
    "glm-4.7": _glm45("glm-4.7", 5120, 92, 12288, 160, 1536, 3, True, 2.5, max_seq_len=202752),
    "kimi-k2": ModelConfig(
        name="kimi-k2", vocab_size=163840, dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, head_dim=128,
        ffn_dim=18432, max_seq_len=131072, rope_theta=50000.0, norm_eps=1e-6, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_dim=64, v_head_dim=128, moe_experts=384, moe_topk=8, moe_ffn_dim=2048, moe_shared_experts=1,
        moe_dense_layers=(0,), moe_score="sigmoid", moe_routed_scaling=2.827, moe_bias_update_rate=0.001,
        rope_yarn=(32.0, 4096, 1.0, 1.0, 1.0, True), mla_mscale=(0.1 * math.log(32.0) + 1.0) ** 2,
    ),
    "minimax-m2": ModelConfig(
        name="minimax-m2", vocab_size=200064, dim=3072, n_layers=62, n_heads=48, n_kv_heads=8, head_dim=128,
        ffn_dim=1536, max_seq_len=196608, rope_theta=5e6, norm_eps=1e-6, qk_norm=True, qk_norm_full=True,
        partial_rotary=0.5, moe_experts=256, moe_topk=8, moe_ffn_dim=1536, moe_score="sigmoid",
        moe_bias_update_rate=0.001,
    ),
})

def get_model_config(name: str, **overrides) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model {name!r}; valid presets: {', '.join(MODEL_PRESETS)}")
    cfg = MODEL_PRESETS[name].with_overrides(**{k: v for k, v in overrides.items() if v is not None})
    cfg.validate()
    return cfg
