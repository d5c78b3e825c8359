"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA whose queries each attend only the `index_topk` keys a
lightning indexer picks, as transformers' DeepseekV32Attention / GlmMoeDsaAttention compute it.

The indexer (`Indexer`): q_h = wq_b(query latent) per indexer head, one key k = LayerNorm(wk x) shared by the heads,
their first qk_rope_dim dimensions rotated (halves for DeepSeek-V3.2, interleaved pairs for GLM-5); the score of key
t for query s is I(s, t) = Σ_h w_h(s) · ReLU(q_h(s)·k(t) / √d), w = weights_proj(x) / √heads, computed in fp32.
Each query keeps the top-k of its causal keys (of its own document under document masking). Ties are broken by
position, the earlier key first (a stable descending sort), so the choice depends on the scores alone, never on
how a layout cuts the sequence. transformers runs the indexer under `no_grad`: it gets no gradient from the language
loss and its own training objective (DeepSeek's KL term) is not part of transformers (docs/sparse-attention.md).

Sparse MLA (`sparse_mla`) works in MLA's absorbed form on the latent: each head's no-rope query is moved into the
latent space through its rows of wkv_b (q·k_nope = (W_ukᵀ q)·c), the selected keys' latents c and rotary keys are
gathered once for all heads, softmax over those k keys only, and the latent output goes back out through W_uv:
k keys of work per query, not s. Under TP the heads split as in MLA (wq_b, wkv_b by head; the indexer replicated);
under CP the latents and indexer keys of the whole sequence are all-gathered (`ParallelContext.cp.gather_sequence`),
and the top-k of every local query is taken over the whole causal sequence exactly as one device takes it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from ..rules import inventory
from .mla import MLA
from .params import create, linear_of
from .rope import apply_rope

SCORE_CHUNK = 1 << 24
"""Elements of the indexer's fp32 per-head scores [rows, heads, keys] per query chunk (no gradient: a transient)."""


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias from the inventory (the indexer's k_norm)."""

    def __init__(self, weight: inventory.Param, bias: inventory.Param, eps: float):
        super().__init__()
        self.eps = eps
        self.weight, self.bias = create(weight), create(bias)

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def rope_halves(x, cos, sin):
    """RoPE on rotate-half pairs (i, i + d/2): the DeepSeek-V3.2 indexer's layout. x [b, s, heads, d]."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).type_as(x)


class Indexer(nn.Module):
    """The lightning indexer: per-query scores over keys, from which `select` takes the top-k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        p = inventory.by_name(inventory.indexer(cfg))
        self.n_heads, self.head_dim, self.rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_dim
        self.interleave = cfg.index_rope_interleave
        self.wq_b = linear_of(p, "wq_b")
        self.wk = linear_of(p, "wk")
        self.k_norm = LayerNorm(p["k_norm.weight"], p["k_norm.bias"], 1e-6)
        self.weights_proj = linear_of(p, "weights_proj")

    def _rotate(self, x, cos, sin):
        rot = apply_rope if self.interleave else rope_halves
        return torch.cat((rot(x[..., :self.rope], cos, sin), x[..., self.rope:]), dim=-1)

    def keys(self, x, cos, sin):
        """The one indexer key per token [b, s, d]."""
        return self._rotate(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)

    def queries(self, x, q_latent, cos, sin):
        """Per-head queries [b, s, heads, d] and head weights [b, s, heads] (fp32, times heads^-½)."""
        b, s = x.shape[:2]
        q = self._rotate(self.wq_b(q_latent).view(b, s, self.n_heads, self.head_dim), cos, sin)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        return q, w

    def scores(self, q, w, k):
        """I [b, s, t] = Σ_h w_h · ReLU(q_h·k / √d), in fp32 (transformers' order of operations)."""
        s = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * self.head_dim ** -0.5)
        return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)


def select(scores, q_pos, topk: int, q_doc=None, k_doc=None):
    """Each query's top-k keys: (indices [b, s, k'] into the key axis, valid [b, s, k']), k' = min(topk, t).

    `scores` [b, s, t] over keys in sequence order (key j at position j), `q_pos` [s] the queries' positions;
    `q_doc` [b, s] / `k_doc` [b, t] document ids. A key is a candidate when causal (and of the query's document);
    among equal scores the earlier key wins. Fewer candidates than k leave the tail invalid (masked in attention)."""
    t = scores.shape[-1]
    masked = torch.arange(t, device=scores.device) > q_pos.unsqueeze(-1)  # [s, t]
    masked = masked.unsqueeze(0)
    if q_doc is not None:
        masked = masked | (q_doc.unsqueeze(-1) != k_doc.unsqueeze(1))
    scores = scores.masked_fill(masked, float("-inf"))
    # contiguous: a view would keep the whole [b, s, t] int64 sort alive for backward
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :min(topk, t)].contiguous()
    return order, ~masked.expand_as(scores).gather(-1, order)


