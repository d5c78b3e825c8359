"""The one place the plain model becomes the layout's model: `parallelize` applies the axes in this order.

1. the model on the meta device, with one `ParallelContext` (the model's only view of the layout);
2. `apply_tp`: tensor parallelism — modules swapped for their TP versions by name (Megatron's plan), the SP
   regions, the vocabulary-parallel loss, and each replicated parameter's TP gradient rule;
3. `apply_ep`: expert parallelism — every MoE block rebuilt with its experts split over ep (replicated over TP);
4. `apply_cp`: context parallelism — attention over the cp axis (ring or Ulysses), RoPE at global positions;
5. `apply_pp`: pipeline parallelism — only this rank's stages kept, tied embedding copies marked, dW deferred
   under the split-backward schedules;
6. `init_weights`: every parameter materialised from the rule declared where it was created — the global tensor
   drawn from a generator seeded by (seed, parameter name), each rank keeping its slice, so every layout starts
   from bit-identical global weights — and the dropout streams;
7. `apply_compile`: torch.compile of each block, before recompute so a recomputed block checkpoints the
   compiled forward;
8. `apply_recompute`: activation recompute (selective or full);
9. `load`: the run's starting weights (--init-from-hf), over the initialised ones;
10. `apply_dp`: data parallelism and ZeRO — the gradient reducer, which installs the gradient reduction and
    the ZeRO-3 gathers; last, because ZeRO ≥ 1 moves every parameter into its bucket's flat buffer.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Callable

import torch
from torch import nn

from .config import ModelConfig, ParallelConfig, TrainConfig
from .context_parallel.local import local_attention
from .context_parallel.plan import ContextParallel
from .data_parallel import GradReducer
from .expert_parallel.moe import MoE, build_moe, share_aux_pool
from .expert_parallel.placement import expert_layouts
from .mesh import Mesh
from .models.context import ParallelContext
from .models.gated_deltanet import GatedDeltaNet
from .models.kimi_delta import KimiDeltaAttention
from .models.llama import Transformer
from .models.params import carry, carry_param, declare, head_partial, init_of, init_std
from .models.sparse_attention import set_indexer_objective
from .optim import build_reducer
from .recompute import apply_recompute
from .tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from .tensor_parallel.fused import store_fused
from .tensor_parallel.layers import (ColumnParallelLinear, ColumnRegion, RowParallelLinear, ShardSpec,
                                     VocabParallelEmbedding, enter_region, get_spec, set_spec)
from .tensor_parallel.random import RNGTracker, replicated_dropout


def parallelize(cfg: ModelConfig, mesh: Mesh, seed: int, parallel: ParallelConfig | None = None, *, schedule=None,
                act_dtype: torch.dtype = torch.float32, load: Callable[[Transformer], None] | None = None,
                train: TrainConfig | None = None, rounds: int = 1) -> tuple[Transformer, GradReducer | None]:
    """The model for this rank of `mesh` under `parallel` (None: the single-device model), each axis applied in
    the order the module docstring gives; with `train` (the run `parallel` belongs to), its gradient reducer too.

    `schedule`: a pipeline schedule (only this rank's stages are kept; a split-backward one defers dW).
    `act_dtype` (bf16 activations) is the embedding's output dtype, so the residual stream and every activation
    payload downstream follow it. `load(model)`: the starting weights, written before DP copies them into
    ZeRO's buffers. `rounds`: the microbatches each step runs (the reducer's backward passes per step).
    """
    p = parallel or ParallelConfig()
    ctx = ParallelContext(moe=_unsplit_moe, attention=local_attention)  # apply_ep splits the experts over ep
    with torch.device("meta"):
        model = Transformer(cfg, ctx)
    apply_tp(model, mesh, p)
    apply_ep(model, mesh, p)
    model.tok_embeddings.out_dtype = act_dtype  # the residual stream's dtype, from the embedding apply_tp made
    apply_cp(model, mesh, p)
    apply_pp(model, mesh, p, schedule, act_dtype)
    init_weights(model, mesh, p, seed)
    if train is not None and train.fp8:  # the linears' GEMMs in FP8, each scale over its logical tensor
        from .fp8.apply import apply_fp8

        apply_fp8(all_blocks(model), mesh, p, train.fp8, train.seq_len)
        if train.fp8_all_gather:  # SP gathers of the FP8 linears' inputs in FP8 (the ZeRO-3 ones: apply_dp)
            from .fp8.wire import install_activations

            install_activations(all_blocks(model), p.sequence_parallel and mesh["tp"].active)
    if p.compile:
        apply_compile(model)
    apply_recompute(model, p.recompute, p.recompute_layers, compiled=p.compile)
    if train is not None and train.dsa_stage != "none":  # the DSA indexers' KL (the warm-up freezes the rest)
        set_indexer_objective(model, train.dsa_stage, train.dsa_kl_weight,
                              (train.global_batch or train.micro_batch * p.dp) * train.seq_len)
    if load is not None:
        load(model)
    reducer = None
    if train is not None:
        # the gradient reduction and the ZeRO-3 gathers are installed here (apply_dp lists their hooks)
        reducer = apply_dp(model, mesh, train, rounds)
        if train.fp8 and train.fp8_all_gather and reducer.units is not None:
            from .fp8.wire import install_weights

            install_weights(reducer.units, model)  # ZeRO-3 gathers of FP8 linears' weights in FP8
    return model, reducer


def build_model(cfg: ModelConfig, mesh: Mesh, seed: int, parallel: ParallelConfig | None = None, *,
                schedule=None, act_dtype: torch.dtype = torch.float32) -> Transformer:
    """`parallelize`'s model without data parallelism: what HF import and export, generation and the parity
    tests build."""
    return parallelize(cfg, mesh, seed, parallel, schedule=schedule, act_dtype=act_dtype)[0]


def plain_model(cfg: ModelConfig) -> Transformer:
    """The unsharded model with the one-device context (MoE blocks unsplit): what HF import/export and the
    single-device tests build directly, under the caller's device (meta for names and shapes)."""
    model = Transformer(cfg, ParallelContext(moe=_unsplit_moe, attention=local_attention))
    share_aux_pool(model)
    return model


