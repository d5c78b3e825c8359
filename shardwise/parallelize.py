"""The one entry point that turns the plain model into the layout's model.

`build_model` makes the model on the meta device, swaps modules for their tensor-parallel versions
by name (the plan below), then materialises every parameter from a layout-independent rule: the
global tensor is drawn from a generator seeded by (seed, parameter name) and each rank keeps its
slice. Every layout therefore starts from bit-identical global weights.
"""
from __future__ import annotations

import dataclasses
import zlib

import torch
from torch import nn

from .config import ModelConfig, ParallelConfig
from .mesh import Mesh
from .expert_parallel.moe import MoE, share_aux_pool
from .models.llama import Transformer, build_moe
from .recompute import apply_recompute
from .tensor_parallel.layers import (ColumnParallelLinear, ColumnRegion, RowParallelLinear, ShardSpec,
                                     VocabParallelEmbedding, enter_region, get_spec, set_spec)
from .tensor_parallel.random import ReplicatedDropout, RNGTracker


def _kv_rows(cfg: ModelConfig, tp) -> tuple[tuple[int, int], int, str | None]:
    """Rows of wk/wv this rank holds: an even split when n_kv >= tp, else the one K/V head its queries use."""
    hd = cfg.head_dim
    if cfg.n_kv_heads >= tp.size:
        per = cfg.n_kv_heads // tp.size * hd
        return (tp.rank * per, per), 1, None
    ranks_per_kv = tp.size // cfg.n_kv_heads
    return (tp.rank // ranks_per_kv * hd, hd), ranks_per_kv, "tp_kv"


# Replicated weights that each TP rank back-propagates through its own heads only: Qwen3's q/k norms, MLA's
# down-projections and latent norms. Their gradients are partial sums over TP even without SP.
PER_HEAD_PARTIAL = ("q_norm.weight", "k_norm.weight", "wq_a.weight", "q_a_norm.weight", "wkv_a.weight",
                    "kv_a_norm.weight")


def _mla_tensor_parallel(attn, cfg: ModelConfig, tp, sp: bool) -> None:
    """MLA's plan: heads split (wq / wq_b and wkv_b column-parallel by head, wo row-parallel), down-projections
    and norms replicated; the block input enters the region once (SP all-gather, else Megatron's f, whose
    backward sums the per-rank partial input gradients)."""
    kw = dict(device="meta")
    qk, h = cfg.head_dim + cfg.qk_rope_dim, cfg.dim
    if cfg.q_lora_rank:
        attn.wq_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * qk, tp, enter=False, **kw)
    else:
        attn.wq = ColumnParallelLinear(h, cfg.n_heads * qk, tp, enter=False, **kw)
    attn.wkv_b = ColumnParallelLinear(cfg.kv_lora_rank, cfg.n_heads * (cfg.head_dim + cfg.v_head_dim), tp,
                                      enter=False, **kw)
    attn.wo = RowParallelLinear(cfg.n_heads * cfg.v_head_dim, h, tp, sequence_parallel=sp, **kw)
    if tp.active:
        attn.register_forward_pre_hook(lambda m, args: (enter_region(args[0], tp, sp), *args[1:]))


def all_blocks(model: Transformer) -> list[nn.Module]:
    """Every transformer block: the model's layers, then the MTP modules' blocks (same kind, same plan)."""
    return list(model.layers.values()) + ([m.block for m in model.mtp.values()] if model.mtp is not None else [])


