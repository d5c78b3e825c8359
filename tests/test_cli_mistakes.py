"""A user's mistakes, driven as a user makes them: each exits 2 (a warning: 0) with one line and no traceback.

One Python process imports shardwise once and forks a child per case; each child runs the console entry point
(`shardwise.cli.main`, as `shardwise ...` does) with its own argv, environment and stdout/stderr files, so the
cases cost one interpreter start between them.
"""
import json
import subprocess
import sys
import textwrap

import pytest

DRIVER = textwrap.dedent("""
    import json, os, sys, traceback
    import shardwise.config.file, shardwise.training.launch  # imported once, before the forks
    from shardwise.cli import build_parser, main

    build_parser()  # and every subcommand's module

    results = []
    for i, (argv, env) in enumerate(json.loads(sys.argv[1])):
        out, err = f"case{i}.out", f"case{i}.err"
        pid = os.fork()
        if pid == 0:
            os.environ.update(env)
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        results.append({"code": code, "out": open(out).read(), "err": open(err).read()})
    print(json.dumps(results))
""")

TORCHRUN = {"WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"}
"""torchrun's environment for 3 processes, without MASTER_ADDR: a rank that reached a collective would fail."""

CASES = {
    "plan_gpus_no_layout_divides": (["plan", "--model", "llama3-8b", "--gpus", "1000"], {}),
    "plan_none_fits_in_memory": (["plan", "--model", "llama3-70b", "--gpus", "1"], {}),
    "flag_typo": (["train", "--stpes", "5"], {}),
    "config_key_typo": (["train", "--config", "typo.toml"], {}),
    "torchrun_world_rank0": (["train", "--tp", "2", "--steps", "1"], TORCHRUN | {"RANK": "0",
                                                                              "TORCHELASTIC_ERROR_FILE": "error.json"}),
    "torchrun_world_rank1": (["train", "--tp", "2", "--steps", "1"], TORCHRUN | {"RANK": "1", "LOCAL_RANK": "1"}),
    "schedule_without_pp": (["train", "--schedule", "1f1b", "--print-config"], {}),
    "print_config": (["train", "--print-config"], {}),
    "checkpoint_list_missing": (["checkpoint", "list", "runs/nope"], {}),
    "convert_onto_existing_file": (["checkpoint", "convert", "runs/nope", "--to-safetensors", "model.safetensors"], {}),
}


def _drive(cases: dict, cwd) -> dict:
    """Each case's {"code", "out", "err"}, run in order by one forked driver in `cwd`."""
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(list(cases.values()))], capture_output=True,
                       text=True, timeout=300, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return dict(zip(cases, json.loads(r.stdout)))


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    where = tmp_path_factory.mktemp("mistakes")
    (where / "typo.toml").write_text("stpes = 5\n")
    (where / "model.safetensors").write_text("the user's earlier export")
    results = _drive(CASES, where)
    results["error_file"] = (where / "error.json").read_text() if (where / "error.json").exists() else None
    results["untouched"] = (where / "model.safetensors").read_text() == "the user's earlier export"
    return results


def one_line(result: dict, code: int = 2) -> str:
    """The case's exit status is `code` and stderr is exactly one line, with no traceback: that line."""
    assert "Traceback" not in result["err"], result["err"]
    lines = result["err"].strip().splitlines()
    assert result["code"] == code and len(lines) == 1, result
    return lines[0]


def test_plan_says_which_gpu_counts_have_a_layout(ran):
    line = one_line(ran["plan_gpus_no_layout_divides"])
    assert line.startswith("shardwise plan: error: no layout divides 1000 GPUs and global batch 1024"), line
    assert "nearest GPU counts that have a layout: 512 or 1024" in line and "GB" not in line, line


def test_plan_none_fitting_in_memory_is_another_message(ran):
    line = one_line(ran["plan_none_fits_in_memory"], code=1)
    assert line.startswith("shardwise plan: no layout fits (4 valid layouts, none within 72 GB per GPU)"), line


def test_flag_typo_gets_the_subcommands_usage_and_a_suggestion(ran):
    r = ran["flag_typo"]
    assert r["code"] == 2 and "Traceback" not in r["err"]
    lines = r["err"].strip().splitlines()
    assert lines[0].startswith("usage: shardwise train "), lines[0]  # train's usage, not the top level's
    assert [x for x in lines if "error:" in x] == [lines[-1]]
    assert lines[-1] == "shardwise train: error: unrecognized arguments: --stpes 5; did you mean --steps?"


