"""Multi-head Latent Attention (DeepSeek-V2/V3), as transformers' DeepseekV3Attention computes it.

q = wq_b(norm(wq_a x)) (or wq x without a query latent), per head [nope | rope]; one latent
c = wkv_a x = [c_kv | k_rope] with k_rope a single rotary key shared by all heads; wkv_b(norm(c_kv)) gives
each head's [k_nope | v]. RoPE rotates only the rope parts (interleaved pairs: HF's rope_interleave layout,
so its weights load unpermuted). Softmax scale (head_dim + qk_rope_dim)^-0.5, times YaRN's mscale² when the
RoPE is YaRN (`ModelConfig.mla_mscale`); the value head size v_head_dim may differ from the q/k size.

Under TP the heads split: wq / wq_b and wkv_b column-parallel by head, wo row-parallel; the down-projections
and their norms are replicated, and since each rank back-propagates only its heads into them, their gradients
(and the block input's) are partial sums over TP: they are declared `head_partial` where they are made.
Kimi-Linear's MLA (`mla_nope`) rotates nothing: its shared key part stays as projected.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..rules import inventory
from .attention import AttentionCore, attend
from .context import ParallelContext
from .params import linear_of
from .rope import apply_rope


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_cls, ctx: ParallelContext | None = None, layer_id: int = 0):
        super().__init__()
        p = inventory.by_name(inventory.mla(cfg))
        self.nope, self.rope, self.v_dim, self.kv_rank = cfg.head_dim, cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.rotary = not cfg.mla_nope
        qk = self.nope + self.rope
        self.scale = qk ** -0.5 * cfg.mla_mscale  # DeepSeek's YaRN multiplies the softmax scale by mscale²
        if cfg.q_lora_rank:
            self.wq_a = linear_of(p, "wq_a")
            self.q_a_norm = norm_cls(p["q_a_norm.weight"], cfg.mla_norm_eps)
            self.wq_b = linear_of(p, "wq_b")
        else:
            self.wq = linear_of(p, "wq")
        self.wkv_a = linear_of(p, "wkv_a")
        self.kv_a_norm = norm_cls(p["kv_a_norm.weight"], cfg.mla_norm_eps)
        self.wkv_b = linear_of(p, "wkv_b")
        self.wo = linear_of(p, "wo")
        # MLA's scale (nope + rope)^-0.5 is 1/√(q's head size), the kernels' default, but q/k head size differs
        # from v's: the core pads and must keep the scale explicit.
        self.core = AttentionCore(ctx or ParallelContext(), layer_id, cfg.attn_dropout, self.scale)

    def forward(self, x, cos, sin, doc_ids=None):
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        b, s = q.shape[:2]  # the projections' sequence: a plan may hand x in over a sequence shard
        q = q.view(b, s, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(c_kv)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        if self.rotary:
            q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope.unsqueeze(2), cos, sin)
        else:  # Kimi-Linear's MLA: the shared key part unrotated
            k_rope = k_rope.unsqueeze(2)
        k_rope = k_rope.expand(-1, -1, k_nope.shape[2], -1)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)
        k = torch.cat((k_nope, k_rope), dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        return attend(self, q, k, v, doc_ids)
