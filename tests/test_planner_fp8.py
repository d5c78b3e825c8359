"""The planner under `--fp8`: its `fp8_amax` all-reduces against the ledger of real gloo steps, its FP8 peak, step
time and MFU, and `simulate --fp8` against the plan on full-size rows (slow).

The ledger check runs several FP8 layouts one after another in one spawn of 4 gloo ranks (one `train_step` each)
and holds every planned op equal to the measured one (count, bytes, wire bytes) on every axis — the `fp8_amax`
all-reduces of tp, dp_cp, cp, edp included — but the routed all-to-alls (their payloads follow the routing) and the
bookkeeping tags the planner leaves out. In the same spawn the dense layouts' saved activations of one microbatch
(`test_planner_ledger`'s saved-tensor hook) are held to the plan's: under --fp8-all-gather with SP the region
entries save the gathered FP8 operand, one byte per element.
"""
from __future__ import annotations

import json

import pytest
import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.fp8.recipes import recipe
from shardwise.planner import Cluster, estimate, get_gpu
from shardwise.planner.errors import PlanError
from shardwise.planner.activations import microbatch_activation_bytes
from shardwise.planner.layout import from_train_config, parse_layout, stages, Layout, Workload
from shardwise.planner.models import get_model
from shardwise.rules.fp8 import CASTS, FP8_BLOCKS
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks
from test_model_families import DEEPSEEK
from test_mtp import DEEPSEEK_MTP
from test_planner_ledger import _one_microbatch
from test_simulate import _simulate, _within

KW = dict(seq_len=32, micro_batch=2)
# name: (model, ParallelConfig kwargs, TrainConfig kwargs) — all on 4 ranks
LAYOUTS = {
    "dp2-tp2-sp-tensorwise": ("tiny", dict(dp=2, tp=2, sequence_parallel=True), dict(fp8="tensorwise")),
    "dp2-tp2-rowwise-full": ("tiny", dict(dp=2, tp=2, recompute="full"), dict(fp8="rowwise")),
    # blocks longer than the whole dimension: reduced like tensorwise ones (128 > tiny's 96 features, 32 tokens)
    "dp2-tp2-blockwise": ("tiny", dict(dp=2, tp=2, zero=1), dict(fp8="blockwise")),
    "dp2-cp2-mxfp8": ("tiny", dict(dp=2, cp=2), dict(fp8="mxfp8")),  # a 32-token tile: the whole sequence, over cp
    "dp4-ep2-moe-rowwise": ("tiny-moe", dict(dp=4, ep=2), dict(fp8="rowwise")),
    # MLA + MoE (MLA under TP: tests/test_fp8_mla_tp.py): the MLA linears' amaxes over cp, the experts' over edp
    "dp2-cp2-ep2-deepseek-tensorwise": (DEEPSEEK, dict(dp=2, cp=2, ep=2), dict(fp8="tensorwise")),
    # --fp8-all-gather: SP activations and ZeRO-3 weights as FP8 bytes
    "wire-dp2-tp2-sp-tensorwise": ("tiny", dict(dp=2, tp=2, sequence_parallel=True),
                                   dict(fp8="tensorwise", fp8_all_gather=True)),
    "wire-dp2-tp2-sp-zero3-tensorwise": ("tiny", dict(dp=2, tp=2, sequence_parallel=True, zero=3),
                                         dict(fp8="tensorwise", fp8_all_gather=True)),
    "wire-dp4-zero3-blockwise": ("tiny", dict(dp=4, zero=3), dict(fp8="blockwise", fp8_all_gather=True)),
    "wire-dp4-ep2-zero3-deepseek": (DEEPSEEK, dict(dp=4, ep=2, zero=3), dict(fp8="tensorwise", fp8_all_gather=True)),
    # MLA+MTP under tp and ZeRO-3: the down-projections' gradients, summed over tp before their casts, are whole, so
    # their units' buckets are reduce-scattered every microbatch (not deferred for a tp sum); MTP's units in FP8
    "wire-dp2-ep2-tp2-zero3-mtp": (DEEPSEEK_MTP, dict(dp=2, ep=2, tp=2, zero=3),
                                   dict(fp8="tensorwise", fp8_all_gather=True)),
}
IGNORED_TAGS = ("metrics", "grad_norm", "fp8_tiles")  # fp8_tiles: routing-sized (test_fp8_moe_sp checks them)
SAVED = [n for n in LAYOUTS if LAYOUTS[n][0] == "tiny" and (n.startswith("wire-") or n == "dp2-tp2-sp-tensorwise")]
"""Layouts whose saved activations are measured (dense: no routing in the figure), with and without the FP8 wire."""


