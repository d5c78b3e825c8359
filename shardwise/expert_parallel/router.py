"""Top-k token router with the Switch/GShard balancing loss, z-loss and DeepSeek's loss-free bias.

Without `token_axes`, losses are per rank (micro-batch local, as in Switch and Megatron's
default): f and P below are computed over the N tokens this rank routes in this forward. With
`token_axes` (set by shardwise's parallel plan), f and N are global over the microbatch spread
across those axes, and each rank contributes its tokens' share of P, so the summed loss equals the
single-device loss of the same global microbatch. The z-loss stays per rank.

    aux   = E · Σᵢ fᵢ·Pᵢ,  fᵢ = (1 / (N·k)) · #{(t, j): idx[t, j] = i}   (share of the N·k assignments)
                          Pᵢ = (1 / N) · Σₜ p[t, i]                      (mean full-distribution prob)
    z     = (1 / N) · Σₜ logsumexp(logits[t])²

p is softmax over all E logits ("softmax" score), or sigmoid scores normalised to sum 1 per token
("sigmoid"). fᵢ counts the selected experts (bias included, before any capacity drop) and carries
no gradient; Pᵢ carries the gradient. Uniform routing gives aux = 1.

The loss-free bias (arXiv 2408.15664) is added to the selection scores (the logits when softmax
comes after top-k) for *selection only*; the combine weights come from the unbiased scores. It
changes only in `update_bias`, from counts all-reduced over the axes that hold different tokens,
so every rank keeps the same bias.

A `RoutingTape` (set by `shardwise verify`) records each forward's choices with their margins and can
force the choices of another run (routing replay): the gates still come from this router's own scores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..models.params import create
from ..rules.inventory import by_name, router


@dataclass
class Routing:
    """One forward's routing: indices/weights [N, k], counts [E] (selected, pre-drop), scalar losses.

    `loss` = aux_loss_coef·aux_loss + z_loss_coef·z_loss, the term to add to the training loss (the z term only
    under aux_scope "model", whose aux term the MoE block pools over layers from `global_counts`, `n_global`
    and `prob_sum`).
    """

    indices: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    loss: torch.Tensor
    global_counts: torch.Tensor | None = None
    """Selections per expert over the whole microbatch (the token axes), detached."""
    n_global: torch.Tensor | float = 0.0
    prob_sum: torch.Tensor | None = None
    """Σ over this rank's tokens of the full probability distribution [E] (with grad)."""


class RoutingTape:
    """One router's choices per forward, for verify's routing replay.

    `calls` gets (indices [N, k], margin [N]) per forward, in call order (microbatch order); a checkpoint
    recomputation (which runs inside backward) is not recorded again. `margin` is how far the choice is from
    changing: the k-th minus the (k+1)-th selection score, and under group-limited routing also the last kept
    minus the first dropped group score. When `forced` is not empty, its next [N, k] replaces the router's own
    top-k: the combine weights are this router's scores at the forced experts, so only the choice is borrowed.
    """

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.forced: list[torch.Tensor] = []

    def take(self, indices: torch.Tensor, margin) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:  # a recomputation inside backward: not a new forward
            return indices
        self.calls.append((indices.detach().clone(), margin().detach()))
        return self.forced.pop(0) if self.forced else indices


