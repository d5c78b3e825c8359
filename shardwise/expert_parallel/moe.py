"""The MoE feed-forward block: router → dispatch → grouped experts → combine (+ shared experts).

Drop-in for the dense FeedForward: [b, s, dim] → [b, s, dim]. Each forward sets

* `self.aux_loss` — coefficient-weighted aux + z loss of this rank's tokens (a scalar with grad).
  The training loop adds it to the loss with the same weighting as the cross-entropy: since
  gradients are summed over dp×cp and the CE is divided by the global token count, add
  `aux_loss · local_tokens / global_tokens` per micro-batch (the token-weighted mean over ranks
  and micro-batches, Switch's per-micro-batch convention).
* `self.stats` — an `MoEStats` of the step's load (host numbers, no extra sync).

Call `update_bias(mesh["dp_cp"])` once per optimizer step when `bias_update_rate` > 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..mesh import Axis
from ..models.llama import FeedForward
from ..models.params import linear_of
from ..rules import inventory
from .dispatch import AllToAllDispatcher
from .experts import GroupedExperts
from .positions import TokenLayout, expert_rows, token_ids
from .router import Router


@dataclass
class MoEStats:
    """This rank's routing in the last forward (assignments after capacity; before, for `dropped`)."""

    tokens_per_expert: list[int]
    dropped: int
    aux_loss: torch.Tensor
    z_loss: torch.Tensor

    @property
    def max_load(self) -> int:
        return max(self.tokens_per_expert)

    @property
    def mean_load(self) -> float:
        return sum(self.tokens_per_expert) / len(self.tokens_per_expert)

    @property
    def imbalance(self) -> float:
        """max / mean load: 1 is perfectly balanced, E is everything on one expert."""
        return self.max_load / self.mean_load if self.mean_load else 0.0


class _AttachAuxLoss(torch.autograd.Function):
    """forward: identity on the block output / backward: also feed d(scale·aux)/d(aux) = scale to the aux loss.

    The aux loss then joins backward wherever the block sits — even on a pipeline stage that never
    sees the training loss — without the loop having to collect it (Megatron's MoEAuxLossAutoScaler).
    """

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.aux_meta
        return g, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class AuxPool:
    """Hugging Face's cross-layer aux loss (moe_aux_loss_scope "model"): the selections of every MoE layer in this
    microbatch, keyed by layer, for the gradient of the pooled loss. The loss E·Σᵢ Cᵢ·Sᵢ / (L·N)² is bilinear with
    C detached, so layer l's probability sums S_l get E·C / (L·N)² — C complete once every layer ran forward
    (hence one pipeline stage holds all layers)."""

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.counts: dict[str, torch.Tensor] = {}
        self.n_tokens: torch.Tensor | float = 0.0


class _AttachPooledAux(torch.autograd.Function):
    """forward: identity on the block output / backward: the pooled aux loss's gradient into this layer's
    probability sums, and this layer's share of the loss's value into the block's `step_aux`."""

    @staticmethod
    def forward(ctx, out, prob_sum, moe):
        ctx.moe = moe
        ctx.prob_sum = prob_sum.detach()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        moe = ctx.moe
        pool, router = moe.pool, moe.router
        total = sum(pool.counts.values())
        norm = (pool.n_tokens * pool.n_layers) ** 2
        d_sum = router.n_experts * total / norm  # d aux / d S_l
        moe.step_aux = moe.step_aux + torch.dot(d_sum, ctx.prob_sum) * moe.aux_scale
        return g, d_sum * (router.aux_loss_coef * moe.aux_scale), None


def build_moe(cfg: ModelConfig, ep_axis: Axis | None = None, expert_replicas: int = 1, device=None,
              layout=None) -> "MoE":
    """The MoE feed-forward of one block (router, E experts split over ep_axis — placed by `layout`, a
    `rules.placement.ExpertLayout`, or contiguous —, shared experts)."""
    return MoE(cfg.dim, cfg.moe_ffn_dim or cfg.ffn_dim, cfg.moe_experts, cfg.moe_topk, ep_axis,
               shared_experts=cfg.moe_shared_experts, capacity_factor=cfg.moe_capacity_factor,
               score=cfg.moe_score, softmax_before_topk=cfg.moe_softmax_before_topk,
               aux_loss_coef=cfg.moe_aux_loss_coef, z_loss_coef=cfg.moe_z_loss_coef,
               bias_update_rate=cfg.moe_bias_update_rate, expert_replicas=expert_replicas, device=device,
               aux_scope=cfg.moe_aux_loss_scope, n_group=cfg.moe_n_group, topk_group=cfg.moe_topk_group,
               norm_topk=cfg.moe_norm_topk, routed_scaling=cfg.moe_routed_scaling, group_topk=cfg.moe_group_topk,
               router_bias=cfg.moe_router_bias, expert_bias=cfg.moe_expert_bias, swiglu_limit=cfg.moe_swiglu_limit,
               swiglu_alpha=cfg.moe_swiglu_alpha, shared_gate=cfg.moe_shared_gate, layout=layout)


def share_aux_pool(model: nn.Module) -> None:
    """Give every MoE block of `model.layers` one AuxPool when the model's aux loss is pooled over layers."""
    cfg = model.cfg
    if cfg.moe_aux_loss_scope != "model":
        return
    pool = AuxPool(sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers)))
    for name, block in model.layers.items():
        if isinstance(block.feed_forward, MoE):
            block.feed_forward.pool, block.feed_forward.pool_key = pool, name


