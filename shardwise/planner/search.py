"""Enumerate every valid layout for a cluster, drop those that do not fit, rank by estimated step time.

The degrees come from the divisors of the GPU count; each candidate must pass `layout_problems`
(heads, KV heads, FFN, experts, layers, sequence, schedule rules) and, unless allowed, keep every TP
group inside one NVLink domain. Under ZeRO 2/3 it also tries hybrid sharding (`_dp_shards`). Memory is checked before the (costlier) time model runs.
When no candidate exists at all, `no_layout_reason` says why (the GPU count or the global batch) and which GPU
counts nearby would have one: a different mistake from "none fits in memory".
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from math import gcd, lcm

from shardwise.planner.estimate import Assumptions, axis_links, estimate, fits, memory_by_stage
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout, Workload, layout_problems
from shardwise.planner.models import ModelSpec
from shardwise.rules.validation import cp_seq_problem, dp_shard_problem, heads_tp_problem, layers_pp_problem


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
            out += [(sched, v) for v in vps if not layers_pp_problem(spec.n_layers, pp * v, space.uneven_pp)]
        else:
            out.append((sched, 2 if sched == "dualpipev" else 1))
    return out


def _dp_shards(space: SearchSpace, dp: int, pp: int, cp: int, tp: int, domain: int) -> list[int]:
    """The dp_shard values (None = all of dp) worth estimating for one (dp, pp, cp, tp)."""
    if space.zero < 2 or dp == 1:
        return [None]
    if space.dp_shard is not None:
        return [space.dp_shard if 0 < space.dp_shard < dp and not dp_shard_problem(dp, space.dp_shard) else None]
    inside = [s for s in divisors(dp)[:-1] if axis_links(dp, pp, cp, tp, 1, domain, s)["dp_shard"] != "network"]
    return [None] + inside[-1:]


def candidates(spec: ModelSpec, cluster: Cluster, wl: Workload, space: SearchSpace):
    """Every layout that can run (memory not yet checked)."""
    n = cluster.gpus
    for tp in divisors(n):
        if heads_tp_problem(spec.n_heads, tp):
            continue
        for pp in divisors(n // tp):
            if layers_pp_problem(spec.n_layers, pp, uneven=True):
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
                            if not layout_problems(spec, lay, n, wl.seq_len, space.uneven_pp, wl.fp8):
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


def _may_have_layout(spec: ModelSpec, cluster: Cluster, wl: Workload, space: SearchSpace) -> bool:
    """A quick necessary condition for `candidates` to yield: some dp × tp × pp × cp split of the GPUs with
    dp × micro-batch dividing the global batch, tp dividing the heads (inside a domain), pp the layers and cp
    the sequence. Lets `nearest_gpu_counts` skip most counts without enumerating their layouts."""
    n = cluster.gpus
    for dp in divisors(gcd(n, wl.global_batch)):
        if all(wl.global_batch % (dp * mb) for mb in space.micro_batches):
            continue
        inner = n // dp
        for tp in divisors(gcd(inner, spec.n_heads)):
            if tp > cluster.domain and not space.allow_tp_cross_domain:
                continue
            for pp in divisors(inner // tp):
                cp = inner // (tp * pp)
                if not layers_pp_problem(spec.n_layers, pp, space.uneven_pp) and not cp_seq_problem(wl.seq_len, cp) \
                        and not (space.max_cp and cp > space.max_cp):
                    return True
    return False


def nearest_gpu_counts(spec: ModelSpec, cluster: Cluster, wl: Workload, space: SearchSpace) -> list[int]:
    """The closest GPU count below `cluster.gpus` and the closest up to twice it that have at least one valid
    layout for this model and global batch; past one node only whole nodes count (as `Cluster` requires)."""
    n, node = cluster.gpus, cluster.gpus_per_node

    def ok(g: int) -> bool:
        if g > node and g % node:
            return False
        c = replace(cluster, gpus=g)
        return _may_have_layout(spec, c, wl, space) and next(candidates(spec, c, wl, space), None) is not None

    below = next((g for g in range(n - 1, 0, -1) if ok(g)), None)
    above = next((g for g in range(n + 1, 2 * n + 1) if ok(g)), None)
    return [g for g in (below, above) if g is not None]


def no_layout_reason(spec: ModelSpec, cluster: Cluster, wl: Workload, space: SearchSpace) -> str:
    """Why `candidates` is empty: the global batch, which no dp × micro-batch of any split of these GPUs
    divides (with the nearest GPU counts that have a layout), or the model and workload themselves."""
    n, mbs = cluster.gpus, ", ".join(map(str, space.micro_batches))
    if all(wl.global_batch % mb for mb in space.micro_batches):
        return f"global batch {wl.global_batch} is not divisible by micro-batch {mbs}"
    # A global batch every split divides (dp | n, micro-batch | lcm), with m >= 2·pp: only the split rules remain.
    free = replace(wl, global_batch=2 * n * lcm(*space.micro_batches))
    dps = sorted({lay.dp for lay in candidates(spec, cluster, free, space)})
    if not dps:  # plain data parallelism passes every rule that depends on the GPU count: no count would help
        plain = Layout(dp=n, mb=space.micro_batches[0], m=2, zero=space.zero, recompute=space.recompute,
                       cp_impl=space.cp_impl)
        problems = layout_problems(spec, plain, n, wl.seq_len, space.uneven_pp, wl.fp8) or ["no split passes the search's rules"]
        return f"no layout of {spec.name} can run this workload on any GPU count: {'; '.join(problems)}"
    shown = ", ".join(map(str, dps[:6])) + (", ..." if len(dps) > 6 else "")
    near = nearest_gpu_counts(spec, cluster, wl, space)
    return (f"no layout divides {n} GPUs and global batch {wl.global_batch}: dp × micro-batch must divide it, and "
            f"{spec.name} on {n} GPUs has dp {shown} (micro-batch {mbs})"
            + (f"; nearest GPU counts that have a layout: {' or '.join(map(str, near))}" if near else ""))
