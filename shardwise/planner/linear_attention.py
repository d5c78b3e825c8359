"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in the planner, derived from the runtime
(`models/gated_deltanet.py`, `context_parallel/linear_attention.py`): what a layer's mixer saves for backward, its
FLOPs and its context-parallel traffic. Its parameters are the inventory's (`rules.inventory.gated_deltanet`).

The six input projections are one TP region (one entry, like attention's q/k/v), `wo` its exit, so the layer's TP
traffic is attention's; only the per-step sum of partial gradients differs (`tp_partial_params`). A `Stage` lists
which of its layers are Gated DeltaNet ones (`Stage.linear`).
"""
from __future__ import annotations

from shardwise.rules import inventory
from shardwise.rules.inventory import CHUNK
from shardwise.rules.partition import chunk_ids


def held_layers(stage, lay) -> tuple[int, int]:
    """(Gated DeltaNet layers `stage` holds, how many of them are in the layout's recompute set: full recompute re-runs
    those; selective replays attention cores only, so none of theirs)."""
    if not stage.linear:
        return 0, 0
    n = sum(stage.linear)
    if lay.recompute == "none":
        return n, 0
    if not stage.recomputed:
        return n, n
    return n, sum(1 for lin, r in zip(stage.linear, stage.recomputed) if lin and r)


def tp_partial_params(spec) -> int:
    """Per layer, the parameters whose gradient is partial over tp even without SP: the gated norm's weight (and
    Kimi Delta Attention's gate down-projections wf_a, wg_a)."""
    return sum(p.local_numel() for p in inventory.linear_mixer(spec) if p.head_partial)


def cp_comm(led, spec, lay, wl, layers: int, again: int) -> None:
    """Per microbatch, each Gated DeltaNet layer under cp (`context_parallel/linear_attention.py`): forward one
    all-gather of this rank's chunks' [M | B] state maps (fp32 [chunks·b, nv/tp, d_k, d_k + d_v]) and one of their
    convolution tails (e bytes, [chunks·b, K−1, 2·qk + v channels]); backward the reduce-scatter of each
    (the ledger books a reduce-scatter's whole input: cp times the shard). Independent of the sequence length.
    Full recompute repeats the forward's two all-gathers of the `again` recomputed layers."""
    c = lay.cp
    if c < 2 or not layers:
        return
    chunks = len(chunk_ids(0, c, lay.cp_order))  # the sequence chunks each rank holds
    nk, nv = spec.linear_k_heads // lay.tp, spec.linear_v_heads // lay.tp
    dk, dv = spec.linear_k_dim, spec.linear_v_dim
    maps = 4 * chunks * lay.mb * nv * dk * (dk + dv)
    tails = wl.act_bytes * chunks * lay.mb * (spec.linear_conv_kernel - 1) * (2 * nk * dk + nv * dv)
    for nbytes in (maps, tails):
        led.add("cp", "all_gather", nbytes, c, layers + again)
        led.add("cp", "reduce_scatter", c * nbytes, c, layers)


def chunk_rule_terms(b: int, s: int, nv: int, dk: int, dv: int, e: int, transition: bool = False,
                     channel: bool = False) -> dict[str, int]:
    """What `models.gated_deltanet.chunk_gated_delta_rule` saves on b·nv heads of s tokens (padded to S, nc chunks of
    C), by name. The rule runs in fp32 with autocast off, so every entry is fp32 whatever e is; e only decides how v
    arrives: fp32 and unpadded it is a view of the convolution's output (`pointwise_terms`), e-byte it is copied.
    Padding copies q, k, v and β; unpadded, β is the sigmoid's output and v (fp32) a view. q and k are made contiguous
    (a copy that replaces the L2 norms' or the head repeat's outputs, which nothing else saves; a cp piece is copied
    from its narrowed view), so the chunk matmuls view their operands and save no copies. Chunk slices are views. The
    first chunk's state is a constant zero, so its two reads (w·S, q·S) save only the state. `channel` (Kimi Delta
    Attention's per-channel gate): the decays and the elementwise k·k, q·k products before their channel sums carry
    a d_k axis ([p, C, d_k]: the layer's largest tensors)."""
    C = CHUNK
    S = -(-s // C) * C
    nc, p = S // C, b * S * nv  # chunks; padded token-heads
    later = nc - 1  # chunks whose state needs a gradient
    padded = S != s
    g = dk if channel else 1  # the gate's channels
    t = {
        "masks ~lower, ~lower.tril(-1) (bool [C, C])": 2 * C * C,
        "pair decays exp(Σg) [p, C, g]": 4 * p * C * g,
        "UT system (I + β k kᵀ ⊙ pair), solve's A [p, C]": 4 * p * C,
        "k·kᵀ and q·kᵀ products, × pair's input [p, C, g] ×2": 2 * 4 * p * C * g,
        "intra-chunk scores, intra·v_new's operand [p, C]": 4 * p * C,
        "read_old, to_end decays [p, g]": 2 * 4 * p * g,
        "β padded, β·k's and β·v's operand (unpadded: the sigmoid's output) [p]": 4 * p if padded else 0,
        "whole-chunk decay [b, nv, nc, g]": 4 * b * nv * nc * g,
        "q, k (contiguous); β·k; w (solve's output) [p, d_k] ×4": 4 * 4 * p * dk,
        "u (solve's output) [p, d_v]": 4 * p * dv,
        "v padded or copied to fp32, β·v's operand [p, d_v]": 4 * p * dv if padded or e != 4 else 0,
        "states entering each chunk, state·decay's operand [d_k, d_v] per chunk": 4 * b * nv * nc * dk * dv,
        "kd = k·to_end [p, d_k]": 4 * p * dk,
        "qd = q·read_old [p, d_k] (read once a state needs a gradient)": 4 * p * dk if later else 0,
        "v_new per chunk [p, d_v]": 4 * p * dv,
    }
    if transition:
        t.update(transition_terms(b, s, nv, dk))
    return t


def transition_terms(b: int, s: int, nv: int, dk: int) -> dict[str, int]:
    """What `transition=True` adds (context parallelism's state map M and effective queries Q), per chunk, fp32:
    M ← M·decay − kdᵀ·(w·M) and Q = (qd − intra·w)·M. M starts as the identity (an expanded [d_k, d_k] eye, no
    gradient), so the first chunk's (qd − intra·w) and w are not saved for ·M."""
    C = CHUNK
    S = -(-s // C) * C
    nc, chunk = S // C, b * nv * C
    later = nc - 1
    return {
        "M's identity start (expanded eye) [d_k, d_k]": 4 * dk * dk,
        "M after each earlier chunk, M·decay's operand [d_k, d_k] per later chunk": 4 * b * nv * dk * dk * later,
        "w·M, kdᵀ·(w·M)'s operand [chunk, d_k] per chunk": 4 * chunk * dk * nc,
        "Q stacked (padded; matmul outputs), Q·S_in's operand [b·nv·S, d_k]": 4 * b * nv * S * dk,
        "qd − intra·w, ·M's operand [chunk, d_k] per later chunk": 4 * chunk * dk * later,
    }


def _channels(spec, tp: int) -> int:
    """The convolution's channels on one tp rank: q, k and v."""
    return (2 * spec.linear_k_heads * spec.linear_k_dim + spec.linear_v_heads * spec.linear_v_dim) // tp


def pointwise_terms(spec, mb: int, s_loc: int, tp: int, e: int) -> dict[str, int]:
    """The mixer's saved tensors outside the convolution's input and the chunk rule, alike on one device and under
    cp (s_loc tokens either way): the conv's output and kernel, the L2 norms, β and g, the gated norm (which keeps
    its input, z and its rsqrt: `GatedNormFunction`)."""
    n, kw = mb * s_loc, spec.linear_conv_kernel
    nk, nv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    ck, cv, cc = nk * spec.linear_k_dim, nv * spec.linear_v_dim, _channels(spec, tp)
    t = {
        "conv's output, silu's input (e) [n, qkv]": e * n * cc,
        "q/k L2 norms' rsqrts [n, nk] ×2": 2 * 4 * n * nk,
        "β = sigmoid(·) [n, nv]": 4 * n * nv,
        "softplus's input and output [n, nv] ×2": 2 * 4 * n * nv,
        "exp(A_log), its negation [nv] ×2": 2 * 4 * nv,
        "gated norm's rsqrt [n, nv]": 4 * n * nv,
        "z, the gated norm's gate (a view of wz's output) (e) [n, v]": e * n * cv,
        "the gated product, wo's input (e) [n, v]": e * n * cv,
    }
    if e == 4:
        t["conv kernels concatenated [qkv, K]"] = 4 * cc * kw
        t["silu's output, the L2 norms' input (a view of q, k, v) [n, qkv]"] = 4 * n * cc
    else:
        t["q, k fp32 copies, the L2 norms' input [n, qk] ×2"] = 2 * 4 * n * ck
        t["the rule's output cast to e, the gated norm's input (e) [n, v]"] = e * n * cv
    return t


def kda_pointwise_terms(spec, mb: int, s_loc: int, tp: int, e: int) -> dict[str, int]:
    """`pointwise_terms` of a Kimi Delta Attention mixer (`models/kimi_delta.py`): the conv and L2 norms as Gated
    DeltaNet's, a per-channel gate (softplus over [n, v]), the gates' low-rank inputs, and the sigmoid-gated norm in
    plain fp32 autograd (its input upcast, rsqrt, normed value, weight·normed, the sigmoid, the product)."""
    n, kw, nh, d = mb * s_loc, spec.linear_conv_kernel, spec.linear_v_heads // tp, spec.linear_v_dim
    c, cc = nh * d, _channels(spec, tp)
    t = {
        "conv's output, silu's input (e) [n, qkv]": e * n * cc,
        "q/k L2 norms' rsqrts [n, h] ×2": 2 * 4 * n * nh,
        "β = sigmoid(·) [n, h]": 4 * n * nh,
        "softplus's input and output [n, v] ×2": 2 * 4 * n * c,
        "exp(A_log), its negation [h] ×2": 2 * 4 * nh,
        "wf_a's and wg_a's outputs, wf_b's and wg_b's inputs (e) [n, d] ×2": 2 * e * n * d,
        "gated norm's rsqrt [n, h]": 4 * n * nh,
        "normed, weight·normed, sigmoid(gate) [n, v] ×3": 3 * 4 * n * c,
        "the gated product, wo's input (e) [n, v]": e * n * c,
    }
    if e == 4:
        t["conv kernels concatenated [qkv, K]"] = 4 * cc * kw
        t["silu's output, the L2 norms' input (a view of q, k, v) [n, qkv]"] = 4 * n * cc
    else:
        t["q, k fp32 copies, the L2 norms' input [n, v] ×2"] = 2 * 4 * n * c
        t["the rule's output cast to e, upcast again: the norm's input [n, v]"] = 4 * n * c
    return t


def mixer_terms(spec, mb: int, s_loc: int, tp: int, e: int) -> dict[str, int]:
    """What one device's mixer saves past its region input (which the block counts) and its autocast weight copies
    (`activations.autocast_weight_bytes`), by name: b = mb sequences of s_loc tokens, this rank's nk key and nv value
    heads, e-byte activations over a residual of the same width. Every entry is one storage autograd keeps (views
    of one storage count once), its bytes from its shape; tests/test_planner_new_families.py checks the sum against
    the saved-tensor hooks of a real layer."""
    nv, kw, kda = spec.linear_v_heads // tp, spec.linear_conv_kernel, getattr(spec, "kda", False)
    t = {"conv's padded input (e) [b, s + K − 1, qkv]": e * mb * (s_loc + kw - 1) * _channels(spec, tp)}
    t.update(kda_pointwise_terms(spec, mb, s_loc, tp, e) if kda else pointwise_terms(spec, mb, s_loc, tp, e))
    if e == 4:
        t["the rule's stacked output (padded), the gated norm's input [b·S, v]"] = (
            4 * mb * -(-s_loc // CHUNK) * CHUNK * nv * spec.linear_v_dim)
    t.update(chunk_rule_terms(mb, s_loc, nv, spec.linear_k_dim, spec.linear_v_dim, e, channel=kda))
    return t


def cp_mixer_terms(spec, mb: int, s_loc: int, tp: int, e: int, cp: int, order: str,
                   rank: int | None = None) -> dict[str, int]:
    """`mixer_terms` of one cp rank (`context_parallel/linear_attention.py`): its chunks' convolutions apart (each
    with a K−1 halo), the chunk rule with `transition` per chunk of s_loc / chunks tokens, and the composition:
    the gathered [M | B] maps and the states S_in(c) entering global chunks 0..max(ids) of this `rank` (None: the
    rank holding the last chunk, the largest)."""
    per = len(chunk_ids(0, cp, order))
    last = max(chunk_ids(rank, cp, order)) if rank is not None else cp * per - 1
    L = s_loc // per
    b, nv, dk, dv, kw = mb, spec.linear_v_heads // tp, spec.linear_k_dim, spec.linear_v_dim, spec.linear_conv_kernel
    cc, kda = _channels(spec, tp), getattr(spec, "kda", False)
    t = kda_pointwise_terms(spec, mb, s_loc, tp, e) if kda else pointwise_terms(spec, mb, s_loc, tp, e)
    t["conv's padded input per chunk (e) [b, s/chunks + K − 1, qkv]"] = e * b * (L + kw - 1) * cc * per
    for j in range(per):
        for k, v in chunk_rule_terms(b, L, nv, dk, dv, e, transition=True, channel=kda).items():
            t[f"chunk {j}: {k}"] = v
    t["gathered [M | B] maps, M·S's operand (none when S_in(0) is all this rank reads) "
      "[cp·chunks·b, nv, d_k, d_k + d_v]"] = 4 * cp * per * b * nv * dk * (dk + dv) if last else 0
    t["states entering global chunks 0..last [d_k, d_v] each"] = 4 * b * nv * dk * dv * (last + 1)
    if e == 4:
        t["the chunks' outputs concatenated, the gated norm's input [n, v]"] = 4 * b * s_loc * nv * dv
    else:  # autocast_weight_bytes counts one bf16 copy of the kernels; each chunk's conv1d casts its own
        t["further conv kernel casts (e) [qkv, K] per chunk past the first"] = e * cc * kw * (per - 1)
    return t


def mixer_activation_bytes(spec, mb: int, s_loc: int, tp: int, e: int, cp: int = 1, order: str = "balanced") -> float:
    """The sum of `mixer_terms` (one device, tp), or of `cp_mixer_terms` (cp > 1) on its largest rank."""
    if cp > 1:
        return float(sum(cp_mixer_terms(spec, mb, s_loc, tp, e, cp, order).values()))
    return float(sum(mixer_terms(spec, mb, s_loc, tp, e).values()))
