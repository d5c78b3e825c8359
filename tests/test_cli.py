"""The command line: bad input exits 2 with one line, train writes its run directory, verify prints JSON."""
import json
import subprocess
import sys
import time
from unittest import mock

import pytest

from shardwise.cli import main


def shardwise(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


class Launched(Exception):
    """Raised instead of starting ranks: the arguments passed every check made before any rank starts."""


def main_without_ranks(argv: list[str]) -> int:
    """`shardwise.cli.main(argv)` in this process (milliseconds), with the launcher and the one-rank path
    replaced by `Launched`, so a bad-input case costs no process and a valid one starts no rank."""
    def launched(*args, **kwargs):
        raise Launched(argv)

    with mock.patch("shardwise.training.launch.run_local", launched), mock.patch("shardwise.cli._run", launched):
        try:
            return main(argv)
        except SystemExit as e:  # argparse's own errors (unknown flag, non-integer value)
            return e.code


@pytest.mark.parametrize("args, message", [
    (["train", "--ep", "2"], "--ep 2 needs an MoE model"),
    (["train", "--cp", "2", "--seq-len", "102"], "cannot be split over cp c=2"),
    (["train", "--pp", "3"], "8 layers cannot be split evenly over 3 stages"),
    (["train", "--tp", "3"], "--tp 3 does not divide n_heads=8"),
    (["train", "--model", "nope"], "unknown model 'nope'; valid presets: tiny"),
    (["train", "--data", "/nonexistent.txt"], "no such file"),
    (["train", "--seq-len", "4096"], "exceeds max_seq_len=512"),
    (["train", "--steps", "0"], "--steps 0 must be a positive integer"),
    (["verify", "--tp", "2", "--attn-dropout", "0.1"], "verify needs --attn-dropout 0"),
    (["train", "--dp", "2", "--global-batch", "7"], "must be a multiple of micro-batch 4 × dp 2"),
    (["train", "--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (["verify", "--label-smoothing", "1.5"], "--label-smoothing 1.5 must be in [0, 1)"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    """In-process: the checks run before any rank starts, so none needs a process of its own."""
    assert main_without_ranks(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardwise {args[0]}: error: ") and message in lines[0], lines


def test_bad_input_from_the_shell_exits_2_before_any_rank():
    """The same contract end to end, once, as a user's shell sees it."""
    t0 = time.monotonic()
    r = shardwise("train", "--tp", "3")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "shardwise train: error: --tp 3 does not divide n_heads=8 of model 'tiny'; valid: 1, 2, 4, 8"], r.stderr
    assert time.monotonic() - t0 < 30


def test_train_writes_run_directory(tmp_path):
    out = tmp_path / "run"
    r = shardwise("train", "--steps", "30", "--out", str(out), "--no-progress", "--seq-len", "64")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 31))
    assert set(rows[0]) >= {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s"}
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # the default 4-rank job visibly learns
    ledger = json.loads((out / "comm.json").read_text())
    assert ledger["layout"]["tp"] == 2 and ledger["layout"]["dp"] == 2
    assert ledger["per_step"][0]["axes"]["tp"]["all_reduce"]["bytes"] > 0
    assert ledger["per_step"][0]["axes"]["dp_cp"]["all_reduce"]["bytes"] > 0
    assert len(list((out / "comm").glob("rank*.json"))) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_loss"] == rows[-1]["loss"]
    assert "trained tiny" in r.stdout


def test_verify_prints_json_last_line(capsys):
    """In-process (the ranks are forked from this process, as the CLI forks them from its own)."""
    assert main(["verify", "--tp", "2", "--dp", "2", "--steps", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) >= {"layout", "steps", "max_loss_abs_diff", "max_grad_rel_diff", "max_param_rel_diff",
                           "passed"}
    assert result["passed"] is True and result["steps"] == 2 and result["layout"]["tp"] == 2


def test_every_run_flag_is_declared_once_against_its_field():
    """Each run flag names a real TrainConfig / ParallelConfig field and takes its default from it; every
    TrainConfig field a user sets has a flag, so adding a knob is one field and one RUN_FLAGS row."""
    import dataclasses

    from shardwise.cli import build_parser, config_from_args
    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.config.flags import RUN_FLAGS, flag_default

    owners = {"parallel": ParallelConfig, "": TrainConfig}
    covered = set()
    for flag in RUN_FLAGS:
        if flag.field is None or flag.field.startswith("model_overrides."):
            continue
        owner, _, name = flag.field.rpartition(".")
        assert name in {f.name for f in dataclasses.fields(owners[owner])}, flag.name
        covered.add(flag.field)
    unset = {"model", "parallel", "model_overrides", "final_checkpoint", "eos_id", "resolved_model"}
    assert {f.name for f in dataclasses.fields(TrainConfig)} - unset <= covered
    assert {f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)} <= covered
    zero = next(f for f in RUN_FLAGS if f.name == "--zero")
    assert flag_default(zero, "train") == ParallelConfig().zero
    args = build_parser().parse_args(["verify", "--log-every", "5", "--mtp-init", "fresh",
                                      "--allow-tokenizer-mismatch", "--zero", "1", "--dp", "2"])
    cfg = config_from_args(args, None)
    assert (cfg.log_every, cfg.mtp_init, cfg.allow_tokenizer_mismatch, cfg.parallel.zero) == (5, "fresh", True, 1)
    assert cfg.steps == 3 and not cfg.final_checkpoint
