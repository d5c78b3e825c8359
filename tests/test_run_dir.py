"""Run directories and resume: a final checkpoint by default, `latest` decides what resumes, a finished run is
left alone, a non-empty --out needs --resume/--auto-resume/--overwrite, the LR schedule survives an extended
run, and Ctrl-C stops every rank with one line."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from shardwise.cli import main

from test_cli import main_without_ranks

ONE = ["--dp", "1", "--tp", "1", "--seq-len", "16", "--micro-batch", "1", "--no-progress", "--no-report"]


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_resume_and_run_directory_contract(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *ONE, "--steps", "4", "--out", str(run)]) == 0
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-4"]  # the default run's final checkpoint
    capsys.readouterr()

    assert main_without_ranks(["train", *ONE, "--steps", "4", "--out", str(run)]) == 2  # would mix two runs
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0] and "--overwrite" in err[0], err

    before = _tree(run)  # a finished run: says so, exit 0, touches nothing
    assert main_without_ranks(["train", *ONE, "--steps", "4", "--out", str(run), "--resume"]) == 0
    assert "already at step 4 (--steps 4)" in capsys.readouterr().err
    assert _tree(run) == before

    # A stale step-300 newer than `latest` (another run's) is not resumed; the schedule's length (4) is kept,
    # so the two extra steps run at min-lr instead of jumping back up.
    shutil.copytree(ckpts / "step-4", ckpts / "step-300")
    assert main(["train", *ONE, "--steps", "6", "--out", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from {ckpts / 'step-4'} (step 4)" in err, err
    assert "steps 5..6 run past the LR schedule's 4 steps" in err and "LR schedule changes" not in err, err
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[3]["lr"] == rows[4]["lr"] == rows[5]["lr"] == 3e-3 / 10
    assert (ckpts / "latest").read_text() == "step-6\n"  # checkpoints enabled: the last step is saved

    assert main(["train", *ONE, "--steps", "8", "--out", str(run), "--resume", "--lr-decay-steps", "8",
                 "--no-checkpoint"]) == 0
    err = capsys.readouterr().err
    assert "LR schedule changes from step 7: cosine 0.003→0.0003 over 4 steps (1 warm-up) -> " \
           "cosine 0.003→0.0003 over 8 steps (1 warm-up)" in err, err
    assert (ckpts / "latest").read_text() == "step-6\n"  # --no-checkpoint

    assert main(["train", *ONE, "--steps", "2", "--out", str(run), "--overwrite", "--no-checkpoint"]) == 0
    assert not ckpts.exists() or not any(p.name.startswith("step-") for p in ckpts.iterdir())
    assert [r["step"] for r in _rows(run)] == [1, 2]


def test_resume_without_checkpoint_and_auto_resume(tmp_path, capsys):
    fresh = tmp_path / "fresh"
    t0 = time.monotonic()
    assert main_without_ranks(["train", *ONE, "--out", str(fresh), "--resume"]) == 2  # before any rank
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume: no checkpoint under" in err[0] and "--auto-resume" in err[0], err
    assert not fresh.exists() and time.monotonic() - t0 < 30  # no rank started (main_without_ranks)
    assert main_without_ranks(["train", *ONE, "--out", str(fresh), "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite replaces the run" in err[0] and "choose one" in err[0], err
    assert main(["train", *ONE, "--steps", "2", "--out", str(fresh), "--auto-resume"]) == 0  # fresh start
    assert "resuming" not in capsys.readouterr().err
    assert main(["train", *ONE, "--steps", "3", "--out", str(fresh), "--auto-resume"]) == 0  # the requeued job
    assert "resuming from" in capsys.readouterr().err
    assert [r["step"] for r in _rows(fresh)] == [1, 2, 3]


def _default_sigint():
    """The run's SIGINT as a terminal's foreground job has it: a suite started in the background by a shell
    without job control inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", "--dp", "2", "--tp", "1", "--steps",
                             "100000", "--seq-len", "16", "--micro-batch", "1", "--save-every", "2", "--out", str(run),
                             "--no-progress", "--no-report"], stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run / "checkpoints" / "latest").exists():
            time.sleep(0.5)
        assert (run / "checkpoints" / "latest").exists(), "no checkpoint within 120 s"
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 20, "ranks did not stop within seconds"
    finally:  # a failed check must not leave a 100,000-step run behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    line = err.strip().splitlines()[-1]
    last = (run / "checkpoints" / "latest").read_text().strip()
    assert line.startswith("shardwise train: interrupted at step ") and \
        line.endswith(f"; last checkpoint {last}; continue with --resume"), err
    step = int(line.split("interrupted at step ")[1].split(";")[0])
    assert step == _rows(run)[-1]["step"] >= 2
    try:
        os.killpg(proc.pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "a rank outlived the interrupted run"
