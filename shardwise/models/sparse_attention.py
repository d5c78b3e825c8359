"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA whose queries each attend only the `index_topk` keys a
lightning indexer picks, as transformers' DeepseekV32Attention / GlmMoeDsaAttention compute it.

The indexer (`Indexer`): q_h = wq_b(query latent) per indexer head, one key k = LayerNorm(wk x) shared by the heads,
their first qk_rope_dim dimensions rotated (halves for DeepSeek-V3.2, interleaved pairs for GLM-5); the score of key
t for query s is I(s, t) = Σ_h w_h(s) · ReLU(q_h(s)·k(t) / √d), w = weights_proj(x) / √heads, computed in fp32.
Each query keeps the top-k of its causal keys (of its own document under document masking). Ties are broken by
position, the earlier key first (a stable descending sort), so the choice depends on the scores alone, never on
how a layout cuts the sequence. transformers runs the indexer under `no_grad`: it gets no gradient from the language
loss. Its own training objective, DeepSeek's KL term (not part of transformers), is `set_indexer_objective`'s:
a dense warm-up (dense attention, the main model frozen) or sparse training (docs/sparse-attention.md).

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

from .. import comm
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


def sparse_mla(q_lat, q_rope, latent, idx, valid, scale: float, report=None, probs: bool = False):
    """Softmax attention of each query over its selected keys, in the latent space.

    q_lat [b, h, s, r] (no-rope queries through W_uk), q_rope [b, h, s, rope]; latent [b, t, r + rope] (every key's
    normalised c and rotated k_rope); idx / valid [b, s, k]. Returns the latent output [b, h, s, r]; with `probs`
    also the attention probabilities summed over these heads [b, s, k] (fp32, no gradient: the indexer's target)."""
    b, h, s, r = q_lat.shape
    k, dim = idx.shape[-1], latent.shape[-1]
    rows = inventory.dsa_query_rows(b, k, dim, h)  # several chunks: each recomputed in backward, not stored
    outs = []
    for i in range(0, s, rows):
        j = min(s, i + rows)
        args = (q_lat[:, :, i:j], q_rope[:, :, i:j], latent, idx[:, i:j], valid[:, i:j])
        if j - i < s and torch.is_grad_enabled():  # several chunks: keep each chunk's gathers out of memory
            outs.append(checkpoint(_sparse_chunk, *args, scale, report, probs, use_reentrant=False))
        else:
            outs.append(_sparse_chunk(*args, scale, report, probs))
    if not probs:
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return tuple(torch.cat(t, dim=d) if len(outs) > 1 else t[0] for t, d in zip(zip(*outs), (2, 1)))


def _sparse_chunk(q_lat, q_rope, latent, idx, valid, scale, report, probs=False):
    b, s, k = idx.shape
    r = q_lat.shape[-1]
    sel = latent.gather(1, idx.reshape(b, s * k, 1).expand(-1, -1, latent.shape[-1])).view(b, s, k, -1)
    q = torch.cat((q_lat, q_rope.to(q_lat.dtype)), dim=-1).transpose(1, 2)  # [b, s, h, r + rope]
    logits = torch.matmul(q, sel.transpose(-1, -2)) * scale  # [b, s, h, k]
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    if report is not None:
        with torch.no_grad():
            report(logits.float().amax(dim=(0, 1, 3)))
    p = torch.softmax(logits.float(), dim=-1)
    out = torch.matmul(p.to(sel.dtype), sel[..., :r]).transpose(1, 2)  # [b, h, s, r]
    return (out, p.detach().sum(dim=2)) if probs else out


def indexer_kl(logits, target, valid):
    """Σ over queries of KL(target ‖ softmax(logits over the valid keys)): logits [b, s, n] with gradient, target
    [b, s, n] (fp32, each row a distribution, zero where not valid), valid [b, s, n]."""
    logq = torch.log_softmax(logits.masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0.0)
    return (torch.xlogy(target, target) - target * logq).sum()


