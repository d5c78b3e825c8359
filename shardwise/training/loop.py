"""The training run (`shardwise train`): builds the mesh and the `Trainer`, resumes, and loops over steps with
evaluation and checkpoints; what the run writes (run directory, metrics, console, ledgers, summary) is the
`RunWriter`'s, one rank's step the `Trainer`'s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch

from .. import comm, host
from .activation_memory import SavedActivationMeter, static_storage_bytes
from ..config import TrainConfig
from ..config.schedule import lr_plan
from .faults import install_faults
from ..resilience.elastic import fit_world, mesh_world
from ..resilience.memory import MemoryCopies
from ..resilience.recover import DETECTED, recover
from ..resilience.store import Progress, node_info, release
from . import preemption
from .assemble import assembled, checkpoint_root
from .run_dir import resume
from .writer import RunWriter
from .trainer import Trainer, make_mesh


def train_main(cfg: TrainConfig, device: torch.device | None = None, planned_activations: dict | None = None) -> dict:
    """Train on this rank; rank 0 writes the run directory and returns the summary. `planned_activations`: the
    planner's figures for this run (`planner.run_figures`), which the entry point hands in so that the runtime
    imports no planner module. Stopped by --save-on-signal, every rank's result has `preempted`."""
    with preemption.catching(cfg.save_on_signal):  # from the start: a signal during setup stops after step 1
        return _train(cfg, device, planned_activations)


def _train(cfg: TrainConfig, device: torch.device | None, planned_activations: dict | None) -> dict:
    cfg = assembled(cfg)
    if mesh_world() is not None:  # fewer (or more) ranks than planned: elastic data parallelism's layout
        cfg = fit_world(cfg, mesh_world())
    device = device or torch.device("cpu")
    if device.type == "cuda":  # TF32 tensor cores for fp32 matmuls (verify keeps full fp32)
        torch.set_float32_matmul_precision("high")
    mesh = make_mesh(cfg, device)
    # Rank 0 names the run directory: under torchrun every process computed its own from its own clock.
    cfg = dataclasses.replace(cfg, out=comm.all_gather_object(cfg.out, mesh["ckpt"])[0])
    trainer = Trainer(cfg, mesh)
    node = node_info(mesh["ckpt"].size, bool(cfg.mem_ckpt_every)) if mesh["world"].active else None
    copies = MemoryCopies(trainer, node) if node is not None and cfg.mem_ckpt_every else None
    trainer.memory_copies, trainer.node = copies, node  # where a fault in the mem-ckpt phase or a lost node strikes
    install_faults(cfg, trainer)
    rank0 = mesh.rank == 0
    ckpt_dir = checkpoint_root(cfg)
    start, cfg = _starting_point(cfg, trainer, node, ckpt_dir)
    trainer.progress = Progress(node.store, mesh.rank) if node is not None else None
    if start >= cfg.steps:  # nothing to train: the run directory stays as it is
        if rank0:
            print(f"shardwise: checkpoint at step {start} already reaches --steps {cfg.steps}", file=sys.stderr)
        return {"out": cfg.out, "steps": cfg.steps, "already_done": start} if rank0 else {}
    static_peak = []
    hook = trainer.reducer.optimizer.register_step_post_hook(
        lambda *_: static_peak.append(static_storage_bytes(trainer)) if not static_peak else None)
    writer = RunWriter(cfg, trainer, start, planned_activations)
    try:
        act_peak, sites, stopped = train_steps(cfg, trainer, writer, start, ckpt_dir)
    except comm.CollectiveError as e:  # every survivor says where it was when it lost a peer
        detected(trainer, e)
        raise
    finally:
        hook.remove()
        writer.close()
    from ..checkpoint import wait_for_save

    wait_for_save(trainer)  # an async save's last checkpoint is published before the run ends
    if stopped is not None:  # the scheduler's grace period is short: no report PNGs
        writer.cfg = dataclasses.replace(writer.cfg, report=False)
    summary = writer.finish(act_peak, static_peak[0] if static_peak else 0, sites)
    release(node)  # after finish's barrier: no rank of this node reads its copies any more
    return summary if stopped is None else summary | {"preempted": stopped}


