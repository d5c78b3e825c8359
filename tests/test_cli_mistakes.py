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
    import shardwise.config_file, shardwise.launch  # imported once, before the forks
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
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    where = tmp_path_factory.mktemp("mistakes")
    (where / "typo.toml").write_text("stpes = 5\n")
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(list(CASES.values()))], capture_output=True,
                       text=True, timeout=300, cwd=where)
    assert r.returncode == 0, r.stderr
    results = dict(zip(CASES, json.loads(r.stdout)))
    results["error_file"] = (where / "error.json").read_text() if (where / "error.json").exists() else None
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
