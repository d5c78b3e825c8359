"""One source of truth for plan and train: the same model specs and flags, and plan rows that run as printed.

* `shardwise.config`, `shardwise.rules.partition`, `shardwise.hf.config` and the planner import no torch (checked
  in a fresh interpreter, validation and plan-with-commands included).
* The planner's presets are the trainer's `MODEL_PRESETS` by construction (`ModelSpec` subclasses
  `ModelConfig`); an HF config.json is read by the trainer's reader for both.
* Every plan knob is a train flag of the same name; each row's command parses back (through train's own
  parser) to the row's layout, and `--explain` takes train flags.
* The top 3 rows of a tiny 4-GPU plan run as printed (`--steps 2 --device cpu ...` appended): measured
  static bytes equal the row's exactly, activation bytes within 10%.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys

import pytest

from shardwise import cli
from shardwise.config import MODEL_PRESETS, ModelConfig
from shardwise.hf.config import config_from_hf
from shardwise.planner import PRESETS, ModelSpec, load_hf_config
from shardwise.commands.train_command import parse_train_flags
from shardwise.planner.layout import Layout

TINY_PLAN = ["plan", "--model", "tiny", "--gpus", "4", "--gpus-per-node", "4", "--seq-len", "128",
             "--global-batch", "8", "--json"]
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 256}


def _plan(capsys, argv) -> list[dict] | dict:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_config_and_planner_import_no_torch(tmp_path):
    code = f"""
import sys
import shardwise.config, shardwise.rules.partition, shardwise.hf.config, shardwise.planner, shardwise.commands.plan
from shardwise.config import ParallelConfig, TrainConfig
cfg = TrainConfig(parallel=ParallelConfig(pp=2, cp=2, schedule="interleaved", vp=2), global_batch=8)
cfg.resolve_world()
from shardwise.cli import main
assert main({TINY_PLAN + ["--top", "2"]!r}) == 0
assert main(["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "128", "--explain", "--tp 2 --pp 2"]) == 0
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
loaded += sorted(m for m in sys.modules if m.startswith(("shardwise.models", "shardwise.pipeline.stage")))
print("TORCH", loaded)  # nor the model: config -> pipeline.stage -> model -> config was a circle
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "TORCH []"


def test_presets_agree_by_construction():
    assert issubclass(ModelSpec, ModelConfig)
    for name, cfg in MODEL_PRESETS.items():
        spec = PRESETS[name]
        assert spec == ModelSpec.of(cfg) and not spec.untrainable
        fields = [f.name for f in dataclasses.fields(ModelConfig)]
        assert {f: getattr(spec, f) for f in fields} == {f: getattr(cfg, f) for f in fields}, name
    assert set(PRESETS) == set(MODEL_PRESETS) and not [n for n, s in PRESETS.items() if s.untrainable]


def test_hf_config_one_reader(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    trained = config_from_hf(str(path))
    assert load_hf_config(path) == ModelSpec.of(trained)
    args = cli.build_parser().parse_args(["train", "--model-config", str(path), "--tp", "2", "--seq-len", "64"])
    assert cli.config_from_args(args, None).model_config() == trained
    rows = _plan(capsys, ["plan", "--model-config", str(path), "--gpus", "2", "--seq-len", "64", "--global-batch", "4",
                          "--json", "--top", "1"])
    assert shlex.split(rows[0]["command"])[2:4] == ["--model-config", str(path)] and rows[0]["command_refused"] is None
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300}))
    rows = _plan(capsys, ["plan", "--model-config", str(gpt2), "--gpus", "2", "--seq-len", "64", "--json", "--top", "1"])
    assert rows[0]["command"] is None and "model_type 'gpt2'" in rows[0]["untrainable"]


PLAN_KNOBS = ("--model", "--model-config", "--zero", "--recompute", "--sequence-parallel", "--no-sequence-parallel",
              "--dtype", "--micro-batch", "--global-batch", "--seq-len", "--schedule", "--vp", "--cp-impl",
              "--fp32-residual", "--no-fp32-residual", "--grad-reduce-dtype")


def test_every_plan_knob_is_a_train_flag():
    parser = cli.build_parser()
    train = {s for a in parser._sw_runs["train"]._actions for s in a.option_strings}
    plan = {s for a in parser._subparsers._group_actions[0].choices["plan"]._actions for s in a.option_strings}
    assert set(PLAN_KNOBS) <= plan & train