def _config(name: str, seed: int) -> TrainConfig:
    model, par, kw = LAYOUTS[name]
    dp = par.get("dp", 1)
    return TrainConfig(model=model, parallel=ParallelConfig(**par), steps=1, seed=seed, progress=False,
                       global_batch=KW["micro_batch"] * dp * 2, **KW, **kw).resolved()


def one_step(cfg: TrainConfig):
    """Inside ranks: (trainer, mesh, the ledger's axes) of one train step of `cfg`."""
    mesh = make_mesh(cfg, torch.device("cpu"))
    trainer = Trainer(cfg, mesh)
    mesh.ledger.reset()
    trainer.train_step(0)
    return trainer, mesh, mesh.ledger.steps[-1]["axes"]


def _run(names: list[str], seed: int) -> dict:
    out = {}
    for name in names:
        cfg = _config(name, seed)
        trainer, mesh, axes = one_step(cfg)
        out[name] = dict(rank=mesh.rank, pp=mesh["pp"].rank, axes=axes)
        if name in SAVED:
            out[name]["activation"] = _one_microbatch(trainer, cfg)[0]
    return out


@pytest.fixture(scope="module")
def measured():
    seed = fresh_seed()
    with torch.device("meta"):  # warm torch's lazy imports once, before forking
        torch.nn.Embedding(2, 2)
    ranks = run_ranks(4, _run, list(LAYOUTS), seed)
    return seed, {name: [r[name] for r in ranks] for name in LAYOUTS}


def _comparable(axes: dict) -> dict:
    return {(axis, op): v for axis, ops in axes.items() for op, v in ops.items()
            if op.partition(":")[2] not in IGNORED_TAGS and not op.startswith("all_to_all")}


def assert_ops_as_planned(measured_axes: dict, planned_axes: dict, where: str) -> dict:
    """Every op the ledger measured is planned with the same count, bytes and wire bytes, and every planned op was
    measured (metrics, grad-norm and the routing-sized all-to-alls aside); the comparable measured ops."""
    got, planned = _comparable(measured_axes), _comparable(planned_axes)
    for key in set(got) | set(planned):
        m, p = got.get(key), planned.get(key)
        assert m is not None and p is not None, f"{where} {key}: measured {m}, planned {p}"
        assert (m["count"], m["bytes"], m["wire_bytes"]) == (p["count"], p["bytes"], p["wire_bytes"]), \
            f"{where} {key}: measured {m}, planned {p}"
    return got


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_amax_all_reduces_match_the_ledger(measured, name):
    seed, runs = measured
    cfg = _config(name, seed)
    spec, lay, wl = from_train_config(cfg)
    est = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)
    for rep in runs[name]:
        where = f"{name} rank {rep['rank']} (seed {seed})"
        got = assert_ops_as_planned(rep["axes"], est["stages"][rep["pp"]]["comm_ops_per_step"], where)
        assert any(k[1] == "all_reduce:fp8_amax" for k in got), f"{where}: no fp8_amax all-reduce measured"


