"""One layout's prediction: memory per rank, FLOPs, communication, pipeline bubble, step time and MFU.

FLOPs are `rules.flops`' (Narayanan et al. 2021 generalised to the model's real projections), the count the
training run's MFU uses too; here split per stage and tp rank.

The step-time model is deliberately simple and its knobs are flags (`Assumptions`): compute runs at a
fixed fraction of peak; TP, EP and PP traffic sits on the critical path of every microbatch; CP ring
traffic hides behind the attention it feeds; the pipeline stretches m microbatches by 1/(1−bubble);
gradient reduction after backward is exposed (shardwise does it after the last microbatch) unless
--dp-overlap says otherwise; the optimizer step streams 28 bytes per updated parameter through HBM.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from shardwise.rules import flops
from shardwise.rules.flops import layer_flops_per_token, linear_layer_delta, mtp_flops_per_token
from shardwise.planner import gpt_oss, linear_attention, moe_skew
from shardwise.planner.comm_model import stage_edges, stage_ledgers, whole_step
from shardwise.planner.errors import PlanError
from shardwise.planner.fp8 import amax_seconds
from shardwise.planner.fp8_grad import fp8_spec
from shardwise.planner.hardware import Cluster, spans_link
from shardwise.planner.layout import (
    Layout, Workload, chunk_owners, group_size, group_spans, recomputed_layer_ids, stage_layer_ids, stages,
)
from shardwise.planner.activations import ACTIVATION_MODELS, stage_activation_bytes
from shardwise.planner.memory import stage_params, static_bytes, zero_buckets
from shardwise.planner.muon import muon_static
from shardwise.planner.models import ModelSpec, active_params, padded_vocab, total_params
from shardwise.planner.peak import peak_terms
from shardwise.planner.schedule import bubble_fraction
from shardwise.planner.tp_overlap import LATENCY_S, Host, choose, exposed_tp

AXES = ("tp", "cp", "pp", "dp_cp", "ep", "edp", "dp_shard", "dp_replicate")
ADAM_STEP_BYTES = 28
"""Read param, grad, two moments (4 bytes each), write param and moments."""


@dataclass(frozen=True)
class Assumptions:
    flops_efficiency: float = 0.6
    """Achievable fraction of peak dense FLOP/s for the model's kernels."""
    link_efficiency: float = 0.8
    """Achievable fraction of link bandwidth for collectives (NCCL bus bandwidth vs peak)."""
    dp_overlap: float = 0.0
    """Fraction of gradient-reduction time hidden behind backward (0: shardwise reduces after it)."""
    usable_memory: float = 0.9
    """Fraction of GPU memory the planner may fill (the rest: CUDA context, NCCL buffers, fragmentation)."""
    activation_model: str = "shardwise"
    """'shardwise' (what its implementation saves, checked against real runs) or 'korthikanti' (the paper)."""
    tp_overlap: bool = False
    """Under SP, the layers' TP collectives run in tp chunks under the GEMMs (tp_overlap.py); a layout from a train
    command with --tp-overlap says so itself."""

    def __post_init__(self):
        if self.activation_model not in ACTIVATION_MODELS:
            raise PlanError(f"activation model {self.activation_model!r}; valid: {', '.join(ACTIVATION_MODELS)}")


def peak_flops(cluster: Cluster, wl: Workload) -> float:
    return flops.peak_flops(cluster.gpu, wl.precision)


def fp8_peak(cluster: Cluster, wl: Workload) -> float | None:
    """The GPU's dense FP8 peak under --fp8 (None without it); a GPU without FP8 is a PlanError."""
    if not wl.fp8:
        return None
    try:
        return flops.fp8_peak_flops(cluster.gpu)
    except ValueError as e:
        raise PlanError(str(e)) from None


@lru_cache(maxsize=256)
def model_flops(spec: ModelSpec, wl: Workload, recompute: str = "none", recomputed: frozenset | None = None) -> float:
    """`rules.flops.model_flops` of one step of `wl` (cached: the search asks per layout)."""
    return flops.model_flops(spec, wl.seq_len, wl.global_batch, recompute, recomputed)


@lru_cache(maxsize=8192)
def axis_links(dp: int, pp: int, cp: int, tp: int, ep: int, domain: int, dp_shard: int | None = None) -> dict:
    """Link each axis rides: a group crossing any scale-up domain boundary is limited by the network."""
    lay = Layout(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, dp_shard=dp_shard)
    if domain >= lay.world_size:
        return {a: "nvlink" if group_size(lay, a) > 1 else None for a in AXES}
    return {a: spans_link(group_spans(lay, a), group_size(lay, a), domain) for a in AXES}


