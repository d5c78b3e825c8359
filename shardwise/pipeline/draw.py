"""Gantt chart of a pipeline timeline, simulated or recorded.

Both the simulator (``SimResult.events()``) and the executor's ``timeline.json`` produce the same
per-rank event dicts {"kind", "microbatch", "chunk", "start", "end"}, so one picture format
serves "what the schedule should do" and "what the run did".
"""

from __future__ import annotations

from pathlib import Path

# One hue per kind; chunk c is drawn lighter and hatched so V/interleaved chunks stand apart.
_COLORS = {"F": "#3b7dd8", "B": "#2ca25f", "W": "#f28e2b"}
_NAMES = {"F": "F forward", "B": "B backward", "W": "W weight grad"}
_HATCHES = ("", "//", "..", "xx", "\\\\", "++")


def _shade(hex_color: str, chunk: int) -> tuple[float, float, float]:
    rgb = [int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = min(0.45 * chunk, 0.7)  # blend toward white for higher chunks
    return tuple(c + (1 - c) * mix for c in rgb)


def draw_timeline(per_rank_events: list[list[dict]], out_png: str | Path, title: str = "") -> Path:
    """Write a PNG with one row per rank (rank 0 on top), boxes labelled by microbatch.

    Raises RuntimeError if matplotlib is not installed (it is an optional dependency).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise RuntimeError("drawing a timeline needs matplotlib: pip install matplotlib") from e

    events = [e for ops in per_rank_events for e in ops]
    if not events:
        raise ValueError("no events to draw")
    t0 = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - t0 or 1.0
    p = len(per_rank_events)
    chunks = sorted({int(e.get("chunk", 0)) for e in events})

    # Figure + Agg canvas directly (no pyplot): no global backend switch, safe in any process.
    fig = Figure(figsize=(min(max(8.0, len(events) / p * 0.35), 28.0), 0.5 * p + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for rank, ops in enumerate(per_rank_events):
        for e in ops:
            kind, chunk = e["kind"], int(e.get("chunk", 0))
            start, width = e["start"] - t0, e["end"] - e["start"]
            ax.barh(rank, width, left=start, height=0.8, color=_shade(_COLORS.get(kind, "#999999"), chunk),
                    edgecolor="black", linewidth=0.4, hatch=_HATCHES[chunk % len(_HATCHES)])
            if width > span / 120:  # skip labels that would not fit
                ax.text(start + width / 2, rank, str(e["microbatch"]), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel("time")
    kinds = [k for k in _COLORS if any(e["kind"] == k for e in events)]
    handles = [Patch(facecolor=_COLORS[k], edgecolor="black", label=_NAMES[k]) for k in kinds]
    if len(chunks) > 1:
        handles += [Patch(facecolor=_shade("#888888", c), edgecolor="black",
                          hatch=_HATCHES[c % len(_HATCHES)], label=f"chunk {c}") for c in chunks]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "pipeline timeline")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out
