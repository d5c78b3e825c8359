"""How a run is cut up, as pure arithmetic: layers into pipeline stages, tokens into context-parallel chunks, and
which ring steps a sliding window reaches.

Torch-free on purpose: config validation, the planner and the executors all use these rules, so what
`shardwise plan` assumes is what `shardwise train` builds. Errors are ValueErrors whose message names
the flag; config.py turns them into ConfigError, the planner into PlanError.
"""
from __future__ import annotations

ORDERS = ("balanced", "contiguous")


def balanced_counts(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage for an uneven split: the first n_layers % n_stages stages take one more."""
    q, r = divmod(n_layers, n_stages)
    return [q + (1 if j < r else 0) for j in range(n_stages)]


def split_layers(n_layers: int, n_stages: int, pp_layers: list[int] | None = None) -> list[range]:
    """Global layer indices of every stage: an even split, or `pp_layers` (one count per stage)."""
    if pp_layers is not None:
        if len(pp_layers) != n_stages:
            raise ValueError(f"--pp-layers {','.join(map(str, pp_layers))} has {len(pp_layers)} entries; "
                             f"need one per stage (pp × vp = {n_stages})")
        if any(c < 0 for c in pp_layers) or sum(pp_layers) != n_layers:
            raise ValueError(f"--pp-layers {','.join(map(str, pp_layers))} must be non-negative counts summing to "
                             f"the model's {n_layers} layers")
        counts = pp_layers
    else:
        if n_layers % n_stages:
            raise ValueError(f"{n_layers} layers cannot be split evenly over {n_stages} stages (pp × vp); "
                             f"pass --pp-layers with {n_stages} counts summing to {n_layers}")
        counts = [n_layers // n_stages] * n_stages
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def recomputed_layers(chunks, layers: int | None) -> list[int]:
    """--recompute-layers N: the first N layers of each pipeline chunk (`chunks`: each chunk's layer ids in model
    order; N None: every layer). The runtime applies it, the planner counts it."""
    return [i for ids in chunks for i in list(ids)[:layers]]


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"context-parallel order {order!r}: expected one of {', '.join(ORDERS)}")


def num_chunks(cp_size: int, order: str) -> int:
    """How many equal chunks the sequence is cut into: 2c (balanced), c (contiguous), 1 without CP."""
    _check_order(order)
    if cp_size == 1:
        return 1
    return 2 * cp_size if order == "balanced" else cp_size


def chunk_ids(cp_rank: int, cp_size: int, order: str) -> tuple[int, ...]:
    """The global chunk indices rank `cp_rank` holds, in local order (always increasing)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp rank {cp_rank} out of range for cp size {cp_size}")
    if num_chunks(cp_size, order) == cp_size:
        return (cp_rank,)
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def check_seq_len(seq_len: int, cp_size: int, order: str) -> int:
    """Raise ValueError unless `seq_len` splits into equal chunks; return the chunk length."""
    n = num_chunks(cp_size, order)
    if seq_len <= 0 or seq_len % n:
        why = f"2·cp = {n} chunks (load-balanced order)" if order == "balanced" else f"cp = {n} shards"
        raise ValueError(f"sequence length s={seq_len} cannot be split over cp c={cp_size} in {order!r} order: "
                         f"s must be a positive multiple of {n} ({why})")
    return seq_len // n


def chunk_intervals(rank: int, cp_size: int, order: str, s_local: int, start: int = 0,
                    stop: int | None = None) -> list[tuple[int, int]]:
    """Global positions [a, b) of cp rank `rank`'s local rows start:stop, one interval per chunk they touch."""
    stop = s_local if stop is None else stop
    chunks = chunk_ids(rank, cp_size, order)
    length = s_local // len(chunks)
    out = []
    for i, c in enumerate(chunks):
        lo, hi = max(start, i * length), min(stop, (i + 1) * length)
        if lo < hi:
            out.append((c * length + lo - i * length, c * length + hi - i * length))
    return out


def window_cut(q_iv, k_iv, window: int) -> tuple[bool, bool]:
    """(some query sees a key, the window hides some key causality alone would show) for position intervals:
    query q sees key k iff 0 <= q − k < window."""
    visible = cut = False
    for qa, qb in q_iv:
        for ka, kb in k_iv:
            lo, hi = qa - (kb - 1), (qb - 1) - ka  # every difference q − k between the two lies in [lo, hi]
            visible |= hi >= 0 and lo < window
            cut |= hi >= window
    return visible, cut


def ring_step_list(cp_size: int, order: str, s_local: int, window: int) -> list[int]:
    """The ring attention steps that run: 0 (the own block) and every step i at which some rank's window reaches
    the block of the rank i behind it (equal on every rank). Without a window, or where every step is reached,
    0 … c − 1; the balanced order under a window within a chunk needs only 1 and c − 1 (rank r's chunk r reaches
    rank r − 1's, its chunk 2c − 1 − r rank r + 1's). Each step past 0 moves one K/V block forward and one dK/dV
    accumulator backward: the ring's sends are counted from this list by the runtime and the planner alike."""
    if not window or window >= s_local * cp_size:
        return list(range(cp_size))
    return [0] + [step for step in range(1, cp_size) if any(
        window_cut(chunk_intervals(r, cp_size, order, s_local),
                   chunk_intervals((r - step) % cp_size, cp_size, order, s_local), window)[0]
        for r in range(cp_size))]


def window_bands(s: int, window: int) -> list[tuple[tuple[int, int], tuple[int, int]]] | None:
    """(query rows [a, b), key columns [c, d)) of each band one head's windowed attention over s tokens runs:
    rows [a, a + W) read keys [a − W + 1, a + W); None where banding saves nothing (no window, or s ≤ 2W: one
    masked call is as cheap). `context_parallel.local.bands` runs these bands."""
    if not window or s <= 2 * window:
        return None
    return [((a, min(a + window, s)), (max(0, a - window + 1), min(a + window, s))) for a in range(0, s, window)]


def local_scores(s: int, window: int) -> int:
    """Query-key scores one head's attention over a whole sequence of s tokens computes (one device, Ulysses): s² in
    one causal or masked call — a kernel call's work counted whole, as FlopCounterMode counts it — or the bands'
    rows × keys: W rows against 2W − 1 keys each, but the first band's W keys and a short last band's."""
    per_band = window_bands(s, window)
    if per_band is None:
        return s * s
    return sum((qb - qa) * (kb - ka) for (qa, qb), (ka, kb) in per_band)


def ring_block_pairs(q_rank: int, kv_rank: int, cp_size: int, order: str,
                     s_local: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Causal ring attention's block pairs of rank `q_rank` against rank `kv_rank`'s K/V, as local (rows, columns)
    spans: the own block whole; else one pair per group of query chunks that see the same earlier key chunks, those
    query chunks against the span of those key chunks (`ring_attention.block_plan`'s calls)."""
    if q_rank == kv_rank:
        return [((0, s_local), (0, s_local))]
    q_chunks, kv_chunks = chunk_ids(q_rank, cp_size, order), chunk_ids(kv_rank, cp_size, order)
    length = s_local // len(q_chunks)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, a in enumerate(q_chunks):
        seen = tuple(j for j, b in enumerate(kv_chunks) if b < a)
        if seen:
            groups.setdefault(seen, []).append(i)
    return [((qi[0] * length, (qi[-1] + 1) * length), (seen[0] * length, (seen[-1] + 1) * length))
            for seen, qi in groups.items()]


def ring_scores(cp_size: int, order: str, s_local: int, window: int) -> list[int]:
    """Query-key scores per head each cp rank computes in one causal ring pass: over the steps `ring_step_list`
    keeps, every block pair some query's window reaches (`window_cut`; without a window, or one as long as the
    sequence, every pair), each pair's call counted whole."""
    windowed = window and window < s_local * cp_size
    steps = ring_step_list(cp_size, order, s_local, window)
    out = []
    for rank in range(cp_size):
        total = 0
        for step in steps:
            kv = (rank - step) % cp_size
            for (qa, qb), (ka, kb) in ring_block_pairs(rank, kv, cp_size, order, s_local):
                if not windowed or window_cut(chunk_intervals(rank, cp_size, order, s_local, qa, qb),
                                              chunk_intervals(kv, cp_size, order, s_local, ka, kb), window)[0]:
                    total += (qb - qa) * (kb - ka)
        out.append(total)
    return out
