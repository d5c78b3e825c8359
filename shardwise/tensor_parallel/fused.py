"""Fused projections (`--fused-projections`): the projections that read one input share one storage.

q/k/v, w1/w3, and MLA's down-projections (wq_a or wq, with wkv_a) each form a `ColumnRegion`. With fusion,
`store_fused` moves the region's weights (and biases) into one buffer per rank, back to back in the region's
order: this rank's [q_r; k_r; v_r] is one contiguous [Σ n_i, h] matrix, and the region runs one GEMM on it
(`joined` returns it as a view, no copy).

The parameters stay separate views of that buffer rather than one parameter. Everything keyed by parameter then
reads the same with and without fusion: each view keeps its own `ShardSpec` (a GQA K/V head shared by several
ranks sits beside query heads that are not shared), Muon orthogonalises q, k and v separately as the unfused run
does, and checkpoints, Hugging Face names, verify and the planner see the same tensors. A checkpoint written by a
fused run therefore loads into an unfused run and back.

What would split the storage is code that re-points a parameter's `.data`: ZeRO's flat buckets do, and keep
the region contiguous when its weights land next to each other in one bucket (ZeRO-3's per-block bucket; ZeRO-1/2
unless a bucket boundary falls inside the region). Where they do not, `joined` concatenates per call: the result
is the same, only slower.
"""
from __future__ import annotations

import torch
from torch import nn

from .grad_store import weight_grads


def adjacent(ts: list[torch.Tensor]) -> bool:
    """Whether `ts` lie back to back in one storage, each contiguous, so that together they are one tensor."""
    first = ts[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:] for t in ts):
        return False
    storage, off = first.untyped_storage(), first.storage_offset()
    for t in ts:  # torch keeps one Python object per storage, so identity is storage identity (fake ones too)
        if t.untyped_storage() is not storage or t.storage_offset() != off:
            return False
        off += t.numel()
    return True


def joined(ts: list[torch.Tensor]) -> torch.Tensor:
    """[t_1; t_2; ...] along dim 0: a view of their common storage when they are `adjacent`, else a copy."""
    if len(ts) == 1:
        return ts[0]
    if not adjacent(ts):
        return torch.cat(ts)
    first = ts[0]
    shape = (sum(t.shape[0] for t in ts), *first.shape[1:])
    return first.as_strided(shape, first.stride() if first.ndim > 1 else (1,), first.storage_offset())


def split_weight_grads(x: torch.Tensor, g: torch.Tensor, ws, bs) -> list:
    """[dW_1, db_1, dW_2, db_2, ...] of y = x [W_1; W_2; ...]ᵀ + b from one GEMM on the joined output gradient `g`
    (each dW_i a row block of it)."""
    dw, db = weight_grads(x, g, joined(list(ws)), None if bs[0] is None else joined(list(bs)))
    rows = [w.shape[0] for w in ws]
    dbs = db.split(rows) if db is not None else [None] * len(ws)
    return [t for pair in zip(dw.split(rows), dbs) for t in pair]


def _rehome(layers: list[nn.Module], attr: str) -> None:
    """Give every layer's `attr` parameter a view of one new buffer holding them back to back (values kept)."""
    params = [getattr(layer, attr) for layer in layers]
    first = params[0]
    buf = torch.empty((sum(p.shape[0] for p in params), *first.shape[1:]), dtype=first.dtype, device=first.device)
    off = 0
    with torch.no_grad():
        for layer, p in zip(layers, params):
            view = buf[off:off + p.shape[0]]
            view.copy_(p)
            new = nn.Parameter(view, requires_grad=p.requires_grad)
            for k, v in vars(p).items():
                if k.startswith("_sw_"):
                    setattr(new, k, v)
            layer._parameters[attr] = new
            off += p.shape[0]


def _register_together(parent: nn.Module) -> None:
    """Reorder `parent`'s children so each fused region's layers sit together in the region's order (MLA registers
    wq_b between wq_a and wkv_a): parameters are then listed, and ZeRO buckets them, back to back."""
    names = {id(c): n for n, c in parent._modules.items()}
    order: list[str] = []
    for name, child in parent._modules.items():
        region = getattr(child, "region", None)
        if name in order:
            continue
        if region is not None and region.fused and all(id(layer) in names for layer in region.layers):
            order += [names[id(layer)] for layer in region.layers]
        else:
            order.append(name)
    parent._modules = {name: parent._modules[name] for name in order}


def store_fused(model: nn.Module) -> int:
    """Store each fused region's weights (and biases) in one buffer, in the region's order; returns the count.

    Run once, after the parameters are materialised and before anything (an optimizer, a reducer) holds them."""
    regions = {}
    for m in model.modules():
        region = getattr(m, "region", None)
        if region is not None and region.fused:
            regions.setdefault(id(region), region)
    for m in list(model.modules()):
        if any(getattr(c, "region", None) in regions.values() for c in m.children()):
            _register_together(m)
    for region in regions.values():
        _rehome(region.layers, "weight")
        if region.layers[0].bias is not None:
            _rehome(region.layers, "bias")
    return len(regions)


def region_stored(region) -> bool:
    """Whether a fused region's weights are still one storage (tests and the benchmark check the fast path)."""
    return adjacent([layer.weight for layer in region.layers])
