"""Predicted collectives of one rank for one training step, op by op, in shardwise's ledger convention.

Per collective, `bytes` is the payload this rank contributes (all_reduce: the tensor; reduce_scatter:
the full input; all_gather: the local shard; all_to_all: the whole input including the self part;
send/recv: the tensor) and `wire_bytes` what it puts on links under ring algorithms (all_reduce
2(n−1)/n·N, reduce_scatter (n−1)/n·N_in, all_gather (n−1)·N_shard, all_to_all (n−1)/n·N under uniform
routing, p2p N). Axes: tp, pp, cp, dp_cp (dense grads and ZeRO over dp×cp), ep, edp (expert grads).

The tp and dp_cp functions mirror what shardwise's step issues; pp, cp and ep follow the textbook
schedules those axes will implement, each in its own function so it is easy to adjust when they land.
"""
from __future__ import annotations

from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners
from shardwise.planner.models import ModelSpec, Params, local_kv_heads, padded_vocab


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    base = op.split(":")[0]
    if base == "all_reduce":
        w = 2 * (n - 1) * nbytes / n
    elif base in ("reduce_scatter", "all_to_all"):
        w = (n - 1) * nbytes / n
    elif base == "all_gather":
        w = (n - 1) * nbytes
    elif base in ("send", "recv"):
        w = nbytes
    else:
        raise ValueError(f"unknown op {op!r}")
    return int(w) if w == int(w) else w


class CommLedger:
    """axis → op → {count, bytes, wire_bytes} for one rank; `merge` accumulates a scaled copy of another."""

    def __init__(self) -> None:
        self.ops: dict[str, dict[str, dict]] = {}

    def add(self, axis: str, op: str, nbytes: int, group: int, count: int = 1) -> None:
        if group < 2 or count <= 0:
            return
        e = self.ops.setdefault(axis, {}).setdefault(op, {"count": 0, "bytes": 0, "wire_bytes": 0})
        e["count"] += count
        e["bytes"] += count * nbytes
        e["wire_bytes"] += count * wire_bytes(op, nbytes, group)

    def merge(self, other: CommLedger, times: int = 1) -> CommLedger:
        for axis, ops in other.ops.items():
            for op, e in ops.items():
                d = self.ops.setdefault(axis, {}).setdefault(op, {"count": 0, "bytes": 0, "wire_bytes": 0})
                for key in d:
                    d[key] += times * e[key]
        return self

    def per_axis(self, key: str = "bytes") -> dict[str, float]:
        return {axis: sum(e[key] for e in ops.values()) for axis, ops in self.ops.items()}

    def sent_bytes(self, axis: str) -> float:
        """Wire bytes this rank sends on `axis` (links are full duplex, so receives add no time)."""
        return sum(e["wire_bytes"] for op, e in self.ops.get(axis, {}).items() if op != "recv")


