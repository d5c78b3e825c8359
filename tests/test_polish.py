"""What a new user meets first, said plainly: prepare-data's progress in a log file, the README's quick-start
verify without a warning, plan's columns and SP state explained, a model train would refuse marked as such in
plan's rows and --json, --model-config's help naming every model_type the reader accepts, and the layout a
torchrun job gets with no layout flag."""
import io
import json

import pytest

from shardwise import cli
from shardwise.config.args import DEFAULT_LAYOUT, degrees
from shardwise.data.prepare import Progress, prepare_data
from shardwise.rules.hf_types import model_types
from shardwise.rules.validation import REST


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_plain_lines_off_a_terminal():
    log = io.StringIO()
    shown = Progress(every_s=0, stream=log)
    shown.update(100, 3)
    shown.update(50, 2)
    shown.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2
    assert lines[-1].startswith("prepare-data documents=5 tokens=150 tokens_per_s=")
    quiet = io.StringIO()
    Progress(enabled=False, every_s=0, stream=quiet).update(10, 1)
    assert quiet.getvalue() == ""
    tty = _Terminal()
    bar = Progress(every_s=0, stream=tty)
    bar.update(100, 3)
    bar.close()
    assert "\r" in tty.getvalue() and "documents=" not in tty.getvalue()  # a bar, not lines


def test_prepare_data_writes_no_carriage_return_into_a_log(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello world\n" * 50)
    prepare_data([str(src)], "byte", str(tmp_path / "out"))  # progress on, stderr captured: not a terminal
    assert "\r" not in capsys.readouterr().err


def _cfg(*argv):
    return cli.config_from_args(cli.build_parser().parse_args(list(argv)), None)


def test_quick_start_verify_runs_enough_microbatches_for_its_pipeline():
    """The README's `verify --model tiny --tp 2 --pp 2` must not warn (microbatches >= pp); train keeps its one."""
    cfg = _cfg("verify", "--model", "tiny", "--tp", "2", "--pp", "2")
    assert cfg.grad_accum >= cfg.parallel.pp == 2
    assert _cfg("verify", "--pp", "2", "--schedule", "dualpipev").grad_accum == 4
    assert _cfg("verify", "--pp", "2", "--microbatches", "3").grad_accum == 3
    assert _cfg("verify", "--pp", "2", "--global-batch", "4").global_batch == 4
    assert _cfg("verify", "--tp", "2").global_batch is None
    assert _cfg("train", "--pp", "2").grad_accum == 1


def test_layout_with_no_layout_flag():
    args = cli.build_parser().parse_args(["train"])
    assert degrees(args, None) == {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1} == {"pp": 1, "cp": 1, "ep": 1} | DEFAULT_LAYOUT
    assert degrees(args, 4) == {"dp": REST, "tp": 1, "pp": 1, "cp": 1, "ep": 1}  # torchrun: dp is its world


def test_model_config_help_names_every_model_type_read():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    helps = {name: next(a.help for a in p._actions if "--model-config" in a.option_strings)
             for name, p in sub.items() if name in ("train", "verify", "plan")}
    for text in helps.values():
        assert all(t in text for t in model_types()), text
    assert "gpt2" in helps["plan"] and "gpt2" not in helps["train"]


TINY = ["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "256", "--global-batch", "16"]


def test_plan_header_and_legend_say_what_the_rows_run(capsys):
    assert cli.main([*TINY, "--top", "3", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert all(not r.rstrip().endswith(" sp") for r in rows)
    assert "SP off (it needs tp > 1)" in out and "SP on" not in out
    assert "mN: microbatches per step" in out and "dp_cp: gradient reduction over dp×cp" in out
    assert "edp" not in out and "train" not in out.split("\n")[3]  # dense: no expert axis; every row trains
    assert cli.main([*TINY, "--top", "40", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    if any(r.rstrip().endswith(" sp") for r in rows) and not all(r.rstrip().endswith(" sp") for r in rows):
        assert "SP on where tp > 1 (rows marked sp)" in out and "sp: sequence parallelism" in out


def test_plan_explains_hybrid_sharding_and_expert_axes(capsys):
    base = ["plan", "--model", "llama3-8b", "--gpus", "16", "--zero", "3", "--dp-shard", "1", "--top", "2"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert " hs1" in out and "hsN: hybrid sharding" in out and "dp_replicate: gradient all-reduce" in out
    assert cli.main(["plan", "--model", "llama3-8b", "--gpus", "16", "--explain", "dp=2,tp=8"]) == 0
    assert "edp" not in capsys.readouterr().out  # a dense model has no expert gradients to mention
    assert cli.main(["plan", "--model", "tiny-moe", "--gpus", "8", "--seq-len", "256", "--explain", "dp=8,ep=2"]) == 0
    assert "(edp: expert gradients over the dp×cp ranks left once ep is carved out)" in capsys.readouterr().out


def test_plan_marks_a_model_train_refuses(tmp_path, capsys):
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300}))
    argv = ["plan", "--model-config", str(gpt2), "--gpus", "2", "--seq-len", "64", "--top", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("! shardwise train has no model_type 'gpt2'")
    head = next(line for line in out if line.lstrip().startswith("#"))
    assert head.rstrip().endswith("train")
    rows = [line for line in out if line[:3].strip().isdigit()]
    assert rows and all(r.rstrip().endswith(" no") for r in rows)
    assert cli.main([*argv, "--json"]) == 0
    for row in json.loads(capsys.readouterr().out):
        assert row["trainable"] is False and row["command"] is None and "gpt2" in row["untrainable"]
    assert cli.main([*argv, "--explain", "dp=2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable"] is False
    assert cli.main([*TINY, "--top", "2", "--json"]) == 0
    assert all(r["trainable"] for r in json.loads(capsys.readouterr().out))


@pytest.mark.parametrize("mt", ["bert"])
def test_unsupported_model_type_names_the_same_list(tmp_path, mt):
    from shardwise.config import ConfigError
    from shardwise.hf.config import config_from_hf

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": mt}))
    with pytest.raises(ConfigError, match=", ".join(model_types())):
        config_from_hf(str(path))
