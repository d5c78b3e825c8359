"""Muon over a layout: every logical matrix is orthogonalised whole, once, by one rank of the ranks holding it.

The state is one momentum buffer per held tensor, laid out as AdamW's exp_avg would be (the full local
parameter under ZeRO-0, the rank's flat shard of each bucket under ZeRO ≥ 1), so the elementwise part of
the step (momentum, Nesterov) runs on whatever the rank holds. Then, per group of matrices — under ZeRO ≥ 1
each Muon bucket, so only one bucket's whole matrices are live at a time; under ZeRO-0 all dense ones, all
expert ones — over the ranks that hold pieces or copies of them — the data axis (dp×cp, dp_shard under
HSDP, edp for experts) times tp:

1. gather: the Nesterov shard is all-gathered over the data axis (ZeRO ≥ 1: the bucket's flat buffer),
   then TP-split matrices over tp (one flat all-gather for all of them), so every rank of the group can
   assemble any matrix of the group: Wq, Wk, Wv separately, each expert separately;
2. orthogonalise: matrices are dealt (`rules.muon.deal`, which the planner reads too) to the group's ranks
   greedily by Newton–Schulz cost (rows·cols·min), largest first, each to the least-loaded rank. Every rank
   runs the same deterministic deal, so no rank waits for an assignment, and the largest load exceeds the
   mean by at most one matrix's cost;
3. scatter: each rank packs its orthogonalised matrices into one buffer padded to the largest rank's, and
   the buffers are all-gathered over tp and then over the data axis; each rank keeps its own slice.

Every byte goes through `shardwise.comm` with the tag "muon", so the ledger shows it per axis.
"""
from __future__ import annotations

import torch

from .. import comm
from ..rules.muon import deal
from ..tensor_parallel.layers import get_spec
from .muon import apply_update, muon_update, nesterov

TAG = "muon"


class _Group:
    """Muon parameters stepped together over one data axis: (name, param, bucket or None, offset, numel)."""

    def __init__(self, axis, entries):
        self.axis, self.entries = axis, entries


