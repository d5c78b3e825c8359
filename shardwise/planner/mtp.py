"""DeepSeek-V3 multi-token prediction in the planner (the trainer's side: shardwise/models/mtp.py, docs/mtp.md).

The D MTP modules live on the last pipeline stage. Module k (0-based) holds enorm, hnorm, eh_proj [d, 2d]
(replicated over tp: its gradient is TP-partial under SP, like the norms), a transformer block of layer
n_layers + k (MoE or dense by the model's own rule) and shared_head.norm; the embedding and the LM head are the
model's. A last stage without the embedding holds a copy of it (its vocabulary shard) unless the embedding is
tied, in which case the head's copy serves; the copy's gradient is summed over the "emb" group once per step.
Each module runs its block, one more LM head and cross-entropy per microbatch.
"""
from __future__ import annotations

from shardwise.planner.models import BOOL, INT64, ModelSpec, Tensor, embedding_tensors, mtp_module_tensors


def embedding_copy(spec: ModelSpec, embedding: bool) -> bool:
    """Whether a last stage holds an embedding copy for MTP: it lacks the embedding, and the head is untied."""
    return bool(spec.mtp_layers) and not embedding and not spec.tie_embeddings


def mtp_stage_tensors(spec: ModelSpec, embedding: bool, tp: int = 1, ep: int = 1) -> list[Tensor]:
    """What the MTP adds to a last stage, in parameter order: the D modules, then the embedding copy if any."""
    out = [x for k in range(spec.mtp_layers) for x in mtp_module_tensors(spec, k, tp, ep)]
    return out + (embedding_tensors(spec, tp) if embedding_copy(spec, embedding) else [])


def mtp_activation_bytes(spec: ModelSpec, layer_bytes, tokens: int, tokens_local: int, vocab_local: int,
                         act_bytes: int, resid_bytes: int, tp: int, sp: bool) -> float:
    """Saved for backward by the D modules per microbatch (`layer_bytes(moe)`: a block's figure). Each module:
    enorm (fp32 input, x·rsqrt, rsqrt), hnorm (x·rsqrt, rsqrt, and the fp32 copy of a bf16 input; an fp32 input
    is the hidden the previous head keeps), the eh_proj input (2d per token of the rank's sequence) and under bf16
    autocast its weight copy, the block, shared_head.norm, what the LM head reads (the stacked [h; norm(h)]
    output, or under SP the all-gathered norm(h)), the fp32 softmax over the local vocabulary and the loss scalar.
    Under SP the LM head keeps the gathered copy, so an fp32 hnorm input is held for it: the main model's normed
    hidden and each earlier module's stacked output. int64 ids and labels: without tp one [D, b, s] tensor each;
    under tp per module the embedding's shifted ids and mask and the vocabulary-parallel cross-entropy's local
    targets and two masks. Once: the summed loss."""
    n, d, depth = tokens_local, spec.dim, spec.mtp_layers
    norms = (8 * d + 4) + ((4 if resid_bytes == 4 else 8) * d + 4) + (8 * d + 4)
    head_in = resid_bytes * tokens * d if sp else 2 * resid_bytes * n * d
    module = ((norms + act_bytes * 2 * d) * n + head_in + 4 * tokens * vocab_local + 4
              + ((INT64 + BOOL + INT64 + 2 * BOOL) * tokens if tp > 1 else 0) + (act_bytes * 2 * d * d if act_bytes != 4 else 0))
    once = 8 + (0 if tp > 1 else 2 * INT64 * tokens * depth)
    if sp and resid_bytes == 4:
        once += resid_bytes * n * d * (1 + 2 * (depth - 1))
    return sum(layer_bytes(spec.is_moe_layer(spec.n_layers + k)) + module for k in range(depth)) + once