def _unsplit_moe(cfg: ModelConfig, _layer_id: int) -> MoE:
    return build_moe(cfg)


def apply_tp(model: Transformer, mesh: Mesh, parallel: ParallelConfig) -> None:
    """Tensor parallelism, Megatron's plan: q/k/v and w1/w3 column-parallel, wo/w2 row-parallel, vocab-parallel
    embedding, head and loss; every parameter no plan splits is replicated over TP. MoE blocks are `apply_ep`'s.

    `fused_projections`: q/k/v and w1/w3 each run as one GEMM (`ColumnRegion`); without it, separate GEMMs.
    `tp_overlap` (needs SP): every SP all-gather before a column-parallel GEMM and reduce-scatter after a
    row-parallel one runs in tp chunks under the GEMMs.
    """
    cfg, tp = model.cfg, mesh["tp"]
    sp = parallel.sequence_parallel and tp.active
    overlap = parallel.tp_overlap and sp
    fused = parallel.fused_projections
    kw = dict(device="meta")
    _swap(model, "tok_embeddings", VocabParallelEmbedding(cfg.vocab_size, cfg.dim, tp, sp, **kw))
    for block in all_blocks(model):
        attn, ffn = block.attention, block.feed_forward
        h, hd = cfg.dim, cfg.head_dim
        if isinstance(ffn, MoE):
            ffn = None
        linear_layers = None
        if isinstance(attn, KimiDeltaAttention):
            _kda_tensor_parallel(attn, cfg, tp, sp)
            attn = None
        elif isinstance(attn, GatedDeltaNet):
            _linear_attention_tensor_parallel(attn, cfg, tp, sp)
            linear_layers = [attn.wq, attn.wk, attn.wv, attn.wz, attn.wb, attn.wa]
        elif cfg.is_mla:
            _mla_tensor_parallel(attn, cfg, tp, sp, overlap, fused)
            attn = None
        else:
            kv_rows, kv_replicas, kv_reduce = _kv_rows(cfg, tp)
        bias = cfg.attention_bias
        if attn is not None and linear_layers is None:
            q_rows = cfg.n_heads * hd * (2 if cfg.attn_output_gate else 1)  # gated: each head's [q | gate] rows
            _swap(attn, "wq", ColumnParallelLinear(h, q_rows, tp, bias=bias, enter=False, **kw))
            _swap(attn, "wk", ColumnParallelLinear(h, cfg.n_kv_heads * hd, tp, bias=bias, enter=False, rows=kv_rows,
                                                   replicas=kv_replicas, grad_reduce=kv_reduce, **kw))
            _swap(attn, "wv", ColumnParallelLinear(h, cfg.n_kv_heads * hd, tp, bias=bias, enter=False, rows=kv_rows,
                                                   replicas=kv_replicas, grad_reduce=kv_reduce, **kw))
            _swap(attn, "wo", RowParallelLinear(cfg.n_heads * hd, h, tp, bias=cfg.attention_out_bias,
                                                sequence_parallel=sp, **kw))
            if attn.sinks is not None:
                attn.sinks = _head_sinks(cfg, tp)
            if cfg.qk_norm_full:  # MiniMax-M2's width norms: their weights split with q's and k's columns
                q_cols = cfg.n_heads * hd // tp.size
                attn.q_norm.weight = _norm_shard(attn.q_norm.weight, (tp.rank * q_cols, q_cols), 1, None)
                attn.k_norm.weight = _norm_shard(attn.k_norm.weight, kv_rows, kv_replicas, kv_reduce)
        if ffn is not None:
            _swap(ffn, "w1", ColumnParallelLinear(h, cfg.ffn_dim, tp, enter=False, **kw))
            _swap(ffn, "w3", ColumnParallelLinear(h, cfg.ffn_dim, tp, enter=False, **kw))
            _swap(ffn, "w2", RowParallelLinear(cfg.ffn_dim, h, tp, sequence_parallel=sp, **kw))
        # One region entry per sub-block, shared by its column-parallel projections: under SP one all-gather
        # (or, overlapped, the region's chunked one); without SP a ColumnRegion that is also Megatron's f (its
        # backward all-reduce overlapped with dW); fused, a ColumnRegion at any tp.
        for region, layers in ((attn, linear_layers or ([attn.wq, attn.wk, attn.wv] if attn else [])),
                               (ffn, [ffn.w1, ffn.w3] if ffn else [])):
            if region is None:
                continue
            if sp and not overlap:
                region.register_forward_pre_hook(_region_entry(tp, sp))
            if fused or overlap or (tp.active and not sp):
                region.register_forward_pre_hook(ColumnRegion(layers, tp, reduce=tp.active and not sp, overlap=overlap,
                                                              fused=fused, own=(2,) if region is attn else ()))
    _swap(model, "output", ColumnParallelLinear(cfg.dim, cfg.vocab_size, tp, sequence_parallel=sp, **kw))
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    _set_overlap(model, overlap)
    ctx = model.ctx
    ctx.tp_axis, ctx.sequence_parallel = tp, sp
    ctx.cross_entropy = functools.partial(_vocab_parallel_loss, tp, model.tok_embeddings.vocab_start, cfg.vocab_size)
    moe = {id(q) for m in model.modules() if isinstance(m, MoE) for q in m.parameters()}
    _replicated_over_tp([q for q in model.parameters() if id(q) not in moe], tp, sp)


