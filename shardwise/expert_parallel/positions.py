"""Where each routed expert row sits in the single device's order: its global token and its row within its expert.

The single device flattens a microbatch's tokens [B·S] in order, and each expert's rows are its tokens in that order
(the dispatcher's stable sort by expert). A layout rank routes only its tokens (its dp rows, its cp cut of each
sequence, its tp chunk under SP), so an expert's rows on the rank that computes it are a routing-dependent subset,
grouped by source rank. Their single-device positions follow from counts alone:

1. `token_ids`: the global token id of each of this rank's flattened MoE rows (layout arithmetic, no communication).
   They form runs of consecutive ids (a sequence's piece); every rank holding tokens holds the same number of runs.
2. `expert_rows`: per (run, expert) counts, all-gathered over the token-holding axes (dp×cp, and tp under SP); an
   exclusive prefix sum over the runs in token order gives each run's first row within each expert; a row's position
   is that plus its rank within its run. The positions (and, where asked, token ids) travel with the rows through
   the ep dispatch's all-to-all and its regroup, so the rank computing an expert holds each row's single-device
   position.

Used in training where `--fp8 blockwise|mxfp8` tiles an expert's rows along the tokens and those tiles span ranks
(`fp8.scaling.TokenTiles`, tag `fp8_positions`, counted by `planner.fp8.positions_microbatch`), and by verify's FP8
replay to place the routed experts' operands (tag `verify`).

Dropless routing only: under a capacity factor each rank drops by its own counts, which the single device does not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm
from ..context_parallel.sharding import shard_sequence
from .dispatch import DispatchHandle, all_to_all_rows


@dataclass(frozen=True)
class TokenLayout:
    """How a rank's flattened MoE rows sit in the single device's microbatch: `dp` rows of `micro_batch` sequences
    of `seq_len` tokens, each sequence cut over `cp` (`cp_order`) and, under SP, that cut chunked over `tp`. `axes`:
    the mesh axes over which ranks hold different tokens (dp×cp, and tp under SP)."""

    seq_len: int
    dp: tuple[int, int] = (0, 1)
    cp: tuple[int, int] = (0, 1)
    cp_order: str = "balanced"
    sp: tuple[int, int] = (0, 1)
    axes: tuple = ()

    @classmethod
    def of(cls, mesh, seq_len: int, cp_order: str, sequence_parallel: bool) -> "TokenLayout":
        dp, cp, tp = mesh["dp"], mesh["cp"], mesh["tp"]
        sp = sequence_parallel and tp.active
        return cls(seq_len, (dp.rank, dp.size), (cp.rank, cp.size), cp_order, (tp.rank, tp.size) if sp else (0, 1),
                   (mesh["dp_cp"], tp) if sp else (mesh["dp_cp"],))

    def max_runs(self, n_tokens: int) -> int:
        """The runs of consecutive token ids `n_tokens` local rows are gathered as: two per local sequence under cp
        (the balanced cut's two pieces; a contiguous cut pads its one, so the bytes the planner counts do not depend
        on --cp-order), else one; at least one, so every rank gathers alike."""
        local = self.seq_len // (self.cp[1] * self.sp[1])
        per = 2 if self.cp[1] > 1 else 1
        return max(1, -(-n_tokens // local) * per)


def token_ids(lay: TokenLayout, micro_batch: int, device=None) -> torch.Tensor:
    """[micro_batch · local tokens]: the single device's flat token index (within the microbatch, whose sequences
    are every dp rank's in dp order) of each of this rank's flattened MoE rows, in the order the MoE flattens them."""
    (d, _), (c, n_cp), (t, n_tp) = lay.dp, lay.cp, lay.sp
    rows = d * micro_batch + torch.arange(micro_batch, device=device)
    ids = rows[:, None] * lay.seq_len + torch.arange(lay.seq_len, device=device)[None, :]
    ids = shard_sequence(ids, c, n_cp, lay.cp_order)
    if n_tp > 1:
        ids = ids.chunk(n_tp, dim=1)[t]
    return ids.reshape(-1)


@dataclass
class ExpertRows:
    """The rank's dispatched rows (local-expert-major, as the experts take them): `token`, each row's global token
    id (None unless asked: only a test reads it); `position`, its row within its logical expert in the single
    device's order; `totals` [E], every logical expert's rows over the single device's microbatch."""

    token: torch.Tensor | None
    position: torch.Tensor
    totals: torch.Tensor
    topk: int = 1
    """The routing's k: Σ `totals` = `tokens` × k (dropless)."""
    tokens: int = 0
    """The single device's tokens in the microbatch."""


