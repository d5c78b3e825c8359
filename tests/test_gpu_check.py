"""benchmarks/gpu_check.py: --dry-run runs the device check's code on CPU with tiny shapes, and the real
run starts every multi-rank job before this process makes a CUDA call."""
import importlib.util
import json
import subprocess
import sys

import pytest
import torch


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", "benchmarks/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_dry_run():
    r = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    names = [v["layout"] for v in res["verify"]]
    assert names == ["tp2", "pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "pp2-zb", "pp2-dualpipev", "cp2-ring",
                     "cp2-ulysses", "ep2", "zero3", "tp2-muon-clip"]
    assert all(v["passed"] and v["mode"] == "gloo" for v in res["verify"]), res["verify"]
    dims = {(k["qk_dim"], k["v_dim"], k["document_mask"]) for k in res["kernel_parity"]}
    assert dims == {(d, dv, m) for d, dv in ((12, 12), (16, 16), (24, 16)) for m in (False, True)}
    for k in res["kernel_parity"]:
        assert k["kernel"] == "flash_cpu" and max(k[x] for x in ("out", "dq", "dk", "dv")) < 1e-5, k
    assert next(k for k in res["kernel_parity"] if k["v_dim"] == 16 and k["qk_dim"] == 24)["padded_to"] == [24, 24]
    assert res["attention_kernels"] == {"ring_attention": "flash_cpu"} and res["vocab_ce_rel_diff"] < 1e-6
    assert [t["dtype"] for t in res["train"]] == ["fp32", "bf16", "bf16"] and res["bf16_vs_fp32_first_loss_diff"] < 5e-2
    fp32, bf16, muon = res["train"]
    assert muon["optimizer"] == "muon" and muon["final_loss"] < muon["first_loss"] + 0.5, muon
    assert res["muon_ns_bf16_vs_fp32"]["dtype"] == "float32" and res["muon_ns_bf16_vs_fp32"]["rel_diff"] < 5e-2
    assert 0 < bf16["planner_activation_gib"] < fp32["planner_activation_gib"] < fp32["planner_peak_gib"]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("gpus, mode", [(1, "gloo-cuda"), (4, "nccl")])
def test_no_cuda_call_before_the_ranks_start(monkeypatch, gpus, mode):
    """With mocked GPUs: the verify runs (forks) come first, CUDA is touched only afterwards."""
    gc = _gpu_check()
    events = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)  # NVML: allowed before forking
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: events.append("cuda init"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: events.append("cuda init") or "H200")
    monkeypatch.setattr(gc, "verify_layouts", lambda m, seq_len: events.append(f"verify {m}") or [])

    def parity(*a):
        raise _Stop

    monkeypatch.setattr(gc, "kernel_parity", parity)
    with pytest.raises(_Stop):
        gc.main([])
    assert events == [f"verify {mode}", "cuda init"]


def test_without_cuda_the_real_check_exits_2(monkeypatch, capsys):
    gc = _gpu_check()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert gc.main([]) == 2
    assert capsys.readouterr().err.strip() == "gpu_check: no CUDA device; use --dry-run on CPU"
