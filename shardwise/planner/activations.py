"""Activation memory per rank and microbatch: what one microbatch saves for backward, stage by stage.

Activations have two models (`ACTIVATION_MODELS`):

* "shardwise" (default): the tensors shardwise's own implementation saves for backward, term by term
  (`shardwise_layer_activation_bytes`), checked against real runs by tests/test_planner_ledger.py (the
  bytes of the unique storages autograd's saved-tensor hooks see during one microbatch forward).
  Where it differs from the textbook: the RMSNorms compute in fp32 (each saves its fp32 input, the
  normalised product and the rsqrt); the residual stream is bf16 under bf16 (fp32 with --fp32-residual); SDPA is a
  flash kernel that saves q, k, v, the output and an fp32 log-sum-exp, never the s×s scores (they
  appear only with attention dropout, which takes SDPA's math path on CPU); SwiGLU saves four
  [n, ffn] tensors (w1 out, silu out, w3 out, their product); under bf16 autocast over an fp32 residual
  every linear saves its own bf16 cast of the input (q, k and v each cast the norm output) and a bf16 copy of its
  weight — per microbatch in flight, since each microbatch runs in its own autocast region (TP without SP runs
  q/k/v and w1/w3 as one ColumnRegion function: its input once, no weight copies); the LM head's cross-entropy
  saves the fp32 softmax over the (padded) local vocabulary. MLA (DeepSeek) counts its latents and their
  norms, and the core at one padded head size (docs/models.md); MoE routers count their fp32 routing tensors
  (softmax or sigmoid, renormalised or not). Measured equal to real runs (MoE: to a few bytes per layer).
* "korthikanti": Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", §4), term by term, generalised to GQA, SwiGLU and MoE: with e-byte activations and 1-byte
  dropout masks a GPT layer stores s·b·h·(34 + 5·a·s/h) bytes at e=2; tensor parallelism divides the 24
  sbh of sharded terms and the attention scores; sequence parallelism also divides the 10 replicated
  sbh; selective recompute drops the attention-score terms; full recompute keeps only each layer's
  input. It describes Megatron with unfused attention, not shardwise: on `tiny` it is 11–38% below
  what shardwise saves in fp32 and 60–70% below under bf16 (most of that the weight copies).

A stage holds its per-microbatch figure for every microbatch its schedule keeps in flight
(`schedule.in_flight`), plus the last stage's head (logits/softmax) for one microbatch.
"""
from __future__ import annotations

import dataclasses
import functools

from shardwise.planner import gpt_oss, moe_skew, sparse_attention
from shardwise.planner.fp8 import wire_activations
from shardwise.rules.fp8 import FP8_BYTES
from shardwise.planner.linear_attention import mixer_activation_bytes
from shardwise.planner.layout import Layout, Stage, Workload, chunk_layer_ids, chunk_owners
from shardwise.planner.models import (
    BOOL, INT64, ModelSpec, Params, attention_tensors, local_kv_heads, mlp_tensors, padded_vocab,
)
from shardwise.planner.mtp import mtp_activation_bytes
from shardwise.planner.schedule import in_flight


ACTIVATION_MODELS = ("shardwise", "korthikanti")


def _norm_saved(tokens: int, h: int) -> int:
    """An fp32 RMSNorm (autocast leaves it alone) saves its input, x·rsqrt and the rsqrt: 8·n·h + 4·n bytes."""
    return 8 * tokens * h + 4 * tokens


def region_input(tokens: int, h: int, consumers: int, e: int, r: int = 4) -> int:
    """What the linears entering a region save of their shared input (r bytes, the residual's dtype): one
    tensor (an SP all-gather returns it contiguous) — unless autocast casts it, once per consuming linear
    (bf16 autocast over an fp32 residual, --fp32-residual)."""
    return r * tokens * h if r == e else consumers * e * tokens * h


def region_entry(spec: ModelSpec, lay: Layout, wl: Workload, tokens: int, consumers: int) -> int:
    """What a mixer's or dense MLP's region saves of its input: one tensor in the residual's dtype under TP without SP
    (`ColumnRegion`), `region_input` otherwise — but under --fp8-all-gather's FP8 SP gather (`fp8.wire_activations`)
    only the gathered FP8 operand, one byte per element, which every FP8 linear reading it saves in its place."""
    h, e, r = spec.dim, wl.act_bytes, wl.resid_bytes
    if _column_region(spec, lay):
        return r * tokens * h
    if wire_activations(lay, wl):
        return FP8_BYTES * tokens * h
    return region_input(tokens, h, consumers, e, r)


