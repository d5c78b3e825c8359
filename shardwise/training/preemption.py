"""Saving on preemption (`--save-on-signal`): a scheduler's SIGTERM (or SIGUSR1) ends the run at a step boundary
with a checkpoint instead of killing it mid-step.

The handler only sets a flag, so a signal can land anywhere (inside a collective, a save) without harm. At each
step boundary the ranks agree through one tiny object gather on the gloo `ckpt` group (no device sync, counted
by the ledger): a signal that reached any one rank — the launcher forwards its own to every rank — stops them all
after the same step. A rank also gets the signal when its launcher dies (`die_with_parent`), so it saves and
stops instead of training on as an orphan.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading

from .. import comm

PREEMPTED_EXIT_CODE = 143
"""A run stopped by --save-on-signal after saving: 128 + SIGTERM, what shells and schedulers already read as
"terminated on request" — not 0, so `afterok` dependencies and `&&` chains do not take the run as finished, and
apart from 1 (failure), 2 (refused input), 130 (Ctrl-C) and 13 (injected crash)."""

_requested: list[str] = []  # signal names received since `install`


def _note(signum, frame) -> None:
    _requested.append(signal.Signals(signum).name)


def install(name: str) -> tuple[bool, object]:
    """Catch signal `name` in this process: it requests a stop instead of ending the process. Returns (installed,
    the handler it replaced); not installed off the main thread, where Python sets no handlers."""
    if threading.current_thread() is not threading.main_thread():
        return False, None
    signum = signal.Signals[name]
    _requested.clear()
    previous = signal.signal(signum, _note)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})  # blocked by the launcher until a handler existed
    return True, previous


@contextlib.contextmanager
def catching(name: str | None):
    """`install` for the duration of a run, the previous handler afterwards; nothing for None."""
    installed, previous = install(name) if name else (False, None)
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.Signals[name], signal.SIG_DFL if previous is None else previous)


def requested() -> str | None:
    """The first signal this process received since `install`, or None."""
    return _requested[0] if _requested else None


def stop_agreed(mesh) -> str | None:
    """Collective over `ckpt` at a step boundary: the signal any rank received (every rank the same), or None."""
    return next((s for s in comm.all_gather_object(requested(), mesh["ckpt"]) if s), None)


PR_SET_PDEATHSIG = 1


def die_with_parent(name: str | None, parent: int) -> None:
    """Linux: have the kernel send this process `name` (SIGKILL when None) when the process that started it dies,
    so a rank never outlives its launcher. `parent`: the launcher's pid, to catch a launcher that died first."""
    signum = signal.Signals[name] if name else signal.SIGKILL
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to ask the kernel for
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


def preempted_line(stopped: dict) -> str:
    """The one line a preempted run ends with; `stopped`: `train_main`'s {step, signal, checkpoint}."""
    head = f"preempted at step {stopped['step']} ({stopped['signal']})"
    if stopped["checkpoint"] is None:
        return f"{head}; no checkpoint written (--no-checkpoint)"
    return f"{head}; saved checkpoint {stopped['checkpoint']}; continue with --resume"
