"""Enumerate every valid layout for a cluster, drop those that do not fit, rank by estimated step time.

The degrees come from the divisors of the GPU count; each candidate must pass `layout_problems`
(heads, KV heads, FFN, experts, layers, sequence, schedule rules) and, unless allowed, keep every TP
group inside one NVLink domain. Under ZeRO 2/3 it also tries hybrid sharding (`_dp_shards`). Memory is checked before the (costlier) time model runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import gcd

from shardwise.planner.estimate import Assumptions, axis_links, estimate, fits, memory_by_stage
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout, Workload, layout_problems
from shardwise.planner.models import ModelSpec


@dataclass(frozen=True)
class SearchSpace:
    zero: int = 1
    recompute: str = "selective"
    sp: bool = True
    """Sequence parallelism on every layout with tp > 1."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    max_vp: int = 4
    max_cp: int | None = None
    allow_tp_cross_domain: bool = False
    uneven_pp: bool = False
    vp: int | None = None
    """Interleaved: only this many chunks per pipeline rank (train's --vp); None = search 2..max_vp."""
    cp_impl: str = "ring"
    dp_shard: int | None = None
    """ZeRO 2/3 hybrid sharding: None = try dp (full sharding) and the largest S < dp whose shard group stays
    in one scale-up domain (a smaller in-domain S only adds memory); an int: only that S (0, or one that does
    not divide dp: no hybrid sharding)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(space: SearchSpace, spec: ModelSpec, pp: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for sched in space.schedules:
        if sched == "interleaved":
            vps = [space.vp] if space.vp else range(2, space.max_vp + 1)
            out += [(sched, v) for v in vps if (spec.n_layers // pp) % v == 0 or space.uneven_pp]
        else:
            out.append((sched, 2 if sched == "dualpipev" else 1))
    return out


def _dp_shards(space: SearchSpace, dp: int, pp: int, cp: int, tp: int, domain: int) -> list[int]:
    """The dp_shard values (None = all of dp) worth estimating for one (dp, pp, cp, tp)."""
    if space.zero < 2 or dp == 1:
        return [None]
    if space.dp_shard is not None:
        return [space.dp_shard if 0 < space.dp_shard < dp and dp % space.dp_shard == 0 else None]
    inside = [s for s in divisors(dp)[:-1] if axis_links(dp, pp, cp, tp, 1, domain, s)["dp_shard"] != "network"]
    return [None] + inside[-1:]


def candidates(spec: ModelSpec, cluster: Cluster, wl: Workload, space: SearchSpace):
    """Every layout that can run (memory not yet checked)."""
    n = cluster.gpus
    for tp in divisors(n):
        if spec.n_heads % tp:
            continue
        for pp in divisors(n // tp):
            if pp > spec.n_layers:
                continue
            for cp in divisors(n // (tp * pp)):
                if space.max_cp and cp > space.max_cp:
                    continue
                dp = n // (tp * pp * cp)
                links = axis_links(dp, pp, cp, tp, 1, cluster.domain)
                if links["tp"] == "network" and not space.allow_tp_cross_domain:
                    continue
                shards = _dp_shards(space, dp, pp, cp, tp, cluster.domain)
                eps = divisors(gcd(dp * cp, spec.moe_experts)) if spec.is_moe else [1]
                for ep in eps:
                    for mb in space.micro_batches:
                        if wl.global_batch % (dp * mb):
                            continue
                        m = wl.global_batch // (dp * mb)
                        for (sched, vp), hs in product(_schedules(space, spec, pp), shards):
                            lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, vp=vp, schedule=sched, mb=mb, m=m,
                                         zero=space.zero, recompute=space.recompute, sequence_parallel=space.sp and tp > 1,
                                         cp_impl=space.cp_impl, dp_shard=hs)
                            if not layout_problems(spec, lay, n, wl.seq_len, space.uneven_pp):
                                yield lay


def search(spec: ModelSpec, cluster: Cluster, wl: Workload, space: SearchSpace = SearchSpace(),
           assume: Assumptions = Assumptions()) -> list[dict]:
    """Estimates of every fitting layout, fastest first (ties: less memory first)."""
    results = []
    for lay in candidates(spec, cluster, wl, space):
        mem = memory_by_stage(spec, lay, wl, assume.activation_model)
        if fits(mem, cluster, assume):
            results.append(estimate(spec, cluster, lay, wl, assume, mem=mem))
    results.sort(key=lambda r: (r["step_time_s"], r["total_bytes_per_rank"]))
    return results