def test_config_key_typo_gets_a_suggestion(ran):
    line = one_line(ran["config_key_typo"])
    assert "unknown key 'stpes' (did you mean 'steps'?); valid keys:" in line, line


def test_torchrun_world_that_does_not_fit_the_layout(ran):
    """Rank 0 says it once, the others say nothing; every rank exits 2 before any collective, and torchrun's
    failure summary gets the line through its error file."""
    line = one_line(ran["torchrun_world_rank0"])
    assert line == "shardwise train: error: world size 3 is not divisible by pp=1 × cp=1 × tp=2 = 2", line
    assert ran["torchrun_world_rank1"]["code"] == 2 and ran["torchrun_world_rank1"]["err"] == ""
    assert json.loads(ran["error_file"])["message"] == line


def test_schedule_without_pipeline_warns(ran):
    line = one_line(ran["schedule_without_pp"], code=0)
    assert line == "shardwise train: warning: --schedule 1f1b has no effect without --pp > 1"
    assert ran["print_config"]["err"] == ""  # the default schedule is not a given flag


def test_print_config_shows_values_as_typed_and_no_internals(ran):
    out = ran["print_config"]["out"]
    assert "# min-lr = 0.0003  (default: --lr / 10)" in out
    assert "_head_dim_derived" not in out and "None" not in out and "\nschedule =" not in out
    assert "\nlr = 0.003\n" in out and "\nhead_dim = 12\n" in out


def test_checkpoint_list_of_a_missing_directory_is_an_error(ran):
    line = one_line(ran["checkpoint_list_missing"])
    assert line.startswith("shardwise checkpoint list: error: runs/nope is not a directory"), line
    assert ran["checkpoint_list_missing"]["out"] == ""  # no `[]` to mistake for an empty root


