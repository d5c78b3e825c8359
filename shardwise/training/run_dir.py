"""A run directory over time: where a new run goes, which run a bare `--resume` continues, and the resume
itself (the checkpoint `latest` names, its LR schedule kept or a change announced in one line). The checks
made before any rank starts are `shardwise.training.assemble.check_run_dir`."""
from __future__ import annotations

import dataclasses
import os
import sys
import time

from ..config import TrainConfig
from ..config.schedule import describe_plan, lr_at_plan, lr_plan


def default_out_dir() -> str:
    """runs/<timestamp>, with a suffix when that directory exists (two runs started in one second)."""
    base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    out, n = base, 1
    while os.path.exists(out):
        n += 1
        out = f"{base}-{n}"
    return out


def newest_run_with_checkpoints(root: str = "runs") -> str | None:
    runs = sorted(d for d in (os.listdir(root) if os.path.isdir(root) else [])
                  if os.path.exists(os.path.join(root, d, "checkpoints", "latest")))
    return os.path.join(root, runs[-1]) if runs else None


def resume(cfg: TrainConfig, trainer, ckpt_dir: str, rank0: bool) -> tuple[int, TrainConfig]:
    """Load the checkpoint `latest` names (or the newest older intact one); keep its LR schedule's length unless
    --lr-decay-steps is given, and say in one line when the schedule changes. Returns its step and the config with
    that length."""
    from ..checkpoint import load_checkpoint
    from ..config.schedule import validate_optim

    info = load_checkpoint(ckpt_dir, trainer, required=True)
    start = info["step"]
    stored = info["extra_state"].get("lr_plan")
    if stored and cfg.lr_decay_steps is None:
        cfg = dataclasses.replace(cfg, lr_decay_steps=stored["lr_decay_steps"])
        validate_optim(cfg)
    if rank0:
        for path, reason in info["skipped"]:
            print(f"shardwise: skipped checkpoint {path}: {reason}", file=sys.stderr)
        print(f"shardwise: resuming from {info['path']} (step {start})", file=sys.stderr)
        plan = lr_plan(cfg)
        if stored and stored != plan:
            print(f"shardwise: LR schedule changes from step {start + 1}: {describe_plan(stored)} -> "
                  f"{describe_plan(plan)}", file=sys.stderr)
        first = max(plan["lr_decay_steps"], start) + 1  # of the steps still to run
        if cfg.steps >= first:
            print(f"shardwise: steps {first}..{cfg.steps} run past the LR schedule's "
                  f"{plan['lr_decay_steps']} steps at {lr_at_plan(plan['lr_decay_steps'], plan):g} "
                  "(--lr-decay-steps N re-plans it)", file=sys.stderr)
    return start, cfg