def shardwise_layer_activation_bytes(spec: ModelSpec, moe: bool, lay: Layout, wl: Workload,
                                     recompute: str | None = None) -> float:
    """Bytes shardwise's TransformerBlock saves for backward per microbatch on one rank (weight copies of
    bf16 autocast excluded: `autocast_weight_bytes`).

    n = mb·s/cp tokens per rank; n_r = n/tp of them in the replicated region under SP (norms, residual
    dropout, MoE routing), n otherwise. Attention: norm, region input, then
    * flash SDPA (cp=1): q and k after RoPE, v, the output (which is also wo's input), fp32 LSE [b, hq, s];
    * ring (cp>1): the same, K/V as contiguous copies, plus wo's input (the output re-laid-out);
    * Ulysses (cp>1): head-sharded q, k, v (K/V replicated when hkv < cp), output, LSE, wo's input and the
      two int64 position permutations of the balanced order;
    * attention dropout (SDPA's math path, what CPU runs): the softmax, the dropout mask and the dropped
      probabilities [b, hq, s_loc, s], scaled q, K/V expanded to hq heads, and wo's input.
    Dense MLP: norm, region input, SwiGLU's four [n, ffn/tp] tensors (GELU: two). MoE (replicated over
    tp, routing n_r tokens, dropless and balanced: each rank's experts receive n_r·k rows): norm, the
    router's fp32 logits, probabilities and LSE and int64 top-k indices, dispatch bookkeeping (two int64
    index vectors and the fp32 weights of the n_r·k assignments), the received rows and their regroup
    permutations, four [rows, expert_ffn] expert tensors, the combined rows and their weighted copy,
    and the shared experts' SwiGLU tensors. Residual dropout adds its mask (activation dtype; under SP
    the n_r·h slice a rank keeps is a view of the full n·h mask every rank draws).

    Recompute (shardwise.recompute): "selective" checkpoints the attention core — with SDPA it drops the
    LSE and, with attention dropout, the s×s tensors (a flash kernel never stores scores, so it saves
    little); under cp (ring or Ulysses) checkpoint keeps only the core's inputs q, k, v, so the kernel's
    own copies, output, LSE and permutations go. "full" keeps each layer's input only (the residual's
    dtype; under SP its 1/tp shard); the layer being recomputed is `recompute_transient_bytes`.
    Measured against real runs by tests/test_recompute_planner.py.
    """
    recompute = recompute or lay.recompute
    e, t, h, c = wl.act_bytes, lay.tp, spec.dim, lay.cp
    r = wl.resid_bytes
    s_loc = wl.seq_len // c
    n = lay.mb * s_loc
    n_r = n // t if lay.sp else n
    if recompute == "full":
        return r * n_r * h  # each layer's input (the residual's dtype); the layer being recomputed is added per stage
    hq, hkv = spec.n_heads // t, local_kv_heads(spec, t)
    dk, dv = spec.k_dim, spec.v_dim
    mask = e * n * h if spec.dropout > 0 else 0  # under SP each rank keeps its slice of the full mask
    lse = 4 * n * hq if recompute == "none" else 0  # selective recompute of the attention core drops it
    attn = _norm_saved(n_r, h) + mask
    if spec.qk_norm:  # Qwen3's fp32 per-head norms of this rank's q and k heads, on every token of its sequence
        # (MiniMax-M2's width norms: one statistic per token for q and one for k)
        attn += 8 * n * (hq + hkv) * dk + 4 * n * (2 if spec.qk_norm_full else hq + hkv)
    if spec.is_dsa:  # DeepSeek Sparse Attention: the latents and the k-key sparse core (planner/sparse_attention.py)
        attn += region_input(n, h, 2, e, r) + _mla_latent_bytes(spec, n, e) - e * n * spec.kv_lora_rank
        attn += sparse_attention.attention_bytes(spec, lay.mb, s_loc, wl.seq_len, hq, e, recompute)
        return attn + _mlp_bytes(spec, moe, lay, wl, n, n_r, mask)
    if spec.is_mla and (c == 1 or recompute == "selective") and not (c == 1 and spec.attn_dropout > 0):
        return attn + _mla_attention_bytes(spec, n, hq, e, r, recompute) + _mlp_bytes(spec, moe, lay, wl, n, n_r, mask)
    attn += region_entry(spec, lay, wl, n, 2 if spec.is_mla else 3)
    if spec.is_mla:
        attn += _mla_latent_bytes(spec, n, e)
    if c > 1 and recompute == "selective":  # checkpoint keeps the core's inputs q, k, v; wo keeps its input
        attn += e * n * (hq * dk + hkv * (dk + dv) + hq * dv)
    elif c > 1:
        # MLA pads the narrower of q/k and v to one head size before ring / Ulysses (they move K and V as one
        # shape): the kernels' tensors have that size; wo's input is the output sliced back to v's
        kd = vd = max(dk, dv) if spec.is_mla else None
        kd, vd = kd or dk, vd or dv
        if lay.cp_impl == "ulysses":
            rep = c // hkv if hkv % c else 1
            attn += e * n * (hq * kd + rep * hkv * (kd + vd) + hq * vd + hq * dv) + lse
            attn += 2 * 8 * wl.seq_len  # gather / scatter permutations of the balanced order
        else:
            attn += e * n * (hq * kd + hkv * (kd + vd) + hq * vd) + e * n * hq * dv + lse
    elif spec.attn_dropout > 0:
        scores = lay.mb * hq * s_loc * wl.seq_len
        attn += (3 * e * scores if recompute == "none" else 0) + e * n * hq * (2 * dk + 2 * dv)
    else:
        attn += e * n * (hq * dk + hkv * (dk + dv) + hq * dv) + lse
    if spec.attn_output_gate:  # gated attention: out · sigmoid(gate) saves sigmoid's output, the product (wo's input)
        attn += 2 * e * n * hq * dv
    return attn + _mlp_bytes(spec, moe, lay, wl, n, n_r, mask)


