"""Predicted collectives of one rank for one training step, op by op, in shardwise's ledger convention.

Per collective, `bytes` is the payload this rank contributes (all_reduce: the tensor; reduce_scatter:
the full input; all_gather: the local shard; all_to_all: the whole input including the self part;
send: the tensor; recv: 0, only counted) and `wire_bytes` what it puts on links under ring algorithms
(all_reduce 2(n−1)/n·N, reduce_scatter (n−1)/n·N_in, all_gather (n−1)·N_shard, all_to_all (n−1)/n·N
under uniform routing, send N). Wire bytes are accumulated unrounded and rounded once on output, as the
ledger does. Axes: tp, pp, cp, dp_cp (dense grads and ZeRO over dp×cp), ep, edp (expert grads).

The tp and dp_cp functions mirror what shardwise's step issues; pp, cp and ep follow the textbook
schedules those axes will implement, each in its own function so it is easy to adjust when they land.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners
from shardwise.planner.memory import stage_tensors
from shardwise.planner.models import ModelSpec, Params, local_kv_heads, padded_vocab


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank puts on links for one collective of payload `nbytes` in a group of `n` (ring algorithms)."""
    base = op.split(":")[0]
    if base == "all_reduce":
        return 2 * (n - 1) * nbytes / n
    if base in ("reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes / n
    if base == "all_gather":
        return float((n - 1) * nbytes)
    if base == "send":
        return float(nbytes)
    if base == "recv":
        return 0.0  # the ledger counts receives but books their bytes on the sender
    raise ValueError(f"unknown op {op!r}")


class CommLedger:
    """axis → op → [count, bytes, wire_bytes] for one rank; `merge` accumulates a scaled copy of another."""

    def __init__(self) -> None:
        self.ops: dict[str, dict[str, list]] = {}

    def add(self, axis: str, op: str, nbytes: int, group: int, count: int = 1, pieces: int | None = None) -> None:
        """`count` collectives of `nbytes` each; `pieces` instead splits one logical op's bytes over that many."""
        if group < 2 or count <= 0:
            return
        e = self.ops.setdefault(axis, {}).setdefault(op, [0, 0, 0.0])
        e[0] += pieces or count
        e[1] += count * nbytes
        e[2] += count * wire_bytes(op, nbytes, group)

    def merge(self, other: CommLedger, times: int = 1) -> CommLedger:
        for axis, ops in other.ops.items():
            for op, e in ops.items():
                d = self.ops.setdefault(axis, {}).setdefault(op, [0, 0, 0.0])
                for i in range(3):
                    d[i] += times * e[i]
        return self

    def as_dict(self) -> dict:
        """{axis: {op: {count, bytes, wire_bytes}}} with wire bytes rounded once, as shardwise's ledger does."""
        return {axis: {op: {"count": c, "bytes": b, "wire_bytes": round(w)} for op, (c, b, w) in ops.items()}
                for axis, ops in self.ops.items()}

    def per_axis(self, key: str = "bytes") -> dict[str, int]:
        i = {"count": 0, "bytes": 1, "wire_bytes": 2}[key]
        return {axis: round(sum(e[i] for e in ops.values())) for axis, ops in self.ops.items()}

    def sent_bytes(self, axis: str) -> float:
        """Wire bytes this rank sends on `axis` (links are full duplex, so receives add no time)."""
        return sum(e[2] for op, e in self.ops.get(axis, {}).items() if op != "recv")


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


BUCKET_BYTES = 25 * 2**20
"""shardwise.data_parallel.BUCKET_BYTES: ZeRO-0 closes an all-reduce bucket once it holds this much."""


@lru_cache(maxsize=4096)
def zero0_buckets(spec: ModelSpec, tp: int, ep: int, n_dense: int, n_moe: int, embedding: bool, head: bool) -> int:
    """All-reduces ZeRO-0 issues for a stage's dense grads: its tensors in order, 25 MiB buckets."""
    stage = Stage(0, n_dense, n_moe, embedding, head)
    count = size = held = 0
    for t in stage_tensors(spec, stage, Layout(tp=tp, ep=ep)):
        if t.expert:
            continue
        size, held = size + 4 * t.numel, held + 1
        if size >= BUCKET_BYTES:
            count, size, held = count + 1, 0, 0
    return count + (1 if held else 0)


def _reduce_grads(led: CommLedger, axis: str, groups: list[int], group: int, zero: int, m: int,
                  buckets: int = 1) -> None:
    """fp32 grads of one reduction group; `groups` are the numels of shardwise's flat optimizer buffers."""
    if group < 2 or not any(groups):
        return
    if zero == 0:
        led.add(axis, "all_reduce", sum(groups) * 4, group, pieces=buckets)
        return
    for numel in filter(None, groups):
        padded = -(-numel // group) * group
        if zero in (1, 2):
            led.add(axis, "reduce_scatter", padded * 4, group)
            led.add(axis, "all_gather", padded // group * 4, group)
        else:  # ZeRO-3 / FSDP: gather weights for forward and backward, reduce-scatter grads, every microbatch
            led.add(axis, "all_gather", padded // group * 4, group, 2 * m)
            led.add(axis, "reduce_scatter", padded * 4, group, m)


def dp_grad_sync(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, local: Params) -> None:
    """Dense grads over dp×cp, expert grads over the expert-data-parallel group, as shardwise's GradReducer:
    ZeRO-0 a bucketed all-reduce; ZeRO-1 a reduce-scatter and, after the update, an all-gather per flat
    buffer (matrices, then norms/biases), each padded to a multiple of the group size."""
    g = lay.dp * lay.cp
    buckets = zero0_buckets(spec, lay.tp, lay.ep, stage.n_dense, stage.n_moe, stage.embedding, stage.head) \
        if lay.zero == 0 and g > 1 else 1
    _reduce_grads(led, "dp_cp", [local.dense - local.vectors, local.vectors], g, lay.zero, lay.m, buckets)
    _reduce_grads(led, "edp", [local.expert], g // lay.ep, lay.zero, lay.m)


PP_BOUNDARY_BYTES = 4
"""Bytes per element of what stages exchange: shardwise's residual stream stays fp32 under bf16 autocast,
and its pipeline executor sends float32 activations and gradients."""


def pp_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Per microbatch, every chunk boundary leaving this stage sends the activation forward, and every
    boundary entering it sends the gradient back; receives are counted with 0 bytes, as the ledger does.
    Under SP the boundary tensor is the sequence shard [mb, s/cp/tp, h].
    """
    if lay.pp < 2:
        return
    nbytes = _tokens(lay, wl) // (lay.tp if lay.sp else 1) * spec.dim * PP_BOUNDARY_BYTES
    out_edges, in_edges = stage_edges(chunk_owners(lay), lay.pp)[stage.index]
    led.add("pp", "send", nbytes, lay.pp, out_edges + in_edges)  # activations out, grads back
    led.add("pp", "recv", 0, lay.pp, out_edges + in_edges)


def stage_edges(owner: list[int], pp: int) -> list[tuple[int, int]]:
    """Per stage: (chunk boundaries leaving it, boundaries entering it) along the model's chunk order."""
    out, inn = [0] * pp, [0] * pp
    for a, b in zip(owner, owner[1:]):
        if a != b:
            out[a] += 1
            inn[b] += 1
    return list(zip(out, inn))


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
    n = rings * (c - 1) * stage.n_layers
    led.add("cp", "send", k_blk, c, n)
    led.add("cp", "send", v_blk, c, n)
    led.add("cp", "recv", 0, c, 2 * n)


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
    """Ledgers of one rank of `stage`: (one microbatch, once-per-step grad sync, whole step = m·mb + sync).

    The whole-step ledger is the prediction to compare with shardwise's measured per-rank ledger, op by op.
    """
    mb, sync = stage_ledgers(spec, stage, lay, wl, local)
    return mb, sync, whole_step(mb, sync, lay.m)


def stage_ledgers(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, local: Params) -> tuple[CommLedger, CommLedger]:
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
    dp_grad_sync(sync, spec, stage, lay, local)
    return mb, sync


def whole_step(mb: CommLedger, sync: CommLedger, m: int) -> CommLedger:
    return CommLedger().merge(mb, m).merge(sync)
