"""Gated DeltaNet (Yang et al. 2024), the linear-attention layer of Qwen3-Next and Qwen3.5, as transformers'
`Qwen3NextGatedDeltaNet` computes it with its torch fallback (`torch_chunk_gated_delta_rule`).

Per value head the layer keeps a state S [d_k, d_v]. Token t decays it by exp(g_t), removes what S already
predicts for k_t and writes the correction with strength β_t (the delta rule), then reads it with q_t:

    S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t

q, k, v come from a short causal depthwise convolution (silu) of their projections; q and k are L2-normalised
(q also scaled by d_k^−½); β = sigmoid(w_b x), g = −exp(A_log)·softplus(w_a x + dt_bias). The output of each
head goes through an RMSNorm gated by silu(w_z x), then `wo`. Key heads serve n_v/n_k consecutive value heads.

The recurrence is computed chunk-wise (`chunk_gated_delta_rule`): within a chunk of C tokens the WY/UT form
turns C rank-one updates into triangular solves and matmuls, and only the chunk-to-chunk state passes
sequentially. The state after a segment is affine in the state before it, S_end = M S_0 + B: context parallelism
composes the per-rank (M, B) maps (`context_parallel/linear_attention.py`). Document masks reset the state and
the convolution window at each document's first token.

Under TP the heads split: q/k/w_z/w_b/w_a/v projections column-parallel by heads (key heads and the value heads
they serve stay together), the convolution's channels, A_log and dt_bias with them, `wo` row-parallel; the
gated norm's weight is one head's width shared by all heads (a head-partial gradient).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..rules import inventory
from ..rules.inventory import CHUNK
from .context import ParallelContext
from .params import create, linear_of


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / √(Σx² + eps) over the last dim, as FLA and transformers normalise q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def resets_from_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] bool: token t starts a new document (its id differs from token t−1's); token 0 is False (the state
    and the convolution window before it are empty anyway)."""
    r = torch.zeros_like(doc_ids, dtype=torch.bool)
    r[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return r


def causal_conv(x: torch.Tensor, weight: torch.Tensor, halo: torch.Tensor | None = None,
                resets: torch.Tensor | None = None) -> torch.Tensor:
    """silu of the causal depthwise convolution of x [b, s, C] with weight [C, K]: out_t = Σ_j w_j x_{t−K+1+j}.

    `halo` [b, K−1, C] are the K−1 inputs before x (a context-parallel rank's left neighbour's tail; zeros at the
    sequence start). `resets` [b, K−1+s] (halo positions first) mark document starts: input t−d reaches output t
    only if no document starts in (t−d, t].
    """
    b, s, c = x.shape
    kw = weight.shape[-1]
    xp = torch.cat((halo if halo is not None else x.new_zeros(b, kw - 1, c), x), dim=1)
    if resets is None:
        out = F.conv1d(xp.transpose(1, 2), weight.unsqueeze(1), groups=c).transpose(1, 2)
        return F.silu(out)
    started = torch.cumsum(resets.to(torch.int32), dim=1)  # documents started up to each position (inclusive)
    out = x.new_zeros(b, s, c)
    for d in range(kw):
        same = (started[:, kw - 1 - d: kw - 1 - d + s] == started[:, kw - 1:]).unsqueeze(-1)
        out = out + xp[:, kw - 1 - d: kw - 1 - d + s] * weight[:, kw - 1 - d] * same
    return F.silu(out)


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, resets=None, chunk: int = CHUNK,
                           transition: bool = False):
    """The gated delta rule over [b, h, s, ·] inputs (q already normalised and scaled), chunk by chunk.

    Returns (o, final state [b, h, d_k, d_v], (M, Q) or None). With `transition`: M [b, h, d_k, d_k] is the
    segment's state map (S_end = M S_0 + B, B the final state from a zero start) and Q [b, h, s, d_k] the
    effective queries (o(S_0) = o(0) + Q S_0), so a later-known initial state is applied without a rerun.
    `resets` [b, s] bool zero the state before a document's first token.
    All arithmetic in fp32 whatever autocast is on (as FLA's kernels accumulate): the state runs through every chunk
    of the sequence, and bf16 matmuls would round it once per chunk (and save a low-precision copy of each operand).
    Padded tail tokens carry β = 0, g = 0 (no write, no decay); an unpadded v or β is not copied.
    `g` [b, h, s] decays each head's state by one scalar per token (Gated DeltaNet); `g` [b, h, s, d_k] decays each
    key channel's row of the state by its own (Kimi Delta Attention, `models/kimi_delta.py`).
    """
    with torch.autocast(q.device.type, enabled=False):
        return _chunk_rule(q, k, v, g, beta, initial_state, resets, chunk, transition)


