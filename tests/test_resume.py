"""Crash, resume, lose nothing: bitwise-equal losses on the same layout, parity on another layout."""
import functools
import json
import shutil

import pytest

from shardwise.training import launch as launch

from _dist import run_ranks, run_ranks_to_a_crash


def shardwise(capfd, *args) -> tuple[int, str]:
    """`shardwise <args>` run by the CLI's own `main` in this process, its ranks forked from it (no interpreter
    start, and the ranks inherit the warm parent): (exit status, everything the run wrote to stderr)."""
    from shardwise.cli import main

    capfd.readouterr()
    code = main(list(args))
    return code, capfd.readouterr().err


def losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _parse(argv):
    """The TrainConfig `shardwise <argv>` would run."""
    from shardwise.cli import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(argv), None)


@pytest.fixture(scope="module", autouse=True)
def _warm_parent(tmp_path_factory):
    """One single-device step in this process first: forked ranks inherit torch's lazy first-use setup
    instead of paying it each (measured ~10 CPU-s per 4-rank fork cold, ~3 warm)."""
    import torch

    from shardwise.mesh import Mesh
    from shardwise.training.trainer import Trainer

    cfg = _parse(["train", "--model", "tiny-moe", "--steps", "1", "--seq-len", "32", "--micro-batch", "1",
                  "--no-progress", "--no-report", "--out", str(tmp_path_factory.mktemp("warm"))])
    Trainer(cfg, Mesh.single(torch.device("cpu"))).train_step(0)


def _train_each(cfgs):
    """Inside ranks: `train_main` for each config in turn — the CLI's run, in forked ranks."""
    from shardwise.training.loop import train_main

    for cfg in cfgs:
        train_main(cfg)


def test_crash_then_resume_equals_uninterrupted(tmp_path, capfd, monkeypatch):
    common = ["train", "--steps", "8", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "4",
              "--no-progress", "--no-report"]
    full = tmp_path / "full"
    assert shardwise(capfd, *common, "--out", str(full))[0] == 0
    run = tmp_path / "run"
    with monkeypatch.context() as m:  # the survivors' own reports are not read here: no 5 s wait for them
        m.setattr(launch, "run_local", functools.partial(launch.run_local, grace_s=0.5))
        code, err = shardwise(capfd, *common, "--out", str(run), "--save-every", "2", "--keep", "2",
                              "--fault-inject", "1:6:crash")
    assert code != 0 and "rank 1 died" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]
    saved = tmp_path / "saved"
    shutil.copytree(run / "checkpoints", saved)
    code, err = shardwise(capfd, *common, "--out", str(run), "--save-every", "2", "--resume")
    assert code == 0, err
    assert "resuming from" in err and "step-4" in err, err
    assert losses(run) == losses(full)  # bitwise: same layout, RNG and data position restored

    # The same step-4 checkpoint resumed under other layouts continues the run within parity tolerance.
    for name, layout in (("tp4", ["--tp", "4"]), ("dp2_zero1", ["--dp", "2", "--zero", "1"])):
        other = tmp_path / name
        code, err = shardwise(capfd, *common, *layout, "--out", str(other), "--checkpoint-dir", str(saved),
                              "--resume", "--no-checkpoint")  # both resume the same step-4: neither saves into `saved`
        assert code == 0, err
        assert losses(other) == pytest.approx(losses(full)[4:], rel=1e-5), name


def test_damaged_checkpoints_fall_back(tmp_path, capfd):
    """A truncated checkpoint is passed over before any rank starts (sizes only: no checksums there, which for
    a 671B model would read terabytes in one process); one with a flipped byte at its full size is caught by the
    ranks' split checksum. Both are named in one line each, and the resume takes the older intact one; with
    every checkpoint damaged, one line says so."""
    run = tmp_path / "run"
    common = ["train", "--steps", "6", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "4",
              "--no-progress", "--no-report",
              "--out", str(run), "--save-every", "2"]
    assert shardwise(capfd, *common)[0] == 0
    ckpts = run / "checkpoints"

    def data_file(step):
        return next(p for p in sorted((ckpts / f"step-{step}").iterdir()) if p.suffix == ".distcp")

    def flip_byte(step):
        victim = data_file(step)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))

    victim = data_file(6)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    flip_byte(4)
    code, err = shardwise(capfd, *common, "--resume")
    assert code == 0, err
    skipped = [line for line in err.splitlines() if "skipped checkpoint" in line]
    assert len(skipped) == 2 and "step-6" in skipped[0] and "truncated" in skipped[0], err
    assert "step-4" in skipped[1] and "sha256" in skipped[1], err
    assert "step-2" in err.split("resuming from")[1]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-4:] == [3, 4, 5, 6]
    for step in (2, 4, 6):
        flip_byte(step)  # step-6 and step-4 as they were resaved, step-2 newly
    code, err = shardwise(capfd, *common, "--steps", "8", "--resume")
    assert code == 2, err
    line = err.strip().splitlines()
    assert len(line) == 1 and "no intact checkpoint" in line[0] and "step-2" in line[0] and "sha256" in line[0] and "--overwrite" in line[0], err