class _AttachKL(torch.autograd.Function):
    """forward: identity on the attention output / backward: also feed d(scale·kl)/d(kl) = scale to the indexer's KL.

    The KL then joins backward wherever the layer sits (a pipeline stage that never sees the loss included), as the
    MoE aux loss does, without the loop collecting it."""

    @staticmethod
    def forward(ctx, out, kl, scale):
        ctx.scale, ctx.meta = scale, (kl.shape, kl.dtype, kl.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.meta
        return g, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class SparseMLA(MLA):
    """MLA with DeepSeek Sparse Attention: MLA's parameters, then the indexer's.

    `objective` (set by `set_indexer_objective`): "none" (transformers': the indexer untrained), "dense-warmup"
    (dense MLA; in training the indexer learns KL(p ‖ softmax(I)) over every causal key) or "sparse" (top-k MLA; in
    training the indexer learns the KL over the selected keys). p is the main attention's probabilities summed over
    all heads (one tp all-reduce of the per-rank head sums) and L1-normalised per query, without gradient; the
    indexer reads detached inputs, so the KL trains the indexer alone and the language loss never reaches it."""

    def __init__(self, cfg: ModelConfig, norm_cls, ctx=None, layer_id: int = 0):
        super().__init__(cfg, norm_cls, ctx, layer_id)
        self.topk = cfg.index_topk
        self.n_heads = cfg.n_heads
        self.indexer = Indexer(cfg)
        self.objective = "none"
        self.kl_scale = 0.0  # weight / the step's queries: the KL's share of the loss per summed query
        self.step_kl = 0.0  # scale-weighted KL summed over training forwards (no host sync; a reader resets it)

    def forward(self, x, cos, sin, doc_ids=None):
        ctx = self.core.ctx
        train_kl = self.objective != "none" and self.training and torch.is_grad_enabled()
        if self.objective == "dense-warmup":
            out = super().forward(x, cos, sin, doc_ids)
            return self._attach(out, self._dense_kl(x, cos, sin, doc_ids)) if train_kl else out
        q_latent, q_lat, q_rope, latent, w_uv = self._latents(x, cos, sin)
        b, s = x.shape[:2]
        with torch.set_grad_enabled(train_kl):  # on detached inputs: only the KL reaches the indexer
            iq, iw, ik = self._indexer_inputs(x, q_latent, cos, sin)
        cp = ctx.cp
        if cp is not None:  # the whole sequence's keys, in sequence order (forward all-gather, backward reduce-scatter)
            latent = cp.gather_sequence(latent)
            with torch.set_grad_enabled(train_kl):
                ik = cp.gather_sequence(ik)
            q_pos = cp.rope_positions(s, x.device)[1]
        else:
            q_pos = torch.arange(s, device=x.device)
        q_doc = None if doc_ids is None else doc_ids[:, q_pos]
        with torch.no_grad():
            idx, valid = self._select(iq, iw, ik, q_pos, q_doc, doc_ids)
        rec = ctx.max_logits if self.training else None
        report = None if rec is None else (lambda m: rec.record(self.core.layer_id, m))
        args = (q_lat, q_rope, latent, idx, valid, self.scale, report, train_kl)
        if self.core.layer_id in ctx.selective:
            out = ctx.checkpoint_core(sparse_mla, *args)
        else:
            out = sparse_mla(*args)
        if train_kl:
            out, heads_p = out
            kl = self._kl(self._sparse_kl_chunk, heads_p, iq, iw, ik, idx, valid)
        out = torch.einsum("bhsr,hvr->bshv", out, w_uv.to(out.dtype)).reshape(b, s, -1)
        out = self.wo(out)
        return self._attach(out, kl) if train_kl else out

    def _latents(self, x, cos, sin):
        """MLA's absorbed form: the query latent, the per-head [W_ukᵀ q_nope] and rotated q_rope [b, h, s, ·], every
        key's latent [c | k_rope] [b, s, r + rope], and W_uv."""
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
        return q_latent, q_lat, q_rope, latent, w_uv

    def _indexer_inputs(self, x, q_latent, cos, sin):
        """The indexer's queries, head weights and keys, read from detached inputs (transformers: no gradient)."""
        x, q_latent = x.detach(), q_latent.detach()
        iq, iw = self.indexer.queries(x, q_latent, cos, sin)
        return iq, iw, self.indexer.keys(x, cos, sin)

    def _attach(self, out, kl):
        self.step_kl = self.step_kl + kl.detach() * self.kl_scale
        return _AttachKL.apply(out, kl, self.kl_scale)

    def _kl(self, chunk_fn, heads_p, iq, iw, ik, *rows):
        """Σ over this rank's queries of `chunk_fn`'s KL. The target p: this rank's head sums of the attention
        probabilities `heads_p` [b, s, n], summed over tp (the heads split) and divided by the heads (each head's row
        sums to 1: that is the L1 normalisation); fp32, no gradient. Without SP every tp rank computes every query's
        KL (the indexer is replicated and its gradient complete); under SP its weights' gradients are tp-summed
        (sp_replicated), so each tp rank takes its 1/tp of the queries and a reduce-scatter of p gives it theirs.
        `rows`: further tensors [b, s, ...] cut with the queries (the selection's indices and mask)."""
        ctx = self.core.ctx
        tp = ctx.tp_axis
        if tp is not None and tp.active and ctx.sequence_parallel:
            heads_p = comm.reduce_scatter(heads_p, tp, 1, tag="dsa_kl")
            n = heads_p.shape[1]
            mine = slice(tp.rank * n, (tp.rank + 1) * n)
            iq, iw, rows = iq[:, mine], iw[:, mine], [r[:, mine] for r in rows]
        elif tp is not None and tp.active:
            comm.all_reduce(heads_p, tp, tag="dsa_kl")
        target = heads_p.div_(self.n_heads).masked_fill_(~rows[-1], 0.0)
        b, s, keys = heads_p.shape
        per_row = b * keys * (self.indexer.n_heads + self.indexer.head_dim)
        step = max(1, SCORE_CHUNK // max(1, per_row))
        total = 0.0
        for i in range(0, s, step):  # several chunks: each recomputed in backward instead of stored
            part = [t[:, i:i + step] for t in (iq, iw)] + [ik] + [t[:, i:i + step] for t in (*rows, target)]
            total = total + (checkpoint(chunk_fn, *part, use_reentrant=False) if step < s else chunk_fn(*part))
        return total

    def _sparse_kl_chunk(self, iq, iw, ik, idx, valid, target):
        """KL over each query's selected keys: the indexer's scores I(s, S_s) [b, s, k] with gradient."""
        b, s, k = idx.shape
        sel = ik.gather(1, idx.reshape(b, s * k, 1).expand(-1, -1, ik.shape[-1])).view(b, s, k, -1)
        dots = F.relu(torch.matmul(iq.float(), sel.float().transpose(-1, -2)) * self.indexer.head_dim ** -0.5)
        return indexer_kl(torch.matmul(iw.unsqueeze(-2), dots).squeeze(-2), target, valid)

    def _dense_kl_chunk(self, iq, iw, ik, valid, target):
        """KL over every causal key: the indexer's scores I(s, ·) [b, s, t] with gradient."""
        return indexer_kl(self.indexer.scores(iq, iw, ik), target, valid)

    def _dense_kl(self, x, cos, sin, doc_ids):
        """The dense warm-up's KL: the target is the dense MLA's probabilities (absorbed form, no gradient) over every
        causal key (of the query's document); under cp the keys' latents and indexer keys are all-gathered."""
        ctx = self.core.ctx
        s = x.shape[1]
        with torch.no_grad():
            q_latent, q_lat, q_rope, latent, _ = self._latents(x, cos, sin)
        iq, iw, ik = self._indexer_inputs(x, q_latent, cos, sin)
        cp = ctx.cp
        if cp is not None:
            with torch.no_grad():
                latent = cp.gather_sequence(latent)
            ik = cp.gather_sequence(ik)
            q_pos = cp.rope_positions(s, x.device)[1]
        else:
            q_pos = torch.arange(s, device=x.device)
        t = latent.shape[1]
        valid = (torch.arange(t, device=x.device) <= q_pos.unsqueeze(-1)).unsqueeze(0)  # [1, s, t]
        if doc_ids is not None:
            valid = valid & (doc_ids[:, q_pos].unsqueeze(-1) == doc_ids.unsqueeze(1))
        valid = valid.expand(x.shape[0], -1, -1)
        with torch.no_grad():
            q = torch.cat((q_lat, q_rope.to(q_lat.dtype)), dim=-1)  # [b, h, s, r + rope]
            rows = max(1, SCORE_CHUNK // max(1, q.shape[0] * q.shape[1] * t))
            heads_p = torch.cat([torch.softmax((torch.matmul(q[:, :, i:i + rows], latent.unsqueeze(1).transpose(-1, -2))
                                                * self.scale).float().masked_fill(~valid[:, None, i:i + rows],
                                                                                  float("-inf")), dim=-1).sum(1)
                                 for i in range(0, s, rows)], dim=1)
        return self._kl(self._dense_kl_chunk, heads_p, iq, iw, ik, valid)

    def _select(self, iq, iw, ik, q_pos, q_doc, k_doc):
        """Top-k keys of every query, in query chunks that bound the [chunk, heads, keys] fp32 scores."""
        b, s, h = iw.shape
        rows = max(1, SCORE_CHUNK // max(1, b * h * ik.shape[1]))
        parts = [select(self.indexer.scores(iq[:, i:i + rows], iw[:, i:i + rows], ik), q_pos[i:i + rows], self.topk,
                        None if q_doc is None else q_doc[:, i:i + rows], k_doc) for i in range(0, s, rows)]
        return tuple(torch.cat(t, dim=1) for t in zip(*parts)) if len(parts) > 1 else parts[0]


def set_indexer_objective(model: nn.Module, stage: str, weight: float, queries: int) -> None:
    """Train the DSA indexers with DeepSeek's KL term: `stage` "dense-warmup" or "sparse" ("none": transformers'
    model), the KL weighted `weight` / `queries` (the step's queries: a mean, as the language loss is). The dense
    warm-up freezes every parameter but the indexers' (requires_grad off: the reducer and optimizer skip them)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMLA)]
    for m in blocks:
        m.objective, m.kl_scale = stage, weight / queries
    if stage == "dense-warmup":
        keep = {id(p) for m in blocks for p in m.indexer.parameters()}
        for p in model.parameters():
            if id(p) not in keep:
                p.requires_grad_(False)