class MoE(nn.Module):
    """Top-k routed SwiGLU experts, E/ep per ep rank, plus `shared_experts` dense ones (DeepSeek-V3).

    The shared experts are one FeedForward (SwiGLU) of hidden size shared_experts·ffn_dim, which equals the sum
    of that many ffn_dim experts applied to every token.
    """

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, topk: int, ep_axis: Axis | None = None,
                 shared_experts: int = 0, capacity_factor: float | None = None, drop_policy: str = "probs",
                 score: str = "softmax", softmax_before_topk: bool = True, aux_loss_coef: float = 0.0,
                 z_loss_coef: float = 0.0, bias_update_rate: float = 0.0, expert_replicas: int = 1,
                 grouped_mm: bool | None = None, device=None, dtype=None, aux_scope: str = "layer",
                 n_group: int = 1, topk_group: int = 1, norm_topk: bool = True, routed_scaling: float = 1.0,
                 group_topk: int = 2, router_bias: bool = False, expert_bias: bool = False,
                 swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702, shared_gate: bool = False, layout=None):
        super().__init__()
        ep_axis = ep_axis if ep_axis is not None else Axis("ep")
        self.router = Router(dim, n_experts, topk, score, softmax_before_topk, aux_loss_coef, z_loss_coef,
                             bias_update_rate, device=device, dtype=dtype, aux_scope=aux_scope, n_group=n_group,
                             topk_group=topk_group, norm_topk=norm_topk, scaling=routed_scaling, group_topk=group_topk,
                             bias=router_bias)
        self.dispatcher = AllToAllDispatcher(n_experts, ep_axis, capacity_factor, drop_policy, layout)
        self.experts = GroupedExperts(n_experts, dim, ffn_dim, ep_axis, expert_replicas, grouped_mm,
                                      device=device, dtype=dtype, bias=expert_bias, swiglu_limit=swiglu_limit,
                                      swiglu_alpha=swiglu_alpha, layout=layout)
        self.shared = FeedForward(dim, shared_experts * ffn_dim, device, dtype) if shared_experts else None
        # Qwen3-Next: the shared expert's output times sigmoid(w·x), a per-token scalar gate
        gate = inventory.by_name(inventory.moe(dim, ffn_dim, n_experts, shared_experts, shared_gate=shared_gate))
        self.shared_gate = linear_of(gate, "shared_gate", device, dtype) if "shared_gate.weight" in gate else None
        self.aux_loss: torch.Tensor | None = None
        self.stats: MoEStats | None = None
        self.aux_scale = 1.0  # weight of this microbatch's aux loss in the step's loss (set by the loop)
        self.step_dropped = 0  # rows dropped by capacity since the loop last read it
        self.step_aux = 0.0  # scale-weighted aux loss since the loop last read it
        self.pool: AuxPool | None = None  # aux_scope "model": shared by the model's MoE blocks (share_aux_pool)
        self.pool_key = ""
        # a `positions.TokenLayout` where the experts need each row's single-device position: FP8 token tiles that
        # span ranks (fp8/apply.py, tag fp8_positions), or verify's FP8 replay (tag verify)
        self.token_layout = None
        self.positions_tag = "positions"

    def track_positions(self, mesh, seq_len: int, cp_order: str, sequence_parallel: bool, tag: str) -> None:
        """Compute each dispatched row's single-device position in every forward (`positions.expert_rows`), its
        collectives tagged `tag`: the FP8 token tiles' way in (fp8/apply.py), which cannot import this package."""
        self.token_layout = TokenLayout.of(mesh, seq_len, cp_order, sequence_parallel)
        self.positions_tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        rows, handle = self.dispatcher.dispatch(flat, routing.indices, routing.weights)
        where = None
        if self.token_layout is not None:
            ids = token_ids(self.token_layout, shape[0], flat.device)
            where = expert_rows(self.token_layout, ids, routing.indices, handle, self.dispatcher, self.positions_tag)
        out = self.experts(rows, handle.tokens_per_local_expert, handle.local_counts, where)
        out = self.dispatcher.combine(out, handle)
        if self.shared is not None:
            shared = self.shared(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        self.aux_loss = routing.loss
        self.stats = MoEStats(handle.tokens_per_expert, handle.dropped, routing.aux_loss.detach(),
                              routing.z_loss.detach())
        out = out.view(shape)
        self.step_dropped += handle.dropped
        if self.pool is None:
            self.step_aux = self.step_aux + routing.aux_loss.detach() * self.aux_scale  # no host sync
        if self.training and routing.loss.requires_grad:
            out = _AttachAuxLoss.apply(out, routing.loss, self.aux_scale)
        if self.training and self.pool is not None and self.router.aux_loss_coef and routing.prob_sum.requires_grad:
            self.pool.counts[self.pool_key] = routing.global_counts.detach()
            self.pool.n_tokens = routing.n_global
            out = _AttachPooledAux.apply(out, routing.prob_sum, self)
        return out

    def update_bias(self, axis: Axis | None = None) -> torch.Tensor:
        """Loss-free balancing step from the selections since the last call, summed over `axis`."""
        return self.router.update_bias(axis)

    def reset_buffers(self) -> None:
        """Zero the router's bias and pending counts (after materialising from the meta device)."""
        self.router.expert_bias.zero_()
        self.router.pending_counts.zero_()
