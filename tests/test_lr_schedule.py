"""LR schedules and AdamW flags: every schedule's shape, warm-up honoured exactly, min-lr defaults to lr/10
(the fine-tune LR never climbs), flags/TOML/--print-config agree, and the optimizer receives the values."""
import math

import pytest
import torch

from shardwise.cli import build_parser, config_from_args
from shardwise.config import ConfigError, TrainConfig
from shardwise.config.schedule import lr_plan
from shardwise.training.trainer import lr_at

from test_cli import Launched, main_without_ranks


def _cfg(argv):
    return config_from_args(build_parser().parse_args(["train", "--dp", "1", "--tp", "1", *argv]), None)


def _lrs(cfg, n=None):
    return [lr_at(s, cfg) for s in range(n or cfg.steps)]


def test_every_schedule_shape():
    lrs = _lrs(_cfg(["--steps", "100", "--lr", "1e-3", "--warmup-steps", "10"]))
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == 1e-3  # warm-up reaches lr on its last step
    assert lrs[-1] == pytest.approx(1e-4, abs=1e-15)  # cosine ends exactly at min-lr = lr/10 on the last step
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    mid = 10 + (99 - 10) / 2  # cosine's midpoint is the mean of lr and min-lr
    assert lr_at(math.ceil(mid), _cfg(["--steps", "100", "--lr", "1e-3", "--warmup-steps", "11"])) == \
        pytest.approx(5.5e-4)
    lin = _lrs(_cfg(["--steps", "21", "--lr", "1", "--min-lr", "0", "--warmup-steps", "1", "--lr-schedule", "linear"]))
    assert lin[1:] == pytest.approx([1 - k / 19 for k in range(20)])
    wsd = _lrs(_cfg(["--steps", "100", "--lr", "1", "--min-lr", "0.1", "--warmup-steps", "5", "--lr-schedule", "wsd",
                     "--wsd-decay-fraction", "0.2"]))
    assert wsd[4:80] == [1.0] * 76 and wsd[-1] == pytest.approx(0.1) and wsd[80] < 1.0
    assert wsd[79:] == sorted(wsd[79:], reverse=True)
    const = _lrs(_cfg(["--steps", "30", "--lr", "2e-4", "--warmup-steps", "3", "--lr-schedule", "constant"]))
    assert const[2:] == [2e-4] * 28


def test_warmup_is_honoured_and_finetune_lr_never_climbs():
    cfg = _cfg(["--steps", "200", "--warmup-steps", "50"])  # the old CLI capped this at steps/10 = 20
    assert cfg.warmup_steps == 50 and lr_at(49, cfg) == cfg.lr and lr_at(48, cfg) < cfg.lr
    ft = _cfg(["--steps", "200", "--lr", "1e-5"])  # min-lr was a fixed 3e-4: the LR climbed 30x
    assert max(_lrs(ft)) == 1e-5 and lr_at(199, ft) == pytest.approx(1e-6)
    assert lr_plan(ft)["warmup_steps"] == 20 and lr_plan(_cfg(["--steps", "30"]))["warmup_steps"] == 3


def test_decay_steps_shorter_than_steps_holds_min_lr():
    cfg = _cfg(["--steps", "50", "--lr-decay-steps", "20", "--warmup-steps", "2"])
    lrs = _lrs(cfg)
    assert lrs[19] == pytest.approx(cfg.lr / 10) and lrs[19:] == [lrs[19]] * 31


