"""Everything a training run leaves behind, written as it goes: config.json, each step's record (metrics.jsonl,
TensorBoard, the console, an external logger), and at the end every rank's comm ledger, the pipeline
timeline and summary.json. Rank 0 writes what is shared; the end is collective."""
from __future__ import annotations

import json
import os
import statistics

from .. import comm
from ..config import TrainConfig
from ..config.schedule import lr_plan
from .console import Console, peak_memory_bytes
from ..hf.init import init_record
from .observe import Observer
from .report import RunLog


class RunWriter:
    def __init__(self, cfg: TrainConfig, trainer, start: int, planned_activations: dict | None = None):
        """`start`: the step the run resumes after (0: a fresh run); `planned_activations`: the planner's
        {held, recompute_transient} for this run, set beside the measured peak in summary.json."""
        self.cfg, self.trainer, self.start = cfg, trainer, start
        self.planned_activations = planned_activations
        self.rank0 = trainer.mesh.rank == 0
        self.records, self.evals = [], []
        self.pending = []  # rank 0: (record, comm axes, eval) waiting for the record's step time
        self.console = self.metrics = None
        if self.rank0:
            os.makedirs(cfg.out, exist_ok=True)
            write_config(cfg, trainer)
            self.console = Console(cfg, start, f"train {trainer.mesh.describe()}")
            self.metrics = RunLog(cfg.out, start)
        self.observer = Observer(cfg, trainer, cfg.out, self.rank0)

    def step_done(self, rec: dict, ev: dict | None) -> None:
        """A step's record and, when one ran after it, an evaluation's `{"step", "eval_loss"}`."""
        routing = rec.pop("moe_routing", None)  # per-layer histogram: routing.jsonl, not metrics.jsonl
        if routing is not None and self.rank0:
            self.metrics.write_routing(rec["step"], routing)
        self.records.append(rec)
        if ev is not None:
            self.evals.append(ev)
        if self.rank0:
            ledger = self.trainer.mesh.ledger
            rec["peak_mem_bytes"] = peak_memory_bytes(self.trainer.mesh.device)
            self.pending.append((rec, ledger.steps[-1]["axes"] if ledger.steps else None, ev))
            self._write_ready()

    def steps_done(self) -> None:
        """After the last step: its time (device events are read a step late), then its record."""
        self.trainer.timer.flush()
        if self.rank0:
            self._write_ready()

    def _write_ready(self) -> None:
        """Write, in order, the records whose step time is known, with their throughput."""
        while self.pending and self.pending[0][0]["step_time_s"] is not None:
            rec, axes, ev = self.pending.pop(0)
            self.observer.add_throughput(rec)
            self.metrics.write(rec, axes)
            self.metrics.write_eval(ev)
            self.observer.log(rec, ev)
            self.console.step(rec)
            self.console.eval(ev)

    def close(self) -> None:
        """End of the loop (or an error): the profiler, the external logger, the bar and the files."""
        self.observer.close()
        if self.console is not None:
            self.console.close()
        if self.metrics is not None:
            self.metrics.close()

    def finish(self, act_peak: int, static_peak: int, sites: dict) -> dict:
        """Collective: every rank's comm ledger, the pipeline timeline; rank 0 writes comm.json and summary.json
        and returns the summary (other ranks: {}). `act_peak` / `static_peak`: this rank's memory peaks."""
        trainer, mesh, out = self.trainer, self.trainer.mesh, self.cfg.out
        layout = self.cfg.parallel.as_dict()
        pipeline = write_timeline(trainer, out) if trainer.executor is not None else None
        comm_dir = os.path.join(out, "comm")
        if self.rank0:
            os.makedirs(comm_dir, exist_ok=True)
        peaks = comm.all_gather_object((act_peak, static_peak), mesh["ckpt"])
        act_peak, static_peak = (max(col) for col in zip(*peaks))
        comm.barrier(mesh["world"])
        with open(os.path.join(comm_dir, f"rank{mesh.rank}.json"), "w") as f:
            f.write(mesh.ledger.to_json(mesh.rank, layout))
        if not self.rank0:
            return {}
        with open(os.path.join(out, "comm.json"), "w") as f:
            f.write(mesh.ledger.to_json(0, layout))
        if not self.records:
            return {"layout": layout, "model": trainer.model_cfg.name, "steps": self.cfg.steps, "steps_run": 0,
                    "start_step": self.start, "first_loss": float("nan"), "final_loss": float("nan"),
                    "tokens_per_s": 0.0, "comm_bytes_per_step": {}, "out": out}
        summary = self._summary(layout, act_peak, static_peak, sites) | ({"pipeline": pipeline} if pipeline else {})
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        if self.cfg.report:
            from .report import render

            summary["report"] = render(out)[-1]
        return summary

    def _summary(self, layout: dict, act_peak: int, static_peak: int, sites: dict) -> dict:
        """summary.json: over the steps this invocation ran (`steps_run` of them, after `start_step`)."""
        records, mesh = self.records, self.trainer.mesh
        steady = records[1:] or records  # the first step builds state (optimizer moments, caches)
        times = [r["step_time_s"] for r in steady]
        summary = {
            "layout": layout, "model": self.trainer.model_cfg.name, "steps": self.cfg.steps,
            "steps_run": len(records), "start_step": self.start,
            "first_loss": records[0]["loss"], "final_loss": records[-1]["loss"],
            "tokens_per_s": records[0]["tokens"] / (sum(times) / len(times)),
            "comm_bytes_per_step": {a: sum(v["bytes"] for v in ops.values())
                                    for a, ops in (mesh.ledger.steps[-1]["axes"] if mesh.ledger.steps else {}).items()},
            "out": self.cfg.out, "mesh_build_s": mesh.build_s,
            "static_bytes_measured": static_peak,
            "host_syncs_per_step": statistics.median(r["host_syncs"] for r in steady), "host_syncs_by_site": sites,
        } | activation_summary(act_peak, self.planned_activations)
        if self.evals:
            summary["eval_loss"] = self.evals[-1]["eval_loss"]
        if self.cfg.parallel.cp > 1:
            from ..context_parallel.kernels import used

            summary["attention_kernel"] = used(clear=True)
        return summary


