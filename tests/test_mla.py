"""MLA (DeepSeek) specifics not covered by the family-wide tests: summary.json names the padding MLA applies
before ring attention and Ulysses (their kernels move K and V as one shape)."""
import dataclasses

from shardwise.context_parallel import kernels

from _dist import run_ranks
from test_model_families import DEEPSEEK

WIDE_V = dataclasses.replace(DEEPSEEK, v_head_dim=32)  # v wider than q/k's 16 + 8: q and k are padded instead


def _train(tmp):
    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.run import assemble
    from shardwise.train import train_main

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
