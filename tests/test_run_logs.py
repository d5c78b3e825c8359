"""What a cluster user reads: `key=value` log lines in a job's log file, resume when checkpoints are damaged
(one line each way, no traceback), summaries about the steps this invocation ran, and a fresh run's
TensorBoard without the old run's curves."""
import json
import re

from shardwise.cli import main
from shardwise.training.console import Console, eval_line, log_interval, step_line
from shardwise.config import TrainConfig
from shardwise.training.report import layout_text

from test_cli import main_without_ranks, shardwise

ONE = ["--dp", "1", "--tp", "1", "--seq-len", "16", "--micro-batch", "1", "--no-report"]
KEYS = ["step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib", "step_s"]


def _fields(line):
    return dict(kv.split("=", 1) for kv in line.split()[1:])


def _corrupt(ckpt):
    victim = next(p for p in sorted(ckpt.iterdir()) if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])


def test_log_lines_in_a_log_file(tmp_path):
    """stdout not a terminal: no bar, one line per --log-every steps in a fixed key=value format."""
    r = shardwise("train", *ONE, "--steps", "4", "--log-every", "2", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout + r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("train ")]
    assert [_fields(x)["step"] for x in lines] == ["2/4", "4/4"], r.stdout
    assert all(list(_fields(x)) == KEYS for x in lines), lines
    assert float(_fields(lines[-1])["peak_mem_gib"]) > 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["peak_mem_bytes"] > 0 for r in rows)
    assert re.search(r"^trained tiny on dp=1 for 4 steps: ", r.stdout, re.M), r.stdout


def test_line_format_parts_and_intervals(capsys):
    rec = {"step": 30, "loss": 2.5, "loss_main": 2.25, "loss_mtp": 0.25, "moe_aux_loss": 0.01, "lr": 1e-3,
           "grad_norm": 0.5, "tokens": 1000, "step_time_s": 0.5, "mfu": 0.4, "peak_mem_bytes": 2**31}
    assert step_line(rec, 40) == ("train step=30/40 loss=2.5000 loss_main=2.2500 loss_mtp=0.2500 loss_aux=0.01 "
                                  "lr=1.000e-03 grad_norm=0.5000 tokens_per_s=2000 mfu=40.0% peak_mem_gib=2.00 "
                                  "step_s=0.500")
    assert eval_line({"step": 30, "eval_loss": 3.0}) == "eval step=30 eval_loss=3.0000"
    assert [log_interval(TrainConfig(steps=n, log_every=k)) for n, k in ((20, None), (21, None), (5, 3))] == [1, 10, 3]
    console = Console(TrainConfig(steps=40, progress=False), 0, "train")
    for step in (10, 11, 40):
        console.step(dict(rec, step=step, mfu=None))
        console.eval({"step": step, "eval_loss": 3.0} if step == 11 else None)
    out = capsys.readouterr().out.splitlines()
    assert [x.split()[:2] for x in out] == [["train", "step=10/40"], ["eval", "step=11"], ["train", "step=40/40"]]
    assert "mfu=n/a" in out[0]
    assert layout_text({"dp": 1, "pp": 2, "cp": 1, "tp": 1, "ep": 1, "sequence_parallel": False, "zero": 0,
                        "schedule": "1f1b", "vp": 1, "pp_layers": None, "pp_scatter_gather": False}) == \
        "dp=1, pp=2, schedule=1f1b"


def test_resume_with_damaged_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    assert main(["train", *ONE, "--steps", "4", "--save-every", "2", "--out", str(run)]) == 0
    capsys.readouterr()

    _corrupt(ckpts / "step-4")  # the newest damaged: skipped once, the older one resumes
    assert main(["train", *ONE, "--steps", "6", "--resume", "--no-checkpoint", "--out", str(run)]) == 0
    out, err = capsys.readouterr()
    assert err.count("skipped checkpoint") == 1 and f"resuming from {ckpts / 'step-2'}" in err, err
    assert "steps 5..6 run past the LR schedule's 4 steps" in err, err
    assert "trained tiny on dp=1 for 4 steps (3..6 of 6): " in out, out

    _corrupt(ckpts / "step-2")  # every one damaged
    assert main_without_ranks(["train", *ONE, "--steps", "6", "--resume", "--out", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise train: error: --resume: no intact checkpoint") and \
        "step-4: " in err[0] and "step-2: " in err[0] and "truncated" in err[0], err

    assert main(["train", *ONE, "--steps", "3", "--auto-resume", "--out", str(run)]) == 0
    out, err = capsys.readouterr()
    said = [x for x in err.splitlines() if "shardwise" in x]
    assert len(said) == 1 and said[0].startswith(f"shardwise train: --auto-resume: no intact checkpoint under {ckpts} "
                                                 "(step-4: ") and said[0].endswith("); starting fresh"), err
    assert "Traceback" not in err
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    # A checkpoint past the schedule's end (step 5 of 3): only the steps still to run are past it.
    assert main(["train", *ONE, "--steps", "5", "--resume", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", *ONE, "--steps", "7", "--resume", "--out", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "steps 6..7 run past the LR schedule's 3 steps" in err, err
    assert "for 2 steps (6..7 of 7)" in out and "None" not in out, out

    # --overwrite: a new run, and the old run's TensorBoard events are gone with its checkpoints.
    assert main(["train", *ONE, "--steps", "2", "--overwrite", "--out", str(run)]) == 0
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
