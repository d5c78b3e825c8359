"""MLA (DeepSeek) specifics not covered by the family-wide tests: summary.json names the padding MLA applies
before ring attention and Ulysses (their kernels move K and V as one shape)."""
import dataclasses

from shardwise.context_parallel import kernels

from _dist import run_ranks
from test_model_families import DEEPSEEK

WIDE_V = dataclasses.replace(DEEPSEEK, v_head_dim=32)  # v wider than q/k's 16 + 8: q and k are padded instead


def _train(tmp):
    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.training.assemble import assemble
    from shardwise.training.loop import train_main

    out = []
    for model, impl in ((DEEPSEEK, "ring"), (DEEPSEEK, "ulysses"), (WIDE_V, "ring")):
        cfg = TrainConfig(model=model, parallel=ParallelConfig(cp=2, cp_impl=impl), steps=1, seq_len=32,
                          micro_batch=2, global_batch=2, progress=False, report=False, out=f"{tmp}/{impl}{model.v_head_dim}")
        out.append(train_main(assemble(cfg)).get("attention_kernel"))  # rank 0 writes summary.json
    return out


def test_summary_states_mla_padding_under_cp(tmp_path):
    """attention_kernel gains "mla_padding": which head MLA zero-padded, from and to which size, before which
    call site (v 12 → 24 for the tiny DeepSeek; q/k 24 → 32 when v is wider)."""
    kernels.USED.clear()  # forked ranks inherit this process's record
    ring, uly, wide = run_ranks(2, _train, str(tmp_path))[0]
    assert ring == {"ring_attention": "flash_cpu", "mla_padding": "ring_attention: v head 12 zero-padded to 24"}
    assert uly == {"ulysses": "flash_cpu", "mla_padding": "ulysses: v head 12 zero-padded to 24"}
    assert wide == {"ring_attention": "flash_cpu", "mla_padding": "ring_attention: q/k head 24 zero-padded to 32"}


def test_planner_matmul_flops_equal_flop_counter():
    """The planner's per-layer matmul FLOPs (MLA's low-rank projections, Qwen3's q/k-norm attention, MoE routers
    and experts) equal torch's FlopCounterMode on a real forward of each layer. The counter has no formula for
    `_grouped_mm` (the routed experts: 3 GEMMs of 2·rows·dim·ffn each, added here) nor for CPU flash attention
    (the attention core is not compared)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.parallelize import plain_model
    from shardwise.planner.estimate import layer_flops_per_token
    from shardwise.planner.models import ModelSpec
    from test_model_families import DEEPSEEK_NOQ, QWEN3, QWEN3_MOE

    torch.manual_seed(0)
    b, s = 2, 32
    for cfg in (DEEPSEEK, DEEPSEEK_NOQ, QWEN3, QWEN3_MOE):
        model = plain_model(cfg)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        h = model.tok_embeddings(torch.randint(0, cfg.vocab_size, (b, s)))
        cos, sin = model.rope(s, "cpu")
        for i in (0, 1):
            with FlopCounterMode(display=False) as fc:
                model.layers[str(i)](h, cos, sin)
            counted = fc.get_total_flops()
            if cfg.is_moe_layer(i):
                counted += 3 * 2 * b * s * cfg.moe_topk * cfg.dim * cfg.moe_ffn_dim
            planned, _ = layer_flops_per_token(ModelSpec.of(cfg), cfg.is_moe_layer(i), s)
            assert counted == planned * b * s, (cfg.name, i, counted, planned * b * s)
