"""Kimi Delta Attention (KDA, Kimi-Linear), as transformers' `KimiLinearDeltaAttention` computes it with its torch
fallback (`chunk_kimi_delta_attention`).

KDA is Gated DeltaNet with a finer forget gate: token t decays each key channel c of a head's state S [d, d] by its
own exp(g_t[c]) instead of one scalar per head,

    S_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t−1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t

with g = −exp(A_log_h) · softplus(wf_b(wf_a x) + dt_bias) (a low-rank projection to every channel, A_log one per
head), β = sigmoid(wb x). q, k, v come from the same short silu convolution as Gated DeltaNet's, q and k
L2-normalised (q scaled by d^−½). Each head's output goes through an RMSNorm times sigmoid(wg_b(wg_a x)) (the
output gate is low-rank too), then `wo`. Heads have one width d for keys and values, and key heads equal value heads.

The recurrence is `gated_deltanet.chunk_gated_delta_rule` given a [b, h, s, d] gate: the chunked form, the document
resets and the state map that context parallelism composes (`context_parallel/linear_attention.py`) are Gated
DeltaNet's, so KDA is exact under cp by the same state composition. Under TP the heads split: q/k/v, wf_b, wb,
wg_b column-parallel by heads (the kernels, A_log and dt_bias with them), wo row-parallel; wf_a, wg_a and the
norm's weight are replicated with head-partial gradients, as MLA's down-projections.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..rules import inventory
from .context import ParallelContext
from .gated_deltanet import l2norm, run_delta_rule, short_conv
from .params import create, linear_of


class SigmoidGatedNorm(nn.Module):
    """weight · RMSNorm(x) · sigmoid(gate) over one head's values, all in fp32 and cast back to x's dtype at the end
    (transformers' `KimiLinearRMSNormGated`); one weight shared by every head (head-partial under TP)."""

    def __init__(self, weight: inventory.Param, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = create(weight)

    def forward(self, x, gate):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """A Kimi-Linear `linear_attention` mixer; forward(x, cos, sin, doc_ids) like attention's."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None, layer_id: int = 0):
        super().__init__()
        p = inventory.by_name(inventory.kimi_delta(cfg))
        self.d, self.ctx, self.layer_id = cfg.linear_v_dim, ctx or ParallelContext(), layer_id
        # Depthwise kernels of q, k and v kept apart, so TP cuts each by heads like its projection.
        self.conv_q = create(p["conv_q"])
        self.conv_k = create(p["conv_k"])
        self.conv_v = create(p["conv_v"])
        self.A_log = create(p["A_log"])
        self.dt_bias = create(p["dt_bias"])
        self.wq = linear_of(p, "wq")
        self.wk = linear_of(p, "wk")
        self.wv = linear_of(p, "wv")
        self.wf_a = linear_of(p, "wf_a")
        self.wf_b = linear_of(p, "wf_b")
        self.wb = linear_of(p, "wb")
        self.wg_a = linear_of(p, "wg_a")
        self.wg_b = linear_of(p, "wg_b")
        self.norm = SigmoidGatedNorm(p["norm.weight"], cfg.norm_eps)
        self.wo = linear_of(p, "wo")
        self.decode_state: dict | None = None
        """While decoding (`generate`): {"conv": the last K−1 convolution inputs, "state": S}, as Gated DeltaNet's."""

    def forward(self, x, cos=None, sin=None, doc_ids=None):
        """`cos`/`sin` are unused (no RoPE); `doc_ids` [b, s_global] reset the state at document starts."""
        b, s = x.shape[:2]
        d = self.d
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        nh = q.shape[-1] // d  # this rank's heads
        weight = torch.cat((self.conv_q, self.conv_k, self.conv_v), dim=0)
        cp, cache = self.ctx.cp, self.decode_state
        qkv, resets = short_conv(torch.cat((q, k, v), dim=-1), weight, cp, cache, doc_ids)
        q, k, v = qkv.split([nh * d] * 3, dim=-1)
        q = l2norm(q.reshape(b, s, nh, d).float()) * d ** -0.5
        k = l2norm(k.reshape(b, s, nh, d).float())
        v = v.reshape(b, s, nh, d)
        beta = self.wb(x).float().sigmoid()
        f = (self.wf_b(self.wf_a(x)).float() + self.dt_bias.float()).view(b, s, nh, d)
        g = -self.A_log.float().exp().view(nh, 1) * F.softplus(f)  # per channel: [b, s, nh, d]
        o = run_delta_rule([t.transpose(1, 2) for t in (q, k, v, g, beta)], cp, cache, resets, doc_ids)
        o = o.transpose(1, 2).to(x.dtype)  # [b, s, nh, d]
        o = self.norm(o, self.wg_b(self.wg_a(x)).view(b, s, nh, d))
        return self.wo(o.reshape(b, s, nh * d))
