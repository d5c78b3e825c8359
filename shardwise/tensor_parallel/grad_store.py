"""Deferred weight gradients for zero-bubble schedules (the W of F/B/W).

In a split schedule, B must produce only the input gradient the previous stage is waiting for.
Our linear layers therefore, while a store is `capturing`, hand (input, grad_output) to the store
instead of computing dW; the executor runs W(microbatch, chunk) later, which computes and
accumulates those weight gradients. One autograd pass, no recomputation. An FP8 linear (`fp8/linear.py`) defers
its FP8 weight-gradient GEMM as a closure (`defer`): its casts, and their amax all-reduces, run at W.
"""
from __future__ import annotations

from collections import Counter

import torch


class WeightGradStore:
    def __init__(self):
        self.capturing = False
        self.key = None
        self.pending: dict[object, list] = {}

    def put(self, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, grad_out: torch.Tensor) -> None:
        self.defer([weight, bias], lambda: weight_grads(x, grad_out, weight, bias))

    def defer(self, params: list, compute) -> None:
        """At this microbatch's W: `compute()` gives the gradients of `params` (None entries: no parameter)."""
        self.pending.setdefault(self.key, []).append((params, compute))

    def run(self, key) -> None:
        """Compute and accumulate every deferred weight gradient of `key`, then drop the saved tensors. A weight
        used several times in the microbatch (MTP's LM head: 1 + D) gets its hook once, after its last dW, as
        autograd's post-accumulate-grad hook fires once per backward: the reducer counts one gradient per
        parameter and microbatch (a hook per use made a bucket "complete" early)."""
        pending = self.pending.pop(key, [])
        left = Counter(id(p) for params, _ in pending for p in params if p is not None)
        with torch.no_grad():
            for params, compute in pending:
                for p, d in zip(params, compute()):
                    if p is not None:
                        left[id(p)] -= 1
                        _accumulate(p, d, last=not left[id(p)])

    def __len__(self) -> int:
        return sum(len(v) for v in self.pending.values())


def weight_grads(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """dW = gᵀx and db = Σg of y = x Wᵀ + b, in g's dtype (bf16 under autocast), returned in the params' dtypes."""
    g2 = g.reshape(-1, g.shape[-1])
    dw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype)
    return dw, (g2.sum(0).to(bias.dtype) if bias is not None else None)


def _accumulate(p: torch.Tensor, g: torch.Tensor, last: bool = True) -> None:
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g
    hook = getattr(p, "_sw_on_grad", None)  # what autograd's post-accumulate-grad hook would do
    if hook is not None and last:
        hook(p)


class _LinearDeferredW(torch.autograd.Function):
    """forward: y = x Wᵀ + b / backward: dx now; dW, db handed to the store (or computed now when not capturing)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        # The weight rides on ctx, not through save_for_backward: under a saved-tensor hook (activation
        # recompute's checkpoint, the activation meter) autograd unpacks a copy or alias of it, and a
        # deferred dW accumulated there would never reach the parameter's .grad.
        ctx.save_for_backward(x)
        ctx.store, ctx.weight, ctx.bias = store, weight, bias
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        (x,), weight = ctx.saved_tensors, ctx.weight
        dx = g @ weight.to(g.dtype)
        if ctx.store.capturing:
            ctx.store.put(weight, ctx.bias, x, g)
            return dx, None, None, None
        dw, db = weight_grads(x, g, weight, ctx.bias)
        return dx.to(x.dtype), dw, db, None


def linear(x, weight, bias=None, store: WeightGradStore | None = None):
    """F.linear, or the deferred-W version when the layer belongs to a split-backward pipeline stage."""
    if store is None:
        return torch.nn.functional.linear(x, weight, bias)
    return _LinearDeferredW.apply(x, weight, bias, store)
