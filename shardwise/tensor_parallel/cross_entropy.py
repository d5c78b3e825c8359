"""Cross-entropy over vocabulary-sharded logits, without ever forming the [N, V] logits.

Forward: two small collectives per call — a MAX all-reduce of the row maxima and one SUM
all-reduce of the stacked [N, 2 or 3] statistics (sum of exp, target logit, and the row sum of
logits when label smoothing is on). Backward is analytic on the local shard (softmax minus the
smoothed one-hot), with no extra collective. Math is fp32 whatever the logits' dtype, padded
vocabulary columns (>= vocab_size) are excluded, and the input logits are never modified.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axis, vocab_start, vocab_size, ignore_index, label_smoothing):
        n_local = logits.shape[-1]
        z = logits.float()  # a copy when logits are bf16; for fp32 we only read and never write z in place
        valid_cols = max(0, min(n_local, vocab_size - vocab_start))
        if valid_cols < n_local:
            z = z.clone()
            z[..., valid_cols:] = float("-inf")
        row_max = z.amax(dim=-1)
        comm.all_reduce(row_max, axis, op="max")
        shifted = z - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_t = target - vocab_start
        ignored = target == ignore_index
        in_shard = (local_t >= 0) & (local_t < valid_cols) & ~ignored
        idx = local_t.clamp(0, max(n_local - 1, 0)).unsqueeze(-1)
        target_z = torch.gather(shifted, -1, idx).squeeze(-1).masked_fill(~in_shard, 0.0)
        stats = [exp.sum(-1), target_z]
        if label_smoothing > 0:
            stats.append(shifted[..., :valid_cols].sum(-1))
        stats = torch.stack(stats, dim=-1)
        comm.all_reduce(stats, axis)
        lse = stats[..., 0].log()
        loss = lse - stats[..., 1]
        if label_smoothing > 0:
            # smoothed target: (1-ε)·one-hot + ε/V on every real class
            loss = (1 - label_smoothing) * loss + label_smoothing * (lse - stats[..., 2] / vocab_size)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(stats[..., 0].unsqueeze(-1))
        ctx.save_for_backward(softmax, idx, in_shard, ignored)
        ctx.valid_cols, ctx.vocab_size, ctx.eps, ctx.dtype = valid_cols, vocab_size, label_smoothing, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, idx, in_shard, ignored = ctx.saved_tensors
        grad = softmax.clone()  # keep the saved softmax intact so a retained graph can run backward again
        eps = ctx.eps
        grad.scatter_add_(-1, idx, -(1 - eps) * in_shard.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad[..., : ctx.valid_cols] -= eps / ctx.vocab_size
        grad[..., ctx.valid_cols:] = 0.0
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, axis, vocab_start: int = 0, vocab_size: int | None = None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss from this rank's logits shard [..., V/tp] covering vocab ids [vocab_start, vocab_start + V/tp).

    Returns a tensor shaped like `target`, 0 at ignored positions; the caller reduces it (shardwise
    divides the sum by the global count of non-ignored tokens so every layout normalises alike).
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * axis.size
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if not axis.active and vocab_start == 0 and logits.shape[-1] == vocab_size:
        # One rank holding the whole unpadded vocabulary: PyTorch's fused kernel does the same math.
        return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten(), ignore_index=ignore_index,
                               reduction="none", label_smoothing=label_smoothing).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, axis, vocab_start, vocab_size, ignore_index,
                                            label_smoothing)
