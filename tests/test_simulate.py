"""`shardwise simulate`: ranks of a full-size layout on fake tensors, each figure against the planner.

Every test runs in this process (a fake process group is one process's whole world) and asserts the
command's own bounds: static 1%, saved activations 2%, live peak 3%, comm bytes per axis equal.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from shardwise.cli import main
from shardwise.planner import peak
from shardwise.simulate import sweep


def _simulate(capsys, argv: list[str]) -> tuple[int, dict]:
    rc = main(["simulate", *argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1])


def _within(report: dict) -> None:
    for r in report["ranks"]:
        for key, tol in (("static_bytes", 0.01), ("activation_bytes", 0.02), ("peak_bytes", 0.03)):
            m, p = r[key]["measured"], r[key]["planned"]
            assert abs(m - p) <= tol * p, (r["rank"], key, m, p)
        assert all(v["measured"] == v["planned"] for v in r["comm_bytes"].values()), r["comm_bytes"]
        assert r["top_live"] and r["peak_bytes"]["measured"] > r["static_bytes"]["measured"]
    assert report["passed"]


TINY = ["--seq-len", "64", "--micro-batch", "2"]


@pytest.mark.parametrize("flags", [
    ["--dp", "2", "--tp", "2", "--pp", "2", "--sequence-parallel", "--zero", "1", "--microbatches", "2"],
    ["--pp", "2", "--schedule", "gpipe", "--microbatches", "2", "--dtype", "bf16"],
    ["--pp", "2", "--schedule", "interleaved", "--vp", "2", "--microbatches", "2"],
    ["--pp", "2", "--schedule", "zb", "--microbatches", "2"],
    ["--pp", "2", "--schedule", "dualpipev", "--microbatches", "4"],
], ids=["1f1b-tp-sp-zero1", "gpipe-bf16", "interleaved", "zb", "dualpipev"])
def test_tiny_on_every_schedule(capsys, flags):
    rc, report = _simulate(capsys, TINY + flags)
    _within(report)
    assert rc == 0
    assert [r["stage"] for r in report["ranks"]] == [0, 1]


def test_llama3_70b_on_1024_gpus(capsys):
    """tp8 pp4 dp32, ZeRO-1, selective recompute, bf16, 4k tokens: the first and last stage."""
    rc, report = _simulate(capsys, ["--model", "llama3-70b", "--tp", "8", "--pp", "4", "--dp", "32",
                                     "--sequence-parallel", "--zero", "1", "--recompute", "selective",
                                     "--dtype", "bf16", "--seq-len", "4096", "--micro-batch", "1",
                                     "--microbatches", "4", "--ranks", "0,24"])
    assert rc == 0 and report["world"] == 1024
    _within(report)
    assert [r["stage"] for r in report["ranks"]] == [0, 3]
    assert report["ranks"][0]["static_bytes"]["measured"] > 15 * 2**30  # real shapes: ~18 GB of static state


def test_llama3_70b_zero3_full_recompute_cp2_interleaved(shared_simulations):
    """tp8 pp4 dp16 cp2, SP, ZeRO-3, full recompute, interleaved vp2, bf16, 4k tokens (world 1,024), the first and last
    stage: the peak is a unit's backward (its recomputed layer, the running and prefetched unit gathered,
    its gradient bucket beside the two in flight); full recompute's blocks run without autocast's weight
    cache, so a forward no longer holds every layer's bf16 copy (docs/recompute.md). The sweep's 70B layout at 4k
    tokens; test_peak_sweep's LM-head check reads the same last-stage run (`shared_simulations`: simulated once)."""
    report = sweep.simulate(replace(sweep.LAYOUTS["llama3-70b-int-z3-full-s8192"], seq_len=4096), "0,48")
    assert report["world"] == 1024
    _within(report)
    assert [r["stage"] for r in report["ranks"]] == [0, 3]
    for r in report["ranks"]:  # the peak holds gathered units and in-flight gradient buckets beside the statics
        assert r["peak_bytes"]["measured"] > 3 * r["static_bytes"]["measured"]