def memory_by_stage(spec: ModelSpec, lay: Layout, wl: Workload, activation_model: str = "shardwise") -> list[dict]:
    """Per pipeline stage: its Stage, local Params, static breakdown, activation and total bytes."""
    spec = fp8_spec(spec, wl)
    out, seen = [], {}
    for st in stages(spec, lay):
        key = (st.n_dense, st.n_moe, st.embedding, st.head, st.linear) if lay.zero < 2 else st  # ZeRO 2/3: chunks matter
        if key not in seen:
            local = stage_params(spec, st, lay)
            seen[key] = local, static_bytes(local, lay, zero_buckets(spec, st, lay) if lay.zero else None)
            if wl.optimizer == "muon":
                seen[key] = local, muon_static(seen[key][1], spec, st, lay)
        local, static = seen[key]
        act = stage_activation_bytes(spec, st, lay, wl, activation_model)
        peak = peak_terms(spec, st, lay, wl, static["total"], act)
        out.append({"stage": st, "params": local, "static": static, "activation": act, "total": static["total"] + act,
                    "peak": peak["total"], "peak_terms": peak})
    return out


def fits(mem: list[dict], cluster: Cluster, assume: Assumptions) -> bool:
    """The live peak (static + activations + the step's transient buffers) within the usable memory."""
    return max(s["peak"] for s in mem) <= cluster.gpu.memory_bytes * assume.usable_memory


