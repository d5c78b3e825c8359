"""Action timings for the pipeline timeline: host clocks on CPU, CUDA events on the GPU.

On CUDA an action's Python code only queues kernels, so host clocks around it time the launches,
not the work. `ActionClock` records one event pair per action on the current stream and resolves
them only when the timeline is read (once, after the last step), so timing adds no sync to the
hot path. Resolved times are host seconds: the host clock when the step's first event was
recorded plus the GPU time elapsed since it, so ranks stay comparable as they are on CPU.
"""
from __future__ import annotations

import time

import torch


def _cuda_event():
    return torch.cuda.Event(enable_timing=True)


class ActionClock:
    def __init__(self, device: torch.device, event_factory=None):
        self.event_factory = event_factory or (_cuda_event if device.type == "cuda" else None)
        self.begin_step()

    def begin_step(self) -> None:
        self.raw: list[tuple[dict, object, object]] = []
        self.host0, self.origin = time.time(), None
        if self.event_factory is not None:
            self.origin = self.event_factory()
            self.origin.record()

    def start(self):
        if self.event_factory is None:
            return time.time()
        ev = self.event_factory()
        ev.record()
        return ev

    def stop(self, label: dict, started) -> None:
        """Record the end of the action labelled `label` (kind, microbatch, chunk) begun at `started`."""
        if self.event_factory is None:
            self.raw.append((label, started, time.time()))
            return
        ev = self.event_factory()
        ev.record()
        self.raw.append((label, started, ev))

    def events(self) -> list[dict]:
        """This step's actions as timeline dicts; on CUDA waits for the last event once."""
        if self.event_factory is None:
            return [label | {"start": t0, "end": t1} for label, t0, t1 in self.raw]
        if self.raw:
            self.raw[-1][2].synchronize()
        return [label | {"start": self._at(e0), "end": self._at(e1)} for label, e0, e1 in self.raw]

    def _at(self, ev) -> float:
        return self.host0 + self.origin.elapsed_time(ev) / 1000.0  # elapsed_time is in ms
