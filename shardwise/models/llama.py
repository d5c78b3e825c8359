"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, GQA attention (SDPA), SwiGLU MLP.

The model knows nothing of parallelism. Head counts are read off the projection shapes at run
time, so the tensor-parallel plan (`shardwise.parallelize`) can swap `nn.Linear`/`nn.Embedding`
for their sharded versions by module name and the same forward runs on every layout. The loss is
computed by `loss_fn`, a vocabulary-parallel cross-entropy that the plan points at its TP axis.
Packed windows can pass side inputs: document ids (attention stays within each document) and
per-document positions for RoPE (see `documents.py`).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..context_parallel import positions as cp_positions
from ..context_parallel import ring_attention, shard_sequence, ulysses_attention
from ..expert_parallel.moe import MoE, share_aux_pool
from ..mesh import Axis
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..tensor_parallel.random import ReplicatedDropout
from .documents import document_mask
from .mla import MLA, attend
from .mtp import MTPLayer, mtp_forward
from .rope import apply_rope, llama3_inv_freq, rope_tables  # noqa: F401  (re-exported: the model's RoPE)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x):
        xf = x.float()
        # Statistics in fp32; the output keeps the residual stream's dtype (bf16 under bf16 activations),
        # so what enters a TP/SP region or the MoE dispatch moves in that dtype.
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, hd = cfg.dim, cfg.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(h, cfg.n_heads * hd, bias=cfg.attention_bias)
        self.wk = nn.Linear(h, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
        self.wv = nn.Linear(h, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, h, bias=False)
        # Qwen3's per-head q/k norms: one head_dim weight shared by every head, so under TP each rank applies
        # it to its own heads with no collective (its gradient is partial per rank: summed over TP).
        self.q_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.norm_eps) if cfg.qk_norm else None
        self.attn_dropout = cfg.attn_dropout
        self.rng = None  # RNGTracker, set by the parallel plan: attention dropout is a TP-sharded region
        self.cp_axis, self.cp_order, self.cp_impl = None, "balanced", "ring"  # set by the plan under cp > 1
        self.recompute_core = None  # set by shardwise.recompute under selective recompute

    def forward(self, x, cos, sin, doc_ids=None):
        """`doc_ids` [b, s_global] (document masking) are the window's document ids, never sharded."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[:2]
        q, k = q.view(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        return attend(self, q, k, v, doc_ids)

    def core(self, q, k, v, doc_ids=None):
        """The attention core — QKᵀ, softmax, ·V (SDPA, or ring/Ulysses under cp): what selective recompute replays.

        With `doc_ids` a token sees only earlier tokens of its own document (an explicit SDPA mask;
        ring and Ulysses build theirs from the global ids).
        """
        if self.cp_axis is not None and self.cp_axis.active:
            attend = ring_attention if self.cp_impl == "ring" else ulysses_attention
            return attend(q, k, v, self.cp_axis, causal=True, order=self.cp_order, doc_ids=doc_ids)
        p = self.attn_dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        mask = None if doc_ids is None else document_mask(doc_ids, doc_ids)
        with self.rng.fork("tp") if p > 0 and self.rng is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                  enable_gqa=gqa)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def build_moe(cfg: ModelConfig, ep_axis=None, expert_replicas: int = 1, device=None):
    """The MoE feed-forward of one block (router, E experts split over ep_axis, shared experts)."""
    return MoE(cfg.dim, cfg.moe_ffn_dim or cfg.ffn_dim, cfg.moe_experts, cfg.moe_topk, ep_axis,
               shared_experts=cfg.moe_shared_experts, capacity_factor=cfg.moe_capacity_factor,
               score=cfg.moe_score, softmax_before_topk=cfg.moe_softmax_before_topk,
               aux_loss_coef=cfg.moe_aux_loss_coef, z_loss_coef=cfg.moe_z_loss_coef,
               bias_update_rate=cfg.moe_bias_update_rate, expert_replicas=expert_replicas, device=device,
               aux_scope=cfg.moe_aux_loss_scope, n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
               norm_topk=cfg.moe_norm_topk, routed_scaling=cfg.moe_routed_scaling, group_topk=cfg.moe_group_topk)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MLA(cfg, RMSNorm) if cfg.is_mla else Attention(cfg)
        self.attn_resid_dropout = ReplicatedDropout(cfg.dropout)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = build_moe(cfg) if cfg.is_moe_layer(layer_id) else FeedForward(cfg)
        self.ffn_resid_dropout = ReplicatedDropout(cfg.dropout)

    def forward(self, x, cos, sin, doc_ids=None):
        """The residual stream keeps x's dtype: each branch's output is cast to it before the add."""
        x = x + self.attn_resid_dropout(self.attention(self.attention_norm(x), cos, sin, doc_ids)).to(x.dtype)
        return x + self.ffn_resid_dropout(self.feed_forward(self.ffn_norm(x))).to(x.dtype)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # DeepSeek-V3 MTP modules; module k's block is layer n_layers + k, as in DeepSeek's checkpoints.
        self.mtp = nn.ModuleDict({str(k): MTPLayer(cfg.dim, cfg.norm_eps, TransformerBlock(cfg, cfg.n_layers + k),
                                                   RMSNorm) for k in range(cfg.mtp_layers)}) if cfg.mtp_layers else None
        self.mtp_embed = None  # under PP: the last stage's copy of the embedding (pipeline/tied_embedding.py)
        self.mtp_loss = None  # the MTP loss of the microbatches run since the trainer last took it
        share_aux_pool(self)
        self.tp_axis = Axis("tp")  # replaced by the plan; size 1 = single device
        self.vocab_start = 0
        self.sequence_parallel = False
        self.cp_axis, self.cp_order = None, "balanced"

    def rope(self, local_len: int, device, positions: torch.Tensor | None = None):
        """RoPE tables for this rank's tokens: under cp, the global positions of its chunks.

        `positions` [b, s_global] (--reset-positions) are per-token positions of the whole window;
        this rank takes its tokens' share, cut as the tokens were.
        """
        cp = self.cp_axis
        cp_active = cp is not None and cp.active
        seq_len = local_len * cp.size if cp_active else local_len
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        if positions is not None:
            pos = shard_sequence(positions, cp.rank, cp.size, self.cp_order) if cp_active else positions
        else:
            pos = cp_positions(seq_len, cp.rank, cp.size, self.cp_order, device) if cp_active else None
        return rope_tables(self.cfg.rope_dim, local_len, self.cfg.rope_theta, device, positions=pos,
                           scaling=self.cfg.rope_scaling, yarn=self.cfg.rope_yarn)

    def forward(self, tokens, doc_ids=None, positions=None, **mtp):
        """`doc_ids` / `positions` [b, s_global]: document masking and reset RoPE positions (see documents.py);
        `mtp`: the MTP inputs `head` takes (training with --mtp-layers)."""
        cos, sin = self.rope(tokens.shape[1], tokens.device, positions)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, doc_ids)
        return self.head(h, cos, sin, doc_ids, **mtp)

    def head(self, h, cos, sin, doc_ids=None, mtp_ids=None, mtp_labels=None, mtp_scale=None):
        """Final norm and LM head; with `mtp_ids` the MTP modules too, their loss riding on the logits (mtp.py)."""
        h = self.norm(h)
        logits = self.output(h)
        if mtp_ids is None or self.mtp is None:
            return logits
        return mtp_forward(self, h, logits, cos, sin, doc_ids, mtp_ids, mtp_labels, mtp_scale)

    def mtp_embedding(self):
        """The embedding MTP reads: the model's own, or its copy on a last pipeline stage that lacks it."""
        return self.tok_embeddings if self.tok_embeddings is not None else self.mtp_embed

    def loss_fn(self, logits, targets, ignore_index: int = -100, label_smoothing: float = 0.0):
        """Per-token losses [b, s] from (possibly vocabulary-sharded) logits."""
        return vocab_parallel_cross_entropy(logits, targets, self.tp_axis, self.vocab_start, self.cfg.vocab_size,
                                            ignore_index, label_smoothing)

    @staticmethod
    def init_rule(name: str, cfg: ModelConfig) -> tuple[str, float]:
        """How to initialise the *global* tensor called `name`: ('ones', 0), ('zeros', 0) or ('normal', std)."""
        if name.endswith("norm.weight"):
            return "ones", 0.0
        if name.endswith(".bias"):
            return "zeros", 0.0
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            return "normal", 0.02 / math.sqrt(2 * cfg.n_layers)
        return "normal", 0.02
