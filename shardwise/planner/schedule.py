"""Pipeline-schedule facts the cost model needs: the bubble and how many microbatches a stage holds.

gpipe, 1F1B and interleaved have closed forms (Narayanan et al. 2021): bubble (p−1)/(m+p−1) and
(p−1)/(v·m+p−1). ZB-H1 and DualPipeV depend on how backward splits into B and W, so they come from
shardwise's own event simulator (`shardwise.rules.schedule_check`, pure Python) with F = B = W: the idle
time of these schedules stops growing once m reaches a few times p, so it is simulated at
m0 = min(m, 4p) and extrapolated to m as idle/(idle + m·work). Without the simulator they fall back to
ZB-H1's analytic third of the 1F1B bubble.
"""
from __future__ import annotations

from functools import lru_cache

from shardwise.planner.layout import Layout


def bubble_fraction(lay: Layout) -> tuple[float, str]:
    """Idle fraction of the pipelined step and where the number came from."""
    p, m, v = lay.pp, lay.m, lay.vp
    if p == 1:
        return 0.0, "none"
    if lay.schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "analytic"
    if lay.schedule == "interleaved":
        return (p - 1) / (v * m + p - 1), "analytic"
    sim = simulated(lay.schedule, p, min(m, 4 * p), v)
    if sim is not None:
        frac, m0 = sim[0], min(m, 4 * p)
        idle = frac * m0 / (1 - frac)  # in units of one microbatch's work per rank
        return idle / (idle + m), "simulator"
    chunks = 2 if lay.schedule == "dualpipev" else 1
    return (p - 1) / (3 * chunks * m + p - 1), "approximation"


def in_flight(lay: Layout, k: int) -> float:
    """Microbatches whose activations stage k holds at its peak, in units of the whole stage's layers.

    gpipe: all m; 1F1B: p−k; interleaved (Megatron warm-up): 2(p−k−1)+(v−1)p+1 chunks of 1/v stage each,
    i.e. 1+(p−1)/(p·v) stages at k=0 (Korthikanti et al. 2022 §4.2.3); ZB-H1 and DualPipeV: the
    simulator's peak (DualPipeV without it: p+1, DeepSeek-V3 report Table 2).
    """
    p, m, v = lay.pp, lay.m, lay.vp
    if p == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return float(m)
    if lay.schedule == "interleaved":
        return min(v * m, 2 * (p - k - 1) + (v - 1) * p + 1) / v
    if lay.schedule in ("zb", "dualpipev"):
        sim = simulated(lay.schedule, p, min(m, 4 * p), v)
        if sim is not None:
            return sim[1][k] / v
        if lay.schedule == "dualpipev":
            return float(min(m, p + 1))
    return float(min(p - k, m))


@lru_cache(maxsize=256)
def simulated(schedule: str, p: int, m: int, v: int) -> tuple[float, tuple[int, ...]] | None:
    """(bubble fraction, peak in-flight microbatch-chunks per rank) from shardwise's simulator, or None."""
    try:
        from shardwise.rules.schedules import build_schedule
        from shardwise.rules.schedule_check import simulate
    except ImportError:
        return None
    try:
        res = simulate(build_schedule(schedule, p, m, v))
    except ValueError:  # the schedule refuses this (p, m, v); the layout checks should have caught it
        return None
    return res.bubble_fraction, tuple(res.peak_inflight)