def write_config(cfg: TrainConfig, trainer) -> None:
    """config.json: the run's flags, layout, final model, LR plan and (fine-tuning) what it started from."""
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump({"train": {k: v for k, v in vars(cfg).items() if k not in ("parallel", "resolved_model")},
                   "parallel": cfg.parallel.as_dict(), "model": vars(trainer.model_cfg), "lr_plan": lr_plan(cfg)}
                  | ({"init_from_hf": init_record(cfg.init_from_hf)} if cfg.init_from_hf else {}), f, indent=1,
                  default=vars)  # --model-config: TrainConfig.model is a ModelConfig


def write_timeline(trainer, out: str) -> dict | None:
    """Gather the last step's action timings over pp; rank 0 writes timeline.json and returns the bubble report."""
    from ..pipeline.cli import write_timeline as write_events
    from ..rules.schedule_check import analytic_bubble, measured_bubble, simulate

    ex, sched = trainer.executor, trainer.schedule
    gathered = comm.all_gather_object((ex.clock.events(), ex.peak_inflight), trainer.mesh["pp"])
    if trainer.mesh.rank != 0:
        return None
    events = [e for e, _ in gathered]
    write_events(os.path.join(out, "timeline.json"), sched.name, sched.p, sched.m, sched.v, events)
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


def activation_summary(measured: int, pred: dict | None) -> dict:
    """Saved-activation peak of the first step (max over ranks) beside the planner's figure for this run, handed
    in by the entry point (None where the planner does not model the run: --recompute-layers)."""
    return {"activation_bytes_measured": measured,
            "activation_bytes_predicted": None if pred is None else pred["held"],
            "activation_recompute_transient_bytes_predicted": None if pred is None else pred["recompute_transient"]}
