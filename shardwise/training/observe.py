"""Run observability beyond metrics.jsonl: profiler traces, model FLOP/s and MFU, optional W&B / MLflow logging.

* `--profile-steps A:B` records steps A..B (1-based, inclusive) with torch.profiler on every rank and
  writes RUN/profile/rank<R>.json (Chrome trace: chrome://tracing or Perfetto); on a GPU also
  RUN/profile/rank<R>_memory.pickle (`torch.cuda.memory._dump_snapshot`, for pytorch.org/memory_viz).
* Each step's record gains `tflops_per_rank` — the model FLOPs of the step (`rules.flops`, the planner's count too:
  3× the forward's matmuls, attention and LM head; recomputation excluded, as MFU is conventionally defined)
  over the step time and the world size — and `mfu`, that over the device's dense peak (`rules.hardware`'s GPU
  presets; TF32 at half the BF16 rate under fp32), or None where the peak is unknown (CPU, other GPUs).
* `--log-to wandb|mlflow` mirrors the scalars to W&B (offline unless WANDB_MODE says otherwise) or MLflow
  (a local file store under RUN/mlruns unless MLFLOW_TRACKING_URI is set). Neither package is a
  dependency: `pip install 'shardwise[wandb]'` / `'shardwise[mlflow]'`.
"""
from __future__ import annotations

import contextlib
import importlib
import os

import torch

from ..config import ConfigError, TrainConfig
from ..rules.flops import model_flops, peak_flops
from ..rules.hardware import preset_of_device
from .report import SCALARS

_LOGGERS = ("wandb", "mlflow")


def step_model_flops(cfg: TrainConfig, global_batch: int) -> float:
    """Model FLOPs of one optimizer step over the whole job (no recomputation)."""
    return model_flops(cfg.model_config(), cfg.seq_len, global_batch)


def device_peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of this rank's device for `dtype` ('bf16'; 'fp32' runs on TF32 at half), or None."""
    if device.type != "cuda":
        return None
    gpu = preset_of_device(torch.cuda.get_device_name(device))
    return None if gpu is None else peak_flops(gpu, dtype)


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"--log-to {name} needs the {name} package, which is not installed: "
                          f"pip install 'shardwise[{name}]'") from None


def check_logger(cfg: TrainConfig) -> None:
    """Before any rank starts: the --log-to package imports."""
    if cfg.log_to is not None:
        _import(cfg.log_to)


class _WandB:
    def __init__(self, out: str, config: dict):
        wandb = _import("wandb")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "shardwise"), name=os.path.basename(out),
                              dir=out, config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, out: str, config: dict):
        self.mlflow = _import("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            self.mlflow.set_tracking_uri("file:" + os.path.abspath(os.path.join(out, "mlruns")))
        self.mlflow.start_run(run_name=os.path.basename(out))
        self.mlflow.log_params({k: str(v) for k, v in config.items()})

    def log(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _scalars(rec: dict, ev: dict | None) -> dict:
    """The numbers worth a chart: train/<key> and eval/loss."""
    out = {f"train/{k}": float(rec[k]) for k in SCALARS if rec.get(k) is not None}
    out["train/tokens_per_s"] = rec["tokens"] / rec["step_time_s"]
    if ev is not None:
        out["eval/loss"] = float(ev["eval_loss"])
    return out


class Observer:
    """Per rank: the profiler window, FLOP/s and MFU on each record; rank 0: the external logger."""

    def __init__(self, cfg: TrainConfig, trainer, out: str, rank0: bool):
        self.window = cfg.profile_range()
        self.out, self.rank, self.device = out, trainer.mesh.rank, trainer.mesh.device
        self.world = trainer.mesh["world"].size
        self.flops = step_model_flops(cfg, trainer.global_batch)
        self.peak = device_peak_flops(self.device, cfg.dtype)
        self.prof = None
        self.logger = None
        if rank0 and cfg.log_to is not None:
            config = {"layout": cfg.parallel.as_dict(), "model": trainer.model_cfg.name}
            config |= {k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, bool)) or v is None}
            self.logger = (_WandB if cfg.log_to == "wandb" else _MLflow)(out, config)

    @contextlib.contextmanager
    def step(self, n: int):
        """Around (1-based) step n: start the profiler at the window's first step, stop it after its last."""
        if self.window is not None and self.prof is None and self.window[0] <= n <= self.window[1]:
            self._start()
        with torch.profiler.record_function(f"step {n}") if self.prof is not None else contextlib.nullcontext():
            yield
        if self.prof is not None and n >= self.window[1]:
            self._stop()

    def _start(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
        self.prof.start()

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        prof.stop()
        folder = os.path.join(self.out, "profile")
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{self.rank}.json"))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(os.path.join(folder, f"rank{self.rank}_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)

    def add_throughput(self, rec: dict) -> None:
        """tflops_per_rank and mfu (None without a known peak) of the step's record."""
        per_rank = self.flops / rec["step_time_s"] / self.world
        rec["tflops_per_rank"] = per_rank / 1e12
        rec["mfu"] = per_rank / self.peak if self.peak else None

    def log(self, rec: dict, ev: dict | None) -> None:
        if self.logger is not None:
            self.logger.log(_scalars(rec, ev), rec["step"])

    def close(self) -> None:
        """End of the run (or an error): a trace still open is written, the external run is finished."""
        if self.prof is not None:
            self._stop()
        if self.logger is not None:
            self.logger.close()
            self.logger = None