def test_llama3_405b_on_18432_gpus_in_under_2_gb():
    """Fake tensors hold no data: one 405B stage of a world of 18,432 ranks runs in a child under 2 GB RSS."""
    argv = ["--model", "llama3-405b", "--tp", "8", "--pp", "18", "--dp", "128", "--sequence-parallel", "--zero", "1",
            "--recompute", "full", "--dtype", "bf16", "--seq-len", "8192", "--micro-batch", "1",
            "--microbatches", "18", "--ranks", "0", "--json"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    # The child reports its own peak, VmHWM of its address space: RUSAGE_CHILDREN here is the largest of every
    # child this pytest process has waited for (other tests' runs included), and the child's own ru_maxrss starts
    # at this process's RSS (Linux carries the forking process's high-water mark across exec).
    peak = ("import re, runpy, sys\n"
            "sys.argv = ['shardwise', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('shardwise.cli', run_name='__main__')\n"
            "finally:\n    print('MAXRSS_KIB', re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())[1], "
            "file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", peak, "simulate", *argv], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    _within(report)
    assert report["world"] == 18432
    rss = int(out.stderr.split("MAXRSS_KIB")[-1].split()[0]) * 1024  # Linux: KiB
    assert 100 * 2**20 < rss < 2 * 2**30, rss


@pytest.mark.parametrize("recompute, ranks", [("selective", "stages"), ("full", "0")])
def test_mixtral_with_expert_parallelism(capsys, recompute, ranks):
    """mixtral-8x7b on dp16·ep8·tp4·pp2 (world 128), SP, bf16: the planner's balanced routing answers the
    split sizes, and the fake experts take the per-expert loop (fake _grouped_mm would refuse fp32 weights).
    Under full recompute the peak is after backward: the fp32 concatenation of every TP-partial gradient
    (under SP the whole MoE block's, experts included) summed over tp."""
    rc, report = _simulate(capsys, ["--model", "mixtral-8x7b", "--dp", "16", "--ep", "8", "--tp", "4", "--pp", "2",
                                    "--sequence-parallel", "--zero", "1", "--recompute", recompute, "--dtype", "bf16",
                                    "--seq-len", "4096", "--micro-batch", "1", "--microbatches", "4", "--ranks", ranks])
    _within(report)
    assert rc == 0 and report["world"] == 128
    assert all(r["comm_bytes"]["ep"]["measured"] > 0 for r in report["ranks"])
    if recompute == "full":
        assert report["ranks"][0]["peak_phase"] == "gradient reduction"


def test_document_mask_under_ring_attention(capsys):
    """--attention-mask document with ring cp: the document plan (a host read) is answered by the stated
    stand-in — every block pair computed with its mask, the most work and memory — and the run is within
    the bounds."""
    import torch

    from shardwise.cli import build_parser, config_from_args
    from shardwise.context_parallel.ring_attention import _document_plan, block_plan
    from shardwise.simulate.world import DOCUMENT_PLAN, Answers, StandIns

    argv = TINY + ["--cp", "2", "--dp", "2", "--attention-mask", "document"]
    rc, report = _simulate(capsys, argv)
    _within(report)
    assert rc == 0
    main(["simulate", *argv])
    assert DOCUMENT_PLAN in capsys.readouterr().out
    cfg = config_from_args(build_parser().parse_args(["simulate", *argv]), None)
    doc_ids = torch.zeros(2, 64, dtype=torch.long)
    with StandIns(Answers(cfg)):
        plan = _document_plan(0, 2, "balanced", True, 32, doc_ids)
    expected = [block_plan(0, (0 - step) % 2, 2, "balanced", True, 32) for step in range(2)]
    assert [[(q, k) for q, k, _, _ in pairs] for pairs in plan] == [[(q, k) for q, k, _ in p] for p in expected]
    assert all(mask is not None for pairs in plan for *_, mask in pairs)


def test_a_broken_planner_term_fails(capsys, monkeypatch):
    """Leave the zero-bubble weight-gradient store out of the planned peak: simulate sees the difference, exit 1."""
    argv = TINY + ["--pp", "2", "--schedule", "zb", "--microbatches", "2", "--ranks", "1"]
    rc, report = _simulate(capsys, argv)
    assert rc == 0
    monkeypatch.setattr(peak, "weight_store_bytes", lambda *a: 0.0)
    rc, report = _simulate(capsys, argv)
    assert rc == 1 and not report["passed"]
    r = report["ranks"][0]
    assert r["peak_bytes"]["measured"] > 1.03 * r["peak_bytes"]["planned"]
    assert r["static_bytes"]["measured"] == r["static_bytes"]["planned"]


@pytest.mark.parametrize("argv, says", [
    (["--dp", "2", "--ranks", "2"], "rank 2 is outside the world of 2 ranks"),
    (["--dp", "2", "--ranks", "x"], "--ranks 'x'"),
    (["--tp", "3"], "tp"),
    (["--pp", "2", "--compile"], "--compile"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, says):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_plan_shows_the_peak_and_fits_by_it(capsys):
    """`shardwise plan`: a peak column, and "fits" is the live peak within the usable memory."""
    base = ["plan", "--model", "llama3-70b", "--gpus", "1024", "--seq-len", "4096", "--zero", "3",
            "--recompute", "full"]
    assert main(base) == 0
    table = capsys.readouterr().out
    assert "peak GB" in table
    assert main(base + ["--explain", "dp=16,tp=8,pp=4,cp=2,schedule=interleaved,vp=2", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["peak_bytes_per_rank"] > est["total_bytes_per_rank"]  # gathered units, buckets, weight copies
    assert est["fits"] == (est["peak_bytes_per_rank"] <= est["usable_bytes_per_rank"])
    assert all(s["peak_bytes"] >= s["static_bytes"] for s in est["stages"])
    assert main(base + ["--usable-memory", str(est["total_bytes_per_rank"] * 1.001 / 80e9), "--explain",
                        "dp=16,tp=8,pp=4,cp=2,schedule=interleaved,vp=2", "--json"]) in (0, 1)
    tight = json.loads(capsys.readouterr().out)
    assert not tight["fits"]  # static + activations would fit; the peak does not


def _config(argv: list[str]):
    """The run of `simulate ARGV` with 4 layers of the preset's 8: one or two per pipeline chunk, every layer kind
    (MoE, dense) on each stage of tiny-moe, and half the ops to trace (both runs compared trace the same layers)."""
    from shardwise.cli import build_parser, config_from_args
    from shardwise.training.assemble import assemble

    cfg = config_from_args(build_parser().parse_args(["simulate", *argv]), None)
    return assemble(replace(cfg, resolved_model=None, model_overrides={**cfg.model_overrides, "n_layers": 4}))


SHORTENED = {  # layout, the stage compared; tiny shapes, with ZeRO/CP/EP/recompute where they change the
    # per-microbatch work and traffic (ZeRO-2/3 reduce-scatters and ZeRO-3 gathers every microbatch, the cp
    # ring every attention, MoE's token-count-dependent all-to-alls every MoE layer)
    "no-pp-zero3-cp2-full": (["--dp", "2", "--cp", "2", "--zero", "3", "--recompute", "full",
                              "--microbatches", "5"], 0),
    "1f1b-moe-ep2-tp-sp-zero3-bf16": (["--model", "tiny-moe", "--pp", "2", "--dp", "2", "--ep", "2", "--tp", "2",
                                  "--sequence-parallel", "--zero", "3", "--dtype", "bf16", "--microbatches", "5"], 1),
    "interleaved-cp2-zero2": (["--pp", "2", "--schedule", "interleaved", "--vp", "2", "--cp", "2", "--zero", "2",
                               "--microbatches", "10"], 0),
    "zb-zero2-bf16-selective": (["--pp", "2", "--schedule", "zb", "--dp", "2", "--zero", "2", "--dtype", "bf16",
                                 "--recompute", "selective", "--microbatches", "6"], 1),
    "dualpipev-moe-ep2-bf16": (["--model", "tiny-moe", "--pp", "2", "--schedule", "dualpipev", "--dp", "2", "--ep", "2",
                           "--zero", "1", "--dtype", "bf16", "--microbatches", "7"], 1),
}
SAME = ("peak_bytes", "peak_phase", "top_live", "static_bytes", "activation_bytes", "build_peak_bytes", "ledger",
        "comm_bytes", "stage")


@pytest.mark.parametrize("name", sorted(SHORTENED))
def test_a_shortened_step_equals_the_full_step(name):
    """A stage's shortened run (warm-up, one steady period, cool-down; the period's traffic scaled to the full
    count) has exactly the full run's live peak, its moment, the largest groups there, static and activation
    bytes, and the ledger — count, bytes and wire bytes per axis and op."""
    from shardwise.simulate.world import simulate_rank

    argv, stage = SHORTENED[name]
    cfg = _config(["--seq-len", "16", "--micro-batch", "1", "--steps", "2", *argv])
    rank = stage * cfg.parallel.cp * cfg.parallel.tp
    short, full = simulate_rank(cfg, rank), simulate_rank(cfg, rank, every_microbatch=True)
    assert short["microbatches_scaled"] >= 2 and full["microbatches_scaled"] == 0
    assert short["microbatches_run"] + short["microbatches_scaled"] == full["microbatches_run"]
    for key in SAME:
        assert short[key] == full[key], key
