"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) in the planner, derived from the runtime
(`models/gated_deltanet.py`, `context_parallel/linear_attention.py`): the tensors one rank holds of a layer's
mixer, what its forward saves, its FLOPs and its context-parallel traffic.

Parameters, under its TP plan (`parallelize._linear_attention_tensor_parallel`): key heads and the value heads they
serve split over tp, the q/k/v/z/b/a projections and the convolution kernels, A_log and dt_bias cut by heads, `wo`
by input columns, the gated norm's one-head weight replicated with a gradient partial over tp under any TP
(head-partial). The six input projections are one TP region (one entry, like attention's q/k/v), `wo` its exit, so
the layer's TP traffic is attention's; only the per-step sum of partial gradients differs (`tp_partial_params`).

Torch-free; `planner/models.py` asks for these instead of attention's for the layers in `linear_layers`, and a
`Stage` lists which of its layers they are (`Stage.linear`).
"""
from __future__ import annotations

from shardwise.partition import chunk_ids

CHUNK = 64
"""Tokens per chunk of the runtime's chunked form (`models.gated_deltanet.CHUNK`)."""


def linear_attention_tensors(spec, tp: int, tensor_cls, norm: list) -> list:
    """The block's input norm (`norm`), then wq, wk, wv, wz, wb, wa, conv_q, conv_k, conv_v, A_log, dt_bias,
    norm.weight, wo as `tensor_cls` (planner.models.Tensor) entries for one tp rank."""
    h, kw = spec.dim, spec.linear_conv_kernel
    nk, nv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    qk, v = nk * spec.linear_k_dim, nv * spec.linear_v_dim
    out = list(norm)
    out += [tensor_cls(rows * h) for rows in (qk, qk, v, v, nv, nv)]
    out += [tensor_cls(rows * kw) for rows in (qk, qk, v)]  # depthwise kernels [channels, K]: matrices
    out += [tensor_cls(nv, matrix=False), tensor_cls(nv, matrix=False)]
    out += [tensor_cls(spec.linear_v_dim, matrix=False, sp_replicated=True), tensor_cls(v * h)]
    return out


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
    """Per layer, the parameters whose gradient is partial over tp even without SP: the gated norm's weight."""
    return spec.linear_v_dim


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


def flops_per_token(spec, seq_len: int, tp: int = 1) -> tuple[float, float]:
    """(projection, core) forward FLOPs per token of one Gated DeltaNet mixer on one tp rank, as the runtime
    computes it: the six input projections and `wo`; the core per value head and token, in chunks of C = 64:
    the conv (2·K per channel), k·kᵀ and q·kᵀ within the chunk (2·2·C·d_k), the two triangular solves
    (C·(d_v + d_k)), v_new = u − w·S and the state reads q·S (2·2·d_k·d_v), the intra-chunk product with
    v_new (2·C·d_v) and the state update kᵀ·v_new (2·d_k·d_v)."""
    h, C, kw = spec.dim, CHUNK, spec.linear_conv_kernel
    nk, nv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    dk, dv = spec.linear_k_dim, spec.linear_v_dim
    proj = 2.0 * h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + 2.0 * nv * dv * h
    c = min(C, seq_len)
    core = 2.0 * kw * (2 * nk * dk + nv * dv)
    core += nv * (4.0 * c * dk + c * (dv + dk) + 6.0 * dk * dv + 2.0 * c * dv)
    return proj, core


def mixer_activation_bytes(spec, mb: int, s_loc: int, tp: int, e: int, cp: int = 1, order: str = "balanced") -> float:
    """What the mixer saves past its region input (which the block counts), on one rank: b = mb sequences of
    s_loc tokens, this rank's nk key and nv value heads, e-byte activations. Term by term from the runtime:
    the convolution's padded input, output (silu's input) and kernel; q/k's L2 norms (their fp32 inputs and
    rsqrts); β's sigmoid, g's softplus; the chunked rule's fp32 [b, nv, s, C] pair decays, k·kᵀ, the UT system,
    q·kᵀ and the intra-chunk scores, its decay vectors and masks, one [d_k, d_v] state per chunk; then the gated
    norm (its fp32 input, rsqrt, normed output, z's silu and the product, which is also wo's input). The
    [b, nv, s, d_k] and [b, nv, s, d_v] tensors (q, k, v, β·k, u, w, the decayed q/k, v_new and the contiguous
    copies matmul makes of strided chunk slices) are counted by how many of each autograd kept in a fake-tensor
    trace of the layer at full size (s a multiple of C; fp32: 10 and 3; under bf16 autocast the fp32 copies
    differ), not one by one. Under cp add `cp_extra_bytes`."""
    b, C = mb, CHUNK
    nk, nv = spec.linear_k_heads // tp, spec.linear_v_heads // tp
    dk, dv, kw = spec.linear_k_dim, spec.linear_v_dim, spec.linear_conv_kernel
    n, S = b * s_loc, -(-s_loc // C) * C
    p, nc = b * S, S // C
    ck, cv = nk * dk, nv * dv
    cc = 2 * ck + cv
    out = e * b * (s_loc + kw - 1) * cc + e * n * cc + (4 * cc * kw if e == 4 else 0)  # conv input, output, kernel
    out += e * n * cc if e == 4 else 2 * 4 * n * ck  # q/k's L2 norm inputs: silu's output, or their fp32 copies
    out += 2 * 4 * n * nk + 3 * 4 * n * nv + 2 * 4 * nv  # rsqrts, β, g's softplus and product, exp(A_log)
    out += 4 * p * nv * (3 + 5 * C) + 2 * C * C + 4 * b * nv * nc + nc * 4 * b * nv * dk * dv  # chunk rule
    out += (4 * p * nv * dv if e == 4 else 4 * n * cv) + 4 * n * nv + e * n * cv + 4 * n * cv  # gated norm
    out += (e * n * cv if e == 4 else 4 * n * cv) + 4 * n * cv + e * n * cv
    if e == 4:
        out += 4 * p * nv * (10 * dk + 3 * dv)
    else:
        out += 4 * n * nv * (7.4375 * dk + 3 * dv + dk * dv / C - 96)
    return float(out) + (cp_extra_bytes(b, s_loc, nv, dk, dv, e, cp, order) if cp > 1 else 0.0)


CP_FIT = {4: (3.191, 0.663, 1.883), 2: (3.704, 1.666, 0.339)}
"""Per activation width: (per d_k, per d_k²/C, per gathered map byte) of `cp_extra_bytes`, least squares over
fake-tensor traces of the cp path (b 1–2, s_loc 1024–2048, d_k, d_v 64–128, cp 2 and 4, both orders): within
0.8% of the mixer's bytes under bf16, 4% in fp32."""


def cp_extra_bytes(b: int, s_loc: int, nv: int, dk: int, dv: int, e: int, cp: int, order: str) -> float:
    """What the context-parallel rule saves beyond the one-device layer on s_loc tokens: per chunk of C tokens its
    state map M [d_k, d_k] and the effective queries' factors ((q_d − A·w), w·M, Q: [C, d_k] each, with matmul's
    copies of strided slices), and the gathered [M | B] maps the composition reads. Fitted (`CP_FIT`), not derived
    op by op."""
    per_dk, per_dk2, per_map = CP_FIT[4 if e == 4 else 2]
    unit = 4 * b * s_loc * nv
    maps = 4 * cp * len(chunk_ids(0, cp, order)) * b * nv * dk * (dk + dv)
    return unit * (per_dk * dk + per_dk2 * dk * dk / CHUNK) + per_map * maps
