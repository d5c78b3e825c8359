"""Config files, --print-config, `shardwise report`, and property-based bad input (always exit 2, one line)."""
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.cli import main


def shardwise(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_config_file_cli_overrides_and_print_roundtrip(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "tiny"\nsteps = 7\n[layout]\ntp = 2\ndp = 2\nsequence-parallel = true\n'
                   '[moe]\nexperts = 4\ntopk = 1\n')
    assert main(["train", "--config", str(cfg), "--dp", "1", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "tp = 2" in printed and "dp = 1" in printed and "steps = 7" in printed
    assert "sequence-parallel = true" in printed and "moe-experts = 4" in printed
    again = tmp_path / "again.toml"
    again.write_text(printed)
    assert main(["train", "--config", str(again), "--print-config"]) == 0
    assert capsys.readouterr().out == printed


def test_config_file_errors(tmp_path, capsys):
    for text, message in (("bogus = 1", "unknown key 'bogus'"), ("tp = 'two'", "tp = 'two' must be of type int"),
                          ("steps = ", "not valid TOML")):
        path = tmp_path / "bad.toml"
        path.write_text(text)
        assert main(["train", "--config", str(path)]) == 2
        assert message in capsys.readouterr().err


def test_report_renders_pngs(tmp_path):
    run = tmp_path / "run"
    r = shardwise("train", "--pp", "2", "--microbatches", "2", "--steps", "3", "--seq-len", "32", "--no-progress",
                  "--out", str(run))
    assert r.returncode == 0, r.stderr
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "timeline.png").stat().st_size > 1000 and "wrote loss.png" in r.stdout  # train drew them itself
    (run / "timeline.png").unlink()
    r = shardwise("report", str(run))
    assert r.returncode == 0, r.stderr
    for png in ("loss.png", "tokens_per_s.png", "comm_per_axis.png", "timeline.png"):
        assert (run / png).stat().st_size > 1000
    assert "measured bubble" in r.stdout and "pp" in r.stdout
    assert shardwise("report", str(tmp_path / "nope")).returncode == 2


ANY_FLAG = ["--dp", "--tp", "--pp", "--cp", "--ep", "--steps", "--seq-len", "--micro-batch", "--global-batch",
            "--vp", "--microbatches", "--keep", "--moe-topk", "--moe-every"]
HUGE_IS_INVALID = ["--tp", "--pp", "--cp", "--ep", "--vp", "--zero", "--seq-len", "--global-batch", "--moe-topk",
                   "--dp"]
INVALID = st.one_of(
    st.tuples(st.sampled_from(ANY_FLAG), st.integers(-5, 0)),  # zero or negative sizes
    st.tuples(st.sampled_from(["--save-every", "--zero", "--max-bad-steps"]), st.integers(-5, -1)),
    st.tuples(st.sampled_from(HUGE_IS_INVALID), st.integers(3, 7).map(lambda v: v * 1000 + 3)),  # divides nothing
)


@settings(max_examples=40, deadline=None, derandomize=True,  # the same 40 cases every CI run
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=INVALID, model=st.sampled_from(["tiny", "tiny-moe"]), extra=st.sampled_from([[], ["--tp", "2"],
                                                                                        ["--pp", "2"]]))
def test_invalid_configurations_exit_2_with_one_line(bad, model, extra, capsys):
    """Random invalid values never start a rank: exit 2 and one line, whatever else is set."""
    flag, value = bad
    args = ["train", flag, str(value), "--model", model] + [x for x in extra if flag not in extra]
    if flag != "--steps":
        args += ["--steps", "1", "--no-progress"]  # should a valid layout slip through, fail fast
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert main(["train", "--model", "nope"]) == 2 and "unknown model" in capsys.readouterr().err
    assert code == 2, (args, err)
    assert len(err) == 1 and err[0].startswith("shardwise train: error: "), (args, err)
