"""DeepSeek-V3 multi-token prediction (MTP), as the DeepSeek-V3 report defines it (docs/mtp.md).

Module k (k = 1..D) sees the previous depth's hidden state h^{k-1} (h^0: the main model's output after its final
norm, as vLLM and SGLang feed DeepSeek's checkpoints) and the embedding of token i+k:
    h'^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1})]),   h^k = Block_k(h'^k),
    logits^k = Head(shared_head.norm(h^k)),
and predicts t_{i+k+1}. The embedding and the head are the main model's. The loss adds
λ/D · Σ_k CE_k, each CE_k the mean over its counted targets of the whole global batch (Megatron's normalisation).

Every shift happens on the host, over the whole window, before any cp cut (`shift_inputs`): depth k's inputs are
the window's tokens k.. and its labels the main targets k.. (so SFT loss masks carry over), the last k
positions padded (id 0, label ignored). The model then needs no communication beyond its usual layers.
The MTP loss joins the main loss's backward through `_AttachLoss` on the main logits (Megatron's
MTPLossAutoScaler), so the pipeline executor and the trainer's loss path stay as they are.
"""
from __future__ import annotations

import torch
from torch import nn

from ..rules import inventory
from .params import linear_of

IGNORE = -100  # the data loader's IGNORE_INDEX (models import no data module)


class MTPLayer(nn.Module):
    """One MTP module: enorm, hnorm, eh_proj (2d → d), a transformer block of the model's own kind, and its
    final norm (HF `shared_head.norm`). `norm` is the model's RMSNorm class."""

    def __init__(self, dim: int, eps: float, block: nn.Module, norm):
        super().__init__()
        p = inventory.by_name(inventory.mtp_inputs(dim))
        self.enorm = norm(p["enorm.weight"], eps)
        self.hnorm = norm(p["hnorm.weight"], eps)
        # [embedding; hidden] as DeepSeek's checkpoint, vLLM's deepseek_mtp.py and Megatron concatenate them.
        self.eh_proj = linear_of(p, "eh_proj")
        self.block = block
        self.head_norm = norm(inventory.norm("head_norm", dim)[0], eps)

    def forward(self, h, emb, cos, sin, doc_ids=None):
        """h^{k-1} [b, s, d] and Emb(t_{i+k}) [b, s, d] → [h^k, shared_head.norm(h^k)] stacked [2, b, s, d]: every
        weight of the module is used inside its forward, and its one output tensor carries both (ZeRO-3 gathers a
        unit around its forward and hooks its single output to gather it again for backward)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)).to(h.dtype)
        x = self.block(x, cos, sin, doc_ids)
        return torch.stack([x, self.head_norm(x)])


class _AttachLoss(torch.autograd.Function):
    """Identity on `logits`; its backward also gives `loss` the gradient 1, so the MTP loss is back-propagated
    with the main loss it rides on (no second backward call, on any pipeline schedule)."""

    @staticmethod
    def forward(ctx, logits, loss):
        ctx.loss_dtype = loss.dtype
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, g):
        return g, torch.ones((), dtype=ctx.loss_dtype, device=g.device)


def mtp_forward(model, h, logits, cos, sin, doc_ids, ids, labels, scale) -> torch.Tensor:
    """Run the D modules from the main model's normed hidden `h`; return `logits` carrying the MTP loss
    Σ_k scale[k] · Σ_i CE(logits^k_i, labels[k]_i), whose value is also added to `model.mtp_loss` (the report).

    ids / labels [D, b, s_local] come from `shift_inputs`, cut like the main tokens; scale [D] = λ / (D·n_k)."""
    embed = model.mtp_embedding()
    total = None
    for k, layer in enumerate(model.mtp.values()):
        h, normed = layer(h, embed(ids[k]), cos, sin, doc_ids).unbind(0)
        out = model.output(normed)
        part = model.loss_fn(out, labels[k], IGNORE).sum() * scale[k]
        total = part if total is None else total + part
    value = total.detach().reshape(1).float()
    model.mtp_loss = value if model.mtp_loss is None else model.mtp_loss + value
    return _AttachLoss.apply(logits, total)


def shift_inputs(x: torch.Tensor, y: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[D, b, s] input ids and labels of the D depths from a window's tokens `x` and targets `y` [b, s] (host,
    uncut): depth k (1-based) reads token i+k and predicts target i+k; positions past the window are padded
    with id 0 and label IGNORE."""
    b, s = x.shape
    ids = torch.zeros((depth, b, s), dtype=x.dtype, device=x.device)
    labels = torch.full((depth, b, s), IGNORE, dtype=y.dtype, device=y.device)
    for k in range(1, min(depth, s - 1) + 1):
        ids[k - 1, :, :s - k] = x[:, k:]
        labels[k - 1, :, :s - k] = y[:, k:]
    return ids, labels


def depth_counts(y: torch.Tensor | None, global_batch: int, seq_len: int, depth: int) -> list[int]:
    """Counted targets of each depth over the global batch: G·(S−k) without loss masks (`y` None), else the
    non-ignored targets k.. of the global batch's targets `y`."""
    if y is None:
        return [global_batch * max(seq_len - k, 0) for k in range(1, depth + 1)]
    counted = y.numpy() != IGNORE  # a host tensor of the loader's: no device read
    return [int(counted[:, k:].sum()) for k in range(1, depth + 1)]