def _chunk_rule(q, k, v, g, beta, initial_state, resets, chunk, transition):
    """`chunk_gated_delta_rule`'s body, run with autocast off."""
    b, h, s, dk = k.shape
    pad = (chunk - s % chunk) % chunk
    q, k, v = (F.pad(x.float(), (0, 0, 0, pad)) if pad else x.float() for x in (q, k, v))  # .float(): fp32 as is
    # Contiguous q, k (as transformers makes them): the chunk matmuls then fold their batch dims by a view instead
    # of saving a copy of each operand (an unpadded q, k are transposes of [b, s, h, d], or narrowed cp pieces).
    q, k = q.contiguous(), k.contiguous()
    if g.dim() == 4:
        return _channel_rule(q, k, v, g, beta, initial_state, resets, chunk, transition, s, pad)
    g, beta = (F.pad(x.float(), (0, pad)) if pad else x.float() for x in (g, beta))
    n = (s + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    # Decay sums in fp64: a strongly decaying head's Σg reaches −10³ within a chunk, where an fp32 difference of two
    # such sums keeps only ~1e-4 of the decay between nearby tokens (and of its gradient).
    cum = g.double().cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).float()
    pair = diff.masked_fill(~lower, float("-inf")).exp()  # exp(Σ g over (j, i])
    read_old = cum.float().exp()  # the decay from the chunk's start to t: how token t sees the state before the chunk
    to_end = (cum[..., -1:] - cum).float().exp()  # the decay from t to the chunk's end
    whole = cum[..., -1].float().exp()  # the chunk's total decay
    if resets is not None:
        r = F.pad(resets.to(torch.int32), (0, pad)).reshape(b, 1, n, chunk).cumsum(-1)  # starts since chunk start
        pair = pair * (r.unsqueeze(-1) == r.unsqueeze(-2))
        read_old = read_old * (r == 0)
        to_end = to_end * (r[..., -1:] == r)
        whole = whole * (r[..., -1] == 0)
    kb = k * beta.unsqueeze(-1)
    # UT transform: (I + tril(β k kᵀ ⊙ decay, −1)) U = β v, W = β k ⊙ decay-from-start.
    system = (kb @ k.transpose(-1, -2)) * pair
    system = system.masked_fill(~lower.tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * read_old.unsqueeze(-1), upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair
    qd = q * read_old.unsqueeze(-1)
    kd = k * to_end.unsqueeze(-1)
    return _scan(qd, kd, intra, u, w, whole[..., None, None], initial_state, transition, s)


def _scan(qd, kd, intra, u, w, decays, initial_state, transition: bool, s: int):
    """The chunk-to-chunk pass shared by both gates: each chunk reads the state, corrects its values by what the
    state already predicts, then decays the state (`decays` [b, h, n, d_k or 1, 1]: row by row) and writes."""
    b, h, n, chunk, dk = qd.shape
    dv = u.shape[-1]
    state = qd.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    m = torch.eye(dk, device=qd.device).expand(b, h, dk, dk) if transition else None
    outs, reads = [], []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(qd[:, :, i] @ state + intra[:, :, i] @ v_new)
        decay = decays[:, :, i]
        state = state * decay + kd[:, :, i].transpose(-1, -2) @ v_new
        if m is not None:  # how the segment's initial state reaches this chunk's outputs, then its end
            reads.append((qd[:, :, i] - intra[:, :, i] @ w[:, :, i]) @ m)
            m = m * decay - kd[:, :, i].transpose(-1, -2) @ (w[:, :, i] @ m)
    o = torch.stack(outs, dim=2).reshape(b, h, n * chunk, dv)[:, :, :s]
    if m is None:
        return o, state, None
    return o, state, (m, torch.stack(reads, dim=2).reshape(b, h, n * chunk, dk)[:, :, :s])


def _channel_rule(q, k, v, g, beta, initial_state, resets, chunk, transition, s, pad):
    """The rule with a per-channel gate g [b, h, s, d_k] (Kimi Delta Attention): the decay between tokens j <= i of
    a chunk is the vector exp(G_i - G_j), so it weighs the chunk's q·k and k·k products channel by channel
    ([C, C, d_k] per chunk) instead of scaling a [C, C] matrix; the state decays row by row (one row per key
    channel). Sums in fp64 and the rest in fp32, as the scalar rule."""
    b, h, _, dk = k.shape
    g = F.pad(g.float(), (0, 0, 0, pad)) if pad else g.float()
    beta = F.pad(beta.float(), (0, pad)) if pad else beta.float()
    n = (s + pad) // chunk
    q, k, v, g = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v, g))
    beta = beta.reshape(b, h, n, chunk)
    cum = g.double().cumsum(-2)  # [b, h, n, C, d_k]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).float()  # [.., i, j, d_k]
    pair = diff.masked_fill(~lower[..., None], float("-inf")).exp()  # exp(Σ g over (j, i]) per channel
    read_old = cum.float().exp()
    to_end = (cum[..., -1:, :] - cum).float().exp()
    whole = cum[..., -1, :].float().exp()  # [b, h, n, d_k]
    if resets is not None:
        r = F.pad(resets.to(torch.int32), (0, pad)).reshape(b, 1, n, chunk).cumsum(-1)
        pair = pair * (r.unsqueeze(-1) == r.unsqueeze(-2)).unsqueeze(-1)
        read_old = read_old * (r == 0).unsqueeze(-1)
        to_end = to_end * (r[..., -1:] == r).unsqueeze(-1)
        whole = whole * (r[..., -1] == 0).unsqueeze(-1)
    kb = k * beta.unsqueeze(-1)
    system = (kb.unsqueeze(-2) * k.unsqueeze(-3) * pair).sum(-1)
    system = system.masked_fill(~lower.tril(-1), 0.0) + torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * read_old, upper=False, unitriangular=True)
    intra = (q.unsqueeze(-2) * k.unsqueeze(-3) * pair).sum(-1)
    return _scan(q * read_old, k * to_end, intra, u, w, whole[..., None], initial_state, transition, s)


