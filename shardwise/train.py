"""The training run (`shardwise train`): builds the mesh and the `Trainer`, resumes, loops over steps with
evaluation, checkpoints and metrics, and writes the run directory's comm ledgers, timeline and summary.
One rank's step itself lives in `trainer.py`.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys

import torch

from . import comm, host
from .activation_memory import SavedActivationMeter, predicted_activation_bytes, static_storage_bytes
from .config import TrainConfig
from .config.schedule import lr_plan
from .hf_init import init_record
from .report import RunLog
from .run import assembled
from .run_dir import resume
from .trainer import IGNORE_INDEX, Trainer, lr_at, make_mesh, to_device  # noqa: F401 - train's public names


def _write_timeline(trainer: Trainer, out: str) -> dict | None:
    """Gather the last step's action timings over pp; rank 0 writes timeline.json and returns the bubble report."""
    from .pipeline.cli import write_timeline
    from .pipeline.simulate import analytic_bubble, measured_bubble, simulate

    ex, sched = trainer.executor, trainer.schedule
    gathered = comm.all_gather_object((ex.clock.events(), ex.peak_inflight), trainer.mesh["pp"])
    if trainer.mesh.rank != 0:
        return None
    events = [e for e, _ in gathered]
    write_timeline(os.path.join(out, "timeline.json"), sched.name, sched.p, sched.m, sched.v, events)
    # Simulate with each rank's measured mean cost per kind (the last stage also runs the head and
    # loss), so simulated and measured bubbles compare like for like.
    def means(evs):
        durations = {k: [e["end"] - e["start"] for e in evs if e["kind"] == k] for k in "FBW"}
        return {k: sum(d) / len(d) for k, d in durations.items() if d}

    mean = means([e for r in events for e in r])
    sim = simulate(sched, cost_w=0.0, rank_costs=[means(r) for r in events])
    return {"schedule": sched.name, "peak_inflight_per_stage": [pk for _, pk in gathered],
            "analytic_bubble": analytic_bubble(sched.name, sched.p, sched.m, sched.v),
            "simulated_bubble": sim.bubble_fraction, "measured_bubble": measured_bubble(events),
            "mean_action_s": mean}


def _activation_summary(cfg: TrainConfig, measured: int) -> dict:
    """Saved-activation peak of the first step (max over ranks) beside the planner's figure for this run
    (None where the planner does not model the run: --recompute-layers)."""
    pred = predicted_activation_bytes(cfg) if cfg.parallel.recompute_layers is None else None
    return {"activation_bytes_measured": measured,
            "activation_bytes_predicted": None if pred is None else pred["held"],
            "activation_recompute_transient_bytes_predicted": None if pred is None else pred["recompute_transient"]}