@pytest.mark.parametrize("argv, message", [
    (["--min-lr", "0.01", "--lr", "0.001"], "--min-lr 0.01 must be in [0, --lr 0.001]"),
    (["--warmup-steps", "200"], "--warmup-steps 200 must be below the schedule's length 200"),
    (["--warmup-steps", "10", "--lr-decay-steps", "10"], "valid: 0..9"),
    (["--lr-decay-steps", "0"], "--lr-decay-steps 0 must be a positive integer"),
    (["--lr-schedule", "step"], "--lr-schedule 'step' is unknown; valid: cosine, linear, wsd, constant"),
    (["--wsd-decay-fraction", "1.5"], "--wsd-decay-fraction 1.5 must be in (0, 1]"),
    (["--lr-schedule", "wsd", "--warmup-steps", "190"], "exceed the schedule's length 200"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1 must be a non-negative number"),
    (["--grad-clip", "-1"], "--grad-clip -1.0 must be a non-negative max grad norm"),
    (["--adam-betas", "0.9"], "--adam-betas '0.9' must be two numbers"),
    (["--adam-betas", "0.9,1.0"], "--adam-betas 0.9,1.0 must both be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps 0.0 must be a positive number"),
    (["--lr", "-1"], "--lr -1.0 must be a non-negative number"),
])
def test_bad_optimizer_flags_exit_2_with_one_line(argv, message, capsys):
    assert main_without_ranks(["train", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_toml_and_print_config_carry_the_optimizer_keys(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('lr = 1e-4\nlr-schedule = "wsd"\nmin-lr = 1e-5\nwarmup-steps = 7\nlr-decay-steps = 150\n'
                    'wsd-decay-fraction = 0.3\nweight-decay = 0.05\ngrad-clip = 0\nadam-betas = [0.8, 0.99]\n'
                    'adam-eps = 1e-6\n')
    assert main_without_ranks(["train", "--config", str(path), "--print-config"]) == 0
    printed = capsys.readouterr().out
    for line in ('lr-schedule = "wsd"', "min-lr = 1e-05", "warmup-steps = 7", "lr-decay-steps = 150",
                 "wsd-decay-fraction = 0.3", "weight-decay = 0.05", "grad-clip = 0.0", 'adam-betas = "0.8,0.99"',
                 "adam-eps = 1e-06"):
        assert line in printed.splitlines(), (line, printed)
    again = tmp_path / "again.toml"
    again.write_text(printed)
    assert main_without_ranks(["train", "--config", str(again), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    assert "# min-lr = " in _printed_defaults(capsys)


def _printed_defaults(capsys):
    assert main_without_ranks(["train", "--print-config"]) == 0
    return capsys.readouterr().out


def test_optimizer_receives_weight_decay_betas_eps():
    """Single device, ZeRO 0: AdamW's param groups hold the flags' values (no decay on norms)."""
    from shardwise.mesh import Mesh
    from shardwise.training.trainer import Trainer

    cfg = _cfg(["--steps", "2", "--seq-len", "16", "--micro-batch", "1", "--weight-decay", "0.03",
                "--adam-betas", "0.8,0.9", "--adam-eps", "1e-5", "--grad-clip", "0"])
    trainer = Trainer(cfg, Mesh.single(torch.device("cpu")))
    groups = trainer.reducer.optimizer.param_groups
    assert {g["betas"] for g in groups} == {(0.8, 0.9)} and {g["eps"] for g in groups} == {1e-5}
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.03]
    rec = trainer.train_step(0)
    assert rec["lr"] == lr_at(0, cfg)


def test_interleaved_without_vp_means_two_chunks_and_help_shows_defaults(capsys):
    assert _cfg(["--pp", "2", "--schedule", "interleaved", "--microbatches", "4"]).parallel.vp == 2
    assert _cfg(["--pp", "2", "--microbatches", "4"]).parallel.vp == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: cosine)" in text and "(default: 0.9,0.95)" in text and "(default: 200)" in text


def test_pp_with_fewer_microbatches_than_stages_warns(capsys, tmp_path):
    with pytest.raises(Launched):
        main_without_ranks(["train", "--pp", "2", "--dp", "1", "--tp", "1", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert "warning: 1 microbatch(es) per step for 2 pipeline stages" in err
    with pytest.raises(Launched):
        main_without_ranks(["train", "--pp", "2", "--dp", "1", "--tp", "1", "--microbatches", "2",
                            "--out", str(tmp_path / "x")])
    assert "warning" not in capsys.readouterr().err


def test_library_defaults_resolve():
    cfg = TrainConfig(steps=3)
    assert lr_plan(cfg) == {"lr_schedule": "cosine", "lr": 3e-3, "min_lr": 3e-3 / 10, "warmup_steps": 1,
                            "lr_decay_steps": 3, "wsd_decay_fraction": 0.2}
    with pytest.raises(ConfigError, match="--warmup-steps 3 must be below"):
        TrainConfig(steps=3, warmup_steps=3).resolve_world()
