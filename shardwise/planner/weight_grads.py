"""Weight gradients between the backward GEMM that makes them and their accumulation: short-lived, but for
the largest weights of a rank (the local experts' stacks, the LM head's table) gigabytes at one moment.

Autograd runs ready nodes latest-created first, and a weight's cast to the compute dtype was created before
the GEMMs that use it, so each GEMM's backward hands back its weight gradient in the compute dtype and that
gradient waits while the later-created nodes run; then the cast's backward makes the fp32 copy the
flat-buffer accumulation (`GradReducer`'s hook, or `.grad +=`) consumes.
* `GroupedExperts` under bf16: its three `_grouped_mm` backwards leave the stacks' bf16 gradients
  (`mlp_mats` × [E_l, ffn, h]) alive together, then the last-cast stack gets its fp32 copy. In fp32 (the
  per-expert loop) each expert's gradient slice is fp32 and `unbind`'s backward stacks one weight's slices
  into a fresh [E_l, ffn, h]: the same count, with 4 bytes for the compute dtype.
* The LM head (`Transformer.output`, V/tp rows): its matmul's backward makes the bf16 [V/tp, h] weight
  gradient and the input's gradient ([n, h]), then the fp32 copy of the weight gradient; the head's saved
  tensors (its input, the cached weight copy, the loss's softmax) are gone by then.
* The token embedding (V/tp rows, never cast): its backward makes a dense fp32 [V/tp, h] gradient, the
  last thing a first chunk's backward makes, when that microbatch's saved tensors are gone.
* The routed experts under --fp8 (`fp8.experts`: per-expert FP8 GEMMs, each stack unbound right before its own
  GEMMs): each stack's backward returns its experts' weight gradients in the weight's dtype (fp32) and unbind's
  backward, next in line, stacks them into a fresh [E_l, ffn, h] before the next stack's GEMMs run — one stack at a
  time, two fp32 copies of it; the FP8 operands (1 byte per element of the stack, the rows' casts) are freed before.
Under zb and dualpipev on a pipeline the tp linears' weight gradients come from the W action instead
(`weight_store`): the LM head's moment is not this one there.
"""
from __future__ import annotations

from shardwise.planner import moe_skew
from shardwise.planner.activations import head_activation_bytes, microbatch_activation_bytes
from shardwise.planner.layout import Layout, Stage, Workload, chunk_owners
from shardwise.planner.models import ModelSpec, padded_vocab


def expert_weight_grad_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """During an MoE layer's backward, after its experts' GEMMs: the stacks' weight gradients in the compute
    dtype (all `mlp_mats` of them), the fp32 copy of one, and the routed rows' input gradient (n_r·k rows
    of h in the compute dtype); the residual stream's two [n, h] gradients are alive beside them. The
    GEMMs' backwards have freed what they saved: the received rows and the four [rows, expert_ffn] tensors
    (`_mlp_bytes`; under full recompute, of the rebuilt layer), and the stacks' bf16 copies, which the held
    activations count (`autocast_weight_bytes`) unless the layer is recomputed (then made in backward)."""
    if not stage.n_moe:
        return 0.0
    e, r = wl.act_bytes, wl.resid_bytes
    n = lay.mb * wl.seq_len // lay.cp
    n_r = n // lay.tp if lay.sp else n
    stack = spec.moe_experts // lay.ep * spec.expert_ffn_dim * spec.dim
    if wl.fp8:  # the down-projection's stack, first backwarded: its fp32 gradient slices and their stacked copy;
        # its GEMMs have freed their input (the SwiGLU product) and made its gradient, of the same size
        return float(2 * 4 * stack + 2 * r * n * spec.dim)
    rows = moe_skew.busiest_rows(spec, lay, wl, n_r)  # the rows this rank's experts received
    recomputed = lay.recompute == "full" and stage.recompute_split(lay)[0][1]  # some MoE layer rebuilt in backward
    saved_copies = spec.mlp_mats * e * stack if e != 4 and not recomputed else 0
    saved_rows = e * rows * (spec.dim + 4 * spec.expert_ffn_dim)  # the GEMMs' input and four [rows, ffn] tensors
    return float(spec.mlp_mats * e * stack + 4 * stack - saved_copies - saved_rows + e * rows * spec.dim
                 + 2 * r * n * spec.dim)


def head_weight_grad_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """During the LM head's backward, beyond static + the held activations: its weight gradient in the compute
    dtype and its fp32 copy, the input's gradient, and (without a pipeline) the logits the training loop
    still holds — less what this microbatch's head had saved (`head_activation_bytes` and, under bf16, the
    weight copy), freed by the matmul's backward. 0 off the last stage and where W is deferred."""
    if not stage.head or (lay.pp > 1 and lay.schedule in ("zb", "dualpipev")):
        return 0.0
    e = wl.act_bytes
    n = lay.mb * wl.seq_len // lay.cp
    rows = padded_vocab(spec, lay.tp) // lay.tp
    weight = rows * spec.dim
    grad = e * weight  # the GEMM's, in the compute dtype (fp32: the only copy)
    fp32_copy = 4 * weight if e != 4 else 0
    saved_copy = e * weight if e != 4 else 0
    logits = e * n * rows if lay.pp == 1 else 0
    return float(grad + fp32_copy + e * n * spec.dim + logits - head_activation_bytes(spec, lay, wl) - saved_copy)


def embedding_weight_grad_bytes(spec: ModelSpec, stage: Stage, lay: Layout, wl: Workload) -> float:
    """During the token embedding's backward, beyond static + the held activations: its fp32 weight gradient
    and its output's gradient (n rows of h in the residual dtype), less this microbatch's saved tensors of
    the chunk, all freed by then (a head on the same stage is not subtracted). 0 off the first stage."""
    if not stage.embedding:
        return 0.0
    n = lay.mb * wl.seq_len // lay.cp
    rows = padded_vocab(spec, lay.tp) // lay.tp
    mb = microbatch_activation_bytes(spec, stage, lay, wl)
    chunks = sum(1 for o in chunk_owners(lay) if o == stage.index)
    return float(4 * rows * spec.dim + wl.resid_bytes * n * spec.dim - (mb["total"] - mb["head"]) / chunks)