def _region_entry(tp, sp: bool):
    """The forward pre-hook entering a column region (SP's all-gather, in FP8 where the region is marked
    `fp8_wire`), else Megatron's f."""
    return lambda m, args: (enter_region(args[0], tp, sp, getattr(m, "fp8_wire", None)), *args[1:])


def all_blocks(model: Transformer) -> list[nn.Module]:
    """Every transformer block: the model's layers, then the MTP modules' blocks (same kind, same plan)."""
    return list(model.layers.values()) + ([m.block for m in model.mtp.values()] if model.mtp is not None else [])


def _swap(parent: nn.Module, name: str, new: nn.Module) -> None:
    """parent.name = new, carrying the old module's parameter declarations (init rule, partial-ness)."""
    setattr(parent, name, carry(getattr(parent, name), new))


def _kv_rows(cfg: ModelConfig, tp) -> tuple[tuple[int, int], int, str | None]:
    """Rows of wk/wv this rank holds: an even split when n_kv >= tp, else the one K/V head its queries use."""
    hd = cfg.head_dim
    if cfg.n_kv_heads >= tp.size:
        per = cfg.n_kv_heads // tp.size * hd
        return (tp.rank * per, per), 1, None
    ranks_per_kv = tp.size // cfg.n_kv_heads
    return (tp.rank // ranks_per_kv * hd, hd), ranks_per_kv, "tp_kv"


def _mla_tensor_parallel(attn, cfg: ModelConfig, tp, sp: bool, overlap: bool = False, fused: bool = False) -> None:
    """MLA's plan: heads split (wq / wq_b and wkv_b column-parallel by head, wo row-parallel), down-projections
    and norms replicated; the block input enters the region once (SP all-gather, else Megatron's f, whose
    backward sums the per-rank partial input gradients). Under `overlap` or `fused` the projections that read the
    block input (wq_a or wq, and wkv_a) form one `ColumnRegion` (overlapped with `overlap`, one GEMM with `fused`)."""
    kw = dict(device="meta")
    qk, h = cfg.head_dim + cfg.qk_rope_dim, cfg.dim
    if cfg.q_lora_rank:
        _swap(attn, "wq_b", ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * qk, tp, enter=False, **kw))
    else:
        _swap(attn, "wq", ColumnParallelLinear(h, cfg.n_heads * qk, tp, enter=False, **kw))
    _swap(attn, "wkv_b", ColumnParallelLinear(cfg.kv_lora_rank, cfg.n_heads * (cfg.head_dim + cfg.v_head_dim), tp,
                                              enter=False, **kw))
    _swap(attn, "wo", RowParallelLinear(cfg.n_heads * cfg.v_head_dim, h, tp, sequence_parallel=sp, **kw))
    if overlap or fused:
        for name in ("wq_a", "wkv_a") if cfg.q_lora_rank else ("wkv_a",):
            old = getattr(attn, name)
            _swap(attn, name, _replicated_column(old.in_features, old.out_features, tp))
        first = attn.wq_a if cfg.q_lora_rank else attn.wq
        if tp.active and not overlap:
            attn.register_forward_pre_hook(_region_entry(tp, sp))
        attn.register_forward_pre_hook(ColumnRegion([first, attn.wkv_a], tp, reduce=False, overlap=overlap,
                                                    fused=fused))
    elif tp.active:
        attn.register_forward_pre_hook(_region_entry(tp, sp))