def _stage_flops(spec: ModelSpec, st, lay: Layout, wl: Workload) -> tuple[float, float, float]:
    """(hardware FLOPs, attention-core FLOPs fwd+bwd, hardware FLOPs in FP8 GEMMs under --fp8) of one microbatch on
    one rank of stage `st`."""
    tokens = lay.mb * wl.seq_len // lay.cp
    matmul = core = rec_mm = rec_core = high = rec_high = 0.0
    # attention cores in full-layer equivalents: a sliding layer's kernels run only what its window reaches
    ids, chosen = (stage_layer_ids(spec, lay)[st.index], recomputed_layer_ids(spec, lay)) if spec.sliding_layers \
        else ((), frozenset())
    held, held_again = gpt_oss.core_layers(spec, st, lay, wl.seq_len, ids, chosen)
    for moe, n, again, n_core, again_core in zip((False, True), (st.n_dense, st.n_moe), st.recompute_split(lay)[0],
                                                 held, held_again):
        if n:
            mm, cc = layer_flops_per_token(spec, moe, wl.seq_len, lay.tp, lay.sp)
            mm += moe_skew.extra_expert_flops_per_token(spec, lay, wl) if moe else 0.0  # the busiest rank's rows
            matmul, core = matmul + n * mm, core + n_core * cc
            rec_mm, rec_core = rec_mm + again * mm, rec_core + again_core * cc
            hp = flops.high_precision_matmul_per_token(spec, moe, lay.tp, lay.sp)
            high, rec_high = high + n * hp, rec_high + again * hp
    d_mm, d_core = linear_layer_delta(spec, wl.seq_len, lay.tp)
    lin, lin_again = linear_attention.held_layers(st, lay)  # Gated DeltaNet: not the attention core selective replays
    matmul, core, rec_mm = matmul + lin * d_mm, core + lin * d_core, rec_mm + lin_again * d_mm
    attn_core = 2.0 * wl.seq_len * (spec.n_heads // lay.tp) * (spec.k_dim + spec.v_dim)
    rec_core += lin_again * (d_core if lay.recompute == "full" else -attn_core)
    head = 2.0 * spec.dim * (padded_vocab(spec, lay.tp) // lay.tp) if st.head else 0.0
    if st.head and spec.mtp_layers:
        mm, cc = mtp_flops_per_token(spec, lambda moe: layer_flops_per_token(spec, moe, wl.seq_len, lay.tp, lay.sp),
                                     padded_vocab(spec, lay.tp) // lay.tp)
        matmul, core = matmul + mm, core + cc
        high += flops.mtp_high_precision_per_token(spec, padded_vocab(spec, lay.tp) // lay.tp, lay.tp, lay.sp)
    extra = {"none": 0.0, "selective": rec_core, "full": rec_mm + rec_core}[lay.recompute]  # MTP: never recomputed
    fp8 = tokens * (3 * (matmul - high) + (rec_mm - rec_high if lay.recompute == "full" else 0.0)) if wl.fp8 else 0.0
    return tokens * (3 * (matmul + core + head) + extra), tokens * 3 * core, fp8


def _tp_layer(spec: ModelSpec, lay: Layout, wl: Workload, rate: float, flops_per_s: float, link: str | None):
    """Exposed SP communication of one layer and microbatch, with and without --tp-overlap (tp_overlap.py)."""
    tokens = lay.mb * wl.seq_len // lay.cp
    matmul, _ = layer_flops_per_token(spec, False, wl.seq_len, lay.tp, lay.sp)
    latency = LATENCY_S["network" if link == "network" else "nvlink"]
    return exposed_tp(tokens, spec.dim, wl.act_bytes, lay.tp, rate, matmul * tokens, flops_per_s, latency)


def estimate(spec: ModelSpec, cluster: Cluster, lay: Layout, wl: Workload, assume: Assumptions = Assumptions(),
             mem: list[dict] | None = None, detail: bool = False) -> dict:
    """The machine-readable prediction for one layout: the object `shardwise plan --json` prints.

    Bytes are per rank. Memory figures are the largest over pipeline stages; `comm_*_per_step` and
    `comm_ops_per_step` ({axis: {op: {count, bytes, wire_bytes}}}) are global rank 0's (stage 0),
    `comm_bytes_per_step_max` the busiest stage's per axis, and with `detail` `stages` lists every stage.
    FLOPs are per step over the whole cluster. `mem` passes a precomputed `memory_by_stage`.
    """
    if lay.m * lay.mb * lay.dp != wl.global_batch:
        raise PlanError(f"m={lay.m} × mb={lay.mb} × dp={lay.dp} != global batch {wl.global_batch}")
    spec = fp8_spec(spec, wl)
    mem = mem or memory_by_stage(spec, lay, wl, assume.activation_model)
    links = axis_links(lay.dp, lay.pp, lay.cp, lay.tp, lay.ep, cluster.domain, lay.dp_shard)
    rate = {a: cluster.bandwidth(links[a]) * assume.link_efficiency for a in AXES}
    rate["emb"] = rate["pp"]  # tied embeddings' group: the first and last stage, across the pp links
    peak, peak8 = peak_flops(cluster, wl), fp8_peak(cluster, wl)
    bubble, bubble_src = bubble_fraction(lay)

    def seconds(led, axis):
        return led.sent_bytes(axis) / rate[axis]

    edges, per_stage, seen = stage_edges(chunk_owners(lay), lay.pp), [], {}
    windows = [tuple(map(spec.window, ids)) for ids in stage_layer_ids(spec, lay)] if spec.sliding_layers else None
    for s in mem:
        st = s["stage"]
        # Stages that hold the same kind of work share one cost evaluation (only memory differs).
        key = (st.kinds, st.recomputed, st.linear, st.embedding, st.head, edges[st.index],
               windows and windows[st.index])
        if key not in seen:
            mb, sync = stage_ledgers(spec, st, lay, wl, s["params"])
            hw, core, hw8 = _stage_flops(spec, st, lay, wl)
            t_comp = (hw - hw8) / (peak * assume.flops_efficiency)
            t_comp += hw8 / (peak8 * assume.flops_efficiency) if hw8 else 0.0  # --fp8: the FP8 GEMMs at the FP8 peak
            t_cp = max(0.0, seconds(mb, "cp") - core / (peak * assume.flops_efficiency))
            t_mb = t_comp + t_cp + sum(seconds(mb, a) for a in ("tp", "pp", "ep"))
            t_mb += amax_seconds(mb, rate, links) if wl.fp8 else 0.0
            tp_layer = _tp_layer(spec, lay, wl, rate["tp"], peak * assume.flops_efficiency, links["tp"])
            if (assume.tp_overlap or lay.tp_overlap) and lay.sp:  # the layers' SP collectives: exposed time instead of their bytes' time
                t_mb += st.n_layers * (tp_layer.overlap - tp_layer.comm)
            t_sync = seconds(sync, "tp") + seconds(sync, "emb")
            t_sync += (1 - assume.dp_overlap) * sum(seconds(sync, a) for a in ("dp_cp", "edp", "dp_shard", "dp_replicate"))
            updated = s["static"]["optimizer"] / 8  # parameters this rank's Adam step touches (its ZeRO shard)
            t_opt = updated * ADAM_STEP_BYTES / cluster.gpu.hbm_bytes_per_s
            seen[key] = {"mb": t_mb, "tail": t_sync + t_opt, "comp": t_comp, "ledgers": (mb, sync),
                         "tp_layer": tp_layer}
        per_stage.append({**seen[key], **s})
    t_pipe = lay.m * max(p["mb"] for p in per_stage) / (1 - bubble)
    step_time = t_pipe + max(p["tail"] for p in per_stage)
    chosen = frozenset(recomputed_layer_ids(spec, lay)) if lay.recompute_layers is not None else None
    model_f, hw_f = model_flops(spec, wl), model_flops(spec, wl, lay.recompute, chosen)
    rank0 = whole_step(*per_stage[0]["ledgers"], lay.m)
    busiest: dict[str, float] = {}
    for led in {id(p["ledgers"]): whole_step(*p["ledgers"], lay.m) for p in per_stage}.values():
        for axis, b in led.per_axis("bytes").items():
            busiest[axis] = max(busiest.get(axis, 0), b)
    out = {
        "model": spec.name,
        "cluster": cluster.describe(),
        "layout": lay.as_dict(),
        "layout_str": ",".join(f"{k}={str(v).lower()}" for k, v in lay.as_dict().items()),
        "params_total": total_params(spec),
        "params_active": active_params(spec),
        "params_per_rank": max(p["params"].total for p in per_stage),
        "static_bytes_per_rank": max(p["static"]["total"] for p in per_stage),
        "static_breakdown_per_rank": max((p["static"] for p in per_stage), key=lambda d: d["total"]),
        "activation_bytes_per_rank": round(max(p["activation"] for p in per_stage)),
        "total_bytes_per_rank": round(max(p["total"] for p in per_stage)),
        "peak_bytes_per_rank": round(max(p["peak"] for p in per_stage)),
        "usable_bytes_per_rank": cluster.gpu.memory_bytes * assume.usable_memory,
        "fits": fits(mem, cluster, assume),
        "layers_per_stage": max(p["stage"].n_layers for p in per_stage),
        "stage_layers": [p["stage"].n_layers for p in per_stage],
        "bubble_fraction": bubble,
        "bubble_source": bubble_src,
        "comm_rank": "global rank 0 (stage 0); see stages[] for the others",
        "comm_bytes_per_step": rank0.per_axis("bytes"),
        "comm_wire_bytes_per_step": rank0.per_axis("wire_bytes"),
        "comm_bytes_per_step_max": busiest,
        "comm_ops_per_step": rank0.as_dict(),
        "comm_links": {a: links[a] for a in AXES if links[a] and (spec.is_moe or a not in ("ep", "edp"))
                       and (lay.hsdp or a not in ("dp_shard", "dp_replicate"))},
        "comm_time_s": {a: rank0.sent_bytes(a) / rate[a] for a in rank0.ops},
        "model_flops_per_step": model_f,
        "hardware_flops_per_step": hw_f,
        "compute_time_s": lay.m * max(p["comp"] for p in per_stage),
        "step_time_s": step_time,
        "mfu": model_f / (step_time * cluster.gpus * (peak8 or peak)),
        "mfu_bf16_equivalent": model_f / (step_time * cluster.gpus * flops.peak_flops(cluster.gpu, "bf16")),
        "peak_flops_per_gpu": peak8 or peak,
        "fp8": wl.fp8,
        "fp8_all_gather": wl.fp8_all_gather,
        "tokens_per_s": wl.global_batch * wl.seq_len / step_time,
        "assumptions": asdict(assume),
    }
    if spec.is_moe:  # the busiest ep rank's received rows over the mean this plan is for (moe_skew.py)
        out["moe_skew"] = moe_skew.skew(spec, lay, wl)
    if detail:
        if lay.sp and lay.tp > 1:
            out["tp_exposed_per_layer"] = per_stage[0]["tp_layer"].as_dict()
            out["tp_overlap"] = bool(assume.tp_overlap or lay.tp_overlap)
            host = Host(cluster.gpu.name, peak * assume.flops_efficiency, rate["tp"],
                        LATENCY_S["network" if links["tp"] == "network" else "nvlink"])
            on, why = choose(lay.tp, lay.sp, per_stage[0]["tp_layer"], host)
            out["tp_overlap_auto"] = {"on": on, "why": why}  # what train's --tp-overlap-auto picks on this cluster
        out["stages"] = [{
            "stage": p["stage"].index, "layers": p["stage"].n_layers, "embedding": p["stage"].embedding,
            "head": p["stage"].head, "params": p["params"].total, "static_bytes": p["static"]["total"],
            "activation_bytes": round(p["activation"]), "total_bytes": round(p["total"]),
            "peak_bytes": round(p["peak"]), "microbatch_time_s": p["mb"],
            "peak_terms": {k: v if isinstance(v, str) else round(v) for k, v in p["peak_terms"].items()},
            "comm_bytes_per_step": led.per_axis("bytes"), "comm_ops_per_step": led.as_dict(),
        } for p, led in ((p, whole_step(*p["ledgers"], lay.m)) for p in per_stage)]
    return out