@pytest.mark.parametrize("argv,gpus,layers", [
    (["--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192", "--global-batch", "512", "--zero", "3",
      "--recompute", "full", "--uneven-pp", "--max-cp", "2"], 64, 80),
    (["--model", "tiny-moe", "--gpus", "8", "--gpus-per-node", "8", "--seq-len", "256", "--global-batch", "16",
      "--dtype", "fp32", "--no-sequence-parallel", "--cp-impl", "ulysses", "--schedule", "zb,dualpipev,interleaved"],
     8, 8),
])
def test_commands_spell_out_the_row(capsys, argv, gpus, layers):
    rows = _plan(capsys, ["plan", *argv, "--json", "--top", "30"])
    for r in rows:
        cmd, lay = shlex.split(r["command"]), Layout.from_dict(r["layout"])
        head = ["torchrun", "--nnodes", "8", "--nproc-per-node", "8"] if gpus == 64 else ["shardwise", "train"]
        assert cmd[:len(head)] == head
        parsed, wl = parse_train_flags(r["command"], gpus, None, argv[1], layers)
        assert parsed == lay, r["command"]
        assert (wl["precision"], wl["seq_len"]) == ("fp32" if "fp32" in argv else "bf16", int(argv[argv.index("--seq-len") + 1]))
        assert ("--pp-layers" in cmd) == bool(layers % (lay.pp * lay.vp))
    assert gpus == 8 or any("--pp-layers" in r["command"] for r in rows)  # --uneven-pp rows say how to split


def test_explain_takes_train_flags(capsys):
    base = ["plan", "--model", "tiny", "--gpus", "8", "--seq-len", "128", "--json"]
    est = _plan(capsys, base + ["--explain", "--dp 2 --tp 2 --pp 2 --schedule 1f1b"])
    assert {k: est["layout"][k] for k in ("dp", "tp", "pp", "mb", "m", "zero", "recompute", "sp")} == \
        dict(dp=2, tp=2, pp=2, mb=4, m=1, zero=0, recompute="none", sp=False)  # train's defaults for the rest
    row = _plan(capsys, base + ["--global-batch", "16", "--top", "1"])[0]
    again = _plan(capsys, base + ["--explain", row["command"]])
    for key in ("layout", "static_bytes_per_rank", "activation_bytes_per_rank", "step_time_s", "command"):
        assert again[key] == row[key], key
    longer = _plan(capsys, base + ["--explain=--dp 2 --tp 2 --pp 2 --seq-len=256"])  # the = form counts too
    assert longer["activation_bytes_per_rank"] > est["activation_bytes_per_rank"]
    for flags, why in (("--tp 2 --bogus 1", "unrecognized arguments: --bogus 1"),
                       ("--pp 2 --pp-scatter-gather", "--pp-scatter-gather is not modelled"),
                       ("--pp 2 --pp-layers 3,5", "--pp-layers 3,5 is not the planner's balanced split 4,4"),
                       ("--model small --tp 2", "model 'small' is not the plan's 'tiny'"),
                       ("--model=small --tp 2", "model 'small' is not the plan's 'tiny'"),
                       ("--tp 0 --pp 2", "--tp 0 must be a positive integer"),
                       ("--dp 0", "--dp 0 must be a positive integer (or -1)"),
                       ("--micro-batch 0", "--micro-batch 0 must be a positive integer")):
        assert cli.main(base + [f"--explain={flags}"]) == 2  # argparse would read "--model=…" as plan's flag
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err


def test_top_plan_rows_run_as_printed(tmp_path, capsys):
    """The top 3 rows of the tiny plan run as printed; their memory is what the rows predicted."""
    import torch

    with torch.device("meta"):  # warm torch's lazy imports (meta init pulls in dynamo) once, before forking
        torch.nn.Embedding(2, 2)
    rows = _plan(capsys, TINY_PLAN)[:3]
    for i, row in enumerate(rows):
        argv = shlex.split(row["command"])
        assert argv[:2] == ["shardwise", "train"] and row["command_refused"] is None
        out = tmp_path / f"row{i}"
        assert cli.main(argv[1:] + ["--steps", "2", "--device", "cpu", "--no-report", "--no-progress",
                                    "--out", str(out)]) == 0, row["command"]
        s = json.loads((out / "summary.json").read_text())
        assert s["static_bytes_measured"] == row["static_bytes_per_rank"], row["command"]
        ratio = s["activation_bytes_measured"] / row["activation_bytes_per_rank"]
        assert abs(ratio - 1) < 0.10, (row["command"], ratio)
