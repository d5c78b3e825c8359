"""`--fault-inject RANK:STEP:KIND`: a step hook that makes one rank fail the way real jobs fail, so the
launcher's and the loop's handling of it can be tested: `crash` (the process dies, exit code 13), `hang`
(it never reaches the next collective) or `nan` (its loss and gradients become NaN for that step)."""
from __future__ import annotations

import os
import sys
import time

from ..config import TrainConfig

CRASH_EXIT_CODE = 13


class FaultInjector:
    """Called by `Trainer.train_step` before 0-based step `step`; acts at the 1-based step it was given."""

    def __init__(self, step: int, kind: str):
        self.step, self.kind = step, kind

    def __call__(self, trainer, step: int) -> None:
        if step + 1 != self.step:
            return
        rank = trainer.mesh.rank
        if self.kind == "crash":
            print(f"shardwise: fault injection: rank {rank} crashes at step {step + 1}", file=sys.stderr, flush=True)
            os._exit(CRASH_EXIT_CODE)
        if self.kind == "hang":
            print(f"shardwise: fault injection: rank {rank} hangs at step {step + 1}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)
        trainer.poison = True


def install_faults(cfg: TrainConfig, trainer) -> None:
    """Add the run's fault (if any, and if it is this rank's) to the trainer's step hooks."""
    fault = cfg.fault()
    if fault is not None and fault[0] == trainer.mesh.rank:
        trainer.step_hooks.append(FaultInjector(fault[1], fault[2]))
