"""--save-on-signal: a scheduler's SIGTERM to the launcher, to one rank or to the whole job ends the run at a step
boundary with one checkpoint, one line and exit 143; no rank outlives the launcher; --resume from that checkpoint
continues bit-exactly as the uninterrupted run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from shardwise.config.flags import _signal_name
from shardwise.training import preemption

COMMON = ["train", "--dp", "2", "--seq-len", "32", "--micro-batch", "2", "--no-progress", "--no-report",
          "--lr-decay-steps", "40", "--warmup-steps", "4", "--log-every", "1000"]
END = 40
LINE = re.compile(r"^shardwise train: preempted at step (\d+) \(SIGTERM\); saved checkpoint step-(\d+); "
                  r"continue with --resume$")


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _gone(pid: int, within: float = 10.0) -> bool:
    """Not running (a zombie counts as gone: it waits only for its new parent to reap it)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def _preempt(out, target: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start a 2-rank run to 10 000 steps, SIGTERM the launcher ('launcher') or rank 1 ('rank') once step 2 is in
    metrics.jsonl; (the finished process, the ranks' pids)."""
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", *COMMON, "--steps", "10000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        ranks: list[int] = []
        while time.monotonic() - t0 < 240:
            ranks = ranks if len(ranks) == 2 else _children(proc.pid)
            if (out / "metrics.jsonl").exists() and len(_rows(out)) >= 2:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid if target == "launcher" else ranks[1], signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), ranks


@pytest.mark.slow
def test_sigterm_saves_once_and_resume_is_bitwise(tmp_path, uninterrupted_losses):
    reference = uninterrupted_losses  # the whole run's losses (conftest: one run for this and test_practice_iii)

    for target in ("launcher", "rank"):
        run = tmp_path / target
        done, ranks = _preempt(run, target)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == preemption.PREEMPTED_EXIT_CODE == 143, (target, done.stderr)
        match = LINE.match(lines[-1])
        assert match and match[1] == match[2], (target, done.stderr)
        step = int(match[1])
        assert 2 <= step < END, (target, step)
        assert [row["step"] for row in _rows(run)] == list(range(1, step + 1))  # every step run is recorded
        ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert ckpts == ["latest", f"step-{step}"], ckpts  # one checkpoint, at the step reached
        assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{step}"
        assert all(_gone(pid) for pid in ranks), (target, ranks)

        r = subprocess.run([sys.executable, "-m", "shardwise", *COMMON, "--steps", str(END), "--out", str(run),
                            "--resume"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        assert [row["loss"] for row in _rows(run)] == reference, target  # bit-exact: floats compared as stored


def test_signal_names():
    assert _signal_name("TERM") == _signal_name("sigterm") == "SIGTERM"
    assert _signal_name("USR1") == "SIGUSR1" and _signal_name("none") is None
    from shardwise.config import ConfigError

    with pytest.raises(ConfigError, match="--save-on-signal 'KILL' is not supported; valid: SIGTERM, SIGUSR1"):
        _signal_name("KILL")


def test_handler_requests_a_stop_and_is_removed_after():
    before = signal.getsignal(signal.SIGUSR2)
    with preemption.catching("SIGUSR2"):
        assert preemption.requested() is None
        os.kill(os.getpid(), signal.SIGUSR2)
        assert preemption.requested() == "SIGUSR2"
    assert signal.getsignal(signal.SIGUSR2) == before
    with preemption.catching("SIGUSR2"):
        assert preemption.requested() is None  # a new run starts without the old request


def test_one_rank_run_stops_after_the_signal_step_and_resumes_bitwise(tmp_path, monkeypatch):
    """In-process (one rank, as the CLI runs a world of 1): the signal during step 3 stops the run after it."""
    from shardwise.config import TrainConfig
    from shardwise.training import loop

    def cfg(out, **kw):
        return TrainConfig(model="tiny", steps=6, seq_len=32, micro_batch=2, progress=False, report=False,
                           out=str(out), save_on_signal="SIGUSR1", final_checkpoint=True, **kw)

    real = loop.install_faults

    def signal_at_step_3(c, trainer):
        real(c, trainer)
        trainer.step_hooks.append(lambda t, step: os.kill(os.getpid(), signal.SIGUSR1) if step == 2 else None)

    full = loop.train_main(cfg(tmp_path / "full"))
    assert "preempted" not in full
    monkeypatch.setattr(loop, "install_faults", signal_at_step_3)
    got = loop.train_main(cfg(tmp_path / "cut"))
    assert got["preempted"] == {"step": 3, "signal": "SIGUSR1", "checkpoint": "step-3"}
    assert preemption.preempted_line(got["preempted"]) == (
        "preempted at step 3 (SIGUSR1); saved checkpoint step-3; continue with --resume")
    assert (tmp_path / "cut" / "checkpoints" / "latest").read_text().strip() == "step-3"
    assert len(_rows(tmp_path / "cut")) == 3
    monkeypatch.setattr(loop, "install_faults", real)
    loop.train_main(cfg(tmp_path / "cut", resume=True))
    assert [r["loss"] for r in _rows(tmp_path / "cut")] == [r["loss"] for r in _rows(tmp_path / "full")]