def apply_tensor_parallel(model: Transformer, mesh: Mesh, sequence_parallel: bool = False) -> Transformer:
    """Megatron plan: q/k/v and w1/w3 column-parallel, wo/w2 row-parallel, vocab-parallel embedding and head."""
    cfg, tp = model.cfg, mesh["tp"]
    sp = sequence_parallel and tp.active
    kw = dict(device="meta")
    model.tok_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.dim, tp, sp, **kw)
    for block in all_blocks(model):
        attn, ffn = block.attention, block.feed_forward
        h, hd = cfg.dim, cfg.head_dim
        if isinstance(ffn, MoE):
            block.feed_forward = apply_expert_parallel(cfg, mesh, sp)
            ffn = None
        if cfg.is_mla:
            _mla_tensor_parallel(attn, cfg, tp, sp)
            attn = None
        else:
            kv_rows, kv_replicas, kv_reduce = _kv_rows(cfg, tp)
        bias = cfg.attention_bias
        if attn is not None:
            attn.wq = ColumnParallelLinear(h, cfg.n_heads * hd, tp, bias=bias, enter=False, **kw)
            attn.wk = ColumnParallelLinear(h, cfg.n_kv_heads * hd, tp, bias=bias, enter=False, rows=kv_rows,
                                           replicas=kv_replicas, grad_reduce=kv_reduce, **kw)
            attn.wv = ColumnParallelLinear(h, cfg.n_kv_heads * hd, tp, bias=bias, enter=False, rows=kv_rows,
                                           replicas=kv_replicas, grad_reduce=kv_reduce, **kw)
            attn.wo = RowParallelLinear(cfg.n_heads * hd, h, tp, sequence_parallel=sp, **kw)
        if ffn is not None:
            ffn.w1 = ColumnParallelLinear(h, cfg.ffn_dim, tp, enter=False, **kw)
            ffn.w3 = ColumnParallelLinear(h, cfg.ffn_dim, tp, enter=False, **kw)
            ffn.w2 = RowParallelLinear(cfg.ffn_dim, h, tp, sequence_parallel=sp, **kw)
        # One region entry per sub-block, shared by its column-parallel projections: under SP one
        # all-gather; otherwise a ColumnRegion (one f, its backward all-reduce overlapped with dW).
        for region, layers in ((attn, [attn.wq, attn.wk, attn.wv] if attn else []),
                               (ffn, [ffn.w1, ffn.w3] if ffn else [])):
            if region is None or not tp.active:
                continue
            if sp:
                region.register_forward_pre_hook(lambda m, args: (enter_region(args[0], tp, sp), *args[1:]))
            else:
                region.register_forward_pre_hook(ColumnRegion(layers, tp))
    model.output = ColumnParallelLinear(cfg.dim, cfg.vocab_size, tp, sequence_parallel=sp, **kw)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.tp_axis, model.vocab_start, model.sequence_parallel = tp, model.tok_embeddings.vocab_start, sp
    share_aux_pool(model)  # the plan rebuilt the MoE blocks
    # Replicated parameters: norms (partial gradients under SP, since each rank sees s/tp tokens). The per-head
    # q/k norms see only this rank's heads, so their gradients are partial under any TP.
    for name, p in model.named_parameters():
        if not hasattr(p, "_sw_shard"):
            partial = sp or (tp.active and name.endswith(PER_HEAD_PARTIAL))
            set_spec(p, ShardSpec(tuple(p.shape), replicas=tp.size, grad_reduce="tp_sum" if partial else None))
    for m in model.modules():
        if isinstance(m, ReplicatedDropout):
            m.sp_axis = tp if sp else None
    return model


def apply_expert_parallel(cfg: ModelConfig, mesh: Mesh, sp: bool) -> MoE:
    """An MoE block whose experts are split over ep; router, shared experts and experts are replicated over TP.

    Without SP every TP rank routes the same tokens, so replicas compute identical gradients. Under
    SP each TP rank routes its own sequence shard: gradients are partial and summed over TP, and the
    aux loss statistics span tp as well as dp×cp.
    """
    tp = mesh["tp"]
    moe = build_moe(cfg, mesh["ep"], expert_replicas=tp.size, device="meta")
    moe.router.token_axes = (mesh["dp_cp"], tp) if sp else (mesh["dp_cp"],)
    for p in moe.experts.parameters():
        if sp:
            set_spec(p, dataclasses.replace(get_spec(p), grad_reduce="tp_sum"))
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
            p.copy_(spec.local_slice(global_init(init_name, spec.global_shape, cfg, seed)).to(device))