def _replicated_column(in_features: int, out_features: int, tp, partial: bool | None = None) -> ColumnParallelLinear:
    """A replicated projection as a column layer holding every row, so it can join a region. `partial`: its
    gradient is a partial sum over TP (default: under any TP, as MLA's down-projections, whose ranks each
    back-propagate their own heads)."""
    layer = ColumnParallelLinear(in_features, out_features, tp, enter=False, rows=(0, out_features), device="meta")
    partial = tp.active if partial is None else partial
    set_spec(layer.weight, ShardSpec((out_features, in_features), replicas=tp.size,
                                     grad_reduce="tp_sum" if partial else None))
    return layer


def _linear_attention_tensor_parallel(mixer: GatedDeltaNet, cfg: ModelConfig, tp, sp: bool) -> None:
    """Gated DeltaNet's plan: its key heads, and the value heads each serves, split evenly over tp. The q/k/v/z/b/a
    projections are column-parallel by those heads, the convolution's channels, A_log and dt_bias are cut the same
    way, `wo` is row-parallel; the gated norm's weight (one head's width) stays replicated with a head-partial
    gradient. The recurrence needs no communication: each rank runs its own heads."""
    nk, nv, dk, dv, h = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim, cfg.dim
    if nk % tp.size:
        raise ValueError(f"tp={tp.size} must divide the Gated DeltaNet key heads linear_k_heads={nk}")
    kw = dict(device="meta")
    for name, rows in (("wq", nk * dk), ("wk", nk * dk), ("wv", nv * dv), ("wz", nv * dv), ("wb", nv), ("wa", nv)):
        _swap(mixer, name, ColumnParallelLinear(h, rows, tp, enter=False, **kw))
    _swap(mixer, "wo", RowParallelLinear(nv * dv, h, tp, sequence_parallel=sp, **kw))
    _cut_by_heads(mixer, ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias"), tp)


def _cut_by_heads(mixer: nn.Module, names, tp) -> None:
    """A linear mixer's bare parameters (kernels, A_log, dt_bias) cut evenly by rows: this rank's heads."""
    for name in names:
        old = getattr(mixer, name)
        rows = old.shape[0] // tp.size
        new = nn.Parameter(torch.empty(rows, *old.shape[1:], device="meta"))
        set_spec(new, ShardSpec(tuple(old.shape), 0, tp.rank * rows, rows, rows))
        setattr(mixer, name, carry_param(old, new))


def _kda_tensor_parallel(mixer: KimiDeltaAttention, cfg: ModelConfig, tp, sp: bool) -> None:
    """Kimi Delta Attention's plan: heads split evenly over tp. q/k/v, the gates' up-projections wf_b, wg_b and β's
    wb are column-parallel by heads, the kernels, A_log and dt_bias cut the same way, `wo` row-parallel; the gates'
    down-projections wf_a, wg_a and the norm's weight stay replicated (head-partial gradients). The block input
    enters the region once (SP all-gather, else Megatron's f, whose backward sums the ranks' partial input
    gradients), as MLA's; the recurrence needs no communication."""
    nh, d, h = cfg.linear_v_heads, cfg.linear_v_dim, cfg.dim
    if nh % tp.size:
        raise ValueError(f"tp={tp.size} must divide the Kimi Delta Attention heads linear_v_heads={nh}")
    kw = dict(device="meta")
    for name, inp, rows in (("wq", h, nh * d), ("wk", h, nh * d), ("wv", h, nh * d), ("wf_b", d, nh * d),
                            ("wb", h, nh), ("wg_b", d, nh * d)):
        _swap(mixer, name, ColumnParallelLinear(inp, rows, tp, enter=False, **kw))
    _swap(mixer, "wo", RowParallelLinear(nh * d, h, tp, sequence_parallel=sp, **kw))
    _cut_by_heads(mixer, ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias"), tp)
    if tp.active:
        mixer.register_forward_pre_hook(_region_entry(tp, sp))


def _head_sinks(cfg: ModelConfig, tp) -> nn.Parameter:
    """gpt-oss's sinks split with the query heads: this rank's heads' logits (their gradient is complete here)."""
    per = cfg.n_heads // tp.size
    p = declare(nn.Parameter(torch.empty(per, device="meta")), "normal")
    return set_spec(p, ShardSpec((cfg.n_heads,), 0, tp.rank * per, per, per))


def _norm_shard(old: nn.Parameter, rows: tuple[int, int], replicas: int, grad_reduce: str | None) -> nn.Parameter:
    """A 1-D weight cut like the columns it scales (rows = (start, length) of the global vector)."""
    p = carry_param(old, nn.Parameter(torch.empty(rows[1], device="meta")))
    return set_spec(p, ShardSpec(tuple(old.shape), 0, rows[0], rows[1], rows[1], replicas, grad_reduce))


def _vocab_parallel_loss(tp, vocab_start: int, vocab_size: int, logits, targets, ignore_index: int = -100,
                         label_smoothing: float = 0.0):
    return vocab_parallel_cross_entropy(logits, targets, tp, vocab_start, vocab_size, ignore_index, label_smoothing)


def _set_overlap(module: nn.Module, overlap: bool) -> None:
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.overlap = overlap


def _replicated_over_tp(params, tp, sp: bool) -> None:
    """Parameters no plan split (norms, routers, shared experts) are replicated over TP: their gradients are partial
    under SP, since each rank sees s/tp tokens. Those declared head-partial (per-head q/k norms, MLA's
    down-projections) see only this rank's heads: partial under any TP."""
    for p in params:
        if not hasattr(p, "_sw_shard"):
            partial = sp or (tp.active and head_partial(p))
            set_spec(p, ShardSpec(tuple(p.shape), replicas=tp.size, grad_reduce="tp_sum" if partial else None))


def apply_ep(model: Transformer, mesh: Mesh, parallel: ParallelConfig) -> None:
    """Expert parallelism: every MoE block (the layers' and the MTP modules') rebuilt with its routed experts split
    over ep; router, shared experts and experts are replicated over TP, and the blocks share one aux-loss pool
    when the model's aux loss is pooled over layers."""
    tp = mesh["tp"]
    sp = parallel.sequence_parallel and tp.active
    layouts = expert_layouts(parallel, model.cfg.moe_experts) or {}  # --expert-placement: per layer id
    ids = [int(k) for k in model.layers] + ([model.cfg.n_layers + int(k) for k in model.mtp] if model.mtp else [])
    for layer_id, block in zip(ids, all_blocks(model)):
        if isinstance(block.feed_forward, MoE):
            block.feed_forward = moe = _expert_parallel_moe(model.cfg, mesh, sp, parallel.fused_projections,
                                                            layouts.get(layer_id))
            _set_overlap(moe, parallel.tp_overlap and sp)
            _replicated_over_tp(moe.parameters(), tp, sp)
    share_aux_pool(model)


def _expert_parallel_moe(cfg: ModelConfig, mesh: Mesh, sp: bool, fused: bool, layout=None) -> MoE:
    """An MoE block whose experts are split over ep (it declares its own parameters).

    Without SP every TP rank routes the same tokens, so replicas compute identical gradients. Under
    SP each TP rank routes its own sequence shard: gradients are partial and summed over TP, and the
    aux loss statistics span tp as well as dp×cp. `fused`: the shared experts' w1/w3 run as one GEMM.
    """
    tp = mesh["tp"]
    moe = build_moe(cfg, mesh["ep"], expert_replicas=tp.size, device="meta", layout=layout)
    moe.router.token_axes = (mesh["dp_cp"], tp) if sp else (mesh["dp_cp"],)
    for p in moe.experts.parameters():
        if sp:
            set_spec(p, dataclasses.replace(get_spec(p), grad_reduce="tp_sum"))
    if fused and moe.shared is not None:
        _fuse_shared_experts(moe.shared, tp, sp)
    return moe


def _fuse_shared_experts(ffn: nn.Module, tp, sp: bool) -> None:
    """The MoE's shared experts (replicated over TP, on this rank's tokens) with w1/w3 as one fused region; no TP
    entry: their input is already this rank's. Under SP each rank sees its own tokens, so gradients are partial."""
    for name in ("w1", "w3"):
        old = getattr(ffn, name)
        _swap(ffn, name, _replicated_column(old.in_features, old.out_features, tp, partial=sp))
    ffn.register_forward_pre_hook(ColumnRegion([ffn.w1, ffn.w3], tp, reduce=False, fused=True))


def apply_cp(model: Transformer, mesh: Mesh, parallel: ParallelConfig) -> None:
    """Context parallelism: under cp > 1, attention over the cp axis (ring or Ulysses) and RoPE at the layout's
    global positions."""
    cp = mesh["cp"]
    model.ctx.cp = ContextParallel(cp, parallel.cp_order, parallel.cp_impl) if cp.active else None


def apply_pp(model: Transformer, mesh: Mesh, parallel: ParallelConfig, schedule, act_dtype: torch.dtype) -> None:
    """Pipeline parallelism: with a `schedule`, only this rank's stages are kept (`model.chunks` lists them in
    local-chunk order), the embedding's copies on other stages are marked (tied head, MTP), and under a
    split-backward schedule every linear layer defers its dW to one store. Without one, `model.chunks` is None."""
    model.chunks = None
    if schedule is None:
        return
    from .tensor_parallel.grad_store import WeightGradStore
    from .rules.partition import split_layers
    from .pipeline.stage import prune_to_stages
    from .pipeline.tied_embedding import mark_mtp_embedding, mark_tied_copies

    stage_layers = split_layers(model.cfg.n_layers, schedule.num_stages, parallel.pp_layers)
    model.chunks = prune_to_stages(model, mesh["pp"].rank, schedule.layout, stage_layers)
    mark_tied_copies(model, mesh)
    mark_mtp_embedding(model, mesh, act_dtype)
    model.grad_store = WeightGradStore() if schedule.split_bw else None
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.grad_store = model.grad_store


def init_weights(model: Transformer, mesh: Mesh, parallel: ParallelConfig, seed: int) -> None:
    """Every random draw the ranks must agree on: the parameters (`materialize`, seeded by name), then, with
    fused projections, each fused region's weights moved into one buffer (before anything holds them), and the
    dropout streams (`RNGTracker`: one mask over TP where it must agree, per-rank where heads differ)."""
    materialize(model, model.cfg, seed, mesh.device)
    if parallel.fused_projections:
        store_fused(model)
    ctx = model.ctx
    tracker = RNGTracker(seed, mesh["tp"].rank, mesh["pp"].rank, mesh.device)
    ctx.rng = tracker
    ctx.dropout = functools.partial(_dropout, tracker, ctx.tp_axis if ctx.sequence_parallel else None)


def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device) -> None:
    """Allocate and fill every parameter with its slice of the seeded global initialisation.

    Each meta parameter is replaced by a new Parameter created directly on `device` (under a fake
    tensor mode: a fake one), carrying the same shardwise annotations; tied parameters stay one object.
    `Module.to_empty` is not used: torch >= 2.13 swaps tensors in place there and refuses parameters with
    weak references, which fake parameters have.
    """
    made: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                for k, v in vars(p).items():
                    if k.startswith("_sw_"):
                        setattr(new, k, v)
                made[id(p)] = new
            mod._parameters[attr] = made[id(p)]
        for attr, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[attr] = torch.empty(b.shape, dtype=b.dtype, device=device)
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    with torch.no_grad():
        for name, p in model.named_parameters():
            spec = get_spec(p)
            # the LM head's copy of a tied matrix (PP) draws from the embedding's name: equal at init
            init_name = getattr(p, "_sw_tied", name)
            p.copy_(spec.local_slice(global_init(init_name, spec.global_shape, init_of(p, name), cfg, seed)).to(device))


def global_init(name: str, shape, init: str, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The global tensor `name` starts as under its declared rule `init` (models/params.py), seeded by its name."""
    if init in ("ones", "zeros"):
        return torch.ones(shape) if init == "ones" else torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if init == "a_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
    std = shape[-1] ** -0.5 if init == "conv" else init_std(init, cfg.n_layers)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _dropout(tracker: RNGTracker, sp_axis, x: torch.Tensor, p: float) -> torch.Tensor:
    return replicated_dropout(x, p, tracker, sp_axis)


def apply_compile(model: Transformer) -> None:
    """torch.compile the forward of each of this rank's transformer blocks (names and parameters unchanged).

    comm's collectives are compiler-disabled, so each block compiles into the graphs between its
    collectives while every collective, its autograd Function and its ledger entry run eagerly.
    """
    from . import comm

    comm.compile_barriers()
    for block in model.layers.values():
        core = getattr(block.attention, "core", None)  # a Gated DeltaNet layer has none: it compiles whole
        if model.ctx.cp is not None and core is not None:
            # Ring / Ulysses attention: fused kernels between p2p or all-to-all steps. Traced, Dynamo would
            # fall back at the first collective and then compile each per-step helper (and recompile it per
            # block shape), so the whole context-parallel core runs eagerly instead.
            core.compute = torch.compiler.disable(core.compute)
        block.forward = torch.compile(block.forward)


def apply_dp(model: Transformer, mesh: Mesh, train: TrainConfig, rounds: int) -> GradReducer:
    """Data parallelism over dp×cp (experts over edp) at ZeRO stage `train.parallel.zero`: the gradient reducer,
    with the run's optimizer(s) on the shards it owns (data_parallel/reducer.py: a step's gradient work, in order).
    `rounds`: the backward passes (microbatches) of each step.

    The reducer installs, in this order:
    * the ZeRO-3 gathers (ZeRO 3, data_parallel/zero3.py `ParamUnits`): on every unit — the embedding, each block,
      the final norm, the head, the MTP modules — a forward pre-hook that all-gathers it (and prefetches the next),
      a forward hook that frees it and re-gathers it when its output's gradient arrives, and a post-accumulate-grad
      hook per parameter that releases a unit no input gradient passes through;
    * the gradient reduction (data_parallel/buckets.py `OverlappedReduction`): a post-accumulate-grad hook per
      parameter that counts its bucket down and launches the bucket's dp×cp (edp) all-reduce (ZeRO 0) or
      reduce-scatter (ZeRO ≥ 1) from backward once it is complete. At ZeRO 0/1 without overlap the hook only
      adopts the gradient into the bucket's buffer; those buckets, and every bucket holding a TP-partial
      gradient, are reduced in `reduce_and_clip`.
    The TP sums of partial gradients, the tied embedding's sum over emb and HSDP's all-reduce over the replicas
    are not hooks either: they run in `reduce_and_clip`, the first two before the buckets holding those gradients.
    """
    return build_reducer(train, model, mesh, rounds)