class GatedNormFunction(torch.autograd.Function):
    """weight · RMSNorm(x) · silu(z) as transformers' `Qwen3NextRMSNormGated` computes it (fp32, the normed value
    rounded to x's dtype before the weight), saving only x, z and the rsqrt: plain autograd would keep about five
    full-size fp32 tensors (x's copy, the normed value, silu(z), z's copy, weight · normed). The backward recomputes
    the rest and replays autograd's own steps and roundings op for op, so gradients are the plain ones bit for bit
    (tests/test_gated_deltanet.py holds it to that)."""

    @staticmethod
    def forward(ctx, x, z, weight, eps: float):
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, z, weight, r)
        return (weight * (xf * r).to(x.dtype) * F.silu(z.float())).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, r = ctx.saved_tensors
        xf, zf = x.float(), z.float()
        normed = (xf * r).to(x.dtype)
        wn, act = weight * normed, F.silu(zf)
        dy = dy.to(torch.promote_types(wn.dtype, act.dtype))  # the output cast's backward
        d_wn, d_act = (dy * act).to(wn.dtype), (dy * wn).to(act.dtype)
        d_weight = (d_wn * normed).to(weight.dtype).sum_to_size(weight.shape)
        d_n = (d_wn * weight).to(normed.dtype).float()
        d_r = (d_n * xf).sum(-1, keepdim=True)
        d_var = (-0.5 * d_r * r.pow(3)).expand_as(xf) / xf.shape[-1]
        dx = (d_n * r + d_var * (2.0 * xf)).to(x.dtype)
        dz = torch.ops.aten.silu_backward(d_act, zf).to(z.dtype)
        return dx, dz, d_weight, None


