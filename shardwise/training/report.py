"""Run observability: metrics.jsonl + TensorBoard events while training, `shardwise report` after.

`RunLog` is rank 0's writer: one JSON line per step (the contract), one `{"step", "eval_loss"}` line after
each held-out evaluation, and, when the `tensorboard` package is installed, the same scalars as
TensorBoard events under RUN_DIR/tensorboard.
`shardwise report RUN_DIR` renders loss, tokens/s, communication per axis and (with pp) the
recorded pipeline Gantt chart to PNG files and prints a short text summary.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

# A step record's fields charted as train/<field> (TensorBoard, W&B, MLflow), where the record has them.
SCALARS = ("loss", "loss_main", "loss_mtp", "lr", "grad_norm", "step_time_s", "tflops_per_rank", "mfu",
           "moe_max_over_mean_load", "moe_aux_loss", "peak_mem_bytes", "moe_busiest_ep_over_mean")


def _keep_until(path: str, start: int):
    """`path` opened for writing; resuming (`start` > 0) keeps its lines up to the checkpoint's step."""
    rows = []
    if start and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= start]
    f = open(path, "w")
    f.writelines(rows)
    return f


class RunLog:
    def __init__(self, out: str, start: int = 0):
        self.out, self.start = out, start
        self.file = _keep_until(os.path.join(out, "metrics.jsonl"), start)
        self.routing = None  # routing.jsonl, opened at the first MoE step
        self.tb = None
        events = os.path.join(out, "tensorboard")
        if not start:  # a fresh run (--overwrite, --auto-resume with nothing to resume): no old run's curves
            shutil.rmtree(events, ignore_errors=True)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(events, purge_step=start + 1 if start else None)
        except ImportError:
            pass

    def write(self, rec: dict, comm_axes: dict | None = None) -> None:
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is None:
            return
        step = rec["step"]
        for key in SCALARS:
            if key in rec and rec[key] is not None:
                self.tb.add_scalar(f"train/{key}", rec[key], step)
        self.tb.add_scalar("train/tokens_per_s", rec["tokens"] / rec["step_time_s"], step)
        for axis, ops in (comm_axes or {}).items():
            self.tb.add_scalar(f"comm_bytes/{axis}", sum(v["bytes"] for v in ops.values()), step)

    def write_routing(self, step: int, routing: dict) -> None:
        """One step's per-layer routing (`MoEMetrics.record`'s `moe_routing`) as a line of routing.jsonl, and the
        busiest ep rank's load over the mean per layer as TensorBoard scalars routing/layer<i>."""
        if self.routing is None:
            self.routing = _keep_until(os.path.join(self.out, "routing.jsonl"), self.start)
        self.routing.write(json.dumps({"step": step} | routing) + "\n")
        self.routing.flush()
        if self.tb is not None:
            for layer, share in routing["busiest_ep_share"].items():
                self.tb.add_scalar(f"routing/layer{layer}_busiest_ep_over_mean", share * routing["ep"], step)

    def write_eval(self, rec: dict | None) -> None:
        """One evaluation's `{"step": s, "eval_loss": x}` line (and the TensorBoard scalar eval/loss)."""
        if rec is None:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            self.tb.add_scalar("eval/loss", rec["eval_loss"], rec["step"])

    def close(self) -> None:
        self.file.close()
        if self.routing is not None:
            self.routing.close()
        if self.tb is not None:
            self.tb.close()


def layout_text(layout: dict) -> str:
    """A layout for the console: dp and every degree above 1, the options that are on; no None or default."""
    shown = []
    for k, v in layout.items():
        if v is None or v is False or (v in (0, 1) and k != "dp"):
            continue
        shown.append(k if v is True else f"{k}={v}")
    return ", ".join(shown)


