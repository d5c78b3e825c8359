"""Predicted collectives of one rank for one training step, op by op, in shardwise's ledger convention.

Per collective, `bytes` is the payload this rank contributes (all_reduce: the tensor; reduce_scatter:
the full input; all_gather: the local shard; all_to_all: the whole input including the self part;
send: the tensor; recv: 0, only counted) and `wire_bytes` what it puts on links under ring algorithms, from
`rules.wire` as the comm layer records them (all-to-alls under uniform routing). Wire bytes are accumulated
unrounded and rounded once on output, as the ledger does. Axes: tp, pp, cp, dp_cp (dense grads and ZeRO over
dp×cp), ep, edp (expert grads); under hybrid sharding dp_shard (ZeRO 2/3 over S·cp) and dp_replicate (the
shard gradients' all-reduce).

Every function mirrors what shardwise's training step issues, op name and tag included, and
tests/test_planner_ledger.py checks the prediction against the ledger of real CPU runs (tp, SP, dp with
ZeRO 0/1, 1F1B and interleaved pp, ring and Ulysses cp, ep with tiny-moe, and a dp×tp×pp mix) exactly.
Tagged MoE ops are predicted under their tags (`all_to_all:counts|dispatch|combine|combine_grad|
dispatch_grad`, `all_reduce:aux_loss`, `all_reduce:moe_bias`); the all-to-alls' payloads follow the
routing, so for combine and dispatch_grad (and every routed op's wire bytes) the prediction is the
balanced value, which the mean over an ep group's ranks always equals (every row sent is received).
Under --fp8 blockwise / mxfp8 where a routed expert's token tiles span ranks, the experts' position exchange
(`all_gather:fp8_positions` on dp_cp and tp, `all_to_all:fp8_positions` on ep) and their tile amaxes
(`all_reduce:fp8_amax`) are counted by `planner.fp8` (tests/test_fp8_moe_sp.py). Two bookkeeping tags are left out: `all_reduce:metrics` (the logged loss and MoE load numbers) and
`all_reduce:grad_norm` (one scalar per reduction group), a few bytes per step.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from shardwise.rules.buckets import cut_runs
from shardwise.rules.wire import wire_bytes
from shardwise.planner import gpt_oss, linear_attention, moe_skew, sparse_attention
from shardwise.planner.fp8 import fp8_microbatch, sp_wire_gathers, wire_activations, wire_gathers
from shardwise.planner.fp8_grad import fp8_grad_sums, fp8_spec
from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners, recomputed_layer_ids, stage_layer_ids
from shardwise.planner.tp_overlap import chunks
from shardwise.planner.memory import BYTES_GRAD, stage_tensors, stage_unit_entries, zero_buckets
from shardwise.planner.models import ModelSpec, Params, local_kv_heads, padded_vocab
from shardwise.planner.muon import muon_comm, qk_clip_comm
from shardwise.planner.zero3_gathers import bucket_gathers


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
    """One microbatch's TP collectives: vocab-parallel embedding, 2 per TP region and pass, LM head, CE.

    A dense layer has two TP regions (attention, MLP); an MoE layer only attention, since shardwise
    replicates the MoE block over tp (its input is the norm output, or under SP the sequence shard).
    Dtypes follow the residual stream (r bytes: bf16 under bf16 activations, fp32 with --fp32-residual):
    a region's entry (f, or SP's all-gather) carries the norm output forward and its gradient back; its
    exit (g, or SP's reduce-scatter) the e-byte row-parallel output forward and an e-byte gradient back. The embedding output and the LM head's input are r bytes; CE statistics fp32.
    """
    t, h, e, n = lay.tp, spec.dim, wl.act_bytes, _tokens(lay, wl)
    r = wl.resid_bytes
    regions = 2 * stage.n_dense + stage.n_moe
    if not lay.sp:
        if stage.embedding:
            led.add("tp", "all_reduce", n * h * r, t)
        led.add("tp", "all_reduce", n * h * e, t, regions)  # fwd: wo, w2 outputs
        led.add("tp", "all_reduce", n * h * r, t, regions)  # bwd: grads into wq/wk/wv, w1/w3 inputs
        if stage.head:
            led.add("tp", "all_reduce", n * h * r, t)  # bwd: grad of the head's replicated input
    else:
        # --tp-overlap cuts every region's (and the head's) collectives into k messages of the same bytes
        k = chunks(t, wl.seq_len // lay.cp // t, lay.tp_overlap)
        if stage.embedding:
            led.add("tp", "reduce_scatter", n * h * r, t)
            led.add("tp", "all_gather", n // t * h * r, t)
        if wire_activations(lay, wl):  # --fp8-all-gather: the entries' gathers in FP8 (planner/fp8.py)
            sp_wire_gathers(led, spec, lay, wl, regions)
        else:
            led.add("tp", "all_gather", n // t * h * r, t, regions, k * regions)  # fwd: before attention and MLP
        led.add("tp", "all_gather", n // t * h * e, t, regions, k * regions)  # bwd: mirrors of the exits
        led.add("tp", "reduce_scatter", n * h * e, t, regions, k * regions)  # fwd: wo, w2 outputs
        led.add("tp", "reduce_scatter", n * h * r, t, regions, k * regions)  # bwd: mirrors of the entries
        if stage.head:
            led.add("tp", "all_gather", n // t * h * r, t, 1, k)
            led.add("tp", "reduce_scatter", n * h * r, t, 1, k)
    (dense, moe), _ = stage.recompute_split(lay)
    if lay.recompute == "full" and dense + moe:
        # The recomputed forward (of every layer, or under --recompute-layers of the first N of each chunk)
        # repeats every region entry, and every exit but the block's last: torch's
        # checkpoint stops recomputing once the last saved tensor is rebuilt, and nothing after the
        # MLP's exit is saved — unless residual dropout saves its mask there (an MoE block's last TP
        # collective is its attention exit).
        # Under --tp-overlap the MLP's exit is one autograd node with the GEMM whose input it saves: replayed too.
        regions = 2 * dense + moe
        exits = regions if spec.dropout > 0 or (lay.sp and lay.tp_overlap) else dense + moe
        if lay.sp:
            k = chunks(t, wl.seq_len // lay.cp // t, lay.tp_overlap)
            if wire_activations(lay, wl):
                sp_wire_gathers(led, spec, lay, wl, regions)
            else:
                led.add("tp", "all_gather", n // t * h * r, t, regions, k * regions)
            led.add("tp", "reduce_scatter", n * h * e, t, exits, k * exits)
        else:
            led.add("tp", "all_reduce", n * h * e, t, exits)
    if spec.qk_norm_full and t > 1:
        # MiniMax-M2's width q/k norms (models/qk_norm.py): per attention layer, q's and k's [n, 1] fp32 sums of
        # squares all-reduced forward and their gradients backward; full recompute repeats the forward pair
        led.add("tp", "all_reduce", n * 4, t, 4 * (stage.n_dense + stage.n_moe) + 2 * (dense + moe) * (
            lay.recompute == "full"))
    if stage.head:
        led.add("tp", "all_reduce", n * 4, t)  # CE: MAX of the logits
        led.add("tp", "all_reduce", n * 2 * 4, t)  # CE: SUM of exp-sums and target logits


def tp_grad_sync(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout) -> None:
    """Per-step TP grad reductions (`GradReducer._reduce_tp`), from the gradients `memory.stage_unit_entries` marks
    TP-partial (MTP's blocks included): one flat all-reduce of the summed ones (under SP every replicated weight fed
    sequence shards — norms, and the whole MoE block; under any tp the head-partial weights), and one of the K/V
    heads kept whole when n_kv < tp, as an [n_kv_heads, local K/V gradients] buffer."""
    t = lay.tp
    tp_sum = kv = 0
    for _, name, rows in stage_unit_entries(spec, stage, lay):
        if name.partition(".")[0] in ("layers", "mtp", "norm"):  # not the emb-summed copies of the embedding
            for p, x, partial in rows:
                if partial:
                    kv += x.numel if x.whole_head else 0
                    tp_sum += 0 if x.whole_head else x.numel
    if tp_sum:
        led.add("tp", "all_reduce", tp_sum * 4, t)
    if kv:
        led.add("tp", "all_reduce", spec.n_kv_heads * kv * 4, t)


@lru_cache(maxsize=4096)
def zero0_buckets(spec: ModelSpec, tp: int, ep: int, kinds: tuple[bool, ...], embedding: bool, head: bool,
                  expert: bool = False, linear: tuple[bool, ...] = ()) -> int:
    """All-reduces ZeRO-0 issues for a stage's dense (or expert) grads: its tensors in order, cut by
    `bucket_plan.cut_runs`."""
    stage = Stage(0, len(kinds) - sum(kinds), sum(kinds), embedding, head, kinds, linear=linear)
    tensors = [t for t in stage_tensors(spec, stage, Layout(tp=tp, ep=ep)) if t.expert == expert]
    return sum(1 for _ in cut_runs(tensors, lambda t: BYTES_GRAD * t.numel))


def _reduce_grads(led: CommLedger, axis: str, groups: list[int], group: int, m: int, buckets: int = 1,
                  gb: int = 4) -> None:
    """ZeRO-0's bucketed all-reduce of one reduction group's grads (`gb` bytes each: --grad-reduce-dtype)."""
    if group < 2 or not any(groups):
        return
    led.add(axis, "all_reduce", sum(groups) * gb, group, pieces=buckets)


def dp_grad_sync(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, local: Params, gb: int = 4,
                 wl: Workload | None = None) -> None:
    """Dense grads over dp×cp, expert grads over the expert-data-parallel group, as shardwise's GradReducer:
    ZeRO-0 a bucketed all-reduce; ZeRO ≥ 1 a reduce-scatter per bucket (`zero_buckets`, each padded to a
    multiple of its group) — ZeRO 2/3 every micro-batch — and the parameter all-gathers of the stage."""
    g, ge = lay.dp * lay.cp, lay.dp * lay.cp // lay.ep
    kinds = stage.kinds or (False,) * stage.n_dense + (True,) * stage.n_moe

    def buckets(expert: bool, group: int) -> int:
        if lay.zero or group < 2:
            return 1
        return zero0_buckets(spec, lay.tp, lay.ep, kinds, stage.embedding, stage.head, expert, stage.linear)

    if lay.zero == 0:
        _reduce_grads(led, "dp_cp", [local.dense - local.vectors, local.vectors], g, lay.m, buckets(False, g), gb)
        _reduce_grads(led, "edp", [local.expert], ge, lay.m, buckets(True, ge), gb)
        return
    buckets = zero_buckets(spec, stage, lay)
    gathers = bucket_gathers(spec, stage, lay) if lay.zero >= 3 else [1] * len(buckets)
    wire = wire_gathers(led, spec, stage, lay, wl, buckets, gathers) if wl else [False] * len(buckets)
    for b, n, fp8 in zip(buckets, gathers, wire):
        if not b.numel:
            continue
        # ZeRO 2/3 reduce-scatter every micro-batch, except buckets waiting for a TP sum (once per step)
        led.add(b.axis, "reduce_scatter", b.padded * gb, b.group, 1 if lay.zero == 1 or b.deferred else lay.m)
        # ZeRO 1/2 gather the updated parameters once; ZeRO-3 gathers a unit whenever a hold or prefetch finds it
        # freed: twice per micro-batch and chunk, more for MTP's head and embedding (`zero3_gathers`)
        if not fp8:  # an FP8 bucket's gathers are booked by `wire_gathers`
            led.add(b.axis, "all_gather", b.shard * 4, b.group, n)
        if b.axis == "dp_shard":  # hybrid sharding: the fp32 shard gradient summed over the replicas, once
            led.add("dp_replicate", "all_reduce", b.shard * 4, lay.replicas)


def pp_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Per microbatch, every chunk boundary leaving this stage sends the activation forward, and every
    boundary entering it sends the gradient back; receives are counted with 0 bytes, as the ledger does.
    Under SP the boundary tensor is the sequence shard [mb, s/cp/tp, h].
    """
    if lay.pp < 2:
        return
    nbytes = _tokens(lay, wl) // (lay.tp if lay.sp else 1) * spec.dim * wl.resid_bytes  # the residual stream's dtype
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
    """Tied embeddings (or MTP's embedding copy) on different ranks: the first and last stage all-reduce the shared matrix's fp32
    grad (this rank's vocab shard) over their two-rank "emb" group, once per step; none when one rank
    holds both ends (dualpipev)."""
    owner = chunk_owners(lay)
    if (spec.tie_embeddings or spec.mtp_layers) and owner[0] != owner[-1] and (stage.embedding or stage.head):
        led.add("emb", "all_reduce", padded_vocab(spec, lay.tp) // lay.tp * spec.dim * 4, 2)


def _cp_head_dims(spec: ModelSpec) -> tuple[int, int]:
    """K and V head sizes context parallelism moves: MLA pads the narrower of q/k and v to the other's size."""
    if spec.is_mla:
        d = max(spec.k_dim, spec.v_dim)
        return d, d
    return spec.k_dim, spec.v_dim


def cp_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Ring attention, per layer: forward passes cp−1 K and cp−1 V blocks on; backward passes the K/V
    blocks round again plus cp−1 dK and cp−1 dV accumulators (e bytes each, this rank's tp shard of the
    K/V heads). Selective and full recompute re-run the forward ring (the ring is the attention core).
    Ulysses: see `ulysses_microbatch`.
    """
    c = lay.cp
    if c < 2 or not stage.n_layers:
        return
    linear, linear_again = linear_attention.held_layers(stage, lay)  # Gated DeltaNet: its state maps, no ring
    linear_attention.cp_comm(led, spec, lay, wl, linear, linear_again if lay.recompute == "full" else 0)
    if spec.is_dsa:  # DeepSeek Sparse Attention gathers latents and indexer keys instead of a ring or all-to-all
        full_again = sum(stage.recompute_split(lay)[0]) if lay.recompute == "full" else 0
        sparse_attention.cp_comm(led, spec, lay, wl, stage.n_layers, full_again)
        return
    if lay.cp_impl == "ulysses":
        ulysses_microbatch(led, spec, stage, lay, wl)
        return
    blocks = _tokens(lay, wl) * local_kv_heads(spec, lay.tp) * wl.act_bytes
    dk, dv = _cp_head_dims(spec)
    k_blk, v_blk = blocks * dk, blocks * dv
    # the recomputed attention layers re-run their ring (a recomputed linear layer gathers instead, above)
    again = sum(stage.recompute_split(lay)[0]) - linear_again if lay.recompute != "none" else 0
    # per attention layer the ring's hops: cp − 1, fewer for a sliding window the ring stops short of (gpt_oss);
    # a recomputed sliding layer's forward ring stops as short again
    ids = stage_layer_ids(spec, lay)[stage.index] if spec.sliding_layers else None
    hops = gpt_oss.ring_hops(spec, lay, wl, ids, stage.n_layers - linear)
    chosen = recomputed_layer_ids(spec, lay)
    hops_again = gpt_oss.ring_hops(spec, lay, wl, ids and [i for i in ids if i in chosen], again)
    n = 3 * hops + hops_again  # fwd K/V, bwd K/V, bwd dK/dV (+ the recomputed layers' fwd)
    led.add("cp", "send", k_blk, c, n)
    led.add("cp", "send", v_blk, c, n)
    led.add("cp", "recv", 0, c, 2 * n)


def ulysses_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """DeepSpeed-Ulysses, per layer: forward one equal-split all-to-all each for q, k, v (sequence → head
    shards) and the output (back), backward the same four on their grads (each the input tensor, e bytes:
    b·heads·s/cp·d on this tp rank; K/V heads replicated cp/hkv times when hkv < cp). Full recompute
    repeats the forward four; selective only q, k and v's (checkpoint stops recomputing the core once
    its last saved tensor is rebuilt, before the output's all-to-all).
    """
    c, t = lay.cp, lay.tp
    n, e = _tokens(lay, wl), wl.act_bytes
    hq, hkv = spec.n_heads // t, local_kv_heads(spec, t)
    rep = c // hkv if hkv % c else 1
    linear, linear_again = linear_attention.held_layers(stage, lay)
    L = stage.n_layers - linear  # Gated DeltaNet layers run no all-to-all
    again = sum(stage.recompute_split(lay)[0]) - linear_again if lay.recompute != "none" else 0
    qkv = 2 * L + again  # fwd, bwd (+ the recomputed layers' fwd)
    dk, dv = _cp_head_dims(spec)
    led.add("cp", "all_to_all", n * hq * dk * e, c, qkv)  # q, dq
    led.add("cp", "all_to_all", n * hkv * rep * dk * e, c, qkv)  # k, dk
    led.add("cp", "all_to_all", n * hkv * rep * dv * e, c, qkv)  # v, dv
    led.add("cp", "all_to_all", n * hq * dv * e, c, 2 * L + (again if lay.recompute == "full" else 0))  # out, d_out


def ep_microbatch(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> None:
    """Per MoE layer and microbatch, on the ep axis (shardwise's AllToAllDispatcher, dropless):
    forward `all_to_all:counts` (int64 per expert), `:dispatch` (the n·k assigned rows, in the residual's dtype) and
    `:combine` (the expert outputs coming back); backward `:combine_grad` (n·k rows) and `:dispatch_grad`.
    n is this rank's routed tokens: s/cp, or s/cp/tp under SP (each tp rank routes its own shard; without
    SP every tp rank routes — and dispatches — the same tokens). combine and dispatch_grad carry the rows
    this rank's experts received, n·k under balanced routing (the ep group's mean, whatever the routing).
    Router statistics: with the aux/z loss on, one `all_reduce:aux_loss` of (E+1) fp32 per MoE forward
    over every axis holding other tokens of the microbatch (dp×cp, and tp under SP).
    """
    if not stage.n_moe:
        return
    tokens = _tokens(lay, wl) // (lay.tp if lay.sp else 1)
    L = stage.n_moe
    # full recompute repeats the recomputed blocks' forward, router statistics included
    fwd = L + (stage.recompute_split(lay)[0][1] if lay.recompute == "full" else 0)
    if spec.aux_loss:
        for axis, group in (("dp_cp", lay.dp * lay.cp), ("tp", lay.tp if lay.sp else 1)):
            led.add(axis, "all_reduce:aux_loss", (spec.moe_experts + 1) * 4, group, fwd)
    if lay.ep < 2:
        return
    rows = moe_skew.kept_rows(spec, lay, wl, tokens) * spec.dim  # what this rank sends: its kept assignments
    got = moe_skew.busiest_rows(spec, lay, wl, tokens) * spec.dim  # what the (busiest) rank's experts received
    led.add("ep", "all_to_all:counts", spec.moe_experts * 8, lay.ep, fwd)
    led.add("ep", "all_to_all:dispatch", rows * wl.resid_bytes, lay.ep, fwd)
    led.add("ep", "all_to_all:combine", got * wl.act_bytes, lay.ep, fwd)
    led.add("ep", "all_to_all:combine_grad", rows * wl.act_bytes, lay.ep, L)
    led.add("ep", "all_to_all:dispatch_grad", got * wl.resid_bytes, lay.ep, L)


def moe_grad_sync(led: CommLedger, spec: ModelSpec, stage: Stage, lay: Layout) -> None:
    """Once per step, every MoE layer's router sums its selection counts (E fp32) over the token axes for
    the loss-free bias update (`all_reduce:moe_bias`; issued whether or not the bias rate is 0)."""
    if stage.n_moe:
        for axis, group in (("dp_cp", lay.dp * lay.cp), ("tp", lay.tp if lay.sp else 1)):
            led.add(axis, "all_reduce:moe_bias", spec.moe_experts * 4, group, stage.n_moe)


def step_comm(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, local: Params) -> tuple[CommLedger, CommLedger, CommLedger]:
    """Ledgers of one rank of `stage`: (one microbatch, once-per-step grad sync, whole step = m·mb + sync).

    The whole-step ledger is the prediction to compare with shardwise's measured per-rank ledger, op by op.
    """
    mb, sync = stage_ledgers(spec, stage, lay, wl, local)
    return mb, sync, whole_step(mb, sync, lay.m)


def mtp_stages(spec: ModelSpec, stage: Stage) -> list[Stage]:
    """DeepSeek-V3's MTP modules on the last stage (planner/mtp.py), each communicating as a one-block stage
    with an embedding lookup, an LM head and a cross-entropy; never recomputed."""
    if not (stage.head and spec.mtp_layers):
        return []
    kinds = [spec.is_moe_layer(spec.n_layers + k) for k in range(spec.mtp_layers)]
    return [Stage(stage.index, int(not moe), int(moe), True, True, (moe,)) for moe in kinds]


def stage_ledgers(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, local: Params) -> tuple[CommLedger, CommLedger]:
    spec = fp8_spec(spec, wl)
    mb = CommLedger()
    eager = replace(lay, recompute="none")
    for st, ly in [(stage, lay)] + [(m, eager) for m in mtp_stages(spec, stage)]:
        if lay.tp > 1:
            tp_microbatch(mb, spec, st, ly, wl)
        if st is stage:
            pp_microbatch(mb, spec, st, ly, wl)
        cp_microbatch(mb, spec, st, ly, wl)
        ep_microbatch(mb, spec, st, ly, wl)
        if wl.fp8:
            fp8_microbatch(mb, spec, st, ly, wl)
            fp8_grad_sums(mb, spec, st, ly, wl)
    sync = CommLedger()
    if lay.tp > 1:
        # one flat all-reduce, the MTP blocks' TP-partial gradients (MLA's down-projections) included
        tp_grad_sync(sync, spec, stage, lay)
    pp_grad_sync(sync, spec, stage, lay)
    dp_grad_sync(sync, spec, stage, lay, local, wl.grad_reduce_bytes, wl)
    for st in [stage] + mtp_stages(spec, stage):
        moe_grad_sync(sync, spec, st, lay)
    if wl.optimizer == "muon":
        muon_comm(sync, spec, stage, lay)
    if wl.muon_qk_clip:
        qk_clip_comm(sync, spec, stage.n_dense + stage.n_moe + len(mtp_stages(spec, stage)), lay)
    return mb, sync


def whole_step(mb: CommLedger, sync: CommLedger, m: int) -> CommLedger:
    return CommLedger().merge(mb, m).merge(sync)