def test_checkpoint_convert_refuses_to_overwrite_without_the_flag(ran):
    line = one_line(ran["convert_onto_existing_file"])
    assert line == ("shardwise checkpoint convert: error: model.safetensors already exists; choose a new file or pass "
                    "--overwrite to replace it"), line
    assert ran["untouched"]


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "16", "--seq-len", "100000"],
     "no layout of llama3-8b can run this workload on any GPU count: seq_len=100000 exceeds max_seq_len=8192"),
    (["--gpus", "8", "--global-batch", "3", "--micro-batch", "2"], "global batch 3 is not divisible by micro-batch 2"),
    (["--gpus", "24"], "llama3-8b on 24 GPUs has dp 3, 6, 12, 24 (micro-batch 1, 2, 4, 8); nearest GPU counts that "
                       "have a layout: 16 or 32"),
])
def test_plan_says_why_no_layout_exists(argv, message, capsys):
    """The other diagnoses of an empty search, in process: the workload itself, or the micro-batch alone."""
    from shardwise.cli import main

    assert main(["plan", "--model", "llama3-8b", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise plan: error: ") and message in err[0], err


def _word_tokenizer(folder, n_ids: int) -> str:
    """A whitespace-split WordLevel tokenizer.json of `n_ids` words t0.. (the `tokenizers` library)."""
    import os

    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(n_ids)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return os.path.join(folder, "tokenizer.json")


def test_init_from_hf_mtp_and_tokenizer_mistakes(tmp_path):
    """A DeepSeek-V3 folder as transformers' save_pretrained writes it (num_nextn_predict_layers=1, no MTP tensors)
    with its own tokenizer: `--mtp-layers 1` alone and data of another tokenizer each exit 2 with one line;
    `--mtp-init fresh --allow-tokenizer-mismatch` trains (lr 0, one step), saying so once, and hf-export writes the
    checkpoint's weights unchanged and the MTP module exactly as training from scratch initialises it."""
    import os

    import torch

    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from shardwise.hf import weights as hf
    from shardwise.config import TrainConfig
    from shardwise.data.prepare import prepare_data
    from shardwise.hf.config import init_model_config
    from shardwise.mesh import Mesh
    from shardwise.parallelize import build_model

    config = json.loads((__import__("pathlib").Path(__file__).parent / "data" / "deepseek_tiny_config.json").read_text())
    config.pop("rope_parameters", None)
    torch.manual_seed(0)
    model_dir = str(tmp_path / "ds")
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).save_pretrained(model_dir)
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    assert not any(n.startswith("model.layers.4.") for n in original)  # no MTP layer written
    _word_tokenizer(model_dir, 257)
    other = _word_tokenizer(str(tmp_path / "other"), 250)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": " ".join(f"t{(i * 7 + j) % 250}" for j in range(40))})
                                                 + "\n" for i in range(20)))
    data = str(tmp_path / "data")
    prepare_data([str(tmp_path / "docs.jsonl")], other, data, no_eos=True, progress=False)
    (tmp_path / "bytes.txt").write_text("multi-token prediction from a checkpoint without it. " * 20)
    small = ["--dp", "1", "--steps", "1", "--seq-len", "16", "--micro-batch", "1", "--global-batch", "1", "--lr", "0",
             "--no-report", "--no-progress"]
    cases = {
        "mtp_missing": (["train", "--init-from-hf", model_dir, "--mtp-layers", "1", "--data", "bytes.txt", *small,
                         "--out", "r1"], {}),
        "tokenizer_mismatch": (["train", "--init-from-hf", model_dir, "--data", data, *small, "--out", "r2"], {}),
        "fresh": (["train", "--init-from-hf", model_dir, "--mtp-layers", "1", "--mtp-init", "fresh",
                   "--allow-tokenizer-mismatch", "--data", data, *small, "--out", "run"], {}),
        "export": (["hf-export", "run/checkpoints", "exported"], {}),
    }
    got = _drive(cases, tmp_path)
    line = one_line(got["mtp_missing"])
    assert line.startswith(f"shardwise train: error: --init-from-hf {model_dir} has no weights for the 1 MTP module(s)"
                           " of --mtp-layers 1 (no tensor 'model.layers.4."), line
    assert line.endswith("pass --mtp-init fresh to initialise them as in training from scratch"), line
    line = one_line(got["tokenizer_mismatch"])
    assert f"({other})" in line and os.path.join(model_dir, "tokenizer.json") in line, line
    assert line.endswith("or pass --allow-tokenizer-mismatch"), line

    assert got["fresh"]["code"] == 0 and "Traceback" not in got["fresh"]["err"], got["fresh"]
    said = [x for x in got["fresh"]["err"].splitlines() if "--mtp-init fresh" in x]
    assert said == [f"shardwise train: --mtp-init fresh: the 1 MTP module(s) start as in training from scratch "
                    f"(--seed {TrainConfig().seed}), not from --init-from-hf {model_dir}; their embedding and head are "
                    "its own"], got["fresh"]["err"]
    assert got["export"]["code"] == 0, got["export"]
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    for n, t in original.items():  # lr 0: the checkpoint's weights come back unchanged
        torch.testing.assert_close(exported[n], t, atol=0, rtol=0, msg=lambda m: f"{n}: {m}")
    cfg = init_model_config(model_dir, None, {"mtp_layers": 1})
    from shardwise.training.assemble import resolve_model  # fresh modules need no num_nextn_predict_layers in the checkpoint

    assert resolve_model(TrainConfig(model=None, init_from_hf=model_dir, model_overrides={"mtp_layers": 2},
                                     mtp_init="fresh")).mtp_layers == 2
    scratch = build_model(cfg, Mesh.single(torch.device("cpu")), TrainConfig().seed)
    mtp = {k: v for n, t in scratch.named_parameters() if n.startswith("mtp.")
           for k, v in hf._hf_tensors(n, t, cfg).items()}
    assert {"model.layers.4.enorm.weight", "model.layers.4.hnorm.weight", "model.layers.4.eh_proj.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.self_attn.q_a_proj.weight"} <= set(mtp)
    for n, t in mtp.items():  # DeepSeek's names, initialised as training from scratch does
        torch.testing.assert_close(exported[n], t.float(), atol=0, rtol=0, msg=lambda m: f"{n}: {m}")
    torch.testing.assert_close(exported["model.layers.4.shared_head.head.weight"], original["lm_head.weight"],
                               atol=0, rtol=0)
