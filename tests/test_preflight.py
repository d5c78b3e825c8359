"""What a run's surroundings must offer is checked before any rank starts (exit 2, one line), and a checkpoint
the filesystem refuses mid-run is one line with its partial tmp-step-N removed and the intact one named."""
import dataclasses
import errno
import json
import os
import socket
import subprocess
import sys
from unittest import mock

import pytest

from shardwise.cli import main
from shardwise.config import ConfigError, ModelConfig

from test_cli import Launched, main_without_ranks

ONE = ["--dp", "1", "--tp", "1", "--seq-len", "16", "--micro-batch", "1", "--no-progress", "--no-report"]


def _refused(capsys, argv, *needles):
    code = main_without_ranks(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    for n in needles:
        assert n in err[0], err
    return err[0]


def _starts(argv):
    with pytest.raises(Launched):
        main_without_ranks(argv)


def test_output_directories_that_are_files_or_under_one(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    _refused(capsys, ["train", *ONE, "--out", str(f)], f"--out {f}", "is a file, not a directory")
    _refused(capsys, ["train", *ONE, "--out", str(f / "run")], "is a file, not a directory")
    _refused(capsys, ["train", *ONE, "--out", str(tmp_path / "r"), "--checkpoint-dir", str(f / "c")],
             "--checkpoint-dir", "is a file")


def test_read_only_output_directory(tmp_path, capsys):
    """A user's read-only directory (mode 0555); as root, which writes through modes, a read-only tmpfs mounted
    there (CI runs as root)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                                 capture_output=True, text=True)
        assert mounted.returncode == 0, f"root could not mount a read-only tmpfs: {mounted.stderr}"
        undo = ["umount", str(ro)]
    else:
        ro.chmod(0o555)
        undo = ["chmod", "755", str(ro)]
    try:
        _refused(capsys, ["train", *ONE, "--out", str(ro / "run")], "is not writable")
        _refused(capsys, ["train", *ONE, "--out", str(tmp_path / "w"), "--checkpoint-dir", str(ro / "ckpt")],
                 "--checkpoint-dir", "is not writable")
    finally:
        subprocess.run(undo, check=True)


def test_lock_on_out_names_a_live_run_and_takes_over_a_stale_one(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".shardwise-lock"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid}))
        _refused(capsys, ["train", *ONE, "--out", str(run)], f"host {socket.gethostname()}", f"PID {live.pid}")
    finally:
        live.kill()
        live.wait()
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242}))
    _refused(capsys, ["train", *ONE, "--out", str(run)], "host node-elsewhere", "PID 4242", str(lock))
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "job": "77"}))
    with mock.patch.dict(os.environ, {"SLURM_JOB_ID": "77"}):  # the same job, requeued onto another node
        _starts(["train", *ONE, "--out", str(run)])
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid}))  # that run is gone: stale
    _starts(["train", *ONE, "--out", str(run)])
    assert json.loads(lock.read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}


def test_free_space_against_the_checkpoint_size(tmp_path, capsys):
    usage = mock.Mock(return_value=mock.Mock(free=1000))
    with mock.patch("shardwise.training.preflight.shutil.disk_usage", usage):
        _refused(capsys, ["train", *ONE, "--out", str(tmp_path / "r")], "one checkpoint of this run needs",
                 "1000 B free")
        _starts(["train", *ONE, "--out", str(tmp_path / "r2"), "--no-checkpoint"])  # nothing to save


def _fake_checkpoint(root, model: ModelConfig, tokenizer="byte"):
    """A step-2 directory the pre-rank check accepts as intact (manifest, meta.json, .metadata at their sizes)."""
    step = root / "step-2"
    step.mkdir(parents=True)
    meta = {"format": 1, "step": 2, "optimizer_step": 2, "layout": {}, "model": dataclasses.asdict(model),
            "optimizer": "adamw", "extra_state": {"tokenizer": {"source": tokenizer, "eos_id": None}}}
    (step / "meta.json").write_text(json.dumps(meta))
    (step / ".metadata").write_bytes(b"x")
    files = {n: {"bytes": (step / n).stat().st_size, "sha256": ""} for n in ("meta.json", ".metadata")}
    (step / "manifest.json").write_text(json.dumps({"format": 1, "step": 2, "files": files}))
    (root / "latest").write_text("step-2\n")


def test_resume_of_another_model_names_the_first_mismatch(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_checkpoint(run / "checkpoints", ModelConfig())
    line = _refused(capsys, ["train", *ONE, "--out", str(run), "--resume", "--model", "small", "--steps", "4"],
                    "step-2 was saved from another model", "tok_embeddings.weight has shape (257, 96), "
                    "the model needs (257, 256)")
    assert line.startswith("shardwise train: error: --resume:")
    _refused(capsys, ["train", *ONE, "--out", str(run), "--resume", "--model", "tiny-moe", "--steps", "4"],
             "moe_experts 0 there")
    _starts(["train", *ONE, "--out", str(run), "--resume", "--steps", "4"])  # the same model resumes


def test_lr_negative_exponent_is_one_line(capsys):
    _refused(capsys, ["train", *ONE, "--lr", "-1e-3"], "--lr -0.001 must be a non-negative number")


def _safetensors(path):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64, 64)}, str(path))
    return path


def test_truncated_safetensors_is_one_line(tmp_path):
    from shardwise.hf.weights import check_weight_files, safetensors_problem

    whole = _safetensors(tmp_path / "model.safetensors")
    assert safetensors_problem(str(whole)) is None
    check_weight_files(str(tmp_path), "--init-from-hf")
    size = whole.stat().st_size
    os.truncate(whole, size - 100)
    with pytest.raises(ConfigError, match=rf"--init-from-hf {tmp_path}: model.safetensors has {size - 100} bytes, "
                                          rf"its header says {size} \(truncated\)"):
        check_weight_files(str(tmp_path), "--init-from-hf")
    os.truncate(whole, 4)
    assert "no header" in safetensors_problem(str(whole))


def test_missing_safetensors_names_the_extra(tmp_path, capsys):
    with mock.patch.dict(sys.modules, {"safetensors": None}):
        assert main(["hf-export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'shardwise[hf]'" in err[0], err


def test_export_and_prepare_into_a_path_under_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    text = tmp_path / "t.txt"
    text.write_text("hello world\n")
    assert main(["hf-export", str(tmp_path / "ckpt"), str(f / "out")]) == 2
    assert main(["prepare-data", str(text), "--out", str(f / "d"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("is a file, not a directory" in line for line in err), err


def _failing_writer(code: int, step: int):
    """DCP's file writer failing with `code` for the checkpoint of `step` (the disk filling mid-save)."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def write_item(transforms, stream, *args, **kwargs):
        if f"tmp-step-{step}" in str(getattr(stream, "name", "")):
            raise OSError(code, os.strerror(code), stream.name)
        return real(transforms, stream, *args, **kwargs)

    return mock.patch.object(fs, "_write_item", write_item)


@pytest.mark.slow  # a whole (one-rank) train run
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_save_the_filesystem_refuses_is_one_line(tmp_path, capsys, code):
    run = tmp_path / "run"
    with _failing_writer(code, 2):
        assert main(["train", *ONE, "--steps", "2", "--save-every", "1", "--out", str(run)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("train step=")]
    ckpts = run / "checkpoints"
    assert len(err) == 1 and "checkpoint step-2 was not saved: " + os.strerror(code) in err[0], err
    assert f"the partial tmp-step-2 was removed; {ckpts / 'step-1'} is intact" in err[0], err
    assert sorted(os.listdir(ckpts)) == ["latest", "step-1"]
    assert (ckpts / "latest").read_text() == "step-1\n"


@pytest.mark.slow
def test_debug_keeps_the_traceback(tmp_path):
    with _failing_writer(errno.ENOSPC, 1), pytest.raises(BaseException) as e:
        main(["train", *ONE, "--steps", "1", "--out", str(tmp_path / "run"), "--debug"])
    assert "No space left on device" in str(e.value) and type(e.value).__name__ != "SaveFailed"


@pytest.mark.slow
def test_a_full_disk_on_two_ranks_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    with _failing_writer(errno.ENOSPC, 2):  # the forked ranks inherit the patch
        code = main(["train", *ONE[4:], "--dp", "2", "--tp", "1", "--steps", "2", "--save-every", "1",
                     "--out", str(run)])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("train step=")]
    assert code == 2 and len(err) == 1, (code, err)  # as on one rank: the ranks' one line, exit 2
    assert err[0].startswith("shardwise train: error: checkpoint step-2 was not saved: No space left on device"), err
    assert "step-1 is intact" in err[0]
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step-1"]
