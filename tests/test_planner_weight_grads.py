"""The runtime facts the planner reads instead of restating, and the weight-gradient moments of the live peak.

Pure arithmetic: no process, no torch. The moments' bytes are checked against traces by the sweep
(`tests/test_peak_sweep.py`); here, that each is derived from the shapes and appears where it should.
"""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

from shardwise.rules import buckets as bucket_plan
from shardwise.planner import Layout, Workload, get_model, memory_by_stage
from shardwise.commands.plan import main
from shardwise.planner.layout import Stage, stages
from shardwise.planner.models import padded_vocab
from shardwise.planner.peak import PEAK_TERMS
from shardwise.planner.weight_grads import (
    embedding_weight_grad_bytes, expert_weight_grad_bytes, head_weight_grad_bytes,
)

ROOT = Path(__file__).resolve().parents[1] / "shardwise"
DEEPSEEK_TOP = Layout(dp=8, tp=1, pp=32, cp=8, ep=8, schedule="1f1b", mb=1, m=128, zero=1, recompute="full",
                      sequence_parallel=False)
BF16_4K = Workload(seq_len=4096, global_batch=1024)


def test_bucket_facts_have_one_definition():
    """The bucket size, the in-flight limit and the cut are defined once; the reducer and the planner import
    them, and no module spells the limit as a bare slice."""
    defined = {}
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.FunctionDef):
                names = [node.name]
            else:
                continue
            for n in names:
                if n in ("BUCKET_BYTES", "MAX_INFLIGHT", "cut_runs", "cut_buckets"):
                    defined.setdefault(n, []).append(path.relative_to(ROOT).as_posix())
    assert defined == {n: ["rules/buckets.py"] for n in ("BUCKET_BYTES", "MAX_INFLIGHT", "cut_runs")}
    for name in ("data_parallel/reducer.py", "planner/memory.py", "planner/zero2_inflight.py",
                 "planner/zero3_inflight.py", "planner/comm_model.py"):
        assert "shardwise.rules.buckets import" in (ROOT / name).read_text().replace("..rules.buckets", "shardwise.rules.buckets")


def test_cut_runs_closes_at_the_threshold():
    runs = list(bucket_plan.cut_runs([3, 4, 1, 5, 2], lambda x: x, bucket_bytes=5))
    assert runs == [[3, 4], [1, 5], [2]]
    assert list(bucket_plan.cut_runs([], lambda x: x)) == []


def test_head_weight_gradient_is_bf16_plus_fp32_at_tp1():
    """DeepSeek-V3's head at tp1: the bf16 gradient of 129,280 × 7,168 and its fp32 copy (5.6 GB) beside the
    input's gradient and (no pipeline) the logits, less the head's saved tensors; a tp split divides it."""
    spec = get_model("deepseek-v3")
    last = stages(spec, DEEPSEEK_TOP)[-1]
    assert last.head
    table = padded_vocab(spec, 1) * spec.dim
    got = head_weight_grad_bytes(spec, last, DEEPSEEK_TOP, BF16_4K)
    assert 6 * table * 0.8 < got + 2 * table < 6 * table * 1.05  # the saved bf16 copy (2·table) is freed by then
    tp8 = Layout(dp=8, tp=8, pp=32, ep=8, mb=1, m=128, zero=1, recompute="full")
    assert head_weight_grad_bytes(spec, stages(spec, tp8)[-1], tp8, BF16_4K) < got / 6
    zb = Layout(dp=8, pp=32, cp=8, ep=8, mb=1, m=128, zero=1, recompute="full", schedule="zb")
    assert head_weight_grad_bytes(spec, stages(spec, zb)[-1], zb, BF16_4K) == 0  # W comes from the store there


def test_expert_and_embedding_weight_gradients():
    spec = get_model("deepseek-v3")
    stack = spec.moe_experts // 8 * spec.expert_ffn_dim * spec.dim
    moe = Stage(3, 0, 2, False, False)
    got = expert_weight_grad_bytes(spec, moe, DEEPSEEK_TOP, BF16_4K)
    assert abs(got - (3 * 2 * stack + 4 * stack)) < 0.02 * got  # recomputed: its bf16 copies are made in backward
    selective = replace(DEEPSEEK_TOP, recompute="selective")
    assert expert_weight_grad_bytes(spec, moe, selective, BF16_4K) == got - 3 * 2 * stack  # saved copies freed
    assert expert_weight_grad_bytes(spec, Stage(0, 2, 0, True, False), DEEPSEEK_TOP, BF16_4K) == 0
    first = stages(spec, DEEPSEEK_TOP)[0]
    assert embedding_weight_grad_bytes(spec, first, DEEPSEEK_TOP, BF16_4K) > 3.5 * padded_vocab(spec, 1) * spec.dim


def test_peak_terms_name_their_moment(capsys):
    """Every stage's peak names its moment; DeepSeek-V3's top layout peaks in an MoE stage's expert GEMMs, and
    `plan --explain` prints that moment and its terms for the largest stage."""
    spec = get_model("deepseek-v3")
    mem = memory_by_stage(spec, DEEPSEEK_TOP, BF16_4K)
    assert all(isinstance(m["peak_terms"]["moment"], str) for m in mem)
    worst = max(mem, key=lambda m: m["peak"])
    assert "experts' GEMMs" in worst["peak_terms"]["moment"]
    assert set(PEAK_TERMS) | {"total", "moment"} == set(worst["peak_terms"])
    assert main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--seq-len", "4096", "--micro-batch", "1",
                 "--recompute", "full", "--uneven-pp", "--explain",
                 "dp=8,tp=1,pp=32,cp=8,ep=8,vp=1,schedule=1f1b,mb=1,m=128,zero=1,recompute=full,sp=false"]) == 0
    out = capsys.readouterr().out
    assert "live peak of stage" in out and "experts' GEMMs" in out and PEAK_TERMS["static"] in out
