"""Multi-head Latent Attention (DeepSeek-V2/V3), as transformers' DeepseekV3Attention computes it.

q = wq_b(norm(wq_a x)) (or wq x without a query latent), per head [nope | rope]; one latent
c = wkv_a x = [c_kv | k_rope] with k_rope a single rotary key shared by all heads; wkv_b(norm(c_kv)) gives
each head's [k_nope | v]. RoPE rotates only the rope parts (interleaved pairs: HF's rope_interleave layout,
so its weights load unpermuted). Softmax scale (head_dim + qk_rope_dim)^-0.5, times YaRN's mscale² when the
RoPE is YaRN (`ModelConfig.mla_mscale`); the value head size v_head_dim may differ from the q/k size.

Under TP the heads split: wq / wq_b and wkv_b column-parallel by head, wo row-parallel; the down-projections
and their norms are replicated, and since each rank back-propagates only its heads into them, their gradients
(and the block input's) are partial sums over TP (`parallelize`).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..context_parallel import kernels, ring_attention, ulysses_attention
from .documents import document_mask
from .rope import apply_rope


def attend(attn: nn.Module, q, k, v, doc_ids):
    """The attention core on [b, heads, s, d] (through selective recompute when it is on), then `wo`: the tail
    both attention classes share."""
    b, s = q.shape[0], q.shape[2]
    out = attn.core(q, k, v, doc_ids) if attn.recompute_core is None else attn.recompute_core(attn.core, q, k, v, doc_ids)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_cls):
        super().__init__()
        h, nh = cfg.dim, cfg.n_heads
        self.nope, self.rope, self.v_dim, self.kv_rank = cfg.head_dim, cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        qk = self.nope + self.rope
        self.scale = qk ** -0.5 * cfg.mla_mscale  # DeepSeek's YaRN multiplies the softmax scale by mscale²
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_norm = norm_cls(cfg.q_lora_rank, cfg.mla_norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        else:
            self.wq = nn.Linear(h, nh * qk, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = norm_cls(self.kv_rank, cfg.mla_norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, nh * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(nh * self.v_dim, h, bias=False)
        self.attn_dropout = cfg.attn_dropout
        self.rng = None
        self.cp_axis, self.cp_order, self.cp_impl = None, "balanced", "ring"  # set by the plan under cp > 1
        self.recompute_core = None

    def forward(self, x, cos, sin, doc_ids=None):
        b, s = x.shape[:2]
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(b, s, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(c_kv)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).expand(-1, -1, k_nope.shape[2], -1)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)
        k = torch.cat((k_nope, k_rope), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        return attend(self, q, k, v, doc_ids)

    def core(self, q, k, v, doc_ids=None):
        """SDPA (ring or Ulysses under cp) with MLA's scale (nope + rope)^-0.5, which is 1/√(q's head size), the
        kernels' default; q/k head size differs from v's. What selective recompute replays."""
        if self.cp_axis is not None and self.cp_axis.active:
            # ring and Ulysses move K and V as one shape: pad the narrower of q/k and v with zero columns (exact:
            # zero q/k columns add nothing to the scores, zero v columns give zero outputs, sliced off) and pass
            # MLA's scale explicitly.
            dk, dv = q.shape[-1], v.shape[-1]
            site = "ring_attention" if self.cp_impl == "ring" else "ulysses"
            if dv < dk:
                v = F.pad(v, (0, dk - dv))
                kernels.record_padding(site, "v", dv, dk)
            elif dk < dv:
                q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
                kernels.record_padding(site, "q/k", dk, dv)
            attend = ring_attention if self.cp_impl == "ring" else ulysses_attention
            out = attend(q, k, v, self.cp_axis, causal=True, order=self.cp_order, scale=self.scale, doc_ids=doc_ids)
            return out[..., :dv]
        p = self.attn_dropout if self.training else 0.0
        mask = None if doc_ids is None else document_mask(doc_ids, doc_ids)
        dk, dv = q.shape[-1], v.shape[-1]
        if p == 0 and dk != dv:
            # SDPA's fused kernels (CPU flash, CUDA flash) need one head dim for q, k and v: otherwise they fall
            # back to the math path, which stores the s×s scores. Zero columns keep the result exact (q/k: nothing
            # added to the scores, the scale is explicit; v: output columns sliced off below) and the saved tensors
            # those of a flash kernel, as the planner counts them.
            if dv < dk:
                v = F.pad(v, (0, dk - dv))
            else:
                q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
        with self.rng.fork("tp") if p > 0 and self.rng is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None,
                                                 scale=self.scale)
        return out[..., :dv]
