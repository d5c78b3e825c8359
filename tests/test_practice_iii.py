"""Issue 43's remaining cases, tried from outside: a refusal from the ranks mid-run is one line and exit 2 on any
number of ranks (a full disk at a save, a shard deleted mid-run); prepare-data on a full disk; SIGTERM under
torchrun saves once and resumes bit-exactly; a dense model's summary shows no expert axis; every run flag survives
--print-config → --config."""
from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest

from shardwise.cli import build_parser, main
from shardwise.config.flags import ToggleOrAuto
from shardwise.config import ConfigError

from test_preemption import COMMON, END, LINE, _children, _gone, _rows

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS), TESTS]))


def _cli(*argv, patch: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m shardwise ARGV` as a user runs it; `patch`: Python run first (a fault injected into this process)."""
    code = f"import sys\n{patch}\nfrom shardwise.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def _one_line(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if not x.startswith("train step=")]
    assert len(lines) == 1, stderr
    return lines[0]


# ---------------------------------------------------------------- one line from the ranks, exit 2 on any world
def _refuse_on(ranks: tuple[int, ...], kind: str):
    """A rank fn: `ranks` raise a ConfigError subclass while the others wait in a collective for them."""
    import torch
    import torch.distributed as dist

    from shardwise.checkpoint.save import SaveFailed
    from shardwise.data.shards import ShardUnreadable

    if dist.get_rank() in ranks:
        raise (SaveFailed if kind == "save" else ShardUnreadable)(f"{kind} refused on rank {dist.get_rank()}")
    dist.all_reduce(torch.ones(1))  # never completes: the refusing rank is gone


def test_a_refusal_from_some_or_all_ranks_is_the_one_line_exit_2():
    from shardwise.training.launch import run_local

    with pytest.raises(ConfigError, match=r"^save refused on rank 0$") as e:  # every rank (an agreed SaveFailed)
        run_local(_refuse_on, 2, (0, 1), "save", timeout_s=20, grace_s=2)
    assert type(e.value) is ConfigError
    # one rank alone: its peer waits, or loses it in the collective (CollectiveError) — the cause is the refusal
    with pytest.raises(ConfigError, match=r"^shard refused on rank 1$"):
        run_local(_refuse_on, 2, (1,), "shard", timeout_s=20, grace_s=2)


# ---------------------------------------------------------------- a shard unreadable mid-run
def _prepared(tmp_path, shard_tokens: int = 1 << 20) -> str:
    from shardwise.data.loader import default_corpus
    from shardwise.data.prepare import prepare_data

    text = tmp_path / "corpus.txt"
    text.write_text(default_corpus().replace("\0", "\n")[:60000])
    out = str(tmp_path / "data")
    prepare_data([str(text)], "byte", out, shard_tokens=shard_tokens, progress=False)
    return out


def test_a_shard_gone_mid_run_names_the_file(tmp_path):
    from shardwise.data.shards import PreparedData, ShardUnreadable

    data = _prepared(tmp_path, shard_tokens=20000)
    src, debug = PreparedData(data), PreparedData(data, debug=True)
    assert src.read([0, 25000], 8).shape == (2, 8)
    os.remove(os.path.join(data, "tokens-00001.bin"))
    with pytest.raises(ShardUnreadable, match=r"--data .*data: shard tokens-00001\.bin can no longer be read "
                                              r"\(No such file or directory\)"):
        src.read([0, 25000], 8)
    os.truncate(os.path.join(data, "tokens-00002.bin"), 100)
    with pytest.raises(ShardUnreadable, match=r"shard tokens-00002\.bin can no longer be read \(shorter than"):
        src.read([45000], 8)
    with pytest.raises(FileNotFoundError):  # --debug: the original error and its traceback
        debug.read([25000], 8)


@pytest.mark.slow  # a 2-rank CLI run
def test_a_shard_deleted_mid_run_is_one_line_on_two_ranks(tmp_path):
    data = _prepared(tmp_path)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", *COMMON, "--steps", "10000", "--data", data,
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True)
    try:
        t0, ranks = time.monotonic(), []
        while not ((out / "metrics.jsonl").exists() and len(_rows(out)) >= 2):
            ranks = ranks if len(ranks) == 2 else _children(proc.pid)
            assert proc.poll() is None and time.monotonic() - t0 < 240, proc.communicate()
            time.sleep(0.05)
        os.remove(os.path.join(data, "tokens-00000.bin"))
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, stderr
    assert re.fullmatch(r"shardwise train: error: --data .*: shard tokens-00000\.bin can no longer be read \(No such "
                        r"file or directory\); .*", _one_line(stderr)), stderr
    assert len(ranks) == 2 and all(_gone(pid) for pid in ranks), ranks


# ---------------------------------------------------------------- prepare-data on a full disk
FULL_DISK = """
import errno, os, builtins
import shardwise.data.shards as shards
class Full:
    def __init__(self, f): self.f, self.n = f, 0
    def write(self, b):
        self.n += len(b)
        if self.n > 30000: raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(b)
    def close(self): self.f.close()
shards.open = lambda *a, **k: Full(builtins.open(*a, **k))
"""
"""The disk fills while prepare-data writes a shard (its 30 000th byte): the file write raises ENOSPC."""


def test_prepare_data_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    out = tmp_path / "data"
    r = _cli("prepare-data", str(text), "--out", str(out), "--no-progress", patch=FULL_DISK)
    assert r.returncode == 2, r.stderr
    assert _one_line(r.stderr) == (f"shardwise prepare-data: error: --out {out}: writing the shards failed: No space "
                                   "left on device; the partial output was removed, nothing is left at --out; free "
                                   "space or choose another --out"), r.stderr
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]  # no data/, no .data.tmp-PID
    with mock.patch("shardwise.data.shards.ShardWriter.finish", side_effect=OSError(errno.ENOSPC, "full", "x")), \
            pytest.raises(OSError):  # --debug: the original error
        main(["prepare-data", str(text), "--out", str(out), "--no-progress", "--debug"])
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


# ---------------------------------------------------------------- no expert axis on a dense model
def _one_step(model: str, degrees: dict, kw: dict):
    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.training.trainer import Trainer, make_mesh

    cfg = TrainConfig(model=model, parallel=ParallelConfig(**degrees), steps=1, seq_len=32, micro_batch=2,
                      progress=False, **kw).resolved()
    mesh = make_mesh(cfg, __import__("torch").device("cpu"))
    trainer = Trainer(cfg, mesh)
    mesh.ledger.reset()
    trainer.train_step(0)
    return {a: sorted(ops) for a, ops in mesh.ledger.steps[-1]["axes"].items()}


def _several_steps(cases):
    return [_one_step(*c) for c in cases]


CASES = [("tiny", dict(dp=2, zero=1), dict(global_batch=8, optimizer="muon")),
         ("tiny", dict(dp=2, zero=3), dict(global_batch=8)),
         ("tiny-moe", dict(dp=2, zero=1), dict(global_batch=8))]  # experts replicated over edp = dp


def test_dense_models_reduce_no_expert_norm_and_the_planner_agrees():
    from _dist import run_ranks
    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.planner import Cluster, estimate, get_gpu
    from shardwise.planner.layout import from_train_config

    axes = run_ranks(2, _several_steps, CASES)[0]
    for (model, degrees, kw), got in zip(CASES, axes):
        cfg = TrainConfig(model=model, parallel=ParallelConfig(**degrees), steps=1, seq_len=32, micro_batch=2,
                          **kw).resolved()
        spec, lay, wl = from_train_config(cfg)
        est = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)
        planned = {a for a, ops in est["stages"][0]["comm_ops_per_step"].items() if ops}
        if model == "tiny":
            assert "edp" not in got and "ep" not in got and "edp" not in planned, (degrees, got, planned)
        else:  # the guard: a MoE model still reduces its experts' norm over edp, and plans edp traffic
            assert "all_reduce:grad_norm" in got["edp"] and "edp" in planned, (got, planned)


def test_the_summary_names_only_axes_that_carried_bytes():
    from shardwise.training.report import summary_lines

    s = {"model": "tiny", "layout": {"dp": 2, "pp": 1, "cp": 1, "tp": 1, "ep": 1, "zero": 1}, "steps": 2,
         "first_loss": 5.0, "final_loss": 4.0, "tokens_per_s": 1.0, "out": "runs/x",
         "comm_bytes_per_step": {"ckpt": 0, "dp_cp": 8 * 2**20, "edp": 0}}
    assert summary_lines(s)[1] == "communication per step (payload bytes per rank): dp_cp 8.00 MiB"


# ---------------------------------------------------------------- every run flag through --print-config
LAYOUT = {"dp", "tp", "pp", "cp", "ep", "vp", "schedule"}  # printed from the resolved layout: tried together below


def _other_value(a: argparse.Action):
    """A value for flag `a` that is not its default, as argparse would store it."""
    if isinstance(a, (argparse.BooleanOptionalAction, ToggleOrAuto)):
        return not a.default
    if a.nargs == 0:  # store_true
        return True
    if a.choices:
        return next(c for c in a.choices if c != a.default)
    if a.type is int:
        return (a.default or 0) + 3
    if a.type is float:
        return (a.default or 0.0) + 0.25
    return {"adam_betas": "0.8,0.9", "pp_layers": "3,5", "save_on_signal": "SIGUSR1",
            "profile_steps": "3-4"}.get(a.dest, f"{a.dest}-x")


def _round_trip(tmp_path, argv, name: str, cfg=None):
    """(the flags parsed, the flags parsed again from what --print-config printed); `cfg`: the resolved run to
    print with (the flag's own run when None; a flag alone may not make a valid run, and only the layout is
    printed from the resolved run)."""
    from shardwise.config.file import apply_config_file, render_config
    from shardwise.training.assemble import config_from_args

    parser = _PARSER[0] if _PARSER else _PARSER.append(build_parser()) or _PARSER[0]
    sub = parser._sw_runs["train"]
    defaults = {a: a.default for a in sub._actions}, dict(sub._defaults)
    args = parser.parse_args(argv)
    cfg = cfg or config_from_args(args, None)
    path = tmp_path / f"{name}.toml"
    path.write_text(render_config(sub, args, cfg))
    try:
        again = apply_config_file(parser, sub, str(path), ["train", "--config", str(path)])
    finally:  # --config sets its keys as the parser's defaults: back to the flags' own for the next case
        for a, d in defaults[0].items():
            a.default = d
        sub._defaults = defaults[1]
    return vars(args), vars(again)


_PARSER: list = []


def test_every_run_flag_survives_print_config_and_config(tmp_path):
    parser = build_parser()
    sub = parser._sw_runs["train"]
    skip = {"help", "config", "print_config"}
    from shardwise.training.assemble import config_from_args

    default_run = config_from_args(parser.parse_args(["train"]), None)
    tried = 0
    for a in sub._actions:
        if not a.option_strings or a.dest in skip | LAYOUT:
            continue
        value = _other_value(a)
        flag = a.option_strings[0]
        if isinstance(a, (argparse.BooleanOptionalAction, ToggleOrAuto)):
            argv = ["train", flag if value else f"--no-{flag[2:]}"]
        elif a.nargs == 0:
            argv = ["train", flag]
        else:
            argv = ["train", flag, str(value)]
        before, after = _round_trip(tmp_path, argv, a.dest, default_run)
        assert after[a.dest] == before[a.dest] == value, (flag, before[a.dest], after[a.dest])
        tried += 1
    assert tried > 80
    layout = ["train", "--model", "tiny-moe", "--dp", "2", "--tp", "2", "--pp", "2", "--cp", "2", "--ep", "2",
              "--schedule", "interleaved", "--vp", "2", "--microbatches", "4"]
    before, after = _round_trip(tmp_path, layout, "layout")
    for d in LAYOUT | {"microbatches", "model"}:
        assert after[d] == before[d], (d, before[d], after[d])


def test_print_config_keeps_microbatches_from_the_cli(tmp_path, capsys):
    assert main(["train", "--dp", "2", "--tp", "1", "--microbatches", "4", "--micro-batch", "2",
                 "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "microbatches = 4" in printed.splitlines(), printed
    path = tmp_path / "run.toml"
    path.write_text(printed)
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == printed


# ---------------------------------------------------------------- SIGTERM under torchrun
@pytest.mark.slow  # two 2-rank runs under torchrun (and the uninterrupted one once a session: conftest)
@pytest.mark.parametrize("target", ["group", "agent"])
def test_sigterm_under_torchrun_saves_once_and_resumes_bitwise(tmp_path, uninterrupted_losses, target):
    """SIGTERM mid-step to the whole process group (a scheduler's preemption: torchrun's agent and both workers) or
    to torchrun alone (`scancel`, a batch script's trap; the agent forwards it). The workers finish the step, save
    one checkpoint, rank 0 prints the line, each exits 143; torchrun, itself signalled, exits 1 (its own
    SignalException, as documented). No worker outlives it."""
    run = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "shardwise"]
    proc = subprocess.Popen([*torchrun, *COMMON, "--steps", "10000", "--out", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)
    try:
        t0, workers = time.monotonic(), []
        while not ((run / "metrics.jsonl").exists() and len(_rows(run)) >= 2):
            workers = workers if len(workers) == 2 else _children(proc.pid)
            assert proc.poll() is None and time.monotonic() - t0 < 300, proc.communicate()
            time.sleep(0.05)
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr
    ours = [x for x in stderr.splitlines() if x.startswith("shardwise ")]
    assert len(ours) == 1 and (m := LINE.match(ours[0])) and m[1] == m[2], stderr
    step = int(m[1])
    assert [row["step"] for row in _rows(run)] == list(range(1, step + 1))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", f"step-{step}"]
    assert len(workers) == 2 and all(_gone(pid) for pid in workers), workers

    r = subprocess.run([*torchrun, *COMMON, "--steps", str(END), "--out", str(run), "--resume"],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr
    assert [row["loss"] for row in _rows(run)] == uninterrupted_losses  # bit-exact: floats compared as stored
