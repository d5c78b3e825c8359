"""The one entry point that turns the plain model into the layout's model.

`build_model` makes the model on the meta device with one `ParallelContext` (the model's only view of the
layout), swaps modules for their tensor-parallel versions by name (the plan below), fills the context (CP
attention, the vocabulary-parallel loss, dropout streams, recompute), then materialises every parameter from
the rule declared where it was created: the global tensor is drawn from a generator seeded by
(seed, parameter name) and each rank keeps its slice. Every layout therefore starts from bit-identical
global weights.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import torch
from torch import nn

from .config import ModelConfig, ParallelConfig
from .context_parallel.local import local_attention
from .context_parallel.plan import ContextParallel
from .expert_parallel.moe import MoE, build_moe, share_aux_pool
from .mesh import Mesh
from .models.context import ParallelContext
from .models.gated_deltanet import GatedDeltaNet
from .models.llama import Transformer
from .models.params import carry, carry_param, declare, head_partial, init_of, init_std
from .recompute import apply_recompute
from .tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from .tensor_parallel.fused import store_fused
from .tensor_parallel.layers import (ColumnParallelLinear, ColumnRegion, RowParallelLinear, ShardSpec,
                                     VocabParallelEmbedding, enter_region, get_spec, set_spec)
from .tensor_parallel.random import RNGTracker, replicated_dropout


def _kv_rows(cfg: ModelConfig, tp) -> tuple[tuple[int, int], int, str | None]:
    """Rows of wk/wv this rank holds: an even split when n_kv >= tp, else the one K/V head its queries use."""
    hd = cfg.head_dim
    if cfg.n_kv_heads >= tp.size:
        per = cfg.n_kv_heads // tp.size * hd
        return (tp.rank * per, per), 1, None
    ranks_per_kv = tp.size // cfg.n_kv_heads
    return (tp.rank // ranks_per_kv * hd, hd), ranks_per_kv, "tp_kv"


def _unsplit_moe(cfg: ModelConfig, _layer_id: int) -> MoE:
    return build_moe(cfg)


def plain_model(cfg: ModelConfig) -> Transformer:
    """The unsharded model with the one-device context (MoE blocks unsplit): what HF import/export and the
    single-device tests build directly, under the caller's device (meta for names and shapes)."""
    model = Transformer(cfg, ParallelContext(moe=_unsplit_moe, attention=local_attention))
    share_aux_pool(model)
    return model


def _swap(parent: nn.Module, name: str, new: nn.Module) -> None:
    """parent.name = new, carrying the old module's parameter declarations (init rule, partial-ness)."""
    setattr(parent, name, carry(getattr(parent, name), new))


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
            attn.register_forward_pre_hook(lambda m, args: (enter_region(args[0], tp, sp), *args[1:]))
        attn.register_forward_pre_hook(ColumnRegion([first, attn.wkv_a], tp, reduce=False, overlap=overlap,
                                                    fused=fused))
    elif tp.active:
        attn.register_forward_pre_hook(lambda m, args: (enter_region(args[0], tp, sp), *args[1:]))


def _replicated_column(in_features: int, out_features: int, tp, partial: bool | None = None) -> ColumnParallelLinear:
    """A replicated projection as a column layer holding every row, so it can join a region. `partial`: its
    gradient is a partial sum over TP (default: under any TP, as MLA's down-projections, whose ranks each
    back-propagate their own heads)."""
    layer = ColumnParallelLinear(in_features, out_features, tp, enter=False, rows=(0, out_features), device="meta")
    partial = tp.active if partial is None else partial
    set_spec(layer.weight, ShardSpec((out_features, in_features), replicas=tp.size,
                                     grad_reduce="tp_sum" if partial else None))
    return layer


