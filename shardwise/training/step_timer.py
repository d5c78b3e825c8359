"""Step times without a host sync (the metrics rows that wait for them: `RunWriter`).

On an accelerator a host clock around asynchronous launches times the launches, and waiting for a step's
end event at the step's end would stall the queue the step just filled: the time is read a step late.
"""
from __future__ import annotations

import time

import torch


class StepTimer:
    """Step times without a host sync. On an accelerator a host clock around asynchronous launches times
    the launches, and waiting for an end event stalls the queue: each step records a start and an end
    event, and the end is read at the next step's `stop` (complete by then: that step's host read waited
    for the stream), or at `flush`. On CPU the host clock is the step time, known at once."""

    def __init__(self, device: torch.device):
        self.device = device
        self.timed = device.type != "cpu"
        self.t0 = 0.0
        self.open = None
        self.pending: list[tuple] = []  # (start event, end event, record) not yet read

    def _event(self):
        return torch.Event(device=self.device, enable_timing=True)

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.timed:
            self.open = self._event()
            self.open.record()

    def stop(self, rec: dict) -> None:
        """Set rec["step_time_s"]: now (host clock), or once its end event is known to be done."""
        if not self.timed:
            rec["step_time_s"] = time.perf_counter() - self.t0
            return
        end = self._event()
        end.record()
        self.flush()  # the previous step: done, this step's host read waited for the stream past it
        self.pending = [(self.open, end, rec)]
        rec["step_time_s"] = None

    def flush(self) -> None:
        """Read the pending step's time (waits for its end event, if not done yet): also after the loop."""
        for start, end, rec in self.pending:
            end.synchronize()
            rec["step_time_s"] = start.elapsed_time(end) / 1000.0
        self.pending = []
