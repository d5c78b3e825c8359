"""What a training run prints while it trains, so a cluster job's log file can be read: one `key=value` line
every --log-every steps and one line per evaluation. On a terminal a tqdm bar stays at the bottom and the lines
print above it; when stdout is not a terminal (a job's log file) the bar, a stream of carriage returns there,
is off and the lines are the whole output."""
from __future__ import annotations

import resource
import sys

import torch

from ..config import TrainConfig


def log_interval(cfg: TrainConfig) -> int:
    """--log-every, by default every step of a run of at most 20 steps, else every 10th."""
    if cfg.log_every is not None:
        return cfg.log_every
    return 1 if cfg.steps <= 20 else 10


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: the CUDA caching allocator's peak, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


def step_line(rec: dict, steps: int) -> str:
    """One step's record as `train step=N/T loss=... lr=...`: fixed keys in a fixed order, parts only where the
    model has them (MTP, MoE)."""
    fields = [f"step={rec['step']}/{steps}", f"loss={rec['loss']:.4f}"]
    if "loss_mtp" in rec:
        fields += [f"loss_main={rec['loss_main']:.4f}", f"loss_mtp={rec['loss_mtp']:.4f}"]
    if "moe_aux_loss" in rec:
        fields.append(f"loss_aux={rec['moe_aux_loss']:.4g}")
    mfu = "n/a" if rec.get("mfu") is None else f"{rec['mfu']:.1%}"
    fields += [f"lr={rec['lr']:.3e}", f"grad_norm={rec['grad_norm']:.4f}",
               f"tokens_per_s={rec['tokens'] / rec['step_time_s']:.0f}", f"mfu={mfu}",
               f"peak_mem_gib={rec['peak_mem_bytes'] / 2**30:.2f}", f"step_s={rec['step_time_s']:.3f}"]
    if rec.get("skipped"):
        fields.append("skipped=1")
    return "train " + " ".join(fields)


def eval_line(ev: dict) -> str:
    return f"eval step={ev['step']} eval_loss={ev['eval_loss']:.4f}"


class Console:
    """Rank 0's progress output for steps start+1..cfg.steps."""

    def __init__(self, cfg: TrainConfig, start: int, desc: str):
        self.every, self.steps = log_interval(cfg), cfg.steps
        self.bar = None
        if cfg.progress and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=start, desc=desc, dynamic_ncols=True)

    def step(self, rec: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens'] / rec['step_time_s']:.0f}")
        if rec["step"] % self.every == 0 or rec["step"] == self.steps:
            self._print(step_line(rec, self.steps))

    def eval(self, ev: dict | None) -> None:
        if ev is not None:
            self._print(eval_line(ev))

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
