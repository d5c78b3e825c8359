"""A Llama-style decoder in plain PyTorch: RMSNorm, RoPE, GQA attention (SDPA), SwiGLU MLP.

The model knows only its math. Head counts are read off the projection shapes at run time, so the
tensor-parallel plan (`shardwise.parallelize`) can swap `nn.Linear`/`nn.Embedding` for their sharded
versions by module name and the same forward runs on every layout; whatever else a layout changes
(context-parallel attention, the vocabulary-parallel loss, dropout streams, recompute, MoE blocks) the
model reaches through its `ParallelContext` (`context.py`), which the plan fills.
Packed windows can pass side inputs: document ids (attention stays within each document) and
per-document positions for RoPE (see `documents.py`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..rules import inventory
from .attention import AttentionCore, attend
from .context import ParallelContext
from .gated_deltanet import GatedDeltaNet
from .kimi_delta import KimiDeltaAttention
from .mla import MLA
from .mtp import MTPLayer, mtp_forward
from .sparse_attention import SparseMLA
from .params import create, declare, linear_of
from .qk_norm import WidthNorm
from .rope import apply_rope, rope_tables


class RMSNorm(nn.Module):
    def __init__(self, weight: inventory.Param, eps: float):
        """`weight`: the inventory's entry of its weight."""
        super().__init__()
        self.eps = eps
        self.weight = create(weight)

    def forward(self, x):
        xf = x.float()
        # Statistics in fp32; the output keeps the residual stream's dtype (bf16 under bf16 activations),
        # so what enters a TP/SP region or the MoE dispatch moves in that dtype.
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None, layer_id: int = 0):
        super().__init__()
        p = inventory.by_name(inventory.attention(cfg))
        self.head_dim, self.rope_dim, self.gated = cfg.head_dim, cfg.rope_dim, cfg.attn_output_gate
        # Gated attention (Qwen3-Next): each head's q rows are followed by its gate rows, [q_h | gate_h], so TP's
        # split by whole heads keeps a head's gate with it.
        self.wq = linear_of(p, "wq")
        self.wk = linear_of(p, "wk")
        self.wv = linear_of(p, "wv")
        self.wo = linear_of(p, "wo")
        # gpt-oss's sinks: one logit per query head (under TP split with the heads)
        self.sinks = create(p["sinks"]) if "sinks" in p else None
        # Qwen3's per-head q/k norms: one head_dim weight shared by every head, so under TP each rank applies
        # it to its own heads with no collective (its gradient is partial per rank: summed over TP).
        self.q_norm = RMSNorm(p["q_norm.weight"], cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(p["k_norm.weight"], cfg.norm_eps) if cfg.qk_norm else None
        # MiniMax-M2: one norm over all heads' width instead (qk_norm.py), applied before the split into heads
        self.full_norm = cfg.qk_norm_full
        if self.full_norm:
            self.q_norm = WidthNorm(p["q_norm.weight"], cfg.norm_eps, ctx or ParallelContext())
            self.k_norm = WidthNorm(p["k_norm.weight"], cfg.norm_eps, ctx or ParallelContext())
        self.core = AttentionCore(ctx or ParallelContext(), layer_id, cfg.attn_dropout, window=cfg.window(layer_id))

    def forward(self, x, cos, sin, doc_ids=None):
        """`doc_ids` [b, s_global] (document masking) are the window's document ids, never sharded."""
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s = q.shape[:2]
        gate = None
        if self.gated:
            q, gate = q.view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, s, -1)
        if self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(b, s, -1, self.head_dim), k.view(b, s, -1, self.head_dim)
        if self.q_norm is not None and not self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = partial_rope(q, cos, sin, self.rope_dim).transpose(1, 2)
        k = partial_rope(k, cos, sin, self.rope_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        return attend(self, q, k, v, doc_ids, gate)


def partial_rope(x, cos, sin, rope_dim: int):
    """RoPE on each head's first `rope_dim` dimensions (partial rotary); the rest passes unrotated."""
    if rope_dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]), dim=-1)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) · w3 x). Also the MoE's shared experts (one of hidden size S × expert size)."""

    def __init__(self, dim: int, hidden: int, device=None, dtype=None):
        super().__init__()
        p = inventory.by_name(inventory.mlp(dim, hidden))
        self.w1 = linear_of(p, "w1", device, dtype)
        self.w3 = linear_of(p, "w3", device, dtype)
        self.w2 = linear_of(p, "w2", device, dtype)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Dropout(nn.Module):
    """Dropout on the residual stream: through the context's `dropout` (one global mask, cut as the stream is
    cut under SP) when the plan set one, else PyTorch's."""

    def __init__(self, p: float, ctx: ParallelContext):
        super().__init__()
        self.p, self.ctx = p, ctx

    def forward(self, x):
        if self.p == 0.0 or not self.training:
            return x
        if self.ctx.dropout is None:
            return F.dropout(x, self.p, True)
        return self.ctx.dropout(x, self.p)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int = 0, ctx: ParallelContext | None = None):
        super().__init__()
        ctx = ctx or ParallelContext()
        p = inventory.by_name(inventory.block(cfg, cfg.is_moe_layer(layer_id), cfg.is_linear_layer(layer_id)))
        self.attention_norm = RMSNorm(p["attention_norm.weight"], cfg.norm_eps)
        linear = KimiDeltaAttention if cfg.kda else GatedDeltaNet
        mla = SparseMLA if cfg.is_dsa else MLA  # DeepSeek Sparse Attention: MLA over each query's top-k keys
        self.attention = (linear(cfg, ctx, layer_id) if cfg.is_linear_layer(layer_id) else
                          mla(cfg, RMSNorm, ctx, layer_id) if cfg.is_mla else Attention(cfg, ctx, layer_id))
        self.attn_resid_dropout = Dropout(cfg.dropout, ctx)
        self.ffn_norm = RMSNorm(p["ffn_norm.weight"], cfg.norm_eps)
        self.feed_forward = _moe(cfg, layer_id, ctx) if cfg.is_moe_layer(layer_id) else FeedForward(cfg.dim, cfg.ffn_dim)
        self.ffn_resid_dropout = Dropout(cfg.dropout, ctx)

    def forward(self, x, cos, sin, doc_ids=None):
        """The residual stream keeps x's dtype: each branch's output is cast to it before the add."""
        x = x + self.attn_resid_dropout(self.attention(self.attention_norm(x), cos, sin, doc_ids)).to(x.dtype)
        return x + self.ffn_resid_dropout(self.feed_forward(self.ffn_norm(x))).to(x.dtype)