def _tokens(lay: Layout, wl: Workload) -> int:
    return lay.mb * (wl.seq_len // lay.cp)


def tp_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """One microbatch's TP collectives: vocab-parallel embedding, 4 per layer, LM head, vocab-parallel CE.

    The embedding output is fp32 (its parameters are), everything inside layers is e bytes.
    """
    t, h, e, n = lay.tp, spec.dim, wl.act_bytes, _tokens(lay, wl)
    full, shard, L = n * h * e, n // t * h * e, stage.n_layers
    if not lay.sp:
        if stage.embedding:
            led.add("tp", "all_reduce", n * h * 4, t)
        led.add("tp", "all_reduce", full, t, 4 * L)  # fwd: wo, w2 outputs; bwd: grads into wq/wk/wv, w1/w3
        if stage.head:
            led.add("tp", "all_reduce", full, t)  # bwd: grad of the head's replicated input
    else:
        if stage.embedding:
            led.add("tp", "reduce_scatter", n * h * 4, t)
            led.add("tp", "all_gather", n // t * h * 4, t)
        led.add("tp", "all_gather", shard, t, 4 * L)  # fwd: before attention and MLP; bwd: the mirrors
        led.add("tp", "reduce_scatter", full, t, 4 * L)
        if stage.head:
            led.add("tp", "all_gather", shard, t)
            led.add("tp", "reduce_scatter", full, t)
    if stage.head:
        led.add("tp", "all_reduce", n * 4, t)  # CE: MAX of the logits
        led.add("tp", "all_reduce", n * 2 * 4, t)  # CE: SUM of exp-sums and target logits


def tp_grad_sync(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, local: Params) -> None:
    """Per-step TP grad reductions: SP-replicated weights (norms, ...) and K/V heads duplicated when n_kv < tp."""
    t = lay.tp
    if lay.sp and local.sp_replicated:
        led.add("tp", "all_reduce", local.sp_replicated * 4, t)
    if not spec.is_mla and spec.n_kv_heads < t and stage.n_layers:
        per_layer = spec.n_kv_heads * spec.head_dim * (spec.dim + (1 if spec.qkv_bias or spec.linear_bias else 0)) * 2
        led.add("tp", "all_reduce", per_layer * stage.n_layers * 4, t)


def _reduce_grads(led: CommLedger, axis: str, numel: int, group: int, zero: int, m: int) -> None:
    if group < 2 or numel == 0:
        return
    padded = -(-numel // group) * group
    if zero == 0:
        led.add(axis, "all_reduce", numel * 4, group)  # may be issued in buckets; bytes are exact
    elif zero in (1, 2):
        led.add(axis, "reduce_scatter", padded * 4, group)
        led.add(axis, "all_gather", padded // group * 4, group)
    else:  # ZeRO-3 / FSDP: gather weights for forward and backward, reduce-scatter grads, every microbatch
        led.add(axis, "all_gather", padded // group * 4, group, 2 * m)
        led.add(axis, "reduce_scatter", padded * 4, group, m)


def dp_grad_sync(led: CommLedger, lay: Layout, local: Params) -> None:
    """Dense grads over dp×cp, expert grads over the expert-data-parallel group, as ZeRO stage `zero` does."""
    g = lay.dp * lay.cp
    _reduce_grads(led, "dp_cp", local.dense, g, lay.zero, lay.m)
    _reduce_grads(led, "edp", local.expert, g // lay.ep, lay.zero, lay.m)


def pp_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Activation forward and its gradient backward across every chunk boundary that leaves this stage.

    Under SP the boundary tensor is the sequence shard (Megatron sends it that way).
    """
    if lay.pp < 2:
        return
    owner, k = chunk_owners(lay), stage.index
    nbytes = _tokens(lay, wl) // (lay.tp if lay.sp else 1) * spec.dim * wl.act_bytes
    out_edges = sum(owner[j] == k and owner[j + 1] != k for j in range(len(owner) - 1))
    in_edges = sum(owner[j + 1] == k and owner[j] != k for j in range(len(owner) - 1))
    led.add("pp", "send", nbytes, lay.pp, out_edges + in_edges)  # activations out, grads back
    led.add("pp", "recv", nbytes, lay.pp, out_edges + in_edges)


def pp_grad_sync(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout) -> None:
    """Tied embeddings on different stages: first and last stage all-reduce the shared matrix's grad."""
    owner = chunk_owners(lay)
    if spec.tie_embeddings and owner[0] != owner[-1] and (stage.embedding or stage.head):
        led.add("pp", "all_reduce", padded_vocab(spec, lay.tp) // lay.tp * spec.dim * 4, 2)


def cp_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Ring attention, per layer: forward passes cp−1 K and cp−1 V blocks on; backward passes the K/V
    blocks round again plus cp−1 dK and cp−1 dV accumulators (e bytes each, this rank's tp shard of the
    K/V heads). Full recompute re-runs the forward ring. Ring backward recomputes the scores block by
    block anyway, so selective recompute adds no traffic.
    """
    c = lay.cp
    if c < 2 or not stage.n_layers:
        return
    blocks = _tokens(lay, wl) * local_kv_heads(spec, lay.tp) * wl.act_bytes
    k_blk, v_blk = blocks * spec.k_dim, blocks * spec.v_dim
    rings = 3 + (1 if lay.recompute == "full" else 0)  # fwd K/V, bwd K/V, bwd dK/dV (+ recomputed fwd)
    for op in ("send", "recv"):
        led.add("cp", op, k_blk, c, rings * (c - 1) * stage.n_layers)
        led.add("cp", op, v_blk, c, rings * (c - 1) * stage.n_layers)


def ep_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Per MoE layer forward: token-count exchange (int64 per expert), dispatch and combine all-to-alls of
    topk·tokens·h·e; backward: dispatch and combine again. Tokens are this rank's sequence shard (s/cp,
    and s/cp/tp under SP, where each tp rank routes its own shard).
    """
    if lay.ep < 2 or not stage.n_moe:
        return
    tokens = _tokens(lay, wl) // (lay.tp if lay.sp else 1)
    payload = spec.topk * tokens * spec.dim * wl.act_bytes
    led.add("ep", "all_to_all", spec.n_experts * 8, lay.ep, stage.n_moe)
    led.add("ep", "all_to_all", payload, lay.ep, 4 * stage.n_moe)


def step_comm(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, local: Params) -> tuple[CommLedger, CommLedger, CommLedger]:
    """Ledgers of one rank of `stage`: (one microbatch, once-per-step grad sync, whole step = m·mb + sync)."""
    mb = CommLedger()
    if lay.tp > 1:
        tp_microbatch(mb, spec, stage, lay, wl)
    pp_microbatch(mb, spec, stage, lay, wl)
    cp_microbatch(mb, spec, stage, lay, wl)
    ep_microbatch(mb, spec, stage, lay, wl)
    sync = CommLedger()
    if lay.tp > 1:
        tp_grad_sync(sync, spec, stage, lay, local)
    pp_grad_sync(sync, spec, stage, lay)
    dp_grad_sync(sync, lay, local)
    return mb, sync, CommLedger().merge(mb, lay.m).merge(sync)