def _linear_mixer_delta(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, recompute: str | None) -> float:
    """Gated DeltaNet layers save their mixer's tensors (`linear_attention.mixer_activation_bytes`; six linears
    share the region input) instead of attention's; selective recompute does not reach them, and a fully recomputed
    one keeps only its input, like any block."""
    if not stage.linear:
        return 0.0
    e, r, t, h = wl.act_bytes, wl.resid_bytes, lay.tp, spec.dim
    n = lay.mb * wl.seq_len // lay.cp
    n_r = n // t if lay.sp else n
    mask = e * n * h if spec.dropout > 0 else 0
    region = region_entry(spec, lay, wl, n, 6)
    linear = _norm_saved(n_r, h) + mask + region + mixer_activation_bytes(spec, lay.mb, wl.seq_len // lay.cp, t, e, lay.cp,
                                                                             lay.cp_order)
    out = 0.0
    for lin, rec in zip(stage.linear, stage.recomputed or (True,) * len(stage.linear)):
        mode = recompute or (lay.recompute if rec else "none")
        if lin and mode != "full":
            out += linear - (shardwise_layer_activation_bytes(spec, False, lay, wl, mode)
                             - _mlp_bytes(spec, False, lay, wl, n, n_r, mask))
    return out


def _column_region(spec: ModelSpec, lay: Layout) -> bool:
    """TP without SP runs q/k/v (and w1/w3) as one `ColumnRegion` autograd function: it saves the region's input
    once, in the residual's dtype, and no bf16 weight copies (its weights stay on ctx). MLA enters by Megatron's
    f instead, its projections plain linears."""
    return lay.tp > 1 and not lay.sp


def _mla_latent_bytes(spec: ModelSpec, n: int, e: int) -> int:
    """MLA's low-rank latents (replicated over tp: every rank's sequence): each fp32 latent norm saves its input
    (the down-projection's output, or its fp32 copy), x·rsqrt and the rsqrt; the up-projection saves the norm's
    output in the activation dtype. In fp32 the kv norm's input is a view of wkv_a's whole output [c_kv | k_rope]
    (under bf16 its fp32 copy of c_kv). RoPE on the rotary parts saves only views of the cos/sin tables."""
    ranks = [x for x in (spec.q_lora_rank, spec.kv_lora_rank) if x]
    kv_view = 4 * n * spec.qk_rope_dim if e == 4 else 0
    return sum(8 * n * x + 4 * n + e * n * x for x in ranks) + kv_view


def _mla_attention_bytes(spec: ModelSpec, n: int, hq: int, e: int, r: int, recompute: str) -> int:
    """MLA at cp=1 (or its checkpointed core under cp), past the block's norm: the region input (wq_a / wq and
    wkv_a), the latents, then the core. `MLA.core` pads the narrower of q/k and v with zero columns to one head
    size d so SDPA runs a flash kernel (CPU and CUDA flash need one head size; otherwise the math path would
    store the s×s scores): it saves q, k, v and the output at d and the fp32 LSE; wo's input is a copy of the
    output when anything was padded (sliced back to v's size, or laid out [b, h, s, d] by padded q).
    Selective recompute keeps the core's (unpadded) inputs instead."""
    dk, dv = spec.k_dim, spec.v_dim
    d = max(dk, dv)
    out = region_input(n, spec.dim, 2, e, r) + _mla_latent_bytes(spec, n, e)
    wo_in = e * n * hq * dv
    kv_b = e * n * hq * (spec.head_dim + dv)  # an unpadded v is a view of wkv_b's output [k_nope | v]
    if recompute == "selective":  # checkpoint keeps the unpadded inputs; wo its input
        return out + e * n * hq * 2 * dk + kv_b + wo_in
    v = kv_b if dv == d else e * n * hq * d
    return out + e * n * hq * 3 * d + v + 4 * n * hq + (wo_in if dv != dk else 0)


