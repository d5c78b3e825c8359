"""`--fp8` on MLA under TP: the down-projections (wq_a, wkv_a) are replicated over tp and each rank back-propagates
only its own heads into them, so their output gradient is a per-rank partial sum — and an FP8 cast of a partial sum
is not the cast of the sum. `Fp8Config.grad_sum` all-reduces that gradient over tp (`all_reduce:fp8_grad`) before the
backward casts, so every rank computes the whole dW (no tp sum) and dx (handed back by tp rank 0 only).

One two-rank spawn: `shardwise verify --fp8` on the DeepSeek-shaped MLA+MTP MoE at tp2 with SP (tensorwise; its
routed and shared experts' casts are replayed too), on MLA with dense MLPs at tp2 without SP (blockwise) and with
--fused-projections (rowwise), and on Kimi-Linear's shape (KDA's gate down-projections are head-partial too) at tp2,
each held to the bounds derived from the single-device FP8 model's own spread; then with the fix undone (the partial
gradients cast per rank, summed later) at tp2+SP and on Kimi, which verify must fail. The runtime's ledger of one
step at dp2×tp2 (DeepSeek-shaped MLA+MTP with SP, Kimi without) equals the planner's.
"""
import pytest
import torch

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.planner import Cluster, estimate, get_gpu
from shardwise.planner.layout import from_train_config

from _dist import fresh_seed, run_ranks
from test_mtp import DEEPSEEK_MTP
from test_planner_fp8 import assert_ops_as_planned, one_step

# Kimi-Linear's shape: a KDA layer (its gate down-projections wf_a, wg_a are head-partial as MLA's) and an MLA layer
KIMI = ModelConfig(name="kimi-tiny", vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=48,
                   max_seq_len=64, kv_lora_rank=16, qk_rope_dim=8, v_head_dim=8, mla_nope=True, kda=True,
                   linear_layers=(0,), linear_k_heads=4, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8)
# MLA with dense MLPs: the cheaper model for the layouts without SP (the DeepSeek-shaped MLA+MTP MoE runs with SP)
MLA_DENSE = ModelConfig(name="mla-dense", vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=16,
                        ffn_dim=96, max_seq_len=64, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=24, qk_rope_dim=8,
                        v_head_dim=12)
LAYOUTS = {  # name: (model, recipe, parallel degrees)
    "tp2_sp_tensorwise": (DEEPSEEK_MTP, "tensorwise", dict(tp=2, sequence_parallel=True)),  # routed experts replayed
    "tp2_blockwise": (MLA_DENSE, "blockwise", dict(tp=2)),
    "tp2_fused_rowwise": (MLA_DENSE, "rowwise", dict(tp=2, fused_projections=True)),
    "kimi_tp2_tensorwise": (KIMI, "tensorwise", dict(tp=2)),
}
LEDGER = {"mtp_tp2_sp_tensorwise": (DEEPSEEK_MTP, "tensorwise", dict(tp=2, sequence_parallel=True)),
          "kimi_tp2_tensorwise": LAYOUTS["kimi_tp2_tensorwise"]}
BROKEN = ("tp2_sp_tensorwise", "kimi_tp2_tensorwise")


def _cfg(name: str, seed: int, steps: int = 2, dp: int = 1) -> TrainConfig:
    model, fp8, degrees = (LAYOUTS | LEDGER)[name]
    return TrainConfig(model=model, parallel=ParallelConfig(dp=dp, **degrees), steps=steps, seq_len=32,
                       micro_batch=2, global_batch=2 * dp * 2, seed=seed, progress=False, fp8=fp8, warmup_steps=20,
                       lr_decay_steps=200).resolved(2 * dp)


def _ledgers(names: list[str], seed: int) -> dict:
    """Inside ranks: the ledger of one train step (two microbatches) of each layout at dp2."""
    torch.set_num_threads(1)
    return {name: one_step(_cfg(name, seed, steps=1, dp=2))[2] for name in names}


def _verify_all(seed: int) -> dict:
    """Inside ranks: every layout's verdict, then the broken ones' with the output gradients left partial."""
    from shardwise.fp8 import apply
    from shardwise.verify.main import verify_main

    torch.set_num_threads(1)
    out = {name: verify_main(_cfg(name, seed)) for name in LAYOUTS}
    apply._sum_output_gradient = lambda layer, tp: None  # the partial gradients cast per rank, tp-summed later
    return out | {f"{name}/partial": verify_main(_cfg(name, seed)) for name in BROKEN}


def test_ledger_equals_the_plan():
    """Every op the runtime issues at dp2×tp2, MLA+MTP with SP and Kimi-Linear (KDA + MLA) without — the `fp8_grad`
    all-reduces on tp, the tp sum
    without the down-projections, the dp buckets — as the planner counts it; one four-rank spawn."""
    seed = fresh_seed()
    with torch.device("meta"):  # torch's lazy imports once, before forking
        torch.nn.Embedding(2, 2)
    names = list(LEDGER)
    runs = run_ranks(4, _ledgers, names, seed)
    for name in names:
        spec, lay, wl = from_train_config(_cfg(name, seed, steps=1, dp=2))
        planned = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl,
                           detail=True)["stages"][0]["comm_ops_per_step"]
        for rank, run in enumerate(runs):
            where = f"{name} rank {rank} (seed {seed})"
            got = assert_ops_as_planned(run[name], planned, where)
            assert got.get(("tp", "all_reduce:fp8_grad")), f"{where}: no fp8_grad all-reduce measured"


@pytest.mark.slow
def test_verify_fp8_mla_under_tp():
    seed = fresh_seed()
    out = run_ranks(2, _verify_all, seed, timeout_s=600)[0]
    wrong = []  # every layout judged before the assertion, so a failure names all that failed
    for name, (_, fp8, _) in LAYOUTS.items():
        v = out[name]
        if not (v["passed"] and v["coverage"] == 1.0 and len(v["losses"]) == 2):
            wrong.append((name, fp8, v["passed"], v["fp8_budget"]["ratios"], v["coverage"]))
    for name in BROKEN:
        v = out[f"{name}/partial"]
        if v["passed"]:
            wrong.append((f"{name}/partial", v["passed"], v["fp8_budget"]["ratios"]))
    assert not wrong, (seed, wrong)


def test_mla_under_tp_is_accepted(capsys):
    from shardwise.cli import main

    code = main(["train", "--fp8", "tensorwise", "--model-config", "tests/data/deepseek_tiny_config.json",
                 "--tp", "2", "--seq-len", "32", "--print-config"])
    assert code == 0, capsys.readouterr().err
