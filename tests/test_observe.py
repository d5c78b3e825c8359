"""Observability: --profile-steps writes a Chrome trace per rank, metrics carry TFLOP/s per rank and MFU (null on
CPU; the GPU presets' peaks by device name), --log-to dispatches to W&B / MLflow (fake modules: neither is a
dependency) and refuses cleanly when the package is missing; bad flags exit 2."""
import json
import sys
import types
from unittest import mock

import pytest
import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.training.observe import Observer, device_peak_flops, step_model_flops
from shardwise.training.assemble import assemble

from _dist import fresh_seed, run_ranks
from test_cli import main_without_ranks


@pytest.mark.parametrize("args, message", [
    (["--profile-steps", "5:3"], "--profile-steps '5:3' must be A:B with 1 <= A <= B"),
    (["--profile-steps", "0:2"], "must be A:B with 1 <= A <= B"),
    (["--profile-steps", "3"], "must be A:B"),
    (["--profile-steps", "2:500", "--steps", "10"], "ends after the last step 10"),
    (["--log-to", "tensorboard"], "--log-to 'tensorboard' is unknown; valid: wandb, mlflow"),
])
def test_bad_observability_flags_exit_2(args, message, capsys):
    assert main_without_ranks(["train", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_log_to_without_the_package_exits_2(name, capsys):
    with mock.patch.dict(sys.modules, {name: None}):  # None in sys.modules: `import name` raises ImportError
        assert main_without_ranks(["train", "--log-to", name]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"shardwise train: error: --log-to {name} needs the {name} package, which is not installed: "
                     f"pip install 'shardwise[{name}]'"]


def _fake_wandb(log_path):
    """A stand-in `wandb` whose run appends each call to a JSON-lines file (rank 0 runs in a forked child)."""
    def write(kind, **kw):
        with open(log_path, "a") as f:
            f.write(json.dumps({"call": kind, **kw}, default=str) + "\n")

    class Run:
        def log(self, values, step):
            write("log", values=values, step=step)

        def finish(self):
            write("finish")

    def init(**kw):
        write("init", mode=kw["mode"], dir=kw["dir"])
        return Run()

    return types.SimpleNamespace(init=init, __spec__=None)


def test_profile_traces_throughput_and_wandb_on_two_ranks(tmp_path):
    from shardwise.training.loop import train_main

    calls = tmp_path / "wandb_calls.jsonl"
    held = tmp_path / "held.txt"
    held.write_text("held-out text, not trained on. " * 100)
    cfg = assemble(TrainConfig(parallel=ParallelConfig(dp=2), steps=3, seq_len=32, micro_batch=2, eval_data=str(held),
                               eval_steps=1, profile_steps="2:2", log_to="wandb", out=str(tmp_path / "run"),
                               progress=False, report=False, seed=fresh_seed()))
    with mock.patch.dict(sys.modules, {"wandb": _fake_wandb(calls)}):
        run_ranks(2, train_main, cfg)
    for rank in (0, 1):
        trace = json.loads((tmp_path / "run" / "profile" / f"rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "step 2" in names and "step 1" not in names and "step 3" not in names
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    flops = step_model_flops(cfg, 4)
    for r in steps:
        assert r["mfu"] is None  # CPU: no known peak
        assert r["tflops_per_rank"] == pytest.approx(flops / r["step_time_s"] / 2 / 1e12)
    logged = [json.loads(x) for x in calls.read_text().splitlines()]
    assert logged[0] == {"call": "init", "mode": "offline", "dir": str(tmp_path / "run")}
    assert logged[-1] == {"call": "finish"}
    logs = [c for c in logged if c["call"] == "log"]
    assert [c["step"] for c in logs] == [1, 2, 3]
    assert logs[0]["values"]["train/loss"] == steps[0]["loss"]
    assert logs[0]["values"]["train/tflops_per_rank"] == steps[0]["tflops_per_rank"]
    assert "eval/loss" in logs[2]["values"] and "eval/loss" not in logs[0]["values"]


def test_mlflow_dispatch_local_file_store(tmp_path, monkeypatch):
    from shardwise.training.loop import train_main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    calls = []
    fake = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("uri", uri)),
        start_run=lambda run_name: calls.append(("start", run_name)),
        log_params=lambda params: calls.append(("params", params["steps"])),
        log_metrics=lambda values, step: calls.append(("metrics", step, sorted(values))),
        end_run=lambda: calls.append(("end",)))
    cfg = assemble(TrainConfig(steps=2, seq_len=32, micro_batch=2, log_to="mlflow", out=str(tmp_path / "run"),
                               progress=False, report=False, seed=fresh_seed()))
    with mock.patch.dict(sys.modules, {"mlflow": fake}):
        train_main(cfg)
    assert calls[0] == ("uri", "file:" + str(tmp_path / "run" / "mlruns"))
    assert calls[1] == ("start", "run") and calls[2] == ("params", "2") and calls[-1] == ("end",)
    assert [c[1] for c in calls if c[0] == "metrics"] == [1, 2]
    assert {"train/loss", "train/lr", "train/tflops_per_rank", "train/tokens_per_s"} <= set(calls[3][2])


def test_peak_by_device_name_and_mfu():
    cuda = torch.device("cuda", 0)
    with mock.patch("torch.cuda.get_device_name", return_value="NVIDIA H100 80GB HBM3"):
        assert device_peak_flops(cuda, "bf16") == 989e12 and device_peak_flops(cuda, "fp32") == 989e12 / 2
    with mock.patch("torch.cuda.get_device_name", return_value="NVIDIA GB200"):
        assert device_peak_flops(cuda, "bf16") == 2.5e15  # not B200's
    with mock.patch("torch.cuda.get_device_name", return_value="NVIDIA GeForce RTX 4090"):
        assert device_peak_flops(cuda, "bf16") is None
    assert device_peak_flops(torch.device("cpu"), "bf16") is None
    obs = Observer.__new__(Observer)
    obs.flops, obs.world, obs.peak = 8e12, 4, 1e12
    rec = {"step_time_s": 0.5}
    obs.add_throughput(rec)
    assert rec == {"step_time_s": 0.5, "tflops_per_rank": 4.0, "mfu": 4.0}