def _runs(ids: torch.Tensor, n_runs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(run index of each id, first id of each of `n_runs` runs — padded with a sentinel past every id): a run is a
    stretch of consecutive ids. Static shapes only (no boolean indexing), so fake tensors run it (`simulate`); more
    runs than `n_runs` is an index out of range."""
    new = torch.ones_like(ids, dtype=torch.bool)
    new[1:] = ids[1:] != ids[:-1] + 1
    run = torch.cumsum(new.long(), 0) - 1
    starts = torch.full((n_runs,), torch.iinfo(torch.int64).max, dtype=ids.dtype, device=ids.device)
    return run, starts.scatter_reduce_(0, run, ids, "amin")  # a run's ids ascend: its least is its first


def expert_rows(lay: TokenLayout, ids: torch.Tensor, indices: torch.Tensor, handle: DispatchHandle, dispatcher,
                tag: str, with_token: bool = False) -> ExpertRows:
    """The in-expert single-device position (and, `with_token`, the token) of each row this rank's experts receive
    from `handle`'s dispatch of tokens `ids` [N] routed to logical `indices` [N, k]: one all-gather of [runs, E]
    counts per token-holding axis and one all-to-all of the rows' position (and token) over ep, tagged `tag`."""
    n, k = indices.shape
    if dispatcher.capacity_factor is not None:
        raise ValueError("expert row positions need dropless routing (no --moe-capacity-factor)")
    n_experts = dispatcher.n_experts
    n_runs = lay.max_runs(n)
    run, starts = _runs(ids, n_runs)
    flat_e = indices.reshape(-1)
    token = torch.arange(n * k, device=ids.device) // k
    key = run[token] * n_experts + flat_e  # (run, expert) of each assignment
    counts = torch.zeros(n_runs * n_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key))
    # a row's rank within its (run, expert): assignments in flat order are in token order within a run
    order = torch.argsort(key, stable=True)
    seg_start = torch.cumsum(counts, 0) - counts
    within = torch.empty_like(key)
    within[order] = torch.arange(key.numel(), device=ids.device) - seg_start[key[order]]
    table = torch.cat([starts[:, None], counts.view(n_runs, n_experts)], 1)  # [runs, 1 + E]
    mine = torch.arange(n_runs, device=ids.device)  # this rank's runs' rows in the gathered table
    for axis in lay.axes:
        if axis.active:
            mine = mine + axis.rank * table.shape[0]
            table = comm.all_gather(table, axis, tag=tag)
    first = table[:, 0]
    by_start = torch.argsort(first, stable=True)
    per = table[by_start, 1:]
    offset = torch.empty_like(per)
    offset[by_start] = torch.cumsum(per, 0) - per  # rows of each expert in earlier runs
    position = offset[mine].reshape(-1)[key] + within
    perm = handle.order
    sent = torch.stack([position[perm], ids[token[perm]]], 1) if with_token else position[perm][:, None]
    got = all_to_all_rows(sent, dispatcher.axis, handle.in_splits, handle.out_splits, tag)
    if handle.regroup is not None:
        got = got.index_select(0, handle.regroup)
    return ExpertRows(got[:, 1] if with_token else None, got[:, 0], per.sum(0), k,
                      n * lay.dp[1] * lay.cp[1] * lay.sp[1])
