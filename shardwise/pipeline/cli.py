"""``shardwise schedule``: validate, simulate and draw a pipeline schedule, or a recorded run.

timeline.json, written by the pipeline executor into a run directory and read by ``--from``::

    {
      "schedule": "1f1b",          # a name from SCHEDULE_NAMES
      "pp": 4,                     # p, pipeline ranks
      "microbatches": 8,           # m
      "vp": 1,                     # v, chunks per rank (2 for dualpipev)
      "ranks": [                   # one list per pipeline rank, index = pp rank
        [{"kind": "F", "microbatch": 0, "chunk": 0, "start": 0.0012, "end": 0.0040}, ...],
        ...
      ]
    }

``kind`` is "F", "B" or "W" exactly as in the schedule's actions (B is the full backward when the
schedule does not split B/W); ``chunk`` is local to the rank. ``start``/``end`` are seconds on a
clock shared by all ranks (e.g. perf_counter after a barrier); only differences matter, the
reader measures from the earliest start. Extra keys are ignored. ``write_timeline`` produces it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..rules.schedules import SCHEDULE_NAMES, build_schedule
from ..rules.schedule_check import analytic_bubble, measured_bubble, peak_inflight, simulate

_EVENT_KEYS = ("kind", "microbatch", "chunk", "start", "end")


def write_timeline(path: str | Path, schedule: str, pp: int, microbatches: int, vp: int,
                   ranks: list[list[dict]]) -> Path:
    """Write ``ranks`` (per-rank event dicts) as timeline.json; the executor's side of the format."""
    doc = {"schedule": schedule, "pp": pp, "microbatches": microbatches, "vp": vp,
           "ranks": [[{k: e[k] for k in _EVENT_KEYS} for e in ops] for ops in ranks]}
    path = Path(path)
    path.write_text(json.dumps(doc, indent=1))
    return path


def read_timeline(path: str | Path) -> dict:
    """Load and sanity-check timeline.json; events come back sorted by start within each rank."""
    doc = json.loads(Path(path).read_text())
    for key in ("schedule", "pp", "microbatches", "vp", "ranks"):
        if key not in doc:
            raise ValueError(f"{path}: missing key {key!r}")
    if len(doc["ranks"]) != doc["pp"]:
        raise ValueError(f"{path}: pp={doc['pp']} but {len(doc['ranks'])} rank lists")
    for r, ops in enumerate(doc["ranks"]):
        for e in ops:
            missing = [k for k in _EVENT_KEYS if k not in e]
            if missing:
                raise ValueError(f"{path}: rank {r} event {e} lacks {missing}")
        ops.sort(key=lambda e: e["start"])
    return doc


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``schedule`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "schedule",
        help="validate, simulate and draw a pipeline schedule (or a recorded run)",
        description="Print analytic and simulated bubble and peak in-flight microbatches per rank; "
                    "with --from, also the bubble measured in RUN_DIR/timeline.json.",
    )
    p.add_argument("--schedule", choices=SCHEDULE_NAMES,
                   help="schedule to build (read from the file with --from)")
    p.add_argument("--pp", type=int, help="pipeline ranks p")
    p.add_argument("--microbatches", type=int, help="microbatches per step m")
    p.add_argument("--vp", type=int, default=None, help="chunks per rank v (default 1; dualpipev always 2)")
    p.add_argument("--cost-f", type=float, default=1.0, help="forward cost per action (default 1)")
    p.add_argument("--cost-b", type=float, default=1.0,
                   help="input-grad backward cost (default 1); a fused backward costs cost-b + cost-w")
    p.add_argument("--cost-w", type=float, default=1.0, help="weight-grad backward cost (default 1)")
    p.add_argument("--comm", type=float, default=0.0, help="latency added to each cross-rank dependency")
    p.add_argument("--out", type=Path,
                   help="write a Gantt chart PNG here (default with --from: RUN_DIR/timeline.png)")
    p.add_argument("--from", dest="from_dir", type=Path, metavar="RUN_DIR",
                   help="read RUN_DIR/timeline.json recorded by the executor and compare")
    p.set_defaults(func=run)
    return p


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def run(args: argparse.Namespace) -> int:
    """Execute the subcommand; 0 on success, 2 (with one line on stderr) on bad input."""
    try:
        return _run(args)
    except (ValueError, TypeError, OSError, RuntimeError) as e:  # DeadlockError is a RuntimeError
        msg = " ".join(str(e).split())
        print(f"shardwise schedule: error: {msg}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    recorded = None
    if args.from_dir is not None:
        recorded = read_timeline(args.from_dir / "timeline.json")
        name, p, m, v = recorded["schedule"], recorded["pp"], recorded["microbatches"], recorded["vp"]
    else:
        name, p, m, v = args.schedule, args.pp, args.microbatches, args.vp
        if name is None or p is None or m is None:
            raise ValueError("--schedule, --pp and --microbatches are required (or --from RUN_DIR)")
    if v is None:
        v = 2 if name == "dualpipev" else 1
    sched = build_schedule(name, p, m, v)
    sim = simulate(sched, args.cost_f, args.cost_b, args.cost_w, comm=args.comm)

    split = "B/W split" if sched.split_bw else f"fused backward = {args.cost_b + args.cost_w:g}"
    print(f"schedule   {name}  p={p} m={m} v={sched.v}  ({split})")
    print(f"costs      F={args.cost_f:g} B={args.cost_b:g} W={args.cost_w:g} comm={args.comm:g} per action")
    analytic = analytic_bubble(name, p, m, sched.v)
    line = f"bubble     analytic {_fmt(analytic)}  simulated {_fmt(sim.bubble_fraction)}"
    if recorded is not None:
        line += f"  measured {_fmt(measured_bubble(recorded['ranks']))}"
    print(line)
    print(f"makespan   simulated {sim.makespan:g} cost units")
    print("peak in-flight per rank  simulated " + " ".join(map(str, sim.peak_inflight)))
    if recorded is not None:
        print("peak in-flight per rank  measured  " + " ".join(map(str, peak_inflight(recorded["ranks"]))))

    out = args.out
    if out is None and args.from_dir is not None:
        out = args.from_dir / "timeline.png"
    if out is not None:
        from .draw import draw_timeline

        events = recorded["ranks"] if recorded is not None else sim.events()
        source = "recorded" if recorded is not None else "simulated"
        draw_timeline(events, out, f"{name} p={p} m={m} v={sched.v} ({source})")
        print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m shardwise.pipeline.cli schedule ...``."""
    parser = argparse.ArgumentParser(prog="shardwise")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