def _fuse_shared_experts(ffn: nn.Module, tp, sp: bool) -> None:
    """The MoE's shared experts (replicated over TP, on this rank's tokens) with w1/w3 as one fused region; no TP
    entry: their input is already this rank's. Under SP each rank sees its own tokens, so gradients are partial."""
    for name in ("w1", "w3"):
        old = getattr(ffn, name)
        _swap(ffn, name, _replicated_column(old.in_features, old.out_features, tp, partial=sp))
    ffn.register_forward_pre_hook(ColumnRegion([ffn.w1, ffn.w3], tp, reduce=False, fused=True))


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
    for name in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias"):
        old = getattr(mixer, name)
        rows = old.shape[0] // tp.size
        new = nn.Parameter(torch.empty(rows, *old.shape[1:], device="meta"))
        set_spec(new, ShardSpec(tuple(old.shape), 0, tp.rank * rows, rows, rows))
        setattr(mixer, name, carry_param(old, new))


def all_blocks(model: Transformer) -> list[nn.Module]:
    """Every transformer block: the model's layers, then the MTP modules' blocks (same kind, same plan)."""
    return list(model.layers.values()) + ([m.block for m in model.mtp.values()] if model.mtp is not None else [])


def apply_tensor_parallel(model: Transformer, mesh: Mesh, sequence_parallel: bool = False,
                          fused: bool = False, overlap: bool = False) -> Transformer:
    """Megatron plan: q/k/v and w1/w3 column-parallel, wo/w2 row-parallel, vocab-parallel embedding and head.

    `fused`: q/k/v and w1/w3 each run as one GEMM (`ColumnRegion`); without it, separate GEMMs. `overlap`
    (needs SP): every SP all-gather before a column-parallel GEMM and reduce-scatter after a row-parallel one
    runs in tp chunks under the GEMMs.
    """
    cfg, tp = model.cfg, mesh["tp"]
    sp = sequence_parallel and tp.active
    overlap = overlap and sp
    kw = dict(device="meta")
    _swap(model, "tok_embeddings", VocabParallelEmbedding(cfg.vocab_size, cfg.dim, tp, sp, **kw))
    for block in all_blocks(model):
        attn, ffn = block.attention, block.feed_forward
        h, hd = cfg.dim, cfg.head_dim
        if isinstance(ffn, MoE):
            block.feed_forward = apply_expert_parallel(cfg, mesh, sp, fused)  # declares its own parameters
            ffn = None
        linear_layers = None
        if isinstance(attn, GatedDeltaNet):
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
                region.register_forward_pre_hook(lambda m, args: (enter_region(args[0], tp, sp), *args[1:]))
            if fused or overlap or (tp.active and not sp):
                region.register_forward_pre_hook(ColumnRegion(layers, tp, reduce=tp.active and not sp, overlap=overlap,
                                                              fused=fused, own=(2,) if region is attn else ()))
    _swap(model, "output", ColumnParallelLinear(cfg.dim, cfg.vocab_size, tp, sequence_parallel=sp, **kw))
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.overlap = overlap
    ctx = model.ctx
    ctx.tp_axis, ctx.sequence_parallel = tp, sp
    ctx.cross_entropy = functools.partial(_vocab_parallel_loss, tp, model.tok_embeddings.vocab_start, cfg.vocab_size)
    share_aux_pool(model)  # the plan rebuilt the MoE blocks
    # Replicated parameters: norms (partial gradients under SP, since each rank sees s/tp tokens). Those declared
    # head-partial (per-head q/k norms, MLA's down-projections) see only this rank's heads: partial under any TP.
    for p in model.parameters():
        if not hasattr(p, "_sw_shard"):
            partial = sp or (tp.active and head_partial(p))
            set_spec(p, ShardSpec(tuple(p.shape), replicas=tp.size, grad_reduce="tp_sum" if partial else None))
    return model


def _head_sinks(cfg: ModelConfig, tp) -> nn.Parameter:
    """gpt-oss's sinks split with the query heads: this rank's heads' logits (their gradient is complete here)."""
    per = cfg.n_heads // tp.size
    p = declare(nn.Parameter(torch.empty(per, device="meta")), "normal")
    return set_spec(p, ShardSpec((cfg.n_heads,), 0, tp.rank * per, per, per))


def _vocab_parallel_loss(tp, vocab_start: int, vocab_size: int, logits, targets, ignore_index: int = -100,
                         label_smoothing: float = 0.0):
    return vocab_parallel_cross_entropy(logits, targets, tp, vocab_start, vocab_size, ignore_index, label_smoothing)