def train_main(cfg: TrainConfig, device: torch.device | None = None) -> dict:
    """Train on this rank; rank 0 writes the run directory and returns the summary."""
    cfg = assembled(cfg)
    device = device or torch.device("cpu")
    if device.type == "cuda":  # TF32 tensor cores for fp32 matmuls (verify keeps full fp32)
        torch.set_float32_matmul_precision("high")
    mesh = make_mesh(cfg, device)
    trainer = Trainer(cfg, mesh)
    rank0 = mesh.rank == 0
    # Rank 0 names the run directory: under torchrun every process computed its own from its own clock.
    out = cfg.out = comm.all_gather_object(cfg.out, mesh["ckpt"])[0]
    start = 0
    ckpt_dir = cfg.checkpoint_dir or os.path.join(out, "checkpoints")
    if cfg.resume:
        start = resume(cfg, trainer, ckpt_dir, rank0)
        if start >= cfg.steps:  # nothing to train: the run directory stays as it is
            if rank0:
                print(f"shardwise: checkpoint at step {start} already reaches --steps {cfg.steps}", file=sys.stderr)
            return {"out": out, "steps": cfg.steps, "already_done": start} if rank0 else {}
    if rank0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"train": {k: v for k, v in vars(cfg).items() if k not in ("parallel", "resolved_model")},
                       "parallel": cfg.parallel.as_dict(), "model": vars(trainer.model_cfg), "lr_plan": lr_plan(cfg)}
                      | ({"init_from_hf": init_record(cfg.init_from_hf)} if cfg.init_from_hf else {}), f, indent=1,
                      default=vars)  # --model-config: TrainConfig.model is a ModelConfig
    bar = None
    if rank0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train {mesh.describe()}", dynamic_ncols=True)
    records, evals, act_peak, static_peak, unwritten, sites = [], [], 0, [], [], {}
    hook = trainer.reducer.optimizer.register_step_post_hook(
        lambda *_: static_peak.append(static_storage_bytes(trainer)) if not static_peak else None)
    metrics = RunLog(out, start) if rank0 else None
    tokenizer = None  # what hf-export writes beside the weights (rank 0's extra_state is the one stored)
    if rank0 and (cfg.save_every or cfg.final_checkpoint):
        from .hf_export import tokenizer_record

        tokenizer = tokenizer_record(cfg.data, cfg.init_from_hf, trainer.eos_id)
    from .evaluate import Evaluator
    from .observe import Observer

    evaluator = Evaluator(trainer) if cfg.eval_data is not None else None
    observer = Observer(cfg, trainer, out, rank0)
    try:
        for step in range(start, cfg.steps):
            meter = SavedActivationMeter(trainer.model.parameters()) if step == start else None
            with meter or contextlib.nullcontext(), observer.step(step + 1):  # activation memory: first step only
                rec = trainer.train_step(step)
            sites = host.counts()  # this step's host reads by call site (the last one lands in the summary)
            if meter is not None:
                act_peak = meter.peak
            records.append(rec)
            ev = None
            if evaluator is not None and evaluator.due(step + 1, cfg.steps):
                evals.append(ev := {"step": step + 1, "eval_loss": evaluator.run()})
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or \
                    ((cfg.save_every or cfg.final_checkpoint) and step + 1 == cfg.steps):
                from .checkpoint import save_checkpoint

                save_checkpoint(ckpt_dir, step + 1, trainer, {"loss": rec["loss"], "lr_plan": lr_plan(cfg),
                                                             "tokenizer": tokenizer},
                                keep=cfg.keep, async_save=cfg.async_save)
            if rank0:
                unwritten.append((rec, mesh.ledger.steps[-1]["axes"] if mesh.ledger.steps else None, ev))
                unwritten = observer.write_ready(metrics, bar, unwritten)
        trainer.timer.flush()  # the last step's time (device events are read a step late)
        if rank0:
            observer.write_ready(metrics, bar, unwritten)
    finally:
        hook.remove()
        observer.close()
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    from .checkpoint import wait_for_save

    wait_for_save(trainer)  # an async save's last checkpoint is published before the run ends
    layout = cfg.parallel.as_dict()
    pipeline = _write_timeline(trainer, out) if trainer.executor is not None else None
    comm_dir = os.path.join(out, "comm")
    if rank0:
        os.makedirs(comm_dir, exist_ok=True)
    peaks = comm.all_gather_object((act_peak, static_peak[0] if static_peak else 0), mesh["ckpt"])
    act_peak, static_peak = (max(col) for col in zip(*peaks))
    comm.barrier(mesh["world"])
    with open(os.path.join(comm_dir, f"rank{mesh.rank}.json"), "w") as f:
        f.write(mesh.ledger.to_json(mesh.rank, layout))
    if not rank0:
        return {}
    with open(os.path.join(out, "comm.json"), "w") as f:
        f.write(mesh.ledger.to_json(0, layout))
    if not records:
        return {"layout": layout, "model": trainer.model_cfg.name,
                "steps": cfg.steps, "first_loss": float("nan"), "final_loss": float("nan"), "tokens_per_s": 0.0,
                "comm_bytes_per_step": {}, "out": out}
    steady = records[1:] or records  # the first step builds state (optimizer moments, caches)
    times = [r["step_time_s"] for r in steady]
    summary = {
        "layout": layout, "model": trainer.model_cfg.name, "steps": cfg.steps,
        "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
        "tokens_per_s": records[0]["tokens"] / (sum(times) / len(times)),
        "comm_bytes_per_step": {a: sum(v["bytes"] for v in ops.values())
                                for a, ops in (mesh.ledger.steps[-1]["axes"] if mesh.ledger.steps else {}).items()},
        "out": out, "mesh_build_s": mesh.build_s,
        "static_bytes_measured": static_peak,
        "host_syncs_per_step": statistics.median(r["host_syncs"] for r in steady), "host_syncs_by_site": sites,
    } | _activation_summary(cfg, act_peak)
    if pipeline is not None:
        summary["pipeline"] = pipeline
    if evals:
        summary["eval_loss"] = evals[-1]["eval_loss"]
    if cfg.parallel.cp > 1:
        from .context_parallel.kernels import used

        summary["attention_kernel"] = used(clear=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if cfg.report:
        from .report import render

        summary["report"] = render(out)[-1]
    return summary
