"""Model FLOPs: what one token costs each layer, and one optimizer step the whole job — the count MFU's numerator
uses (`training.observe`) and the planner's step time starts from.

Narayanan et al. 2021 (SC'21, §5.1) generalised from GPT's 24h² matmul FLOPs per token and layer to the model's
real projections (GQA, SwiGLU, MoE routed + shared experts, MLA, Gated DeltaNet): forward = 2 × matmul weights a
token passes through + the attention core (4·s·h for full attention, no causal discount, as in the paper; a sliding
window's min(W, s) keys; DeepSeek Sparse Attention's min(k, s) selected keys, plus its indexer's forward) + 2·h·V
for the LM head; backward is twice the forward. Model FLOPs exclude recomputation;
hardware FLOPs add the attention core (selective) or every layer's forward (full) once more.

The config is read duck-typed (a trainer `ModelConfig` or the planner's `ModelSpec`: GPT-2's GELU MLP, 2 matrices,
is read with `getattr`).
"""
from __future__ import annotations

from shardwise.rules.inventory import CHUNK


def k_dim(cfg) -> int:
    """Per-head query/key width (MLA: nope + rope part)."""
    return cfg.head_dim + cfg.qk_rope_dim if cfg.is_mla else cfg.head_dim


def v_dim(cfg) -> int:
    return cfg.v_head_dim if cfg.is_mla else cfg.head_dim


