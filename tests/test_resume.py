"""Crash, resume, lose nothing: bitwise-equal losses on the same layout, parity on another layout."""
import json
import shutil
import subprocess
import sys

import pytest


def shardwise(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_crash_then_resume_equals_uninterrupted(tmp_path):
    common = ["train", "--steps", "8", "--seq-len", "64", "--global-batch", "8", "--no-progress"]
    full = tmp_path / "full"
    assert shardwise(*common, "--out", str(full)).returncode == 0
    run = tmp_path / "run"
    r = shardwise(*common, "--out", str(run), "--save-every", "2", "--keep", "2", "--fault-inject", "1:6:crash")
    assert r.returncode != 0 and "rank 1 died" in r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]
    saved = tmp_path / "saved"
    shutil.copytree(run / "checkpoints", saved)
    r = shardwise(*common, "--out", str(run), "--save-every", "2", "--resume")
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stderr and "step-4" in r.stderr
    assert losses(run) == losses(full)  # bitwise: same layout, RNG and data position restored

    # The same step-4 checkpoint resumed under other layouts continues the run within parity tolerance.
    for name, layout in (("tp4", ["--tp", "4"]), ("dp2_zero1", ["--dp", "2", "--zero", "1"])):
        other = tmp_path / name
        r = shardwise(*common, *layout, "--out", str(other), "--checkpoint-dir", str(saved), "--resume")
        assert r.returncode == 0, r.stderr
        assert losses(other) == pytest.approx(losses(full)[4:], rel=1e-5), name


def test_truncated_checkpoint_falls_back(tmp_path):
    run = tmp_path / "run"
    common = ["train", "--steps", "4", "--seq-len", "64", "--no-progress", "--out", str(run), "--save-every", "2"]
    assert shardwise(*common).returncode == 0
    newest = run / "checkpoints" / "step-4"
    victim = next(p for p in sorted(newest.iterdir()) if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    r = shardwise(*common, "--resume")
    assert r.returncode == 0, r.stderr
    assert "skipped checkpoint" in r.stderr and "step-4" in r.stderr and "resuming from" in r.stderr
    assert "step-2" in r.stderr.split("resuming from")[1]


def test_moe_bias_resume_bitwise(tmp_path):
    """The router's expert_bias (a persistent buffer) is checkpointed: dp2×ep2 with bias updates resumes bitwise."""
    common = ["train", "--model", "tiny-moe", "--dp", "2", "--ep", "2", "--moe-bias-update-rate", "0.01",
              "--steps", "6", "--no-progress"]
    assert shardwise(*common, "--out", str(tmp_path / "full")).returncode == 0
    run = tmp_path / "run"
    assert shardwise(*common, "--out", str(run), "--save-every", "3", "--fault-inject", "1:4:crash").returncode != 0
    r = shardwise(*common, "--out", str(run), "--save-every", "3", "--resume")
    assert r.returncode == 0, r.stderr
    assert losses(run) == losses(tmp_path / "full")