def _mlp_bytes(spec: ModelSpec, moe: bool, lay: Layout, wl: Workload, n: int, n_r: int, mask: int) -> int:
    """The feed-forward half of a block (see `shardwise_layer_activation_bytes`)."""
    e, t, h, r = wl.act_bytes, lay.tp, spec.dim, wl.resid_bytes
    mlp = _norm_saved(n_r, h) + mask
    if not moe:
        swiglu = spec.mlp == "swiglu"
        mlp += region_entry(spec, lay, wl, n, 2 if swiglu else 1)
        mlp += (4 if swiglu else 2) * e * n * (spec.ffn_dim // t)
        return mlp
    k, E, f_e = spec.moe_topk, spec.moe_experts, spec.expert_ffn_dim
    rows = n_r * k
    # the router's fp32 input (the norm output itself when it is fp32, else its fp32 copy) and the shared experts'
    # w1 / w3 input (the same storage in fp32)
    gate = spec.moe_shared_gate and spec.moe_shared_experts  # Qwen3-Next: sigmoid(w·x) times the shared experts
    mlp += 4 * n_r * h + (region_input(n_r, h, 3 if gate else 2, e, r) if spec.moe_shared_experts and e != 4 else 0)
    mlp += 4 * n_r * (2 * E + 1) + 8 * rows + 4 * E  # router: logits, probs, LSE (fp32), top-k indices, counts
    if spec.moe_score == "sigmoid":  # the scores' row sums; with renormalised top-k its weights and their sums
        mlp += 4 * n_r + (4 * n_r + 4 * rows if spec.moe_norm_topk else 0)
    elif not spec.moe_softmax_before_topk:  # softmax over the k chosen logits saves its output
        mlp += 4 * rows
    kept = moe_skew.kept_rows(spec, lay, wl, n_r)  # what a capacity factor leaves of the n_r·k (all, dropless)
    mlp += 8 * rows + 8 * kept + e * kept  # dispatch: send order (all n_r·k), token index (int64), assignment weights
    mlp += 4 * (E // lay.ep)  # the grouped GEMM's int32 offsets
    got = moe_skew.busiest_rows(spec, lay, wl, n_r)  # what this rank's experts receive: rows, or the busiest's
    mlp += e * got * h  # received rows in the compute dtype (the grouped GEMM's input)
    if lay.ep > 1 and E // lay.ep > 1:
        mlp += 2 * 8 * got  # regroup permutation and its inverse
    mlp += 4 * e * got * f_e  # w1 out, silu out, w3 out, product
    mlp += gpt_oss.expert_activation_bytes(spec, e, got)  # gpt-oss: the clamped SwiGLU's and biases' extras
    mlp += 2 * e * kept * h  # combined rows and their router-weighted copy
    mlp += 4 * e * n_r * spec.moe_shared_experts * f_e
    if gate:  # sigmoid(gate(x)) · shared saves the shared experts' output [n_r, h] and sigmoid's [n_r, 1]
        mlp += e * n_r * h + e * n_r
    return mlp


def layer_activation_bytes(spec: ModelSpec, moe: bool, lay: Layout, wl: Workload, recompute: str | None = None,
                           model: str = "shardwise") -> float:
    """Bytes one layer keeps for backward per microbatch on one rank, under activation `model`."""
    if model == "shardwise":
        return shardwise_layer_activation_bytes(spec, moe, lay, wl, recompute)
    if model == "korthikanti":
        return korthikanti_layer_activation_bytes(spec, moe, lay, wl, recompute)
    raise ValueError(f"activation model {model!r}; valid: {', '.join(ACTIVATION_MODELS)}")


def korthikanti_layer_activation_bytes(spec: ModelSpec, moe: bool, lay: Layout, wl: Workload,
                                       recompute: str | None = None) -> float:
    """Bytes one layer keeps for backward per microbatch on one rank (Korthikanti, generalised)."""
    recompute = recompute or lay.recompute
    e, t, h = wl.act_bytes, lay.tp, spec.dim
    s_loc = wl.seq_len // lay.cp
    tokens = lay.mb * s_loc
    rep = 1 / t if lay.sp else 1.0  # share of a "replicated region" tensor a rank keeps
    if recompute == "full":
        return e * tokens * h * rep
    hq, hkv = spec.n_heads // t, local_kv_heads(spec, t)
    mask = 1.0 if spec.dropout > 0 else 0.0
    # Attention: norm input and output, Q and K, V, (scores), out-projection input, residual dropout mask.
    attn = 2 * e * tokens * h * rep + e * tokens * (hq + hkv) * spec.k_dim + e * tokens * hkv * spec.v_dim
    attn += e * tokens * hq * spec.v_dim + mask * tokens * h * rep
    if spec.is_mla:  # compressed latents before and after their norms, replicated over tp like the down-projections
        attn += 2 * e * tokens * (spec.q_lora_rank + spec.kv_lora_rank + spec.qk_rope_dim) * rep
    if recompute == "none":
        scores = lay.mb * hq * s_loc * wl.seq_len  # each local query row against every key
        attn += e * scores + ((1 + e) * scores if spec.attn_dropout > 0 else 0)
    # MLP: norm input and output, the inner activations, residual dropout mask.
    mlp = 2 * e * tokens * h * rep + mask * tokens * h * rep
    inner = 3 if spec.mlp == "swiglu" else 2
    if not moe:
        mlp += inner * e * tokens * (spec.ffn_dim // t)
    else:
        routed = moe_skew.busiest_rows(spec, lay, wl, tokens)  # rows this rank's experts process (mean: k·tokens)
        mlp += 4 * tokens * spec.moe_experts  # fp32 router probabilities
        mlp += 2 * e * routed * h + inner * e * routed * (spec.expert_ffn_dim // t)  # dispatched in, out before combine
        mlp += inner * e * tokens * spec.moe_shared_experts * (spec.expert_ffn_dim // t)
    return attn + mlp


def head_activation_bytes(spec: ModelSpec, lay: Layout, wl: Workload, model: str = "shardwise") -> float:
    """The LM head of one microbatch: cross-entropy keeps the fp32 softmax over the local (padded) vocabulary;
    shardwise's head also saves the final norm, the head's input, and int64 targets plus two bool masks."""
    n = lay.mb * wl.seq_len // lay.cp
    softmax = 4.0 * n * (padded_vocab(spec, lay.tp) // lay.tp)
    if model == "korthikanti":
        return softmax
    n_r = n // lay.tp if lay.sp else n
    head_in = region_input(n, spec.dim, 1, wl.act_bytes, wl.resid_bytes)
    return softmax + _norm_saved(n_r, spec.dim) + head_in + (INT64 + 2 * BOOL) * n


def head_loss_saved_bytes(spec: ModelSpec, lay: Layout, wl: Workload) -> float:
    """What the head's loss saves of `head_activation_bytes`, made only after the head's matmul: the fp32
    softmax over the local vocabulary, the int64 targets and two bool masks."""
    n = lay.mb * wl.seq_len // lay.cp
    return 4.0 * n * (padded_vocab(spec, lay.tp) // lay.tp) + (INT64 + 2 * BOOL) * n


def layer_cast_terms(spec: ModelSpec, moe: bool, lay: Layout, linear: bool = False,
                     fp8: bool = False) -> dict[str, int]:
    """Elements of the weights bf16 autocast casts in one layer of this kind (a Gated DeltaNet layer when `linear`),
    by the module that casts them: the linear (and convolution) ops save their weight's cast for backward. Norms,
    biases, A_log / dt_bias and the MoE router (fp32 routing, autocast off) are not cast. TP without SP runs the
    mixer's input projections (attention's q/k/v; Gated DeltaNet's q/k/v/z/b/a) and a dense MLP's w1/w3 in a
    `ColumnRegion` function, which keeps the fp32 weights on ctx: no casts there. A split backward (zb / dualpipev
    on a pipeline) keeps every tp linear's fp32 weight on ctx too (`grad_store`): only the routed experts cast.
    Under --fp8 (`fp8`) the FP8 linears (`planner.fp8`) keep their fp32 weight on ctx and cast it to FP8 in each GEMM:
    only the convolution kernels and Qwen3-Next's shared-expert gate are cast."""
    split = lay.pp > 1 and lay.schedule in ("zb", "dualpipev")
    terms = dict(_cast_terms(spec, moe, linear, lay.tp, lay.ep, _column_region(spec, lay), split))
    if fp8:
        gate = spec.dim if moe and spec.moe_shared_gate else 0
        terms = {k: v if "conv kernels" in k else gate if k.startswith("MoE shared") else 0 for k, v in terms.items()}
    return terms


@functools.lru_cache(maxsize=4096)
def _cast_terms(spec: ModelSpec, moe: bool, linear: bool, t: int, ep: int, region: bool,
                split: bool) -> tuple[tuple[str, int], ...]:
    """`layer_cast_terms`, cached: the search asks for every layout's stages."""
    h = spec.dim
    out: dict[str, int] = {}
    if linear:  # wq, wk, wv, wz, wb, wa [rows, h]; the depthwise kernels, concatenated then cast by conv1d; wo
        nk, nv = spec.linear_k_heads // t, spec.linear_v_heads // t
        qk, v = nk * spec.linear_k_dim, nv * spec.linear_v_dim
        out["Gated DeltaNet wq, wk, wv, wz, wb, wa"] = 0 if region else h * (2 * qk + 2 * v + 2 * nv)
        out["Gated DeltaNet conv kernels (concatenated) [qkv, K]"] = (2 * qk + v) * spec.linear_conv_kernel
        out["Gated DeltaNet wo"] = v * h
    else:
        mixer = Params.of(attention_tensors(spec, t))
        cast = mixer.total - mixer.vectors
        if region and not spec.is_mla:  # MLA enters by Megatron's f instead: its projections stay plain linears
            hq, hkv = spec.n_heads // t, local_kv_heads(spec, t)
            cast -= h * spec.head_dim * (hq * (2 if spec.attn_output_gate else 1) + 2 * hkv)
        if spec.is_dsa:  # the indexer runs without gradient: autocast's copies of its weights are not saved
            cast -= (spec.q_lora_rank * spec.index_n_heads * spec.index_head_dim
                     + h * (spec.index_head_dim + spec.index_n_heads))
        out["MLA wq_a, wq_b, wkv_a, wkv_b, wo" if spec.is_mla else "attention wq, wk, wv, wo"] = cast
    mlp = Params.of(mlp_tensors(spec, moe, t, ep))
    if not moe:
        w13 = 2 * h * (spec.ffn_dim // t) if spec.mlp == "swiglu" else h * (spec.ffn_dim // t)
        out["MLP w1, w3 (GELU: fc1)"] = 0 if region and spec.mlp == "swiglu" else w13
        out["MLP w2 (the down-projection)"] = h * (spec.ffn_dim // t)
    else:
        out["MoE routed experts' stacks"] = mlp.expert
        out["MoE shared experts (and their gate)"] = mlp.total - mlp.vectors - mlp.expert - spec.moe_experts * h
    return tuple((k, v if k == "MoE routed experts' stacks" or not split else 0) for k, v in out.items())


def _held_layers(stage: Stage) -> list[tuple[bool, bool]]:
    """(MoE, Gated DeltaNet) of each layer `stage` holds."""
    kinds = stage.kinds or (False,) * stage.n_dense + (True,) * stage.n_moe
    return list(zip(kinds, stage.linear or (False,) * len(kinds)))


def autocast_weight_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """bf16 autocast: every linear saves a bf16 copy of its (fp32 master) weight for backward, once per
    microbatch, since each microbatch's forward runs in its own autocast region: each held layer's
    `layer_cast_terms` (a Gated DeltaNet layer's own, not attention's), and the LM head's. 0 for fp32 runs, and for
    the layers full recompute reaches (the copies would be recomputed with the layer; the LM head, outside every
    checkpoint, still saves its copy: `microbatch_activation_bytes` counts it with the head)."""
    if wl.act_bytes == 4:
        return 0.0
    if lay.recompute == "full":  # --recompute-layers: the layers not recomputed save theirs (the head's: see above)
        held = _held_layers(stage)
        plain = [k for k, r in zip(held, stage.recomputed or (True,) * len(held)) if not r] if stage.recomputed else []
        if not plain:
            return 0.0
        moes = [m for m, _ in plain]
        one = Stage(stage.index, moes.count(False), moes.count(True), False, False, tuple(moes),
                    linear=tuple(lin for _, lin in plain))
        return autocast_weight_bytes(spec, one, dataclasses.replace(lay, recompute="none"), wl)
    split = lay.pp > 1 and lay.schedule in ("zb", "dualpipev")  # the head keeps its fp32 weight on ctx too
    head = padded_vocab(spec, lay.tp) // lay.tp * spec.dim if stage.head and not split else 0
    layers = sum(sum(layer_cast_terms(spec, moe, lay, lin, bool(wl.fp8)).values()) for moe, lin in _held_layers(stage))
    return float(wl.act_bytes * (layers + head))


def microbatch_activation_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload,
                                model: str = "shardwise", recompute: str | None = None) -> dict:
    """What one microbatch's forward through this stage's chunks saves for backward, by part:
    {layers, head, embedding, rope, weights, total}. The "shardwise" embedding part is its int64 token ids
    (under tp: the shifted local ids and the out-of-shard mask), rope the fp32 cos/sin tables of each chunk."""
    # under --recompute-layers the rest of each chunk's layers run without recompute
    (dense, moe), plain = stage.recompute_split(lay) if recompute is None else ((stage.n_dense, stage.n_moe), (0, 0))
    layers = sum(n * layer_activation_bytes(spec, k, lay, wl, recompute, model)
                 for k, n in ((False, dense), (True, moe)) if n)
    layers += sum(n * layer_activation_bytes(spec, k, lay, wl, "none", model) for k, n in zip((False, True), plain) if n)
    layers += _linear_mixer_delta(spec, stage, lay, wl, recompute) if model == "shardwise" else 0.0
    n = lay.mb * wl.seq_len // lay.cp
    head = head_activation_bytes(spec, lay, wl, model) if stage.head else 0.0
    out = {"layers": layers,
           "head": head, "embedding": 0.0, "rope": 0.0, "weights": 0.0}
    if stage.head and spec.mtp_layers:  # the MTP modules run after the head, on the last stage: held like it;
        # recompute does not reach their blocks, and bf16 autocast saves their linears' weight copies
        mtp_per = {moe: layer_activation_bytes(spec, moe, lay, wl, "none", model) for moe in (False, True)}
        if model == "shardwise":
            out["weights"] += mtp_weight_copies(spec, stage, lay, wl)
        out["head"] += mtp_activation_bytes(spec, mtp_per.get, n, n // lay.tp if lay.sp else n,
                                            padded_vocab(spec, lay.tp) // lay.tp, wl.act_bytes, wl.resid_bytes, lay.tp,
                                            lay.sp)
    if model == "shardwise":
        out["embedding"] = float((INT64 + (BOOL if lay.tp > 1 else 0)) * n if stage.embedding else 0)
        # apply_rope's real arithmetic saves views of the fp32 cos/sin tables each chunk builds (one storage
        # each, shared by all its layers; under full recompute the checkpoints keep the same tables)
        chunks = sum(1 for o in chunk_owners(lay) if o == stage.index)
        rope_dim = spec.qk_rope_dim if spec.is_mla else spec.k_dim  # MLA rotates only the rope parts
        out["rope"] = float(4 * (wl.seq_len // lay.cp) * rope_dim * chunks if not spec.learned_pos else 0)
        out["weights"] += autocast_weight_bytes(spec, stage, lay, wl)
        if stage.head and lay.recompute == "full" and wl.act_bytes != 4:  # the head is never recomputed
            out["head"] += wl.act_bytes * padded_vocab(spec, lay.tp) // lay.tp * spec.dim
    out["total"] = sum(out.values())
    return out


def stage_activation_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload,
                           model: str = "shardwise") -> float:
    """Peak activation bytes on one rank of `stage`: its microbatch figure (head excluded) for every
    microbatch in flight (its layers' part by `layer_flight`), the head's for one (GPipe: for every microbatch, since all forwards run before the
    first backward), and under full recompute one layer's full activations."""
    mb = microbatch_activation_bytes(spec, stage, lay, wl, model)
    flight = in_flight(lay, stage.index)
    heads = flight if lay.schedule == "gpipe" and lay.pp > 1 else 1
    once = mb["head"] + (head_weight_copies(spec, stage, lay, wl) if model == "shardwise" else 0.0)
    held = (mb["total"] - once - mb["layers"]) * flight + once * heads
    return held + mb["layers"] * layer_flight(spec, stage, lay) + recompute_transient_bytes(spec, stage, lay, wl, model)


def layer_flight(spec: ModelSpec, stage: Stage, lay: Layout) -> float:
    """Microbatches in flight in units of the stage's layers: `in_flight`, except under interleaving with chunks
    of unequal layer counts (uneven --pp-layers, e.g. DeepSeek-V3's head stage of 2, 2, 2, 1), where the rank's
    schedule keeps more of one chunk in flight than of another: the most layers its in-flight chunks hold at any
    forward of its action list, over the stage's layers."""
    chunks = [len(ids) for _, ids in _stage_chunks(spec, lay, stage)]
    if lay.pp == 1 or lay.schedule != "interleaved" or len(set(chunks)) < 2:
        return in_flight(lay, stage.index)
    most = _most_layers_held(lay.schedule, lay.pp, lay.m, lay.vp, stage.index, tuple(chunks))
    return in_flight(lay, stage.index) if most is None else most / sum(chunks)


@functools.lru_cache(maxsize=1024)
def _most_layers_held(schedule: str, p: int, m: int, v: int, k: int, chunks: tuple[int, ...]) -> int | None:
    """The most layers rank k's in-flight chunks hold at any point of its action list (`chunks`: each chunk's
    layer count), or None without the schedule; cached: the search asks about every stage of every layout."""
    steps = _chunk_steps(schedule, p, m, v)
    if steps is None:
        return None
    held = most = 0
    for sign, chunk in steps[k]:
        held += sign * chunks[chunk]
        most = max(most, held)
    return most


@functools.lru_cache(maxsize=64)
def _chunk_steps(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """Per rank, its forwards (+1) and backwards (−1) by chunk in its schedule's order; the schedule built once."""
    try:
        from shardwise.rules.schedules import build_schedule

        ranks = build_schedule(schedule, p, m, v).actions
    except (ImportError, ValueError):
        return None
    return tuple(tuple((1 if a.kind == "F" else -1, a.chunk) for a in actions if a.kind in ("F", "B"))
                 for actions in ranks)


def head_weight_copies(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """The bf16 weight copies of `microbatch_activation_bytes`' "weights" that the LM head and the MTP modules
    save: held, like the head's other tensors, only by a microbatch between the last chunk's F and its B — one
    at a time outside GPipe (on an interleaved last stage more chunks are in flight, not more heads)."""
    if not stage.head or wl.act_bytes == 4:
        return 0.0
    mtp = mtp_weight_copies(spec, stage, lay, wl)
    if lay.recompute == "full":  # the head's own copy is counted with the head already; the MTP's is in "weights"
        return mtp
    split = lay.pp > 1 and lay.schedule in ("zb", "dualpipev")  # the head keeps its fp32 weight on ctx
    return mtp + (0.0 if split else float(wl.act_bytes * padded_vocab(spec, lay.tp) // lay.tp * spec.dim))


def mtp_weight_copies(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """The bf16 autocast casts the D MTP modules' linears save (eh_proj, each block's projections) for one
    microbatch on the head's stage: recompute never reaches the modules, so they are saved under every recompute
    mode, and freed by the microbatch's last-chunk backward like the head's tensors."""
    if not (stage.head and spec.mtp_layers) or wl.act_bytes == 4:
        return 0.0
    blocks = [spec.is_moe_layer(spec.n_layers + k) for k in range(spec.mtp_layers)]
    mtp_stage = Stage(stage.index, blocks.count(False), blocks.count(True), False, False, tuple(blocks))
    return autocast_weight_bytes(spec, mtp_stage, dataclasses.replace(lay, recompute="none"), wl)


def recompute_transient_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload,
                              model: str = "shardwise") -> float:
    """Under full recompute, the layer being recomputed (the largest kind recomputed) materialises its full
    activations once more (during its backward only: checkpoint holds them in its own frame, not as saved
    tensors). Under --recompute-layers N the recomputed layers are each chunk's first N, so their backward
    comes after the chunk's other layers' backward has freed that microbatch's saved tensors of them (with
    their weight copies): the net growth over the held activations, at least 0."""
    (dense, moe), plain = stage.recompute_split(lay)
    if lay.recompute != "full" or not dense + moe:
        return 0.0
    kinds = [k for k, n in ((False, dense), (True, moe)) if n]
    rebuilt = max(layer_activation_bytes(spec, moe, lay, wl, "none", model) for moe in kinds)
    if stage.linear and model == "shardwise":  # a Gated DeltaNet layer rebuilds its own mixer's tensors
        one = Stage(0, 1, 0, False, False, (False,), linear=(True,))
        rebuilt += max(0.0, _linear_mixer_delta(spec, one, lay, wl, "none"))
    if not sum(plain):
        return rebuilt
    return max(0.0, rebuilt - min(_plain_chunk_bytes(spec, lay, wl, ids, model)
                                  for j, ids in _stage_chunks(spec, lay, stage)))


def _stage_chunks(spec: ModelSpec, lay: Layout, stage: Stage) -> list[tuple[int, range]]:
    """(chunk, its global layer ids) of every chunk `stage` holds."""
    return [(j, ids) for j, (o, ids) in enumerate(zip(chunk_owners(lay), chunk_layer_ids(spec, lay))) if o == stage.index]


def _plain_chunk_bytes(spec: ModelSpec, lay: Layout, wl: Workload, ids: range, model: str) -> float:
    """One microbatch's saved tensors (and bf16 weight copies) of a chunk's layers that are not recomputed."""
    kinds = [spec.is_moe_layer(i) for i in ids[lay.recompute_layers:]]
    plain = Stage(0, kinds.count(False), kinds.count(True), False, False, tuple(kinds),
                  linear=tuple(spec.is_linear_layer(i) for i in ids[lay.recompute_layers:]))
    eager = dataclasses.replace(lay, recompute="none", recompute_layers=None)
    acts = sum(layer_activation_bytes(spec, k, lay, wl, "none", model) for k in kinds)
    return acts + (autocast_weight_bytes(spec, plain, eager, wl) if model == "shardwise" and kinds else 0.0)


def rebuilt_weight_copies(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, moe: bool | None = None) -> float:
    """Under bf16 full recompute, the rebuilt layer's bf16 weight casts alive during its MLP's backward: the
    recompute runs with autocast's cache off (`recompute._uncached`), so each linear casts its weight again, and the
    casts its matmuls save stay in the checkpoint's recomputed frame until their own backward. Of the layer's
    `layer_cast_terms` that leaves the mixer's (attention's, MLA's five or Gated DeltaNet's, all alive until the
    mixer's backward) and a dense MLP's w1/w3: the down-projection's backward has run; in an MoE block the shared
    experts (computed after the routed experts' combine, so backwarded before them) are gone by the routed experts'
    GEMMs, whose own casts are that moment's (`weight_grads`). `moe`: that kind (if recomputed here), else the
    largest of the kinds recomputed."""
    if wl.act_bytes == 4 or lay.recompute != "full":
        return 0.0
    held = _held_layers(stage)
    rec = [k for k, r in zip(held, stage.recomputed or (True,) * len(held)) if r]
    gone = ("MLP w2 (the down-projection)", "MoE routed experts' stacks", "MoE shared experts (and their gate)")
    eager = dataclasses.replace(lay, recompute="none", recompute_layers=None)
    out = 0
    for kind, lin in set(rec):
        if moe in (None, kind):
            out = max(out, sum(v for k, v in layer_cast_terms(spec, kind, eager, lin, bool(wl.fp8)).items()
                               if k not in gone))
    return float(wl.act_bytes * out)