def local_kv_heads(cfg, tp: int) -> int:
    """K/V heads attention sees on one tp rank (MLA decompresses one per query head): a 1/tp share, or one whole
    replicated head when there are fewer than tp."""
    return max((cfg.n_heads if cfg.is_mla else cfg.n_kv_heads) // tp, 1)


def mlp_mats(cfg) -> int:
    return 3 if getattr(cfg, "mlp", "swiglu") == "swiglu" else 2


def expert_ffn_dim(cfg) -> int:
    return cfg.moe_ffn_dim or cfg.ffn_dim


def layer_flops_per_token(cfg, moe: bool, seq_len: int, tp: int = 1, sp: bool = False) -> tuple[float, float]:
    """(matmul, attention-core) forward FLOPs per token of one layer on one tp rank (tp=1: the whole layer).

    shardwise replicates an MoE block over tp: without SP every tp rank runs it on all tokens, with SP on
    its s/tp shard (per token of the rank's sequence: 1/tp of the work).
    """
    h, hq = cfg.dim, cfg.n_heads // tp
    if cfg.is_mla:
        q = (h * cfg.q_lora_rank + cfg.q_lora_rank * hq * k_dim(cfg)) if cfg.q_lora_rank else h * hq * k_dim(cfg)
        kv = h * (cfg.kv_lora_rank + cfg.qk_rope_dim) + cfg.kv_lora_rank * hq * (cfg.head_dim + v_dim(cfg))
        attn = q + kv + hq * v_dim(cfg) * h
    else:
        attn = 2 * h * hq * cfg.head_dim + 2 * h * local_kv_heads(cfg, tp) * cfg.head_dim
        attn += h * hq * cfg.head_dim if cfg.attn_output_gate else 0  # gated attention: wq also yields the gate
    if moe:
        mlp = h * cfg.moe_experts + (cfg.moe_topk + cfg.moe_shared_experts) * mlp_mats(cfg) * h * expert_ffn_dim(cfg)
        mlp /= tp if sp else 1
    else:
        mlp = mlp_mats(cfg) * h * (cfg.ffn_dim // tp)
    core = 2.0 * seq_len * hq * (k_dim(cfg) + v_dim(cfg))
    if getattr(cfg, "index_topk", 0):  # DeepSeek Sparse Attention: k keys per query, and the indexer
        core = sparse_core_flops_per_token(cfg, seq_len, tp)
        proj, score = indexer_flops_per_token(cfg, seq_len)
        return 2.0 * (attn + mlp) + proj / 3, core + score / 3
    return 2.0 * (attn + mlp), core


def sparse_core_flops_per_token(cfg, seq_len: int, tp: int = 1) -> float:
    """DeepSeek Sparse Attention's core per token on one tp rank, as `models.sparse_attention` runs it in MLA's
    absorbed form: each head's logits over its min(k, s) selected latents (kv_lora_rank + qk_rope_dim) and the
    weighted sum of their latents (kv_lora_rank). (The absorption itself, W_ukᵀq and W_uv·o, is wkv_b's count.)"""
    keys = min(cfg.index_topk, seq_len)
    return 2.0 * keys * (cfg.n_heads // tp) * (2 * cfg.kv_lora_rank + cfg.qk_rope_dim)


def indexer_flops_per_token(cfg, seq_len: int) -> tuple[float, float]:
    """(projections, scores) forward FLOPs per token of one lightning indexer on every tp rank (replicated): wq_b,
    wk, weights_proj, then each head's q·k over all s keys (no causal discount, like the dense core) and the
    weighted sum over heads. It runs forward only (no gradient), so `layer_flops_per_token` adds a third of it to
    figures that count backward as twice the forward."""
    n, d = cfg.index_n_heads, cfg.index_head_dim
    proj = 2.0 * (cfg.q_lora_rank * n * d + cfg.dim * d + cfg.dim * n)
    return proj, 2.0 * seq_len * n * (d + 1)


def linear_flops_per_token(cfg, seq_len: int, tp: int = 1) -> tuple[float, float]:
    """(projection, core) forward FLOPs per token of one Gated DeltaNet (or Kimi Delta Attention) mixer on one tp
    rank, as the runtime computes it: the six input projections and `wo`; the core per value head and token, in
    chunks of C = 64: the conv (2·K per channel), k·kᵀ and q·kᵀ within the chunk (2·2·C·d_k), the two triangular solves
    (C·(d_v + d_k)), v_new = u − w·S and the state reads q·S (2·2·d_k·d_v), the intra-chunk product with
    v_new (2·C·d_v) and the state update kᵀ·v_new (2·d_k·d_v)."""
    h, C, kw = cfg.dim, CHUNK, cfg.linear_conv_kernel
    nk, nv = cfg.linear_k_heads // tp, cfg.linear_v_heads // tp
    dk, dv = cfg.linear_k_dim, cfg.linear_v_dim
    proj = 2.0 * h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + 2.0 * nv * dv * h
    if getattr(cfg, "kda", False):  # Kimi Delta Attention: q/k/v, β, the two gates' low-rank pairs (wf_a, wg_a
        # replicated over tp), wo; its core has Gated DeltaNet's shapes (the chunk products weigh channels instead)
        proj = 2.0 * h * (3 * nv * dv + nv) + 2 * 2.0 * (h * dv + nv * dv * dv) + 2.0 * nv * dv * h
    c = min(C, seq_len)
    core = 2.0 * kw * (2 * nk * dk + nv * dv)
    core += nv * (4.0 * c * dk + c * (dv + dk) + 6.0 * dk * dv + 2.0 * c * dv)
    return proj, core


def linear_layer_delta(cfg, seq_len: int, tp: int = 1) -> tuple[float, float]:
    """(matmul, core) forward FLOPs per token a Gated DeltaNet layer does beyond the attention layer
    `layer_flops_per_token` counts in its place (`linear_flops_per_token`)."""
    if not cfg.linear_layers:
        return 0.0, 0.0
    hq = cfg.n_heads // tp
    proj, core = linear_flops_per_token(cfg, seq_len, tp)
    attn = 2.0 * ((3 if cfg.attn_output_gate else 2) * cfg.dim * hq * cfg.head_dim
                  + 2 * cfg.dim * local_kv_heads(cfg, tp) * cfg.head_dim)
    return proj - attn, core - 2.0 * seq_len * hq * (k_dim(cfg) + v_dim(cfg))


def window_share(cfg, layer: int, seq_len: int) -> float:
    """The fraction of a full layer's attention-core model FLOPs layer `layer` has at `seq_len` tokens: each query
    against the min(W, s) keys its window holds (the model's own FLOPs; what the kernels run: the planner's
    `gpt_oss.work_share`)."""
    w = cfg.window(layer)
    return min(w, seq_len) / seq_len if w else 1.0


def mtp_flops_per_token(cfg, layer_flops, vocab_local: int) -> tuple[float, float]:
    """(matmul, attention-core) forward FLOPs per token of the D MTP modules on one rank: each module's eh_proj
    (2d → d, replicated), its block (`layer_flops(moe)` → the layers' per-token figures) and one more LM head."""
    matmul = core = 0.0
    for k in range(cfg.mtp_layers):
        mm, cc = layer_flops(cfg.is_moe_layer(cfg.n_layers + k))
        matmul += mm + 2.0 * 2 * cfg.dim * cfg.dim + 2.0 * cfg.dim * vocab_local
        core += cc
    return matmul, core


def model_flops(cfg, seq_len: int, global_batch: int, recompute: str = "none",
                recomputed: frozenset | None = None) -> float:
    """FLOPs of one optimizer step over the whole job (3× forward, plus the recomputation of the layers
    `recomputed`, every layer when None; the MTP modules are never recomputed)."""
    tokens = global_batch * seq_len
    per_kind = {moe: layer_flops_per_token(cfg, moe, seq_len) for moe in (False, True)}
    kinds = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    matmul = sum(per_kind[k][0] for k in kinds)
    core = sum(per_kind[k][1] * window_share(cfg, i, seq_len) for i, k in enumerate(kinds))
    again = [(i, k) for i, k in enumerate(kinds) if recomputed is None or i in recomputed]
    rec_mm = sum(per_kind[k][0] for _, k in again)
    rec_core = sum(per_kind[k][1] * window_share(cfg, i, seq_len) for i, k in again)
    mm, cc = mtp_flops_per_token(cfg, lambda moe: per_kind[moe], cfg.vocab_size)
    matmul, core = matmul + mm, core + cc
    d_mm, d_core = linear_layer_delta(cfg, seq_len)
    lin, lin_again = len(cfg.linear_layers), sum(1 for i, _ in again if cfg.is_linear_layer(i))
    matmul, core, rec_mm = matmul + lin * d_mm, core + lin * d_core, rec_mm + lin_again * d_mm
    # full recompute re-runs a linear layer's core; selective replays attention cores only, none in a linear layer
    rec_core += lin_again * (d_core if recompute == "full" else -per_kind[False][1])
    fwd = tokens * (matmul + core + 2.0 * cfg.dim * cfg.vocab_size)
    extra = {"none": 0.0, "selective": tokens * rec_core, "full": tokens * (rec_mm + rec_core)}[recompute]
    return 3.0 * fwd + extra


def high_precision_matmul_per_token(cfg, moe: bool, tp: int = 1, sp: bool = False) -> float:
    """Forward matmul FLOPs per token of one layer on one tp rank that `--fp8` leaves in high precision: an MoE
    block's router (and Qwen3-Next's shared-expert gate), replicated over tp, 1/tp of the tokens under SP. The rest
    of `layer_flops_per_token`'s matmul runs in FP8 (`shardwise.fp8.apply`)."""
    if not moe:
        return 0.0
    gate = 1 if getattr(cfg, "moe_shared_gate", False) else 0
    return 2.0 * cfg.dim * (cfg.moe_experts + gate) / (tp if sp else 1)


def mtp_high_precision_per_token(cfg, vocab_local: int, tp: int = 1, sp: bool = False) -> float:
    """The MTP modules' high-precision forward matmul FLOPs per token under `--fp8`: each eh_proj, LM head and its
    block's router."""
    return sum(2.0 * 2 * cfg.dim * cfg.dim + 2.0 * cfg.dim * vocab_local
               + high_precision_matmul_per_token(cfg, cfg.is_moe_layer(cfg.n_layers + k), tp, sp)
               for k in range(cfg.mtp_layers))


def fp8_peak_flops(gpu) -> float:
    """Dense FP8 peak of a `rules.hardware.GPU`; a GPU without FP8 tensor cores raises ValueError."""
    if gpu.peak_fp8_flops is None:
        raise ValueError(f"{gpu.name} has no FP8 tensor cores; --fp8 runs on GPUs with an FP8 peak: H100, H200, "
                         "B200, GB200, MI300X")
    return gpu.peak_fp8_flops


def peak_flops(gpu, precision: str) -> float:
    """Dense BF16 peak of a `rules.hardware.GPU`; fp32 runs on TF32 tensor cores at half that rate (every preset's
    datasheet)."""
    return gpu.peak_bf16_flops * (1.0 if precision == "bf16" else 0.5)