def _load_moe_then_step(path, cfgs):
    """Inside ranks: for each (cfg, drop_bias) load checkpoint `path` (resharding as needed) and run the
    next step. Returns (largest |expert_bias − saved bias| over this rank's routers, whether it holds every
    saved router's bias, the restored step (= data position), next step's loss)."""
    import torch

    from shardwise.checkpoint import load_checkpoint, load_global_tensors
    from shardwise.checkpoint.boxes import persistent_buffers
    from shardwise.training.trainer import Trainer, make_mesh

    saved = load_global_tensors(path, prefix="buffer.")
    out = []
    for cfg, drop_bias in cfgs:
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        info = load_checkpoint(path, trainer)
        bias = {n: b for n, _, b in persistent_buffers(trainer.model) if n.endswith("expert_bias")}
        diff = max(float((b - saved[n]).abs().max()) for n, b in bias.items())
        every = set(bias) == {n for n in saved if n.endswith("expert_bias")} and len(bias) > 0
        if drop_bias:  # the control: what the step would see had the bias not been restored
            for b in bias.values():
                b.zero_()
        out.append((diff, every, info["step"], trainer.train_step(info["step"])["loss"]))
    return out


def test_moe_bias_resume_bitwise_and_reshard(tmp_path):
    """The router's expert_bias (a persistent buffer) is checkpointed: dp2×ep2 with bias updates resumes
    bitwise, and the dp2×ep2 checkpoint loaded at dp4×ep4 and dp4×ep1 restores every router's bias
    exactly and continues the run (next loss within layout rounding; with the bias dropped it is not).
    One global microbatch per step in every layout, so the per-microbatch aux loss sees the same tokens."""
    from shardwise.training.launch import RankError

    common = ["train", "--model", "tiny-moe", "--moe-bias-update-rate", "0.01", "--steps", "6", "--seq-len", "64",
              "--global-batch", "4", "--no-progress", "--no-report"]
    dp2ep2 = [*common, "--dp", "2", "--ep", "2", "--micro-batch", "2"]
    run_ranks(2, _train_each, [_parse([*dp2ep2, "--out", str(tmp_path / "full")])])
    full = losses(tmp_path / "full")
    run = tmp_path / "run"
    saving = [*dp2ep2, "--out", str(run), "--save-every", "3"]
    with pytest.raises(RankError, match="rank 1 died"):
        run_ranks_to_a_crash(2, _train_each, [_parse([*saving, "--fault-inject", "1:4:crash"])])
    run_ranks(2, _train_each, [_parse([*saving, "--resume"])])
    assert losses(run) == full

    step3 = str(run / "checkpoints" / "step-3")
    dp4 = [*common, "--dp", "4", "--micro-batch", "1"]
    cfgs = [(_parse([*dp4, "--ep", "4"]), False), (_parse(dp4), False), (_parse([*dp4, "--ep", "4"]), True)]
    results = run_ranks(4, _load_moe_then_step, step3, cfgs)
    for rank in results:
        for diff, every, step, _ in rank:
            assert diff == 0.0 and every and step == 3, rank
    (_, _, _, ep4), (_, _, _, ep1), (_, _, _, dropped) = results[0]
    assert ep4 == pytest.approx(full[3], abs=2e-6) and ep1 == pytest.approx(full[3], abs=2e-6), (ep4, ep1, full)
    assert abs(dropped - full[3]) > 1e-5, (dropped, full)


# Crash and --resume on each layout with its own state to restore: pipeline schedules (1f1b, and zb's
# deferred weight gradients), ring attention, ZeRO-1's sharded AdamW state. Residual dropout (and
# attention dropout on tp×pp) makes every RNG stream count. Ranks are forked from this process (no
# interpreter start per run): the uninterrupted references of all layouts train in one fork, then per
# layout one fork crashes at step 3 and one fresh fork resumes from step-2 — what `--resume` runs.
RESUME_COMMON = ["train", "--steps", "4", "--seq-len", "32", "--micro-batch", "1", "--global-batch", "4",
                 "--dropout", "0.1", "--no-progress", "--no-report"]
RESUME_LAYOUTS = {
    "tp2_pp2_1f1b": ["--tp", "2", "--pp", "2", "--attn-dropout", "0.1"],
    "tp2_pp2_zb": ["--tp", "2", "--pp", "2", "--schedule", "zb"],
    "cp2_ring_dp2": ["--cp", "2", "--dp", "2", "--cp-impl", "ring"],
    "dp2_tp2_zero1": ["--dp", "2", "--tp", "2", "--zero", "1"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    cfgs = [_parse([*RESUME_COMMON, *layout, "--out", str(root / name)]) for name, layout in RESUME_LAYOUTS.items()]
    run_ranks(4, _train_each, cfgs, timeout_s=300)
    return {name: losses(root / name) for name in RESUME_LAYOUTS}


@pytest.mark.parametrize("name", list(RESUME_LAYOUTS))
def test_crash_then_resume_bitwise_per_layout(name, tmp_path, uninterrupted):
    from shardwise.training.launch import RankError

    argv = [*RESUME_COMMON, *RESUME_LAYOUTS[name], "--out", str(tmp_path), "--save-every", "2"]
    with pytest.raises(RankError, match="rank 1 died"):
        run_ranks_to_a_crash(4, _train_each, [_parse([*argv, "--fault-inject", "1:3:crash"])])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-2"]
    run_ranks(4, _train_each, [_parse([*argv, "--resume"])])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # data position: batches 3 and 4 follow step 2
    assert [row["loss"] for row in rows] == uninterrupted[name], name