def summary_lines(s: dict) -> list[str]:
    """`shardwise train`'s closing lines, about the steps this invocation ran (a resumed run: after its
    checkpoint's step)."""
    if "already_done" in s:  # the ranks found the checkpoint at --steps and said so
        return []
    run = s.get("steps_run", s["steps"])
    start = s.get("start_step", 0)
    steps = f"{run} steps" + (f" ({start + 1}..{start + run} of {s['steps']})" if start else "")
    lines = [f"trained {s['model']} on {layout_text(s['layout'])} for {steps}: loss {s['first_loss']:.4f} -> "
             f"{s['final_loss']:.4f}, {s['tokens_per_s']:.0f} tokens/s"]
    # Axes that carried no payload (the preemption check's object gather on ckpt counts 0 bytes) stay in comm.json.
    comm_s = ", ".join(f"{a} {b / 2**20:.2f} MiB" for a, b in s["comm_bytes_per_step"].items() if b) or "none"
    lines.append(f"communication per step (payload bytes per rank): {comm_s}")
    if "pipeline" in s:
        pl = s["pipeline"]
        ana = "n/a" if pl["analytic_bubble"] is None else f"{pl['analytic_bubble']:.3f}"
        lines.append(f"pipeline {pl['schedule']}: bubble analytic {ana}, simulated {pl['simulated_bubble']:.3f}, "
                     f"measured {pl['measured_bubble']:.3f}; peak in-flight microbatches per stage "
                     f"{pl['peak_inflight_per_stage']} (timeline.json)")
    if "eval_loss" in s:
        lines.append(f"eval loss (held out): {s['eval_loss']:.4f}")
    lines.append(f"run directory: {s['out']} (metrics.jsonl, comm.json, summary.json)")
    if "report" in s:
        lines.append(s["report"])
    return lines


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def render(run_dir: str) -> list[str]:
    """Write the PNGs; return the summary lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("shardwise report needs matplotlib: pip install matplotlib") from None
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics):
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a shardwise run directory?)")
    every = _read_jsonl(metrics)
    rows = [r for r in every if "loss" in r]
    evals = [r for r in every if "eval_loss" in r]
    if not rows:
        raise ValueError(f"{metrics} has no training step")
    steps = [r["step"] for r in rows]
    written = []

    def save(fig, name):
        path = os.path.join(run_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r["loss"] for r in rows], lw=1.2, label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=4, lw=1.2,
                color="tab:red", label="eval (held out)")
        ax.legend()
    ax.set(xlabel="step", ylabel="loss", title="training loss" + (" and eval loss" if evals else ""))
    ax.grid(alpha=0.3)
    save(fig, "loss.png")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r["tokens"] / r["step_time_s"] for r in rows], lw=1.2, color="tab:green")
    ax.set(xlabel="step", ylabel="tokens / s", title="throughput")
    ax.grid(alpha=0.3)
    save(fig, "tokens_per_s.png")
    lines = [f"run {run_dir}: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, "
             f"median {sorted(r['tokens'] / r['step_time_s'] for r in rows)[len(rows) // 2]:.0f} tokens/s"]
    if evals:
        lines.append(f"eval loss {evals[0]['eval_loss']:.4f} (step {evals[0]['step']}) -> "
                     f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})")
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    tflops = [r["tflops_per_rank"] for r in rows if r.get("tflops_per_rank") is not None]
    if tflops:
        lines.append(f"median model TFLOP/s per rank {sorted(tflops)[len(tflops) // 2]:.3g}"
                     + (f", MFU {sorted(mfu)[len(mfu) // 2]:.1%}" if mfu else " (MFU: device peak unknown)"))
    comm_path = os.path.join(run_dir, "comm.json")
    if os.path.exists(comm_path):
        with open(comm_path) as f:
            ledger = json.load(f)
        last = ledger["per_step"][-1]["axes"] if ledger["per_step"] else {}
        axes = sorted(last)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        per_axis = [sum(v["bytes"] for v in last[a].values()) / 2**20 for a in axes]
        ax.bar(axes, per_axis, color="tab:orange")
        ax.set(ylabel="MiB per step (payload, rank 0)", title="communication per axis")
        save(fig, "comm_per_axis.png")
        lines.append("communication per step (rank 0, payload bytes): " +
                     ", ".join(f"{a} {b:.2f} MiB" for a, b in zip(axes, per_axis)))
    timeline = os.path.join(run_dir, "timeline.json")
    if os.path.exists(timeline):
        from ..pipeline.cli import read_timeline
        from ..pipeline.draw import draw_timeline
        from ..rules.schedule_check import measured_bubble

        doc = read_timeline(timeline)
        written.append(str(draw_timeline(doc["ranks"], os.path.join(run_dir, "timeline.png"),
                                         f"{doc['schedule']} p={doc['pp']} m={doc['microbatches']} (recorded)")))
        lines.append(f"pipeline {doc['schedule']}: measured bubble {measured_bubble(doc['ranks']):.3f}")
    routing = os.path.join(run_dir, "routing.jsonl")
    if os.path.exists(routing):
        lines.extend(_routing_charts(plt, _read_jsonl(routing), save))
    if "moe_max_over_mean_load" in rows[-1]:
        lines.append(f"MoE max/mean expert load {rows[0]['moe_max_over_mean_load']:.2f} -> "
                     f"{rows[-1]['moe_max_over_mean_load']:.2f}")
    return lines + ["wrote " + ", ".join(os.path.basename(p) for p in written)]


def _routing_charts(plt, recs: list[dict], save) -> list[str]:
    """routing.jsonl drawn: moe_load.png, each layer's tokens per expert over the run relative to that layer's
    mean (a layer × expert heat map), and moe_imbalance.png, the busiest ep rank's load over the mean per step."""
    if not recs:
        return []
    layers = sorted({int(k) for r in recs for k in r["tokens_per_expert"]})
    n_exp = len(next(iter(recs[0]["tokens_per_expert"].values())))
    total = [[0.0] * n_exp for _ in layers]
    for r in recs:
        for i, layer in enumerate(layers):
            for e, c in enumerate(r["tokens_per_expert"].get(str(layer), [])):
                total[i][e] += c
    rel = [[c * n_exp / (sum(row) or 1.0) for c in row] for row in total]
    fig, ax = plt.subplots(figsize=(min(12, 3 + 0.12 * n_exp), min(10, 1.5 + 0.25 * len(layers))))
    im = ax.imshow(rel, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set(xlabel="expert", ylabel="MoE layer", title="tokens per expert / layer mean (whole run)")
    ax.set_yticks(range(len(layers)), [str(x) for x in layers])
    fig.colorbar(im, ax=ax)
    save(fig, "moe_load.png")
    ep = recs[-1]["ep"]
    steps = [r["step"] for r in recs]
    per_step = [[s * r["ep"] for s in r["busiest_ep_share"].values()] for r in recs]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [max(v) for v in per_step], lw=1.2, label="worst layer")
    ax.plot(steps, [sum(v) / len(v) for v in per_step], lw=1.2, label="mean over layers")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="busiest ep rank / mean", title=f"MoE imbalance over ep={ep} (contiguous placement)")
    ax.legend()
    ax.grid(alpha=0.3)
    save(fig, "moe_imbalance.png")
    worst = max(range(len(recs)), key=lambda i: max(per_step[i]))
    return [f"MoE busiest ep rank over mean (ep={ep}): last step {max(per_step[-1]):.2f} (worst layer), "
            f"worst step {steps[worst]} at {max(per_step[worst]):.2f}"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="render a run directory's curves, comm and pipeline chart to PNG")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        lines = render(args.run_dir)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"shardwise report: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