class Muon(torch.optim.Optimizer):
    """Muon for the parameters `is_muon` selects, over a `GradReducer`'s layout (ZeRO 0–3, TP, EP, PP, CP).

    Its param_groups hold the tensors the rank updates (parameters, or ZeRO shards) so the LR schedule sets
    `lr` as for AdamW; `state[t]["momentum"]` is the one buffer per held tensor."""

    def __init__(self, reducer, is_muon, lr: float, weight_decay: float, momentum: float, ns_steps: int,
                 ns_dtype: torch.dtype):
        self.reducer, self.mu, self.ns_steps, self.ns_dtype = reducer, momentum, ns_steps, ns_dtype
        self.tp = reducer.tp
        self.clip = None  # MuonClip (qk_clip.QKClip), run after every step when --muon-qk-clip is set
        self.groups: dict[int, _Group] = {}
        if reducer.zero:
            held = []
            for b in reducer.buckets:
                if b.muon:
                    held.append(b.shard)  # one bucket at a time: at most one bucket's whole matrices are live
                    self.groups[id(b)] = _Group(b.axis, [(n, p, b, off, k) for n, p, off, k in b.offsets])
        else:
            held = [p for n, p in reducer.named if is_muon(n, p)]
            for n, p in reducer.named:
                if is_muon(n, p):
                    axis = reducer.mesh["edp"] if getattr(p, "_sw_expert", False) else reducer.dense_axis
                    self._group(axis).entries.append((n, p, None, 0, p.numel()))
        # every TP rank's (start, valid) of each TP-split matrix: where its rows or columns go in the whole
        mine = {n: (get_spec(p).start, get_spec(p).valid) for g in self.groups.values() for n, p, *_ in g.entries
                if self._tp_split(p)}
        self.tp_specs = comm.all_gather_object(mine, self.tp)
        super().__init__([{"params": held, "weight_decay": weight_decay}] if held else
                         [{"params": [torch.zeros(0)], "weight_decay": weight_decay}], dict(lr=lr))
        for t in held:  # created now, not at the first step: the static footprint and a checkpoint see it
            self.state[t]["momentum"] = torch.zeros_like(t)

    def _group(self, axis) -> _Group:
        return self.groups.setdefault(id(axis), _Group(axis, []))

    def _tp_split(self, p) -> bool:
        return self.tp.active and get_spec(p).dim is not None and not getattr(p, "_sw_expert", False)

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        lr, wd = group["lr"], group["weight_decay"]
        nest = {}
        for t in group["params"]:
            if t.numel():
                grad = t.grad if t.grad is not None else torch.zeros_like(t)
                nest[id(t)] = nesterov(self.state[t]["momentum"], grad, self.mu)
        for g in self.groups.values():
            self._step_group(g, nest, lr, wd)
        if self.clip is not None:
            self.clip.apply()

    def _step_group(self, g: _Group, nest, lr: float, wd: float) -> None:
        """One group, gather to apply; its whole matrices and buffers are freed on return, before the next
        group's are made (the planner's `muon.step_transient_bytes` counts one group's)."""
        local = self._local(g, nest)
        names, mats = self.full_matrices(g, local)
        updates = self._orthogonalise_spread(g.axis, mats)
        self._apply(g, names, updates, lr, wd)

    def _local(self, g: _Group, nest) -> dict[str, torch.Tensor]:
        """Each parameter's Nesterov gradient as the rank's TP shard of it (ZeRO: gathered over the data axis)."""
        out, full_of = {}, {}
        for n, p, b, off, k in g.entries:
            if b is None:
                out[n] = nest[id(p)]
                continue
            if id(b) not in full_of:
                full_of[id(b)] = torch.empty(b.padded, device=b.shard.device, dtype=b.shard.dtype)
                comm.all_gather_into(full_of[id(b)], nest[id(b.shard)], b.axis, tag=TAG)
            out[n] = full_of[id(b)][off:off + k].view(p.shape)
        return out

    def full_matrices(self, g: _Group, local) -> tuple[list[str], list[torch.Tensor]]:
        """(parameter name per matrix, whole 2-D matrices): TP-split ones gathered over tp, experts one each."""
        split = [(n, p) for n, p, *_ in g.entries if self._tp_split(p)]
        whole = {}
        if split:
            flat = comm.all_gather(torch.cat([local[n].reshape(-1) for n, _ in split]), self.tp, tag=TAG)
            per = flat.numel() // self.tp.size
            for r in range(self.tp.size):
                chunk, off = flat[r * per:(r + 1) * per], 0
                for n, p in split:
                    spec = get_spec(p)
                    piece = chunk[off:off + p.numel()].view(p.shape)
                    off += p.numel()
                    if n not in whole:
                        whole[n] = torch.zeros(spec.global_shape, device=p.device, dtype=p.dtype)
                    start, valid = self.tp_specs[r][n]
                    whole[n].narrow(spec.dim, start, valid).copy_(piece.narrow(spec.dim, 0, valid))
        names, mats = [], []
        for n, p, *_ in g.entries:
            m = whole.get(n, local[n])
            for e in (m.unbind(0) if m.ndim == 3 else (m,)):
                names.append(n)
                mats.append(e)
        return names, mats

    def _orthogonalise_spread(self, axis, mats: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every matrix's update, each computed by its one owner in the group (see `deal`) and all-gathered."""
        ranks = axis.size * self.tp.size
        me = axis.rank * self.tp.size + self.tp.rank
        owner = deal([tuple(m.shape) for m in mats], ranks)
        sizes = [0] * ranks
        place = []
        for m, r in zip(mats, owner):
            place.append(sizes[r])
            sizes[r] += m.numel()
        if ranks == 1:
            return [muon_update(m, self.ns_steps, self.ns_dtype) for m in mats]
        width = max(sizes)
        buf = torch.zeros(width, device=mats[0].device)
        for m, r, at in zip(mats, owner, place):
            if r == me:
                buf[at:at + m.numel()] = muon_update(m, self.ns_steps, self.ns_dtype).view(-1)
        every = comm.all_gather(comm.all_gather(buf, self.tp, tag=TAG), axis, tag=TAG)
        return [every[r * width + at:r * width + at + m.numel()].view(m.shape) for m, r, at in zip(mats, owner, place)]

    def _apply(self, g: _Group, names, updates, lr: float, wd: float) -> None:
        """Each rank keeps its own slice of every update (TP rows or columns, its experts, its ZeRO shard)."""
        by_name: dict[str, list[torch.Tensor]] = {}
        for n, u in zip(names, updates):
            by_name.setdefault(n, []).append(u)
        flat_of = {}
        for n, p, b, off, k in g.entries:
            us = by_name[n]
            full = torch.stack(us) if p.ndim == 3 else us[0]
            mine = get_spec(p).local_slice(full) if self._tp_split(p) else full
            if b is None:
                apply_update(p.data, mine, lr, wd)
                continue
            if id(b) not in flat_of:
                flat_of[id(b)] = (b, torch.zeros(b.padded, device=b.shard.device, dtype=b.shard.dtype))
            flat_of[id(b)][1][off:off + k] = mine.reshape(-1)
        for b, flat in flat_of.values():
            lo = b.axis.rank * b.per
            apply_update(b.shard.data, flat[lo:lo + b.per], lr, wd)
