"""Pipeline parallelism. Schedules are data (``schedules``), checked and timed without
processes (``simulate``), drawn (``draw``) and inspected from the command line (``cli``)."""

from .schedules import (
    KINDS,
    SCHEDULE_NAMES,
    Action,
    Schedule,
    StageLayout,
    build_schedule,
    dualpipev,
    gpipe,
    interleaved,
    layout_for,
    one_f_one_b,
    stage_of,
    zero_bubble_h1,
)
from .simulate import (
    DeadlockError,
    ScheduleError,
    SimResult,
    analytic_bubble,
    find_problems,
    measured_bubble,
    peak_inflight,
    simulate,
    validate,
)

__all__ = [
    "KINDS", "SCHEDULE_NAMES", "Action", "Schedule", "StageLayout", "build_schedule", "dualpipev",
    "gpipe", "interleaved", "layout_for", "one_f_one_b", "stage_of", "zero_bubble_h1",
    "DeadlockError", "ScheduleError", "SimResult", "analytic_bubble", "find_problems",
    "measured_bubble", "peak_inflight", "simulate", "validate",
]