def apply_expert_parallel(cfg: ModelConfig, mesh: Mesh, sp: bool, fused: bool = False) -> MoE:
    """An MoE block whose experts are split over ep; router, shared experts and experts are replicated over TP.

    Without SP every TP rank routes the same tokens, so replicas compute identical gradients. Under
    SP each TP rank routes its own sequence shard: gradients are partial and summed over TP, and the
    aux loss statistics span tp as well as dp×cp. `fused`: the shared experts' w1/w3 run as one GEMM.
    """
    tp = mesh["tp"]
    moe = build_moe(cfg, mesh["ep"], expert_replicas=tp.size, device="meta")
    moe.router.token_axes = (mesh["dp_cp"], tp) if sp else (mesh["dp_cp"],)
    for p in moe.experts.parameters():
        if sp:
            set_spec(p, dataclasses.replace(get_spec(p), grad_reduce="tp_sum"))
    if fused and moe.shared is not None:
        _fuse_shared_experts(moe.shared, tp, sp)
    return moe


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


def apply_context_parallel(model: Transformer, mesh: Mesh, order: str, impl: str) -> None:
    """Under cp > 1, point attention at the cp axis (ring or Ulysses) and RoPE at the layout's global positions."""
    cp = mesh["cp"]
    model.ctx.cp = ContextParallel(cp, order, impl) if cp.active else None


def build_model(cfg: ModelConfig, mesh: Mesh, seed: int, parallel: ParallelConfig | None = None, *,
                schedule=None, act_dtype: torch.dtype = torch.float32) -> Transformer:
    """The model for this rank of `mesh` under `parallel` (None: the single-device model).

    With a pipeline `schedule`, only this rank's stages are kept and `model.chunks` lists them in
    local-chunk order; with a split-backward schedule its linear layers defer dW to a store.
    `act_dtype` (bf16 activations) is the embedding's output dtype, so the residual stream and
    every activation payload downstream follow it.
    """
    p = parallel or ParallelConfig()
    ctx = ParallelContext(moe=_unsplit_moe, attention=local_attention)  # the TP plan splits the experts over ep
    with torch.device("meta"):
        model = Transformer(cfg, ctx)
    apply_tensor_parallel(model, mesh, p.sequence_parallel, fused=p.fused_projections, overlap=p.tp_overlap)
    model.tok_embeddings.out_dtype = act_dtype
    apply_context_parallel(model, mesh, p.cp_order, p.cp_impl)
    model.chunks = None
    if schedule is not None:
        from .tensor_parallel.grad_store import WeightGradStore
        from .rules.partition import split_layers
        from .pipeline.stage import prune_to_stages
        from .pipeline.tied_embedding import mark_mtp_embedding, mark_tied_copies

        stage_layers = split_layers(cfg.n_layers, schedule.num_stages, p.pp_layers)
        model.chunks = prune_to_stages(model, mesh["pp"].rank, schedule.layout, stage_layers)
        mark_tied_copies(model, mesh)
        mark_mtp_embedding(model, mesh, act_dtype)
        model.grad_store = WeightGradStore() if schedule.split_bw else None
        for m in model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.grad_store = model.grad_store
    materialize(model, cfg, seed, mesh.device)
    if p.fused_projections:
        store_fused(model)
    tracker = RNGTracker(seed, mesh["tp"].rank, mesh["pp"].rank, mesh.device)
    ctx.rng = tracker
    ctx.dropout = functools.partial(_dropout, tracker, ctx.tp_axis if ctx.sequence_parallel else None)
    if p.compile:  # before recompute, so a fully recomputed block checkpoints the compiled forward
        apply_compile(model)
    apply_recompute(model, p.recompute, p.recompute_layers)
    if p.compile and ctx.checkpoint_core is not None:
        # checkpoint with our RNG-replay context_fn is not traceable: the selective core runs eagerly
        ctx.checkpoint_core = torch.compiler.disable(ctx.checkpoint_core)
    return model


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