def global_init(name: str, shape, cfg: ModelConfig, seed: int) -> torch.Tensor:
    kind, std = Transformer.init_rule(name, cfg)
    if kind in ("ones", "zeros"):
        return torch.ones(shape) if kind == "ones" else torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def apply_context_parallel(model: Transformer, mesh: Mesh, order: str, impl: str) -> None:
    """Point attention at the cp axis (ring or Ulysses) and RoPE at the layout's global positions."""
    cp = mesh["cp"]
    model.cp_axis, model.cp_order = cp, order
    for block in all_blocks(model):
        block.attention.cp_axis, block.attention.cp_order, block.attention.cp_impl = cp, order, impl


def build_model(cfg: ModelConfig, mesh: Mesh, seed: int, parallel: ParallelConfig | None = None, *, schedule=None,
                act_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False) -> Transformer:
    """The model for this rank of `mesh` (the single-device model when every degree is 1).

    With a pipeline `schedule`, only this rank's stages are kept and `model.chunks` lists them in
    local-chunk order; with a split-backward schedule its linear layers defer dW to a store.
    `act_dtype` (bf16 activations) is the embedding's output dtype, so the residual stream and
    every activation payload downstream follow it.
    """
    p = parallel or ParallelConfig(sequence_parallel=sequence_parallel)
    sequence_parallel, pp_layers, cp_order, cp_impl = p.sequence_parallel, p.pp_layers, p.cp_order, p.cp_impl
    residual_dtype, recompute, recompute_layers, compile = act_dtype, p.recompute, p.recompute_layers, p.compile
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_tensor_parallel(model, mesh, sequence_parallel)
    model.tok_embeddings.out_dtype = residual_dtype
    apply_context_parallel(model, mesh, cp_order, cp_impl)
    model.chunks = None
    if schedule is not None:
        from .pipeline.grad_store import WeightGradStore
        from .partition import split_layers
        from .pipeline.stage import prune_to_stages
        from .pipeline.tied_embedding import mark_mtp_embedding, mark_tied_copies

        stage_layers = split_layers(cfg.n_layers, schedule.num_stages, pp_layers)
        model.chunks = prune_to_stages(model, mesh["pp"].rank, schedule.layout, stage_layers)
        mark_tied_copies(model, mesh)
        mark_mtp_embedding(model, mesh, residual_dtype)
        model.grad_store = WeightGradStore() if schedule.split_bw else None
        for m in model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                m.grad_store = model.grad_store
    materialize(model, cfg, seed, mesh.device)
    tracker = RNGTracker(seed, mesh["tp"].rank, mesh["pp"].rank, mesh.device)
    for m in model.modules():
        if isinstance(m, ReplicatedDropout):
            m.tracker = tracker
        elif hasattr(m, "attn_dropout"):
            m.rng = tracker
    model.rng_tracker = tracker
    if compile:  # before recompute, so a fully recomputed block checkpoints the compiled forward
        apply_compile(model)
    apply_recompute(model, recompute, recompute_layers)
    if compile:  # checkpoint with our RNG-replay context_fn is not traceable: the selective core runs eagerly
        for block in model.layers.values():
            if block.attention.recompute_core is not None:
                block.attention.recompute_core = torch.compiler.disable(block.attention.recompute_core)
    return model


def apply_compile(model: Transformer) -> None:
    """torch.compile the forward of each of this rank's transformer blocks (names and parameters unchanged).

    comm's collectives are compiler-disabled, so each block compiles into the graphs between its
    collectives while every collective, its autograd Function and its ledger entry run eagerly.
    """
    from . import comm

    comm.compile_barriers()
    for block in model.layers.values():
        attn = block.attention
        if attn.cp_axis is not None and attn.cp_axis.active:
            # Ring / Ulysses attention: fused kernels between p2p or all-to-all steps. Traced, Dynamo would
            # fall back at the first collective and then compile each per-step helper (and recompile it per
            # block shape), so the whole context-parallel core runs eagerly instead.
            attn.core = torch.compiler.disable(attn.core)
        block.forward = torch.compile(block.forward)