class Router(nn.Module):
    """Linear gate (a bias only with `bias`: gpt-oss) → scores → top-k, in fp32.

    score="softmax": softmax_before_topk=True takes the top-k of softmax(logits) and uses those
    probabilities as weights (Switch/DeepSeek-V2); False takes the top-k logits and softmaxes over
    just those k (Mixtral: weights sum to 1). score="sigmoid" (DeepSeek-V3): top-k of sigmoid
    scores, weights renormalised to sum 1.
    """

    def __init__(self, dim: int, n_experts: int, topk: int, score: str = "softmax", softmax_before_topk: bool = True,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 device=None, dtype=None, aux_scope: str = "layer", n_group: int = 1, topk_group: int = 1,
                 norm_topk: bool = True, scaling: float = 1.0, group_topk: int = 2, bias: bool = False):
        super().__init__()
        if not 1 <= topk <= n_experts:
            raise ValueError(f"topk={topk} must be in [1, n_experts={n_experts}]")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score={score!r}: expected 'softmax' or 'sigmoid'")
        self.n_experts, self.topk, self.score, self.aux_scope = n_experts, topk, score, aux_scope
        self.n_group, self.topk_group, self.norm_topk, self.scaling = n_group, topk_group, norm_topk, scaling
        self.group_topk = group_topk
        self.softmax_before_topk = softmax_before_topk
        self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate = aux_loss_coef, z_loss_coef, bias_update_rate
        p = by_name(router(dim, n_experts, bias))
        self.weight = create(p["weight"], device, dtype)
        # gpt-oss: a learned logit bias, part of the scores (selection and weights), unlike the selection-only one
        self.bias = create(p["bias"], device, dtype) if bias else None
        # Selection-only bias (fp32, in checkpoints) and the selected counts since the last update.
        self.register_buffer("expert_bias", torch.zeros(n_experts, device=device))
        self.register_buffer("pending_counts", torch.zeros(n_experts, device=device), persistent=False)
        # Axes over which one microbatch's tokens are spread (dp×cp, and tp under SP). When set and
        # the aux loss is on, fᵢ and N are taken over the whole global microbatch (one small
        # all-reduce), so the loss — and its gradient — is the same for every layout.
        self.token_axes: tuple = ()
        self.tape: RoutingTape | None = None  # verify's routing replay

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, dim] → Routing. Accumulates `pending_counts` while training (for `update_bias`)."""
        with torch.autocast(x.device.type, enabled=False):  # routing math stays fp32 under bf16 autocast
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        n, e, k = logits.shape[0], self.n_experts, self.topk
        after = self.score == "softmax" and not self.softmax_before_topk
        if self.score == "softmax":
            scores = probs = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        choice = raw = (logits if after else scores).detach() + self.expert_bias
        if self.n_group > 1:
            choice = self._limit_groups(choice)
        _, indices = torch.topk(choice, k, dim=-1)
        if self.tape is not None:
            indices = self.tape.take(indices, lambda: self._margin(raw, choice))
        weights = logits.gather(1, indices).softmax(-1) if after else scores.gather(1, indices)
        if self.score == "sigmoid" and self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)  # HF DeepseekV3TopkRouter's epsilon
        if self.scaling != 1.0:
            weights = weights * self.scaling
        counts = torch.zeros(e, device=x.device).scatter_add_(0, indices.reshape(-1),
                                                              torch.ones(n * k, device=x.device))
        active = [ax for ax in self.token_axes if ax.active]
        if active and (self.aux_loss_coef or self.z_loss_coef):
            stats = torch.cat([counts, counts.new_full((1,), n)])
            for ax in active:
                comm.all_reduce(stats, ax, tag="aux_loss")
            n_global, global_counts = stats[-1], stats[:-1]
            aux = e * torch.dot(stats[:-1] / (n_global * k), probs.sum(0) / n_global)
            z = logits.logsumexp(-1).pow(2).sum() / n_global
        elif n:
            n_global, global_counts = float(n), counts
            aux = e * torch.dot(counts / (n * k), probs.mean(0))
            z = logits.logsumexp(-1).pow(2).mean()
        else:
            n_global, global_counts = 0.0, counts
            aux = z = logits.sum() * 0.0
        if self.training:
            self.pending_counts += counts
        aux_term = 0.0 if self.aux_scope == "model" else self.aux_loss_coef * aux
        return Routing(indices, weights, counts, aux, z, aux_term + self.z_loss_coef * z, global_counts, n_global,
                       probs.sum(0))

    def _group_scores(self, choice: torch.Tensor) -> torch.Tensor:
        """[N, groups]: each group's score, the sum of its top-`group_topk` selection scores."""
        grouped = choice.view(choice.shape[0], self.n_group, self.n_experts // self.n_group)
        return grouped.topk(min(self.group_topk, grouped.shape[-1]), dim=-1)[0].sum(-1)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek's group-limited routing: each group scored by the sum of its top-`group_topk` selection scores
        (V3: 2, V2: 1 = the max); experts outside a token's topk_group best groups are masked out of its choice."""
        n, g = choice.shape[0], self.n_group
        grouped = choice.view(n, g, self.n_experts // g)
        top = self._group_scores(choice)
        best = torch.topk(top, self.topk_group, dim=-1)[1]
        keep = torch.zeros(n, g, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, self.n_experts)

    def _margin(self, raw: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """[N]: the selection-score gap that keeps each token's choice (`RoutingTape`); inf where nothing competes."""
        def gap(scores, k):
            if k >= scores.shape[-1]:
                return torch.full(scores.shape[:1], float("inf"), device=scores.device)
            top = scores.topk(k + 1, dim=-1)[0]
            return torch.nan_to_num(top[:, k - 1] - top[:, k], nan=float("inf"))  # -inf beyond the kept groups
        margin = gap(choice, self.topk)
        if self.n_group > 1:
            margin = torch.minimum(margin, gap(self._group_scores(raw), self.topk_group))
        return margin

    @torch.no_grad()
    def update_bias(self, axis=None, counts: torch.Tensor | None = None) -> torch.Tensor:
        """bias += rate · sign(mean load − load): call once per optimizer step on every rank.

        `counts` defaults to the selections accumulated since the last call; they are summed over
        `axis` — the ranks that route different tokens: mesh["dp_cp"], or a sequence of axes such
        as (dp_cp, tp) under sequence parallelism — so all ranks agree. Returns the counts used.
        """
        counts = (self.pending_counts if counts is None else counts).detach().float().clone()
        for ax in (axis if isinstance(axis, (list, tuple)) else [axis] if axis is not None else []):
            comm.all_reduce(counts, ax, tag="moe_bias")
        if self.bias_update_rate:
            self.expert_bias += self.bias_update_rate * torch.sign(counts.mean() - counts)
        self.pending_counts.zero_()
        return counts
