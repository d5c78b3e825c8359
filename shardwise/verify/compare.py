"""How a layout's shards meet the reference: the values each rank holds (`grad_views`, `param_views`), the matching
slices of the reference, and norm-wise relative differences per parameter with squared norms summed over all ranks —
replicas inflate both sums equally, so the ratios are exact."""
from __future__ import annotations

import torch

from .. import comm
from ..pipeline.tied_embedding import tied_name
from ..tensor_parallel.layers import get_spec


def _views(trainer, views):
    """(name, spec, values, lo, hi within the flattened local parameter) of a reducer's views."""
    local = dict(trainer.model.named_parameters())
    for name, vals, lo, hi in views:  # a pipeline copy of the embedding (MTP's) compares with the embedding
        yield tied_name(name, local[name]), get_spec(local[name]), vals, lo, hi


def grad_views(trainer):
    """The reduced gradient values this rank holds."""
    return _views(trainer, trainer.reducer.grad_views())


def param_views(trainer):
    """The parameter values this rank holds: whole parameters, or ZeRO-3 shards."""
    return _views(trainer, trainer.reducer.param_views())


def against(views, ref: dict[str, torch.Tensor]):
    """(name, mine, matching slice of the reference) for each view."""
    return [(n, mine, spec.local_slice(ref[n]).reshape(-1)[lo:hi]) for n, spec, mine, lo, hi in views]


def per_param_rel(pairs, names, world) -> torch.Tensor:
    """[parameters]: ||x - ref|| / ||ref|| per parameter, with the squared norms summed over all ranks."""
    index = {n: i for i, n in enumerate(names)}
    acc = torch.zeros(len(names), 2, dtype=torch.float64, device=world.device)  # NCCL: on the mesh device
    for name, mine, ref in pairs:
        acc[index[name], 0] += (mine.double() - ref.double()).pow(2).sum()
        acc[index[name], 1] += ref.double().pow(2).sum()
    comm.all_reduce(acc, world, tag="verify")
    return acc[:, 0].sqrt() / acc[:, 1].sqrt().clamp_min(1e-30)


def norms(values: dict, names) -> torch.Tensor:
    """[parameters]: each value's norm, on the host."""
    return torch.stack([values[n].double().norm() for n in names]).cpu()


def global_index(spec, ref: torch.Tensor, lo: int, hi: int, device) -> torch.Tensor:
    """1 + the global element index of each value a view holds (0: padding), through the same `local_slice` that cuts
    the reference: an index tensor cut like the values."""
    idx = spec.local_slice(torch.arange(1, ref.numel() + 1, device=device).view(ref.shape))
    return idx.reshape(-1)[lo:hi]


def coverage(view_lists, ref_params: dict[str, torch.Tensor], world) -> float:
    """Fraction of reference elements every comparison in `view_lists` reached, min over the comparisons.

    Each rank marks the global elements its views cover (`global_index`; padding maps to no element); a max over
    ranks counts a replicated element once, and an element no rank compared stays 0.
    """
    canon = {}  # tied weights: the reference's output.weight IS tok_embeddings.weight; count its elements once
    for n in sorted(ref_params):
        canon.setdefault(id(ref_params[n]), n)
    offset, total = {}, 0
    for n in sorted(set(canon.values())):
        offset[n], total = total, total + ref_params[n].numel()
    offset = {n: offset[canon[id(p)]] for n, p in ref_params.items()}
    marks = torch.zeros(len(view_lists), total, device=world.device)
    for row, views in enumerate(view_lists):
        for n, spec, _, lo, hi in views:
            idx = global_index(spec, ref_params[n], lo, hi, world.device)
            marks[row, offset[n] + idx[idx > 0] - 1] = 1.0
    comm.all_reduce(marks, world, op="max", tag="verify")
    return int((marks > 0).sum(1).min()) / total  # an integer count: exact past float32's 2**24


def layout_values(param_views, ref_params: dict[str, torch.Tensor], world) -> dict[str, torch.Tensor]:
    """The layout's parameters as whole tensors on every rank: each rank scatters the values it holds to their global
    elements (`global_index`), summed over ranks and divided by how many hold each."""
    out = {}
    for n, ref in ref_params.items():
        out[n] = torch.zeros(2, ref.numel(), dtype=torch.float64, device=world.device)
    for n, spec, vals, lo, hi in param_views:
        idx = global_index(spec, ref_params[n], lo, hi, world.device)
        keep = idx > 0
        out[n][0, idx[keep] - 1] += vals.reshape(-1)[keep].double()
        out[n][1, idx[keep] - 1] += 1.0
    for n in sorted(out):
        comm.all_reduce(out[n], world, tag="verify")
    return {n: (t[0] / t[1].clamp_min(1.0)).view(ref_params[n].shape).to(ref_params[n].dtype) for n, t in out.items()}
