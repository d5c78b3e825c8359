"""benchmarks/gpu_check.py --dry-run: the device check's code on CPU with tiny shapes."""
import json
import subprocess
import sys


def test_gpu_check_dry_run():
    r = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(v["passed"] for v in res["verify"]) and len(res["verify"]) == 3
    assert [v["passed"] for v in res["verify_shared_gpu_gloo"]] == [True]
    assert max(res["ring_blocks_vs_sdpa"]["float32"].values()) < 1e-5
    assert max(res["ring_blocks_vs_sdpa_document_mask"]["float32"].values()) < 1e-5
    assert res["attention_kernels"] == ["flash_cpu"] and res["vocab_ce_rel_diff"] < 1e-6
    assert [t["dtype"] for t in res["train"]] == ["fp32", "bf16"] and res["bf16_vs_fp32_first_loss_diff"] < 5e-2
    fp32, bf16 = res["train"]
    assert 0 < bf16["planner_activation_gib"] < fp32["planner_activation_gib"] < fp32["planner_peak_gib"]
