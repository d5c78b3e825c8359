"""All-to-all token dispatcher over the ep axis, in phases (as Megatron's MoEAlltoAllTokenDispatcher).

dispatch:  preprocess  expand every token to its k assignments, apply capacity, stable-sort the
                       kept assignments by global expert id (= by (destination rank, local
                       expert), since rank r owns experts [r·E_l, (r+1)·E_l)); exchange the
                       per-(rank, local expert) counts with one small all-to-all; one host sync.
           all-to-all  rows with variable in/out splits.
           postprocess received rows arrive grouped (source rank, local expert); regroup them
                       to (local expert, source rank) so each local expert's rows are contiguous.
combine:   the mirror: undo the regroup, all-to-all with the splits swapped, then scatter-add the
           k router-weighted contributions back to their tokens.

Under an expert placement (`rules.placement.ExpertLayout`) the router's logical expert ids are mapped to global
slots (rank·E_l + local slot) before the sort — one gather on the device; a replicated expert's row goes to copy
(token + source rank) mod R — and everything after the mapping reads slots for experts. Capacity is applied to
logical experts before the mapping, so drops do not depend on the placement.

Capacity mode (capacity_factor F): each source rank keeps at most ceil(F·N·k/E) assignments per
expert, N its own tokens. Drop priority is deterministic: policy "probs" keeps the highest router
weights (ties: earlier token, then earlier of its k choices); "position" keeps earlier tokens
(within a token, its j-th choice before its (j+1)-th). A dropped assignment contributes nothing
(the token passes through the residual only). Dropless (F None) is the default.

Every all-to-all goes through `shardwise.comm`, tagged, so the ledger's "ep" rows are exact:
all_to_all:counts, :dispatch, :combine and, in backward, :combine_grad and :dispatch_grad.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.overrides import wrap_torch_function

from .. import comm, host
from ..rules.routing import expert_capacity


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all with (in, out) splits / backward: all-to-all of the gradient with the splits swapped."""

    @staticmethod
    def forward(ctx, x, axis, in_splits, out_splits, tag):
        ctx.axis, ctx.in_splits, ctx.out_splits, ctx.tag = axis, in_splits, out_splits, tag
        return comm.all_to_all(x, axis, in_splits, out_splits, tag=tag)

    @staticmethod
    def backward(ctx, g):
        grad = comm.all_to_all(g.contiguous(), ctx.axis, ctx.out_splits, ctx.in_splits, tag=f"{ctx.tag}_grad")
        return grad, None, None, None, None


def all_to_all_rows(x: torch.Tensor, axis, in_splits: list[int], out_splits: list[int], tag: str) -> torch.Tensor:
    """Differentiable variable-split all-to-all along dim 0 (identity on a size-1 axis)."""
    return _AllToAll.apply(x, axis, in_splits, out_splits, tag) if axis.active else x


