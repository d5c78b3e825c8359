"""Every family's parameters, declared once as data: the model modules create them from these entries and the
planner counts their bytes from the same entries.

An entry (`Param`) is one parameter under the runtime's exact name (relative to the module that owns it; a block,
the model and the MTP modules prefix them), its global shape, its initial rule (`models/params.py` INITS), how each
axis splits it and what that makes of its gradient. Lists are in the runtime's `named_parameters` order (a module's
own parameters before its children's), which the ZeRO buckets and checkpoints follow.

The config is read duck-typed (a trainer `ModelConfig`, or the planner's `ModelSpec`, whose architecture variants
only the planner models — GELU MLP, LayerNorm, linear biases, learned positions — are read with `getattr` and
their defaults); the MoE and MLP parts also take plain ints, for the modules that are built from dimensions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import prod

CHUNK = 64
"""Tokens per chunk of Gated DeltaNet's chunked form, transformers' and FLA's default (runtime:
`models.gated_deltanet`; planner: its FLOPs and saved tensors in `planner.linear_attention`)."""

INITS = ("normal", "residual", "ones", "zeros", "conv", "a_log")
"""normal: N(0, 0.02); residual: a residual branch's output projection, N(0, 0.02/√(2·layers)) (GPT-2's scaling,
so the stream's variance does not grow with depth); ones / zeros: norm scales and biases; conv: a depthwise
convolution [channels, kernel], N(0, 1/√kernel) (PyTorch's Conv1d scale); a_log: Gated DeltaNet's log decay
rates, log U(1, 16) (Mamba-2's and Megatron's range). Values are drawn by `shardwise.parallelize`."""

TP_SPLITS = ("col", "row", "vocab", "rep")
"""How TP cuts a parameter: col = dim 0 (output rows), row = dim 1 (input columns), vocab = dim 0 padded up to a
multiple of tp (the vocabulary-parallel embedding and head), rep = replicated."""


@dataclass(frozen=True)
class Param:
    """One parameter as the runtime creates it, and what each axis does to it."""

    name: str
    shape: tuple[int, ...]
    """Global (unsharded) shape."""
    init: str = "normal"
    tp: str = "rep"
    """One of `TP_SPLITS`."""
    heads: int = 0
    """col/row: the split dimension is cut by whole heads of this many (0: evenly by elements)."""
    kv: bool = False
    """GQA's K/V: with fewer heads than tp ranks each rank keeps one whole head, so its gradient is partial over tp."""
    expert: bool = False
    """A routed expert's stacked [E, ...] weight: dim 0 split over ep, its gradient reduced over edp, not dp×cp."""
    sp_replicated: bool = False
    """Replicated over tp but fed sequence shards under SP, so its gradient needs a tp all-reduce."""
    head_partial: bool = False
    """Replicated over tp, and each rank back-propagates through its own heads only: the gradient is partial over tp
    even without SP (Qwen3's q/k norms, MLA's down-projections and latent norms, the gated norm)."""

    @property
    def matrix(self) -> bool:
        """In the optimizer's weight-decayed group and the reducer's matrix buckets: 2-D or more, as the runtime
        decides by `ndim >= 2` (so gpt-oss's [E, n] expert biases are matrices; norms and other biases are not)."""
        return len(self.shape) >= 2

    def local_shape(self, tp: int = 1, ep: int = 1) -> tuple[int, ...]:
        """The shape one rank holds at tensor-parallel degree `tp` and expert-parallel degree `ep`."""
        shape = list(self.shape)
        if self.expert:
            shape[0] //= ep
        d = {"col": 0, "vocab": 0, "row": 1}.get(self.tp)
        if d is not None:
            n = shape[d]
            if self.tp == "vocab":
                shape[d] = -(-n // tp)
            elif self.heads:
                shape[d] = (max(self.heads // tp, 1) if self.kv else self.heads // tp) * (n // self.heads)
            else:
                shape[d] = n // tp
        return tuple(shape)

    def local_numel(self, tp: int = 1, ep: int = 1) -> int:
        return prod(self.local_shape(tp, ep))

    def whole_heads(self, tp: int) -> bool:
        """Each of `tp` ranks keeps a whole head shared with others (fewer heads than ranks): a TP-partial gradient."""
        return self.kv and self.heads < tp

    def under(self, prefix: str) -> Param:
        return dataclasses.replace(self, name=f"{prefix}.{self.name}")


def _prefixed(prefix: str, params) -> list[Param]:
    return [p.under(prefix) for p in params]


def _rep(name: str, shape, init: str = "normal", **kw) -> Param:
    """Replicated over tp and fed sequence shards under SP."""
    return Param(name, tuple(shape), init, "rep", sp_replicated=True, **kw)


def linear(name: str, out: int, inp: int, split: str = "rep", heads: int = 0, bias: bool = False,
           init: str = "normal", **kw) -> list[Param]:
    """An nn.Linear's weight [out, in] (and bias [out], starting at zero): `split` col/row/rep over tp."""
    if split == "rep":
        w = _rep(f"{name}.weight", (out, inp), init, **kw)
        return [w] + ([_rep(f"{name}.bias", (out,), "zeros", **kw)] if bias else [])
    w = Param(f"{name}.weight", (out, inp), init, split, heads, **kw)
    if not bias:
        return [w]
    # a column layer's bias splits with its rows; a row layer's is replicated (its output is the full width)
    b = (Param(f"{name}.bias", (out,), "zeros", "col", heads, kv=kw.get("kv", False)) if split == "col"
         else _rep(f"{name}.bias", (out,), "zeros"))
    return [w, b]


def norm(name: str, dim: int, layernorm: bool = False, head_partial: bool = False) -> list[Param]:
    """RMSNorm's weight (LayerNorm: weight and bias), replicated."""
    out = [_rep(f"{name}.weight", (dim,), "ones", head_partial=head_partial)]
    return out + ([_rep(f"{name}.bias", (dim,), "zeros")] if layernorm else [])


def _layernorm(cfg) -> bool:
    return getattr(cfg, "norm", "rmsnorm") == "layernorm"


def attention(cfg) -> list[Param]:
    """GQA attention (`models.llama.Attention`): sinks, wq, wk, wv, wo, q_norm, k_norm. Gated attention's wq also
    yields each head's gate rows ([q_h | gate_h], so TP's split by whole heads keeps them together)."""
    h, hd, nh, nkv = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    lb = getattr(cfg, "linear_bias", False)
    bias = cfg.attention_bias or lb
    out = [Param("sinks", (nh,), "normal", "col", nh)] if cfg.attention_sinks else []
    out += linear("wq", nh * hd * (2 if cfg.attn_output_gate else 1), h, "col", nh, bias)
    out += linear("wk", nkv * hd, h, "col", nkv, bias, kv=True)
    out += linear("wv", nkv * hd, h, "col", nkv, bias, kv=True)
    out += linear("wo", h, nh * hd, "row", nh, cfg.attention_out_bias or lb, "residual")
    if getattr(cfg, "qk_norm_full", False):
        out += qk_norms_full(cfg)
    elif cfg.qk_norm:
        out += norm("q_norm", hd, head_partial=True) + norm("k_norm", hd, head_partial=True)
    return out


def qk_norms_full(cfg) -> list[Param]:
    """MiniMax-M2's q/k norms over all heads' width (`models.qk_norm.WidthNorm`): weights split with the heads."""
    hd = cfg.head_dim
    return [Param("q_norm.weight", (cfg.n_heads * hd,), "ones", "col", cfg.n_heads),
            Param("k_norm.weight", (cfg.n_kv_heads * hd,), "ones", "col", cfg.n_kv_heads, kv=True)]


def mla(cfg) -> list[Param]:
    """DeepSeek's Multi-head Latent Attention (`models.mla.MLA`): the down-projections and latent norms
    replicated (head-partial), the up-projections and wo split by heads."""
    h, nh = cfg.dim, cfg.n_heads
    qk = cfg.head_dim + cfg.qk_rope_dim
    if cfg.q_lora_rank:
        out = linear("wq_a", cfg.q_lora_rank, h, head_partial=True) + norm("q_a_norm", cfg.q_lora_rank, head_partial=True)
        out += linear("wq_b", nh * qk, cfg.q_lora_rank, "col", nh)
    else:
        out = linear("wq", nh * qk, h, "col", nh)
    out += linear("wkv_a", cfg.kv_lora_rank + cfg.qk_rope_dim, h, head_partial=True)
    out += norm("kv_a_norm", cfg.kv_lora_rank, head_partial=True)
    out += linear("wkv_b", nh * (cfg.head_dim + cfg.v_head_dim), cfg.kv_lora_rank, "col", nh)
    out += linear("wo", h, nh * cfg.v_head_dim, "row", nh, init="residual")
    return out + (_prefixed("indexer", indexer(cfg)) if getattr(cfg, "index_topk", 0) else [])


DSA_GATHER_CHUNK = 1 << 26
"""Elements of the selected latents (or of the per-head logits) one query chunk of DeepSeek Sparse Attention's core
gathers (runtime: `models.sparse_attention`; planner: its saved tensors): with several chunks each is recomputed in
backward instead of stored."""


def dsa_query_rows(batch: int, keys: int, width: int, heads: int) -> int:
    """Queries per chunk of the sparse core: `batch` sequences, `keys` selected per query, latents `width` wide,
    `heads` local query heads."""
    return max(1, DSA_GATHER_CHUNK // max(1, batch * keys * max(width, heads)))


def indexer(cfg) -> list[Param]:
    """DeepSeek Sparse Attention's lightning indexer (`models.sparse_attention.Indexer`), after MLA's own parameters:
    wq_b [heads·d, q_lora_rank] (reads MLA's query latent), wk [d, dim], k_norm (LayerNorm), weights_proj [heads, dim].
    Replicated over tp (every rank scores every key: the top-k needs the sum over all indexer heads); transformers
    runs it without gradient, so its gradients are zero unless the indexer's own loss trains it."""
    n, d = cfg.index_n_heads, cfg.index_head_dim
    return (linear("wq_b", n * d, cfg.q_lora_rank) + linear("wk", d, cfg.dim) + norm("k_norm", d, layernorm=True)
            + linear("weights_proj", n, cfg.dim))


def gated_deltanet(cfg) -> list[Param]:
    """A Gated DeltaNet mixer (`models.gated_deltanet.GatedDeltaNet`), its own parameters (the depthwise kernels
    [channels, K], A_log, dt_bias) before its modules' (the six projections, the gated norm, wo). Key heads and the
    value heads they serve split over tp, everything cut by heads but `wo` (by input columns) and the gated norm's
    one-head weight (replicated, head-partial)."""
    h, kw = cfg.dim, cfg.linear_conv_kernel
    nk, nv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    out = [Param("conv_q", (nk * dk, kw), "conv", "col", nk), Param("conv_k", (nk * dk, kw), "conv", "col", nk),
           Param("conv_v", (nv * dv, kw), "conv", "col", nv),
           Param("A_log", (nv,), "a_log", "col", nv), Param("dt_bias", (nv,), "ones", "col", nv)]
    out += linear("wq", nk * dk, h, "col", nk) + linear("wk", nk * dk, h, "col", nk)
    out += linear("wv", nv * dv, h, "col", nv) + linear("wz", nv * dv, h, "col", nv)
    out += linear("wb", nv, h, "col", nv) + linear("wa", nv, h, "col", nv)
    return out + norm("norm", dv, head_partial=True) + linear("wo", h, nv * dv, "row", nv, init="residual")


def kimi_delta(cfg) -> list[Param]:
    """A Kimi Delta Attention mixer (`models.kimi_delta.KimiDeltaAttention`): its own parameters (the depthwise
    kernels, A_log per head, dt_bias per channel) before its modules' (q/k/v, the decay gate's pair wf_a → wf_b, β's
    wb, the output gate's pair wg_a → wg_b, the gated norm, wo). Heads split over tp; the gates' down-projections
    wf_a, wg_a (to one head's width) and the norm's one-head weight stay replicated, head-partial, as MLA's."""
    h, kw, nh, d = cfg.dim, cfg.linear_conv_kernel, cfg.linear_v_heads, cfg.linear_v_dim
    out = [Param(f"conv_{c}", (nh * d, kw), "conv", "col", nh) for c in "qkv"]
    out += [Param("A_log", (nh,), "a_log", "col", nh), Param("dt_bias", (nh * d,), "ones", "col", nh)]
    out += linear("wq", nh * d, h, "col", nh) + linear("wk", nh * d, h, "col", nh) + linear("wv", nh * d, h, "col", nh)
    out += linear("wf_a", d, h, head_partial=True) + linear("wf_b", nh * d, d, "col", nh)
    out += linear("wb", nh, h, "col", nh)
    out += linear("wg_a", d, h, head_partial=True) + linear("wg_b", nh * d, d, "col", nh)
    return out + norm("norm", d, head_partial=True) + linear("wo", h, nh * d, "row", nh, init="residual")


def linear_mixer(cfg) -> list[Param]:
    """A linear-attention layer's mixer: Kimi Delta Attention's (`kda`) or Gated DeltaNet's."""
    return kimi_delta(cfg) if getattr(cfg, "kda", False) else gated_deltanet(cfg)


def mlp(dim: int, hidden: int, split: bool = True) -> list[Param]:
    """SwiGLU (`models.llama.FeedForward`): w1, w3 [hidden, dim], w2 [dim, hidden]; `split` False: replicated (the
    MoE's shared experts)."""
    if not split:
        return linear("w1", hidden, dim) + linear("w3", hidden, dim) + linear("w2", dim, hidden, init="residual")
    return linear("w1", hidden, dim, "col") + linear("w3", hidden, dim, "col") + linear("w2", dim, hidden, "row",
                                                                                       init="residual")


def gelu_mlp(dim: int, hidden: int, bias: bool) -> list[Param]:
    """GPT-2's fc1, fc2 (planner only)."""
    return linear("fc1", hidden, dim, "col", bias=bias) + linear("fc2", dim, hidden, "row", bias=bias, init="residual")


def router(dim: int, n_experts: int, bias: bool = False) -> list[Param]:
    """The MoE router (`expert_parallel.router.Router`): weight [E, dim] and gpt-oss's logit bias [E]."""
    return [_rep("weight", (n_experts, dim))] + ([_rep("bias", (n_experts,), "zeros")] if bias else [])


def experts(n_experts: int, dim: int, ffn: int, bias: bool = False) -> list[Param]:
    """The routed experts (`expert_parallel.experts.GroupedExperts`), stacked [E, ...] and split over ep: w1, w3
    [E, ffn, dim], w2 [E, dim, ffn]; gpt-oss's biases b1, b3 [E, ffn], b2 [E, dim]."""
    kw = dict(expert=True)
    out = [_rep("w1", (n_experts, ffn, dim), **kw), _rep("w3", (n_experts, ffn, dim), **kw),
           _rep("w2", (n_experts, dim, ffn), "residual", **kw)]
    if bias:
        out += [_rep(n, (n_experts, f), "zeros", **kw) for n, f in (("b1", ffn), ("b3", ffn), ("b2", dim))]
    return out


def moe(dim: int, ffn: int, n_experts: int, shared: int = 0, router_bias: bool = False, expert_bias: bool = False,
        shared_gate: bool = False) -> list[Param]:
    """An MoE block (`expert_parallel.moe.MoE`), replicated over tp: router, routed experts, the shared experts as
    one SwiGLU of shared·ffn, Qwen3-Next's shared-expert gate [1, dim]."""
    out = _prefixed("router", router(dim, n_experts, router_bias))
    out += _prefixed("experts", experts(n_experts, dim, ffn, expert_bias))
    if shared:
        out += _prefixed("shared", mlp(dim, shared * ffn, split=False))
        out += linear("shared_gate", 1, dim) if shared_gate else []
    return out


def moe_of(cfg) -> list[Param]:
    return moe(cfg.dim, cfg.moe_ffn_dim or cfg.ffn_dim, cfg.moe_experts, cfg.moe_shared_experts, cfg.moe_router_bias,
               cfg.moe_expert_bias, cfg.moe_shared_gate)


def block(cfg, moe_layer: bool, linear_layer: bool = False) -> list[Param]:
    """One transformer block (`models.llama.TransformerBlock`): attention_norm, the mixer (attention, MLA or Gated
    DeltaNet or Kimi Delta Attention), ffn_norm, the MLP (dense or MoE)."""
    ln = _layernorm(cfg)
    mixer = linear_mixer(cfg) if linear_layer else mla(cfg) if cfg.is_mla else attention(cfg)
    if moe_layer:
        ffn = moe_of(cfg)
    elif getattr(cfg, "mlp", "swiglu") == "gelu":
        ffn = gelu_mlp(cfg.dim, cfg.ffn_dim, getattr(cfg, "linear_bias", False))
    else:
        ffn = mlp(cfg.dim, cfg.ffn_dim)
    return (norm("attention_norm", cfg.dim, ln) + _prefixed("attention", mixer) + norm("ffn_norm", cfg.dim, ln)
            + _prefixed("feed_forward", ffn))


def embedding(cfg) -> list[Param]:
    """tok_embeddings (vocabulary-parallel) and GPT-2's learned positions (planner only: replicated, not fed
    sequence shards)."""
    out = [Param("tok_embeddings.weight", (cfg.vocab_size, cfg.dim), "normal", "vocab")]
    if getattr(cfg, "learned_pos", False):
        out.append(Param("pos_embeddings.weight", (cfg.max_seq_len, cfg.dim)))
    return out


def head(cfg, tied: bool | None = None) -> list[Param]:
    """The final norm and the LM head (`output`, vocabulary-parallel); a tied head holds no weight of its own."""
    tied = cfg.tie_embeddings if tied is None else tied
    out = norm("norm", cfg.dim, _layernorm(cfg))
    return out + ([] if tied else [Param("output.weight", (cfg.vocab_size, cfg.dim), "normal", "vocab")])


def mtp_inputs(dim: int) -> list[Param]:
    """An MTP module's own parameters before its block: enorm, hnorm, eh_proj [d, 2d] (replicated)."""
    return norm("enorm", dim) + norm("hnorm", dim) + linear("eh_proj", dim, 2 * dim)


def mtp_module(cfg, k: int) -> list[Param]:
    """MTP module k (`models.mtp.MTPLayer`): its inputs' norms and eh_proj, the block of layer n_layers + k,
    head_norm (HF's shared_head.norm)."""
    i = cfg.n_layers + k
    block_params = block(cfg, cfg.is_moe_layer(i), cfg.is_linear_layer(i))
    return mtp_inputs(cfg.dim) + _prefixed("block", block_params) + norm("head_norm", cfg.dim)


def model(cfg) -> list[Param]:
    """The whole model (`models.llama.Transformer`) as one rank without any parallelism holds it."""
    out = embedding(cfg)
    for i in range(cfg.n_layers):
        out += _prefixed(f"layers.{i}", block(cfg, cfg.is_moe_layer(i), cfg.is_linear_layer(i)))
    out += head(cfg)
    for k in range(cfg.mtp_layers):
        out += _prefixed(f"mtp.{k}", mtp_module(cfg, k))
    return out


def by_name(params) -> dict[str, Param]:
    return {p.name: p for p in params}


def zero_units(layer_ids, first: bool, last: bool, mtp_layers: int = 0, mtp_embed: bool = False) -> list[str]:
    """The ZeRO-3 units of one pipeline chunk in forward order, by module name: the embedding (first chunk), each
    block, then (last chunk) the final norm, the LM head, the last stage's embedding copy for MTP and each MTP
    module. A unit is gathered as one, around its module's forward and backward."""
    out = (["tok_embeddings"] if first else []) + [f"layers.{i}" for i in layer_ids]
    if last:
        out += ["norm", "output"] + (["mtp_embed"] if mtp_embed else []) + [f"mtp.{k}" for k in range(mtp_layers)]
    return out


def unit_of(name: str) -> str:
    """The ZeRO-3 unit (a `zero_units` name) a model-level parameter name belongs to."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else parts[0]


def unit_params(cfg, unit: str, tied_head: bool | None = None) -> list[Param]:
    """The parameters unit `unit` (a `zero_units` name) owns, named relative to it: `tied_head` True for a head
    that reads the embedding's weight (none of its own)."""
    if unit in ("tok_embeddings", "mtp_embed"):
        return embedding(cfg)
    if unit == "norm":
        return norm("norm", cfg.dim, _layernorm(cfg))
    if unit == "output":
        return head(cfg, tied_head)[len(norm("norm", cfg.dim, _layernorm(cfg))):]
    kind, _, index = unit.partition(".")
    if kind == "layers":
        i = int(index)
        return block(cfg, cfg.is_moe_layer(i), cfg.is_linear_layer(i))
    if kind == "mtp":
        return mtp_module(cfg, int(index))
    raise ValueError(f"unknown ZeRO unit {unit!r}")
