"""The comm ledger: bytes and op counts per (axis, op), per step. Pure Python, so the mesh and the planner's
checks can hold one without importing torch.distributed."""
from __future__ import annotations

import json
from collections import defaultdict


class Ledger:
    """Bytes and op counts per (axis, op), per step. Cheap: one dict update per collective."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.current: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0])
        self.steps: list[dict] = []

    def record(self, axis: str, op: str, nbytes: int, wire_bytes: float) -> None:
        if self.enabled:
            entry = self.current[(axis, op)]
            entry[0] += 1
            entry[1] += nbytes
            entry[2] += wire_bytes

    @staticmethod
    def _nest(flat) -> dict:
        out: dict = {}
        for (axis, op), (count, nbytes, wire) in sorted(flat.items()):
            out.setdefault(axis, {})[op] = {"count": int(count), "bytes": int(nbytes), "wire_bytes": int(round(wire))}
        return out

    def snapshot(self) -> dict:
        """The current (unfinished) step, nested as {axis: {op: {count, bytes, wire_bytes}}}."""
        return self._nest(self.current)

    def end_step(self, step: int) -> dict:
        entry = {"step": step, "axes": self.snapshot()}
        self.steps.append(entry)
        self.current = defaultdict(lambda: [0, 0, 0])
        return entry

    def reset(self) -> None:
        self.current = defaultdict(lambda: [0, 0, 0])
        self.steps = []

    def totals(self) -> dict:
        flat: dict = defaultdict(lambda: [0, 0, 0])
        for s in self.steps:
            for axis, ops in s["axes"].items():
                for op, v in ops.items():
                    e = flat[(axis, op)]
                    e[0] += v["count"]
                    e[1] += v["bytes"]
                    e[2] += v["wire_bytes"]
        return self._nest(flat)

    def to_json(self, rank: int, layout: dict) -> str:
        return json.dumps({
            "rank": rank,
            "layout": layout,
            "convention": "bytes = payload this rank contributes; wire_bytes = bytes sent on links (ring algorithms)",
            "per_step": self.steps,
            "total": self.totals(),
        }, indent=1)