def _starting_point(cfg: TrainConfig, trainer: Trainer, node, ckpt_dir: str) -> tuple[int, TrainConfig]:
    """The step to start after, and the config with the LR schedule's length it decided: a restarted worker
    group's newest consistent state (memory copies or disk: `resilience.recover`), else --resume's checkpoint,
    else 0."""
    rank0 = trainer.mesh.rank == 0
    recovered = recover(trainer, ckpt_dir, node, cfg.out) if node is not None else None
    if recovered is not None and recovered["source"] == "memory":
        if recovered.get("lr_decay_steps") is not None:
            cfg = trainer.cfg = dataclasses.replace(cfg, lr_decay_steps=recovered["lr_decay_steps"])
        return recovered["start"], cfg
    if cfg.resume or (recovered is not None and recovered["source"] == "disk"):
        start, cfg = resume(cfg, trainer, ckpt_dir, rank0)
        trainer.cfg = cfg  # the LR schedule's length the checkpoint decided
        return start, cfg
    if recovered is None and rank0 and cfg.out:  # a fresh run: no earlier run's recoveries
        with contextlib.suppress(OSError):
            os.remove(os.path.join(cfg.out, "recoveries.jsonl"))
    return 0, cfg


def train_steps(cfg: TrainConfig, trainer: Trainer, writer: RunWriter, start: int,
                ckpt_dir: str) -> tuple[int, dict, dict | None]:
    """Steps start+1..cfg.steps, each followed by its evaluation and checkpoint when due. Returns the first
    step's saved-activation peak, the last step's host reads by call site, and — when --save-on-signal stopped
    the run at a step boundary — {step, signal, checkpoint}."""
    from .evaluate import Evaluator

    tokenizer = None  # what hf-export writes beside the weights (rank 0's extra_state is the one stored)
    if trainer.mesh.rank == 0 and (cfg.save_every or cfg.final_checkpoint):
        from ..hf.export import tokenizer_record

        tokenizer = tokenizer_record(cfg.data, cfg.init_from_hf, trainer.eos_id)
    evaluator = Evaluator(trainer) if cfg.eval_data is not None else None
    act_peak, sites = 0, {}
    progress = getattr(trainer, "progress", None) or _NoProgress()
    progress.note(start, "training")
    for step in range(start, cfg.steps):
        progress.note(phase="train step")
        meter = SavedActivationMeter(trainer.model.parameters()) if step == start else None
        with meter or contextlib.nullcontext(), writer.observer.step(step + 1):  # activation memory: first step only
            rec = trainer.train_step(step)
        sites = host.counts()  # this step's host reads by call site (the last one lands in the summary)
        if meter is not None:
            act_peak = meter.peak
        ev = None
        if evaluator is not None and evaluator.due(step + 1, cfg.steps):
            progress.note(phase="evaluation")
            ev = {"step": step + 1, "eval_loss": evaluator.run()}
        saving = cfg.save_every or cfg.final_checkpoint
        due = checkpoint_due(cfg, step + 1)
        # one gather per boundary, only under a handler, never after the last step (nothing left to stop)
        signal = preemption.stop_agreed(trainer.mesh) if cfg.save_on_signal and step + 1 < cfg.steps else None
        if due or (signal and saving):
            from ..checkpoint import save_checkpoint

            progress.note(phase="checkpoint")
            save_checkpoint(ckpt_dir, step + 1, trainer, {"loss": rec["loss"], "lr_plan": lr_plan(cfg),
                                                         "tokenizer": tokenizer},
                            keep=cfg.keep, async_save=cfg.async_save)
        writer.step_done(rec, ev)
        copies = getattr(trainer, "memory_copies", None)
        if copies is not None and (step + 1) % cfg.mem_ckpt_every == 0:  # after the step's metrics row is written
            progress.note(phase="mem-ckpt")
            copies.copy(step + 1)
        progress.note(step + 1, "step boundary")
        if signal:
            writer.steps_done()
            return act_peak, sites, {"step": step + 1, "signal": signal,
                                     "checkpoint": f"step-{step + 1}" if saving else None}
    writer.steps_done()
    return act_peak, sites, None


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Every --save-every steps, and the last step when checkpoints are on (1-based `step`)."""
    return bool(cfg.save_every and step % cfg.save_every == 0) or \
        bool((cfg.save_every or cfg.final_checkpoint) and step == cfg.steps)


class _NoProgress:
    """No node store (a run without restarts or memory copies): progress goes nowhere."""

    def note(self, completed: int | None = None, phase: str | None = None) -> None:
        pass


def detected(trainer, error: Exception) -> None:
    """A survivor's line: the step and phase it was in when a collective failed (a peer died or hung), also left in
    its progress record for the recovery's report."""
    progress = getattr(trainer, "progress", None)
    phase = progress.phase if progress is not None else "training"
    step = (progress.completed if progress is not None else trainer.step) + 1
    what = str(error).removeprefix(f"rank {trainer.mesh.rank}: ")  # the launcher's report names the rank's error too
    print(f"shardwise: rank {trainer.mesh.rank} {DETECTED} in step {step} ({phase}): {what}", file=sys.stderr,
          flush=True)
    if progress is not None:
        progress.note(phase=f"{DETECTED} in step {step} ({phase})")