@pytest.mark.parametrize("name", SAVED)
def test_saved_activations_match_the_plan(measured, name):
    """One microbatch's saved tensors equal `microbatch_activation_bytes` to 0.1 % (test_planner_ledger's bound);
    --fp8-all-gather under SP saves 3 bytes per element less of each region entry than fp32 (tiny runs in fp32)."""
    seed, runs = measured
    spec, lay, wl = from_train_config(_config(name, seed))
    for rep in runs[name]:
        planned = microbatch_activation_bytes(spec, stages(spec, lay)[rep["pp"]], lay, wl)["total"]
        assert rep["activation"] == pytest.approx(planned, rel=1e-3), \
            f"{name} rank {rep['rank']} (seed {seed}): saved {rep['activation']}, planned {planned}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_expert_weight_gradients_are_one_stack_at_a_time(dtype):
    """The FP8 routed experts' backward (fake tensors, `simulate`'s live-memory count) grows by what
    `expert_weight_grad_bytes` plans beside the residual stream's gradients: one stack's fp32 gradient slices and
    their stacked copy (the flat buffer's hook takes each stacked gradient away), not bf16's three stacks at once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardwise.expert_parallel.experts import GroupedExperts
    from shardwise.fp8.linear import Fp8Config, LinearLayout
    from shardwise.mesh import Axis
    from shardwise.planner.weight_grads import expert_weight_grad_bytes
    from shardwise.simulate.live import LiveMemory

    spec, wl = get_model("tiny-moe"), Workload(seq_len=16, global_batch=1, precision=dtype, fp8="tensorwise")
    lay = Layout(mb=1, m=1)
    stage = next(st for st in stages(spec, lay) if st.n_moe)
    n = wl.seq_len
    rows = n * spec.moe_topk
    with FakeTensorMode():
        ex = GroupedExperts(spec.moe_experts, spec.dim, spec.expert_ffn_dim, Axis("ep"))
        ex.fp8 = Fp8Config(recipe("tensorwise"), LinearLayout())
        for w in ex.parameters():
            w.register_post_accumulate_grad_hook(lambda w: setattr(w, "grad", None))
        x = torch.randn(rows, spec.dim, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16, requires_grad=True)
        with LiveMemory() as live, torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            y = ex(x, [rows // spec.moe_experts] * spec.moe_experts)
            g = torch.ones_like(y)
            live.peak = base = live.live
            y.backward(g)
    planned = expert_weight_grad_bytes(spec, stage, lay, wl) - 2 * wl.resid_bytes * n * spec.dim
    assert live.peak - base == planned, (live.peak - base, planned)


def test_the_rules_blocks_are_the_runtimes():
    """rules.fp8's blocks (the planner's) are the casts `shardwise.fp8.recipes` builds."""
    for name, blocks in FP8_BLOCKS.items():
        r = recipe(name)
        assert tuple(getattr(r, c).block for c in CASTS) == blocks, name


ROW70 = "tp=8,pp=4,dp=32,mb=1,m=32,zero=1,recompute=selective,sp=on"


def _plan(model: str, gpus: int, text: str, gpu: str = "h100-80gb", **wl) -> dict:
    spec = get_model(model)
    w = Workload(seq_len=4096, global_batch=1024, **wl)
    lay = parse_layout(text, Layout(), gpus, 1024)
    return estimate(spec, Cluster(get_gpu(gpu), gpus, 8), lay, w)


def test_fp8_runs_its_gemms_at_the_fp8_peak():
    bf16 = _plan("llama3-70b", 1024, ROW70)
    fp8 = _plan("llama3-70b", 1024, ROW70, fp8="rowwise")
    assert fp8["peak_flops_per_gpu"] == 1979e12 and bf16["peak_flops_per_gpu"] == 989e12
    assert fp8["compute_time_s"] < 0.6 * bf16["compute_time_s"]  # GEMMs at 2x, attention core and head at 1x
    assert bf16["mfu_bf16_equivalent"] == bf16["mfu"]
    assert fp8["mfu_bf16_equivalent"] == pytest.approx(fp8["mfu"] * 1979 / 989)
    assert fp8["model_flops_per_step"] == bf16["model_flops_per_step"]
    b200 = _plan("llama3-70b", 1024, ROW70, gpu="b200", fp8="tensorwise")
    assert b200["peak_flops_per_gpu"] == 4.5e15
    with pytest.raises(PlanError, match="a100-80gb has no FP8"):
        _plan("llama3-70b", 1024, ROW70, gpu="a100-80gb", fp8="tensorwise")


def test_plan_cli_reports_both_mfus(capsys):
    from shardwise.cli import main

    rc = main(["plan", "--model", "llama3-70b", "--gpus", "1024", "--explain", ROW70, "--fp8", "tensorwise",
               "--json"])
    est = json.loads(capsys.readouterr().out)
    assert rc == 0 and est["fp8"] == "tensorwise" and est["mfu_bf16_equivalent"] > est["mfu"] > 0
    assert est["comm_ops_per_step"]["dp_cp"]["all_reduce:fp8_amax"]["count"] > 0
    rc = main(["plan", "--model", "llama3-70b", "--gpus", "1024", "--explain", ROW70, "--fp8-all-gather"])
    assert rc == 2 and "--fp8-all-gather needs --fp8" in capsys.readouterr().err


@pytest.mark.slow
def test_simulate_llama3_70b_fp8(capsys):
    """tp8 pp4 dp32, SP, ZeRO-1, selective recompute, bf16 + tensorwise FP8 (world 1,024), the first stage (the last,
    rank 24, passes too; left out for time): no bf16 weight copies saved, the amax all-reduces over tp and dp_cp."""
    rc, report = _simulate(capsys, ["--model", "llama3-70b", "--tp", "8", "--pp", "4", "--dp", "32",
                                     "--sequence-parallel", "--zero", "1", "--recompute", "selective",
                                     "--dtype", "bf16", "--seq-len", "4096", "--micro-batch", "1",
                                     "--microbatches", "4", "--ranks", "0", "--fp8", "tensorwise"])
    _within(report)
    assert rc == 0 and report["world"] == 1024


@pytest.mark.slow
def test_simulate_fp8_all_gather(capsys):
    """tiny, dp2 tp2 pp2, SP, ZeRO-3, bf16 + tensorwise with --fp8-all-gather, the first stage: the region entries
    save the gathered FP8 operand (activations were planned 8 % high before) and the layers' units are gathered as
    FP8 bytes (the peak 9 % high)."""
    rc, report = _simulate(capsys, ["--seq-len", "64", "--micro-batch", "2", "--dp", "2", "--tp", "2", "--pp", "2",
                                     "--sequence-parallel", "--zero", "3", "--microbatches", "2", "--dtype", "bf16",
                                     "--fp8", "tensorwise", "--fp8-all-gather", "--ranks", "0"])
    _within(report)
    assert rc == 0 and report["ranks"][0]["activation_bytes"]["measured"] == \
        report["ranks"][0]["activation_bytes"]["planned"]


@pytest.mark.slow
def test_simulate_deepseek_v3_fp8(capsys):
    """The sweep's DeepSeek-V3 row (dp8 pp32 cp8 ep8, ZeRO-1, full recompute; world 2,048) with tensorwise FP8, its
    largest stage (two MoE layers: routed experts over edp, shared experts over dp_cp)."""
    rc, report = _simulate(capsys, ["--model", "deepseek-v3", "--dtype", "bf16", "--seq-len", "4096",
                                     "--micro-batch", "1", "--microbatches", "4", "--dp", "8", "--pp", "32",
                                     "--cp", "8", "--ep", "8", "--zero", "1", "--recompute", "full",
                                     "--pp-layers", ",".join(["2"] * 29 + ["1"] * 3), "--ranks", "16",
                                     "--fp8", "tensorwise"])
    _within(report)
    assert rc == 0 and report["world"] == 2048