def _moe(cfg: ModelConfig, layer_id: int, ctx: ParallelContext) -> nn.Module:
    if ctx.moe is None:
        raise ValueError(f"layer {layer_id} is an MoE layer: build the model with a ParallelContext whose `moe` "
                         "makes the block (shardwise.parallelize.build_model or plain_model)")
    return ctx.moe(cfg, layer_id)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None):
        super().__init__()
        self.cfg = cfg
        self.ctx = ctx = ctx or ParallelContext()
        emb = inventory.embedding(cfg)[0]
        self.tok_embeddings = nn.Embedding(*emb.shape)
        declare(self.tok_embeddings.weight, emb.init, emb.head_partial)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i, ctx) for i in range(cfg.n_layers)})
        head = inventory.by_name(inventory.head(cfg, tied=False))
        self.norm = RMSNorm(head["norm.weight"], cfg.norm_eps)
        self.output = linear_of(head, "output")
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # DeepSeek-V3 MTP modules; module k's block is layer n_layers + k, as in DeepSeek's checkpoints.
        self.mtp = nn.ModuleDict({str(k): MTPLayer(cfg.dim, cfg.norm_eps, TransformerBlock(cfg, cfg.n_layers + k, ctx),
                                                   RMSNorm) for k in range(cfg.mtp_layers)}) if cfg.mtp_layers else None
        self.mtp_embed = None  # under PP: the last stage's copy of the embedding (pipeline/tied_embedding.py)
        self.mtp_loss = None  # the MTP loss of the microbatches run since the trainer last took it

    @property
    def rng_tracker(self):
        """The RNG tracker the plan made (checkpoints save and restore its streams)."""
        return self.ctx.rng

    def rope(self, local_len: int, device, positions: torch.Tensor | None = None):
        """RoPE tables for this rank's tokens: under cp, the global positions of its chunks.

        `positions` [b, s_global] (--reset-positions) are per-token positions of the whole window;
        this rank takes its tokens' share, cut as the tokens were.
        """
        cp = self.ctx.cp
        seq_len, pos = cp.rope_positions(local_len, device, positions) if cp is not None else (local_len, positions)
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}")
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
        return self.ctx.cross_entropy(logits, targets, ignore_index, label_smoothing)
