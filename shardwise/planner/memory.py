"""Memory per rank: parameters and optimizer state (static), and activations (per microbatch in flight).

Static: shardwise keeps fp32 parameters (they are the master copy; bf16 is autocast on the fly), fp32
gradients and two fp32 Adam moments, 16 bytes per parameter — the same total as the classic
"bf16 weights + bf16 grads + fp32 master + Adam" split of the ZeRO paper. ZeRO-1 shards the moments over
dp×cp (expert weights: over the expert-data-parallel group), ZeRO-2 also the grads, ZeRO-3 also the
weights; shards are padded up like shardwise's flat ZeRO-1 buffer.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", §4), term by term, generalised to GQA, SwiGLU and MoE: with e-byte activations and 1-byte
dropout masks a GPT layer stores s·b·h·(34 + 5·a·s/h) bytes at e=2; tensor parallelism divides the 24
sbh of sharded terms and the attention scores; sequence parallelism also divides the 10 replicated sbh;
selective recompute drops the attention-score terms; full recompute keeps only each layer's input.
A stage holds that per-layer figure for every microbatch its schedule keeps in flight
(`schedule.in_flight`), plus the last stage's fp32 logits for one microbatch.
"""
from __future__ import annotations

from shardwise.planner.layout import Layout, Stage, Workload
from shardwise.planner.models import (
    ModelSpec, Params, Tensor, embedding_tensors, head_tensors, layer_params, layer_tensors, local_kv_heads,
    padded_vocab,
)
from shardwise.planner.schedule import in_flight

BYTES_WEIGHT, BYTES_GRAD, BYTES_ADAM = 4, 4, 8


def stage_tensors(spec: ModelSpec, stage: Stage, lay: Layout) -> list[Tensor]:
    """The parameter tensors one rank of `stage` holds, in shardwise's named_parameters order."""
    t, ep = lay.tp, lay.ep
    out = embedding_tensors(spec, t) if stage.embedding else []
    out += list(layer_tensors(spec, False, t, ep)) * stage.n_dense + list(layer_tensors(spec, True, t, ep)) * stage.n_moe
    if stage.head:
        out += head_tensors(spec, t, separate_copy=not stage.embedding)
    return out


def stage_params(spec: ModelSpec, stage: Stage, lay: Layout) -> Params:
    """Parameters one rank of this stage holds (tp shards, ep shards, padded vocab rows included)."""
    t, ep = lay.tp, lay.ep
    p = layer_params(spec, False, t, ep) * stage.n_dense + layer_params(spec, True, t, ep) * stage.n_moe
    if stage.embedding:
        p = p + Params.of(embedding_tensors(spec, t))
    if stage.head:
        p = p + Params.of(head_tensors(spec, t, separate_copy=not stage.embedding))
    return p


def _shard(n: int, group: int) -> int:
    return -(-n // group)


def static_bytes(local: Params, lay: Layout) -> dict:
    """Weights, grads and optimizer state of one rank, as ZeRO stage `lay.zero` divides them."""
    g = lay.dp * lay.cp
    ge = max(1, g // lay.ep)

    def part(bytes_per: int, sharded: bool) -> int:
        if not sharded:
            return bytes_per * local.total
        return bytes_per * (_shard(local.dense, g) + _shard(local.expert, ge))

    out = {
        "weights": part(BYTES_WEIGHT, lay.zero >= 3),
        "grads": part(BYTES_GRAD, lay.zero >= 2),
        "optimizer": part(BYTES_ADAM, lay.zero >= 1),
    }
    out["total"] = sum(out.values())
    return out


def layer_activation_bytes(spec: ModelSpec, moe: bool, lay: Layout, wl: Workload, recompute: str | None = None) -> float:
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
        routed = spec.topk * tokens  # tokens this rank's experts process on average (uniform routing)
        mlp += 4 * tokens * spec.n_experts  # fp32 router probabilities
        mlp += 2 * e * routed * h + inner * e * routed * (spec.expert_ffn_dim // t)  # dispatched in, out before combine
        mlp += inner * e * tokens * spec.n_shared_experts * (spec.expert_ffn_dim // t)
    return attn + mlp


def head_activation_bytes(spec: ModelSpec, lay: Layout, wl: Workload) -> float:
    """The fp32 vocab-parallel logits of one microbatch, which cross-entropy keeps for backward."""
    tokens = lay.mb * wl.seq_len // lay.cp
    return 4.0 * tokens * (padded_vocab(spec, lay.tp) // lay.tp)


def stage_activation_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload, per_layer: dict) -> float:
    """Peak activation bytes on one rank of `stage`; `per_layer` maps moe(bool) → layer_activation_bytes."""
    held = (stage.n_dense * per_layer[False] + stage.n_moe * per_layer[True]) * in_flight(lay, stage.index)
    if lay.recompute == "full" and stage.n_layers:
        # The layer being recomputed materialises its full activations once more.
        kinds = [moe for moe, n in ((False, stage.n_dense), (True, stage.n_moe)) if n]
        held += max(layer_activation_bytes(spec, moe, lay, wl, recompute="none") for moe in kinds)
    if stage.head:
        held += head_activation_bytes(spec, lay, wl)
    return held