class GatedRMSNorm(nn.Module):
    """RMSNorm over one head's values, times silu(z): one d_v weight shared by every head (head-partial under TP)."""

    def __init__(self, weight: inventory.Param, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = create(weight)

    def forward(self, x, z):
        return GatedNormFunction.apply(x, z, self.weight, self.eps)


def short_conv(qkv, weight, cp, cache: dict | None, doc_ids):
    """A linear layer's causal convolution of its q/k/v channels: (silu output, the reset flags the single-device
    rule then needs, or None). While decoding (`cache`) it continues from the cached K−1 inputs and keeps the last
    K−1; under context parallelism (`cp`) each chunk reads the inputs before it from the preceding chunk."""
    kw = weight.shape[-1]
    if cache is not None:  # decoding one sequence: continue from the cached window and state
        halo = cache.get("conv")
        cache["conv"] = torch.cat((halo if halo is not None else qkv.new_zeros(qkv.shape[0], kw - 1, qkv.shape[-1]),
                                   qkv), dim=1)[:, -(kw - 1):]
        return causal_conv(qkv, weight, halo), None
    if cp is None:
        resets = None if doc_ids is None else resets_from_documents(doc_ids)
        return causal_conv(qkv, weight, resets=None if resets is None else F.pad(resets, (kw - 1, 0))), resets
    return cp.linear_conv(qkv, weight, doc_ids), None


def run_delta_rule(args, cp, cache: dict | None, resets, doc_ids) -> torch.Tensor:
    """The rule over [b, h, s, ·] inputs (q, k, v, g, β): while decoding from (and into) the cached state, on one
    device with `resets`, or under context parallelism by state composition (`cp.delta_rule`)."""
    if cache is not None:
        o, cache["state"], _ = chunk_gated_delta_rule(*args, initial_state=cache.get("state"))
        return o
    if cp is None:
        return chunk_gated_delta_rule(*args, resets=resets)[0]
    return cp.delta_rule(*args, doc_ids)


class GatedDeltaNet(nn.Module):
    """A Qwen3-Next / Qwen3.5 `linear_attention` mixer; forward(x, cos, sin, doc_ids) like attention's."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None, layer_id: int = 0):
        super().__init__()
        p = inventory.by_name(inventory.gated_deltanet(cfg))
        self.dk, self.dv, self.ctx, self.layer_id = cfg.linear_k_dim, cfg.linear_v_dim, ctx or ParallelContext(), layer_id
        self.wq = linear_of(p, "wq")
        self.wk = linear_of(p, "wk")
        self.wv = linear_of(p, "wv")
        self.wz = linear_of(p, "wz")
        self.wb = linear_of(p, "wb")
        self.wa = linear_of(p, "wa")
        # Depthwise kernels of q, k and v kept apart, so TP cuts each by heads like its projection.
        self.conv_q = create(p["conv_q"])
        self.conv_k = create(p["conv_k"])
        self.conv_v = create(p["conv_v"])
        self.A_log = create(p["A_log"])
        self.dt_bias = create(p["dt_bias"])
        self.norm = GatedRMSNorm(p["norm.weight"], cfg.norm_eps)
        self.wo = linear_of(p, "wo")
        self.decode_state: dict | None = None
        """While decoding (`generate`): {"conv": the last K−1 convolution inputs, "state": S}, read and advanced by
        each call, so a new token costs one recurrence step instead of a rerun of the window."""

    def forward(self, x, cos=None, sin=None, doc_ids=None):
        """`cos`/`sin` are unused (no RoPE); `doc_ids` [b, s_global] reset the state at document starts."""
        b, s = x.shape[:2]
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        z, beta_in, a = self.wz(x), self.wb(x), self.wa(x)
        nk, nv = q.shape[-1] // self.dk, v.shape[-1] // self.dv  # this rank's heads
        weight = torch.cat((self.conv_q, self.conv_k, self.conv_v), dim=0)
        cp, cache = self.ctx.cp, self.decode_state
        qkv, resets = short_conv(torch.cat((q, k, v), dim=-1), weight, cp, cache, doc_ids)
        q, k, v = qkv.split([nk * self.dk, nk * self.dk, nv * self.dv], dim=-1)
        q = l2norm(q.reshape(b, s, nk, self.dk).float()) * self.dk ** -0.5
        k = l2norm(k.reshape(b, s, nk, self.dk).float())
        v = v.reshape(b, s, nv, self.dv)
        if nv != nk:
            q, k = q.repeat_interleave(nv // nk, dim=2), k.repeat_interleave(nv // nk, dim=2)
        beta = beta_in.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = run_delta_rule([t.transpose(1, 2) for t in (q, k, v, g, beta)], cp, cache, resets, doc_ids)
        o = o.transpose(1, 2).to(x.dtype)  # [b, s, nv, dv]
        o = self.norm(o, z.view(b, s, nv, self.dv))
        return self.wo(o.reshape(b, s, nv * self.dv))
