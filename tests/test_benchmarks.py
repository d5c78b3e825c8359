"""Every script under benchmarks/ still runs: each in its --smoke mode (tiny sizes, one repetition) as a
subprocess, ending in one JSON line with the keys its docstring promises. A peer that is not installed
(megatron-core is not in the test extra) shows in that JSON as absent, with the reason."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

# script -> the keys of its last stdout line
PROMISED = {
    "cp_balance.py": {"medians_s", "ratios", "config", "peers", "absent"},
    "dp_peers.py": {"medians_s", "ratios", "config", "loss_abs_diff_vs_peer"},
    "ep_dispatch.py": {"medians_s", "ratios", "paired_ratios", "bytes", "config", "absent"},
    "fp8_ablate.py": {"medians_s", "ratios", "eval_loss", "rel_to_baseline", "config"},
    "fp8_loss.py": {"medians_s", "ratios", "final_loss", "rel_to_bf16", "passed", "config"},
    "fp8_torchao.py": {"medians_s", "ratios", "max_abs_diff", "config"},
    "family_speed.py": {"medians_s", "ratios", "max_abs_diff", "config"},
    "loader_rss.py": {"medians_s", "ratios", "rss_mb", "config"},
    "moe_imbalance.py": {"medians_s", "medians_rows", "ratios", "paired_ratios", "max_abs_diff", "config"},
    "plan_speed.py": {"medians_s", "ratios", "config"},
    "pp_peers.py": {"medians_s", "ratios", "bubbles", "paired_ratios", "loss_diff", "max_grad_diff", "config"},
    "prepare_data.py": {"medians_s", "ratios", "config"},
    "single_device.py": {"medians_s", "ratios", "max_abs_diff", "config"},
    "tp_peers.py": {"medians_s", "ratios", "paired_ratios", "max_abs_diff", "config", "absent"},
    "tp_overlap.py": {"medians_s", "ratios", "absent", "results", "config"},
    "verify_stress.py": {"layouts", "seeds_per_layout", "medians_s", "ratios"},
}
NO_PEER = {"verify_stress.py", "fp8_ablate.py"}  # compare nothing against a peer: their "ratios" is empty
SCRIPTS = sorted(s for s in PROMISED if os.path.isfile(os.path.join(BENCH, s)))
MEGATRON = importlib.util.find_spec("megatron") is not None


def _smoke(script: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), "--smoke"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, f"{script} --smoke failed:\n{r.stderr[-4000:]}"
    last = r.stdout.strip().splitlines()[-1]
    return json.loads(last)


def test_every_benchmark_has_a_smoke_test():
    scripts = {f for f in os.listdir(BENCH) if f.endswith(".py")} - {"gpu_check.py"}
    assert scripts <= set(PROMISED), f"a new benchmark needs a --smoke run here: {sorted(scripts - set(PROMISED))}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_ends_in_one_json_line(script):
    out = _smoke(script)
    assert PROMISED[script] <= set(out), f"missing keys: {PROMISED[script] - set(out)}"
    absent = out.get("absent", {})
    for name, t in out["medians_s"].items():
        if t is None:  # only a peer that could not run may lack a time, and it says why
            assert any(name.startswith(a) or name.endswith(a) for a in absent), (name, absent)
        else:
            assert math.isfinite(t) and t > 0, (name, t)
    assert bool(out["ratios"]) == (script not in NO_PEER), out["ratios"]
    if "megatron" in absent:
        assert not MEGATRON and "megatron" in absent["megatron"]
    if script in ("tp_peers.py", "ep_dispatch.py", "tp_overlap.py"):
        assert ("megatron" in absent) == (not MEGATRON), absent
    if script == "tp_overlap.py":  # overlap on/off and fused/unfused, each exact against the plain run
        assert {"tp2_overlap_vs_plain", "tp2_fused_vs_unfused", "vs_megatron"} <= out["ratios"].keys()
        assert max(out["results"]["tp2"]["max_abs_diff"].values()) < 1e-5, out["results"]
        assert out["results"]["tp2"]["fused_stored"], out["results"]
    if script == "pp_peers.py":  # every pair ran its correctness step and a timed one on the same models
        assert set(out["loss_diff"]) == {"1f1b", "interleaved", "zb", "dualpipev"}
        assert max(out["loss_diff"].values()) < 1e-5 and max(out["max_grad_diff"].values()) < 1e-5, out


class _Stop(Exception):
    pass


def test_gpu_check_smoke_is_the_cpu_dry_run(monkeypatch):
    """gpu_check needs CUDA; --smoke is its CPU dry run (tests/test_gpu_check.py runs it whole): here only the
    argument handling, up to the first multi-rank run."""
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(BENCH, "gpu_check.py"))
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    seen = []

    def verify(mode, seq_len):
        seen.append((mode, seq_len))
        raise _Stop

    monkeypatch.setattr(gc, "verify_layouts", verify)
    monkeypatch.setattr(gc.torch, "set_num_threads", lambda n: None)
    with pytest.raises(_Stop):
        gc.main(["--smoke"])
    assert seen == [("gloo", 32)]
