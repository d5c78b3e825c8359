"""This ep rank's slice of the experts: E/ep SwiGLU FFNs as stacked weights, run over grouped rows.

Weights are the global [E, ...] tensors split on dim 0 over ep, with a ShardSpec each, so the
layout-independent init (draw the global tensor, keep the spec's slice) gives every layout the
same experts. Parameters are marked `_sw_expert`: their gradients are complete over the ep group
(every token routed to them arrives here) and must be summed over "edp" only.

Under an expert placement (`rules.placement.ExpertLayout`) a rank's slots hold logical experts that are not a
contiguous block: their spec is an `ExpertShard`, the index list of logical rows, so init, checkpoints, HF loading
and verify read logical expert ids whatever the placement.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import wrap_torch_function

from .. import comm
from ..fp8.experts import fp8_experts
from ..models.params import declare
from ..rules.inventory import Param, experts
from ..rules.placement import ExpertLayout
from ..tensor_parallel.layers import ShardSpec, set_spec


@dataclass(frozen=True)
class ExpertShard(ShardSpec):
    """Local slot j is logical row `rows[j]` of the global [E, ...] tensor (a placement's slots, in rank order);
    `primary[j]`: that slot is its expert's first copy (replicas: the one a checkpoint writes). `start`/`valid`
    keep the contiguous reading for code that has no index list: never a placement's rows."""

    rows: tuple[int, ...] = ()
    primary: tuple[bool, ...] = ()

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        return full.index_select(0, torch.tensor(self.rows, device=full.device))

    def runs(self) -> list[tuple[int, int, int]]:
        """(local slot, logical row, count) of each run of consecutive primary slots holding consecutive rows."""
        out: list[list[int]] = []
        for j, (row, first) in enumerate(zip(self.rows, self.primary)):
            if not first:
                continue
            if out and out[-1][0] + out[-1][2] == j and out[-1][1] + out[-1][2] == row:
                out[-1][2] += 1
            else:
                out.append([j, row, 1])
        return [tuple(r) for r in out]


def _expert_param(entry: Param, rows: tuple[int, ...], primary, replicas, device, dtype, permuted) -> nn.Parameter:
    """This rank's experts `rows` (logical ids, one per local slot) of the inventory's stacked [E, ...] `entry`."""
    n_local = len(rows)
    p = nn.Parameter(torch.empty((n_local, *entry.shape[1:]), device=device, dtype=dtype))
    declare(p, entry.init, entry.head_partial)
    if permuted:
        set_spec(p, ExpertShard(entry.shape, 0, rows[0], n_local, n_local, replicas, rows=rows, primary=primary))
    else:
        set_spec(p, ShardSpec(entry.shape, 0, rows[0], n_local, n_local, replicas))
    p._sw_expert = True
    return p


@wrap_torch_function(lambda x, *weights: (x, *weights))
def grouped_mm_available(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """torch._grouped_mm runs fused here for rows `x` and `weights` in the dtype they are passed: torch >= 2.8
    on CPU (fp32/bf16); CUDA only in bf16 on sm90+ (in fp32 it falls back to a host copy of the offsets and
    a per-expert loop). Rows and weights 16-byte aligned. Overridable as a torch function: a world whose
    kernel differs (a simulator's stand-in accepts bf16 only) answers for itself."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if any(w.dtype != x.dtype for w in weights):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu":
        return False
    return all(w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0
               for w in weights)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The expert GEMMs' dtype: autocast's where it is on (as for every other linear), else the rows'."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """w1, w3 [E_l, ffn, dim] and w2 [E_l, dim, ffn]: expert e computes w2ₑ(silu(w1ₑ x) · w3ₑ x) (with `bias`, b1, b3
    [E_l, ffn] and b2 [E_l, dim] added to the three projections; `swiglu_limit` > 0: `glu`'s clamped form).

    `grouped_mm`: None picks torch._grouped_mm when it runs here, else a per-expert loop; the loop
    also visits empty experts so every weight stays in the graph (gradient zeros, never None).
    `replicas` is how many ranks outside ep hold the same slice for the grad norm (tp when the
    experts are not TP-sharded). `layout`: which logical experts this rank's slots hold (None: contiguous).
    """

    def __init__(self, n_experts: int, dim: int, ffn_dim: int, ep_axis, replicas: int = 1,
                 grouped_mm: bool | None = None, device=None, dtype=None, bias: bool = False,
                 swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702, layout: ExpertLayout | None = None):
        super().__init__()
        if n_experts % ep_axis.size:
            raise ValueError(f"n_experts={n_experts} not divisible by ep={ep_axis.size}")
        permuted = layout is not None and not layout.identity
        if permuted:
            rows, primary = layout.slots[ep_axis.rank], layout.primary(ep_axis.rank)
        else:
            e_l = n_experts // ep_axis.size
            rows, primary = tuple(range(ep_axis.rank * e_l, (ep_axis.rank + 1) * e_l)), (True,) * e_l
        self.n_experts, self.n_local, self.rows = n_experts, len(rows), rows
        self.first = rows[0]
        self.grouped_mm = grouped_mm
        self.b1 = self.b3 = self.b2 = None  # gpt-oss's biases (and its clamped SwiGLU, `glu`) when `bias`
        for e in experts(n_experts, dim, ffn_dim, bias):  # w1, w3, w2, then the biases
            setattr(self, e.name, _expert_param(e, rows, primary, replicas, device, dtype, permuted))
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        # replicated experts (`--expert-replicas`): (local slot, index among the replicated experts) of this rank's
        # copies; their gradients are summed over the ep ranks holding them
        hot = [] if not permuted else sorted({e for e in range(n_experts) if len(layout.copies(e)) > 1})
        self.copies = [(j, hot.index(e)) for j, e in enumerate(rows) if e in hot]
        self.n_hot, self.ep_axis = len(hot), ep_axis
        self._copy_index = None
        self.fp8 = None  # an Fp8Config under --fp8 (shardwise/fp8/apply.py): per-expert FP8 GEMMs
        # the axes holding rows of the same experts, where their FP8 token tiles span ranks (fp8/apply.py)
        self.fp8_tiles = None

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up; with `swiglu_limit` gpt-oss's clamped form (min(up, ±limit) + 1) · g·σ(α·g), g = min(gate,
        limit) (transformers' GptOssExperts)."""
        if not self.swiglu_limit:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def forward(self, rows: torch.Tensor, counts: list[int], device_counts: torch.Tensor | None = None,
                where=None) -> torch.Tensor:
        """rows [M, dim], contiguous per local expert with `counts` rows each → [M, dim].

        The grouped GEMM runs in the compute dtype (bf16 under autocast: the weights are cast per forward,
        as autocast casts every other linear's), so on sm90 the fused kernel runs. Its offsets are built on
        the device from `device_counts` (the same counts as a device tensor; the dispatcher has them), never
        copied from a host list — that copy would block. `where`: the rows' single-device positions
        (`positions.ExpertRows`), for the FP8 GEMMs."""
        if len(counts) != self.n_local or sum(counts) != rows.shape[0]:
            raise ValueError(f"counts {counts} do not describe {rows.shape[0]} rows over {self.n_local} experts")
        if self.fp8 is not None:
            return fp8_experts(self, rows, counts, where)
        dtype = compute_dtype(rows)
        w1, w3, w2 = (self._summed(w) for w in (self.w1, self.w3, self.w2))
        w1, w3, w2 = (w if w.dtype == dtype else w.to(dtype) for w in (w1, w3, w2))
        use = self.grouped_mm
        if use is None:
            use = grouped_mm_available(rows.to(dtype), w1, w2)
        if use:
            if device_counts is None:  # a caller without device counts: fill them in kernels, no host copy
                device_counts = torch.stack([torch.full((), c, device=rows.device) for c in counts])
            offs = device_counts.cumsum(0).to(torch.int32)
            x = rows.to(dtype)
            with torch.autocast(rows.device.type, enabled=False):  # already in the compute dtype
                b1, b3, b2 = self._row_biases(device_counts, rows.shape[0], dtype)
                h = self.glu(_plus(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs), b1),
                             _plus(torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs), b3))
                return _plus(torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs), b2).to(rows.dtype)
        # unbind, not w[e]: indexing's backward builds a zero-filled gradient of all local experts per expert;
        # unbind's stacks the experts' gradients once
        none = [None] * self.n_local
        b1, b3, b2 = (none if b is None else self._summed(b).unbind(0) for b in (self.b1, self.b3, self.b2))
        outs = []
        for e, (part, a, c, b) in enumerate(zip(rows.split(counts), w1.unbind(0), w3.unbind(0), w2.unbind(0))):
            h = self.glu(F.linear(part, a, b1[e]), F.linear(part, c, b3[e]))
            outs.append(F.linear(h, b, b2[e]))
        return torch.cat(outs)

    def copy_index(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(each replicated slot, its hot expert's row in the summed buffer) as index tensors, built once per device
        rather than in every backward."""
        if self._copy_index is None or self._copy_index[0].device != device:
            self._copy_index = tuple(torch.tensor(c, device=device, dtype=torch.long) for c in zip(*self.copies))
        return self._copy_index

    def _summed(self, w: torch.Tensor) -> torch.Tensor:
        """`w`, whose replicated slots' gradients are summed over their copies in backward (itself without replicas)."""
        return _SumCopies.apply(w, self) if self.n_hot and torch.is_grad_enabled() else w

    def _row_biases(self, device_counts: torch.Tensor, n_rows: int, dtype) -> tuple:
        """Each row's expert biases for the grouped GEMMs (0 without biases), repeated on the device: no host read."""
        if self.b1 is None:
            return None, None, None
        return tuple(torch.repeat_interleave(self._summed(b).to(dtype), device_counts, dim=0, output_size=n_rows)
                     for b in (self.b1, self.b3, self.b2))

    def extra_repr(self) -> str:
        if self.rows != tuple(range(self.first, self.first + self.n_local)):
            return f"experts {list(self.rows)} of {self.n_experts}"
        return f"experts [{self.first}, {self.first + self.n_local}) of {self.n_experts}"


class _SumCopies(torch.autograd.Function):
    """forward: identity on a stacked expert weight / backward: each replicated expert's gradient summed over the ep
    ranks holding a copy (one all-reduce over ep of a [replicated experts, ...] buffer), so every copy steps alike.
    Every ep rank runs it at the same point of the same graph."""

    @staticmethod
    def forward(ctx, w, experts):
        ctx.experts = experts
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        ex = ctx.experts
        slots, hot = ex.copy_index(g.device)
        buf = g.new_zeros((ex.n_hot, *g.shape[1:]))
        buf.index_copy_(0, hot, g.index_select(0, slots))
        comm.all_reduce(buf, ex.ep_axis, tag="expert_replicas")
        return g.index_copy(0, slots, buf.index_select(0, hot)), None


def _plus(t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return t if bias is None else t + bias