def expert_counts(flat_e: torch.Tensor, n_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Rows per expert (int64 [E]) without a host sync (bincount and boolean indexing would sync on GPU)."""
    ones = torch.ones_like(flat_e) if mask is None else mask.to(flat_e.dtype)
    return torch.zeros(n_experts, dtype=flat_e.dtype, device=flat_e.device).scatter_add_(0, flat_e, ones)


def capacity(capacity_factor: float, n_tokens: int, topk: int, n_experts: int) -> int:
    """Assignments each expert accepts from one rank: ceil(F·N·k/E) (`rules.routing`, the planner's rule too)."""
    return expert_capacity(capacity_factor, n_tokens, topk, n_experts)


def keep_mask(indices: torch.Tensor, weights: torch.Tensor, n_experts: int, cap: int,
              policy: str = "probs") -> torch.Tensor:
    """[N·k] bool: which flattened (token, choice) assignments survive a per-expert capacity `cap`."""
    flat_e = indices.reshape(-1)
    if policy == "probs":
        prio = torch.argsort(-weights.detach().reshape(-1), stable=True)  # ties: earlier flat position
    elif policy == "position":
        prio = torch.arange(flat_e.numel(), device=flat_e.device)
    else:
        raise ValueError(f"drop policy {policy!r}: expected 'probs' or 'position'")
    order = prio[torch.argsort(flat_e[prio], stable=True)]  # by expert, then by priority
    counts = expert_counts(flat_e, n_experts)
    seg_start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(flat_e.numel(), device=flat_e.device) - seg_start[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = slot < cap
    return keep


@dataclass
class DispatchHandle:
    """What combine needs from dispatch, plus the step's load numbers (host ints, already synced)."""

    token_idx: torch.Tensor          # [R] source token of each sent row, in send order
    row_weights: torch.Tensor        # [R] router weight of each sent row
    n_tokens: int
    in_splits: list[int]             # rows sent to each ep rank
    out_splits: list[int]            # rows received from each ep rank
    regroup: torch.Tensor | None     # received order → local-expert-major order (None: already grouped)
    tokens_per_local_expert: list[int]
    tokens_per_expert: list[int]     # this rank's kept assignments per global expert
    dropped: int                     # this rank's assignments dropped by capacity
    local_counts: torch.Tensor | None = None  # tokens_per_local_expert on the device (grouped GEMM offsets)
    order: torch.Tensor | None = None  # [R] flat (token, choice) assignment of each sent row (`positions.py`)


class SplitTape:
    """One checkpointed forward's split sizes, replayed by its recomputation instead of a second host read.

    Routing is deterministic given the same inputs (and the restored RNG), so the recomputed counts must equal
    the recorded ones; that is asserted on the device (`torch._assert_async`: no host sync on CUDA), so a
    recomputation that routed differently fails loudly instead of moving rows by stale splits."""

    def __init__(self):
        self.entries: list[tuple[torch.Tensor, list[int]]] = []
        self.replaying, self._next = False, 0

    def record(self, counts: torch.Tensor, synced: list[int]) -> None:
        self.entries.append((counts, synced))

    def replay(self, counts: torch.Tensor) -> list[int] | None:
        """The recorded split sizes for this call (None when nothing was recorded: read them)."""
        if self._next >= len(self.entries):
            return None
        then, synced = self.entries[self._next]
        self._next += 1
        check_same_routing(counts, then)
        return synced


@wrap_torch_function(lambda counts, then: (counts, then))
def check_same_routing(counts: torch.Tensor, then: torch.Tensor) -> None:
    """Fail on the device (no host sync on CUDA) when a recomputation's split sizes differ from its forward's.
    Overridable as a torch function: a world without data (a simulator) has nothing to compare."""
    torch._assert_async((counts == then).all(), "MoE recompute routed differently from its forward")


class AllToAllDispatcher:
    """Moves each token's k assignments to the ep rank owning the chosen expert, and back."""

    def __init__(self, n_experts: int, ep_axis, capacity_factor: float | None = None, drop_policy: str = "probs",
                 layout=None):
        if n_experts % ep_axis.size:
            raise ValueError(f"n_experts={n_experts} not divisible by ep={ep_axis.size}")
        self.n_experts, self.axis = n_experts, ep_axis
        self.n_local = n_experts // ep_axis.size
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.tape: SplitTape | None = None  # set by shardwise.recompute around a checkpointed forward and its replay
        self.layout = None if layout is None or layout.identity else layout
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.layout is not None:
            if self.layout.ep != ep_axis.size:
                raise ValueError(f"expert layout for ep={self.layout.ep}, the ep axis has {ep_axis.size} ranks")
            self.n_local = self.layout.n_local
            self.slot_expert = [e for rank in self.layout.slots for e in rank]  # global slot → logical expert

    def _slots(self, flat_e: torch.Tensor, k: int) -> torch.Tensor:
        """Logical expert of each flattened assignment → the global slot its row goes to (identity: contiguous)."""
        if self.layout is None:
            return flat_e
        if self._tables is None or self._tables[0].device != flat_e.device:
            copies = [self.layout.copies(e) for e in range(self.n_experts)]
            width = max(len(c) for c in copies)
            table = torch.tensor([c + c[:1] * (width - len(c)) for c in copies], device=flat_e.device)
            self._tables = table, torch.tensor([len(c) for c in copies], device=flat_e.device)
        table, n_copies = self._tables
        token = torch.arange(flat_e.numel(), device=flat_e.device) // k
        return table[flat_e, (token + self.axis.rank) % n_copies[flat_e]]

    # ------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):
        """x [N, d], indices/weights [N, k] → (rows [M, d] grouped by local expert, handle)."""
        n, k = indices.shape
        ep, e_l = self.axis.size, self.n_local
        e = ep * e_l  # slots: the experts themselves without a placement
        flat_w = weights.reshape(-1)
        flat_e = self._slots(indices.reshape(-1), k)
        if self.capacity_factor is not None:  # per logical expert: the placement changes no drop
            cap = capacity(self.capacity_factor, n, k, self.n_experts)
            keep = keep_mask(indices, weights, self.n_experts, cap, self.drop_policy)
            sort_key = torch.where(keep, flat_e, e)  # dropped rows sort last and are cut below
        else:
            keep, sort_key = None, flat_e
        perm = torch.argsort(sort_key, stable=True)
        send_counts = expert_counts(flat_e, e, keep)
        recv_counts = comm.all_to_all(send_counts, self.axis, tag="counts")  # [ep·E_l]: (src rank, local expert)
        # The one host sync per MoE layer and microbatch (Megatron's too): split sizes must be Python
        # ints for the all-to-all; one read of both count vectors. A full-recompute replay reuses its forward's.
        both = torch.cat([send_counts, recv_counts])
        synced = self.tape.replay(both) if self.tape is not None and self.tape.replaying else None
        if synced is None:
            synced = host.read(both, "moe split sizes")
            if self.tape is not None:
                self.tape.record(both, synced)
        per_expert, recv = synced[:e], synced[e:]
        kept = sum(per_expert)
        perm = perm[:kept]
        in_splits = [sum(per_expert[r * e_l:(r + 1) * e_l]) for r in range(ep)]
        out_splits = [sum(recv[r * e_l:(r + 1) * e_l]) for r in range(ep)]
        token_idx = perm // k
        rows = all_to_all_rows(x.index_select(0, token_idx), self.axis, in_splits, out_splits, "dispatch")
        regroup = None
        if ep > 1 and e_l > 1:
            chunk = torch.repeat_interleave(torch.arange(ep * e_l, device=x.device), recv_counts,
                                            output_size=sum(out_splits))
            regroup = torch.argsort((chunk % e_l) * ep + chunk // e_l, stable=True)
            rows = rows.index_select(0, regroup)
        per_local = [sum(recv[r * e_l + j] for r in range(ep)) for j in range(e_l)]
        if self.layout is not None:  # the record speaks logical experts
            logical = [0] * self.n_experts
            for slot, c in enumerate(per_expert):
                logical[self.slot_expert[slot]] += c
            per_expert = logical
        handle = DispatchHandle(token_idx, flat_w[perm], n, in_splits, out_splits, regroup, per_local,
                                per_expert, n * k - kept, recv_counts.view(ep, e_l).sum(0), perm)
        return rows, handle

    # ------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Expert outputs [M, d] (local-expert-major) → [N, d]: Σ over kept choices of weight · output."""
        if handle.regroup is not None:
            y = y.index_select(0, torch.argsort(handle.regroup))
        rows = all_to_all_rows(y, self.axis, handle.out_splits, handle.in_splits, "combine")
        contrib = rows * handle.row_weights.unsqueeze(-1).to(rows.dtype)
        out = rows.new_zeros((handle.n_tokens, rows.shape[-1]))
        return out.index_add(0, handle.token_idx, contrib)
