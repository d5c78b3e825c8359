"""`--fault-inject RANK:STEP:KIND[:PHASE]`: make one rank fail the way real jobs fail, so the launcher's, the loop's
and the recovery's handling of it can be tested.

KIND: `crash` (the process exits, code 13), `hang` (it never reaches the next collective), `nan` (its loss and
gradients become NaN for that step), `kill` (SIGKILL: no handler, no report, as the OOM killer does), `node` (its
node is lost: every rank of the node is SIGKILLed and the node's memory copies vanish) or `gone` (the same, and the
node does not come back: the built-in launcher finds `node<k>.gone` beside the node's store and, with --min-dp,
goes on without it — elastic data parallelism). PHASE, where in step STEP
it strikes: `start` (before the step; the default), `forward` (the first module's forward), `backward` (the first
gradient accumulated), `optimizer` (before the optimizer step) or `mem-ckpt` (after the rank kept its memory copy,
before it sends it to its peer).
"""
from __future__ import annotations

import os
import signal
import sys
import time

from ..config import TrainConfig

CRASH_EXIT_CODE = 13


class FaultInjector:
    """Strikes once, at 1-based step `step` in `phase`; `arm` is a step hook called before 0-based step `step`."""

    def __init__(self, step: int, kind: str, phase: str = "start", node_store: str | None = None):
        self.step, self.kind, self.phase, self.node_store = step, kind, phase, node_store
        self.armed = False

    def __call__(self, trainer, step: int) -> None:
        if step + 1 != self.step:
            return
        if self.phase == "start":
            self.strike(trainer)
        else:
            self.armed = True

    def at(self, trainer, phase: str):
        """A hook for `phase` that strikes while armed (any arguments: module, optimizer and tensor hooks differ)."""
        def hook(*_args, **_kwargs):
            if self.armed and self.phase == phase:
                self.armed = False
                self.strike(trainer)
        return hook

    def strike(self, trainer) -> None:
        rank = trainer.mesh.rank
        what = {"crash": "crashes", "hang": "hangs", "nan": "produces NaN", "kill": "is killed (SIGKILL)",
                "node": "loses its node", "gone": "loses its node for good"}[self.kind]
        print(f"shardwise: fault injection: rank {rank} {what} at step {self.step} ({self.phase})", file=sys.stderr,
              flush=True)
        if self.kind == "crash":
            os._exit(CRASH_EXIT_CODE)
        if self.kind == "hang":
            while True:
                time.sleep(3600)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind in ("node", "gone"):
            lose_node(self.node_store, for_good=self.kind == "gone")
        trainer.poison = True


def lose_node(store: str | None, for_good: bool = False) -> None:
    """SIGKILL every rank of this node (their progress records name their pids), wipe the node's memory copies,
    then this process. `for_good`: leave the mark that says the node will not come back."""
    from ..resilience.store import NodeStore, Progress

    if store is not None:
        if for_good:
            with open(store.rstrip(os.sep) + ".gone", "w"):
                pass
        for _, _, _, pid in Progress.read_all(store).values():
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        NodeStore(store, 0).wipe()
    os.kill(os.getpid(), signal.SIGKILL)


def install_faults(cfg: TrainConfig, trainer) -> None:
    """Add the run's fault (if any, and if it is this rank's) to the trainer's step hooks and, for a phase inside
    the step, to the module, gradient, optimizer or memory-copy hooks where it strikes (`trainer.memory_copies`).
    A fault strikes once: a restarted worker group (`trainer.node.restart` > 0) runs without it."""
    memory_copies, node = getattr(trainer, "memory_copies", None), getattr(trainer, "node", None)
    fault = cfg.fault()
    if fault is None or fault[0] != trainer.mesh.rank or (node is not None and node.restart > 0):
        return
    node_store = node.store if node is not None else None
    _, step, kind, phase = fault
    inj = FaultInjector(step, kind, phase, node_store)
    trainer.step_hooks.append(inj)
    if phase == "forward":
        for m in trainer.model.modules():
            m.register_forward_pre_hook(inj.at(trainer, phase))
    elif phase == "backward":
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(inj.at(trainer, phase))
    elif phase == "optimizer":
        trainer.reducer.optimizer.register_step_pre_hook(inj.at(trainer, phase))
    elif phase == "mem-ckpt" and memory_copies is not None:  # config validation requires --mem-ckpt-every
        memory_copies.before_send.append(lambda s: inj.at(trainer, phase)() if s == step else None)