def sparse_mla(q_lat, q_rope, latent, idx, valid, scale: float, report=None):
    """Softmax attention of each query over its selected keys, in the latent space.

    q_lat [b, h, s, r] (no-rope queries through W_uk), q_rope [b, h, s, rope]; latent [b, t, r + rope] (every key's
    normalised c and rotated k_rope); idx / valid [b, s, k]. Returns the latent output [b, h, s, r]."""
    b, h, s, r = q_lat.shape
    k, dim = idx.shape[-1], latent.shape[-1]
    rows = inventory.dsa_query_rows(b, k, dim, h)  # several chunks: each recomputed in backward, not stored
    outs = []
    for i in range(0, s, rows):
        j = min(s, i + rows)
        args = (q_lat[:, :, i:j], q_rope[:, :, i:j], latent, idx[:, i:j], valid[:, i:j])
        if j - i < s and torch.is_grad_enabled():  # several chunks: keep each chunk's gathers out of memory
            outs.append(checkpoint(_sparse_chunk, *args, scale, report, use_reentrant=False))
        else:
            outs.append(_sparse_chunk(*args, scale, report))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _sparse_chunk(q_lat, q_rope, latent, idx, valid, scale, report):
    b, s, k = idx.shape
    r = q_lat.shape[-1]
    sel = latent.gather(1, idx.reshape(b, s * k, 1).expand(-1, -1, latent.shape[-1])).view(b, s, k, -1)
    q = torch.cat((q_lat, q_rope.to(q_lat.dtype)), dim=-1).transpose(1, 2)  # [b, s, h, r + rope]
    logits = torch.matmul(q, sel.transpose(-1, -2)) * scale  # [b, s, h, k]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if report is not None:
        with torch.no_grad():
            report(logits.float().amax(dim=(0, 1, 3)))
    p = torch.softmax(logits.float(), dim=-1).to(sel.dtype)
    return torch.matmul(p, sel[..., :r]).transpose(1, 2)  # [b, h, s, r]


class SparseMLA(MLA):
    """MLA with DeepSeek Sparse Attention: MLA's parameters, then the indexer's."""

    def __init__(self, cfg: ModelConfig, norm_cls, ctx=None, layer_id: int = 0):
        super().__init__(cfg, norm_cls, ctx, layer_id)
        self.topk = cfg.index_topk
        self.indexer = Indexer(cfg)

    def forward(self, x, cos, sin, doc_ids=None):
        ctx = self.core.ctx
        q_latent = self.q_a_norm(self.wq_a(x))
        b, s = x.shape[:2]
        q = self.wq_b(q_latent).view(b, s, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        c = self.kv_a_norm(c_kv)
        q_rope = apply_rope(q_rope, cos, sin).transpose(1, 2)  # [b, h, s, rope]
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).squeeze(2)
        w = self.wkv_b.weight.view(-1, self.nope + self.v_dim, self.kv_rank)  # this rank's heads [h, nope + v, r]
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q_lat = torch.einsum("bshn,hnr->bhsr", q_nope, w_uk.to(q_nope.dtype))
        latent = torch.cat((c, k_rope.to(c.dtype)), dim=-1)  # [b, s, r + rope]: what a key is, for every head
        with torch.no_grad():  # transformers' indexer: no gradient from the language loss
            iq, iw = self.indexer.queries(x, q_latent, cos, sin)
            ik = self.indexer.keys(x, cos, sin)
        cp = ctx.cp
        if cp is not None:  # the whole sequence's keys, in sequence order (forward all-gather, backward reduce-scatter)
            latent = cp.gather_sequence(latent)
            with torch.no_grad():
                ik = cp.gather_sequence(ik)
            q_pos = cp.rope_positions(s, x.device)[1]
        else:
            q_pos = torch.arange(s, device=x.device)
        q_doc = None if doc_ids is None else doc_ids[:, q_pos]
        with torch.no_grad():
            idx, valid = self._select(iq, iw, ik, q_pos, q_doc, doc_ids)
        rec = ctx.max_logits if self.training else None
        report = None if rec is None else (lambda m: rec.record(self.core.layer_id, m))
        if self.core.layer_id in ctx.selective:
            out = ctx.checkpoint_core(sparse_mla, q_lat, q_rope, latent, idx, valid, self.scale, report)
        else:
            out = sparse_mla(q_lat, q_rope, latent, idx, valid, self.scale, report)
        out = torch.einsum("bhsr,hvr->bshv", out, w_uv.to(out.dtype)).reshape(b, s, -1)
        return self.wo(out)

    def _select(self, iq, iw, ik, q_pos, q_doc, k_doc):
        """Top-k keys of every query, in query chunks that bound the [chunk, heads, keys] fp32 scores."""
        b, s, h = iw.shape
        rows = max(1, SCORE_CHUNK // max(1, b * h * ik.shape[1]))
        parts = [select(self.indexer.scores(iq[:, i:i + rows], iw[:, i:i + rows], ik), q_pos[i:i + rows], self.topk,
                        None if q_doc is None else q_doc[:, i:i + rows], k_doc) for i in range(0, s, rows)]
        return tuple(torch.cat(t, dim=1) for t in zip(*parts)) if len(parts) > 1 else parts[0]
