"""--tp-overlap-auto: the planner's rule decides the overlap per layout and host, train records the choice and why,
and a run under it still equals the single-device model.

The rule (planner/tp_overlap.py `choose`): off with nothing to chunk (no SP, tp 1); off on a CPU host with 2 or
fewer cores per rank (gloo's progress threads take the GEMMs' cores: the overlapped block measured 1.26–1.37× the
plain one at tp4 on 2 cores); otherwise on exactly where the exposed-communication term says the GEMMs hide more
than the extra chunks' latency costs.
"""
import json

import pytest

from shardwise import cli
from shardwise.config import ModelConfig, TrainConfig
from shardwise.planner.tp_overlap import Host, choose, choose_for_run, cpu_host, exposed_tp

from _dist import fresh_seed

BENCH = ModelConfig(name="bench", dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=1408, max_seq_len=512)
GPU = Host("gpu", flops_per_s=500e12, link_bytes_per_s=100e9, latency_s=8e-6)


def test_rule_off_without_sp_and_on_few_cores_per_rank():
    """tp_overlap.py's benchmark block: off at tp2 and tp4 on this 2-core box, on with cores to spare (its GEMM per
    chunk is 10× the chunk's transfer); nothing to chunk without SP."""
    for tp in (2, 4):
        on, why = choose_for_run(BENCH, tp, True, 1, 1, 512, 4, cpu_host(2, tp))
        assert not on and f"{2 / tp:g} CPU cores per rank" in why, why
        on, why = choose_for_run(BENCH, tp, True, 1, 1, 512, 4, cpu_host(64, tp))
        assert on and why.startswith("on: exposed TP"), why
    assert choose_for_run(BENCH, 4, False, 1, 1, 512, 4, cpu_host(64, 4))[0] is False
    assert choose_for_run(BENCH, 1, True, 1, 1, 512, 4, cpu_host(64, 1))[0] is False
    # 3 cores per rank is past the progress threshold: the exposed term decides
    assert choose_for_run(BENCH, 2, True, 1, 1, 512, 4, cpu_host(6, 2))[0] is True


def test_rule_follows_the_exposed_term_on_a_device():
    """On an accelerator (no host-core rule) the choice is the exposed term's: long GEMMs on, none off."""
    kw = dict(tokens=4096, dim=4096, act_bytes=2, rate=GPU.link_bytes_per_s, flops_per_s=GPU.flops_per_s,
              latency=GPU.latency_s)
    long, short = exposed_tp(tp=4, projection_flops=1e13, **kw), exposed_tp(tp=4, projection_flops=0.0, **kw)
    assert choose(4, True, long, GPU)[0] is True and long.overlap < long.plain
    on, why = choose(4, True, short, GPU)
    assert not on and why.startswith("off: exposed TP") and short.overlap > short.plain, why
    assert cpu_host(2, 4).cores_per_rank == 0.5


def _train_cfg(argv):
    parser = cli.build_parser()
    args = cli.parse(parser, argv)
    return cli._configure(parser, args, argv, None, False)[1]


def test_cli_resolves_prints_and_records(monkeypatch, capsys):
    """train: the choice (by cores per rank, then by the exposed term either way) lands in the run's config
    (parallel.tp_overlap, with tp_overlap_auto beside it in config.json) and the startup line says it and why;
    --tp-overlap with --tp-overlap-auto is refused in one line."""
    argv = ["train", "--model", "tiny", "--tp", "4", "--dp", "1", "--sequence-parallel", "--tp-overlap-auto"]

    def chosen(extra=()):
        cfg = cli._tp_overlap_auto(_train_cfg(argv + list(extra)), "cpu", None, True, "train")
        assert cfg.tp_overlap_auto is True
        return cfg.parallel.as_dict().get("tp_overlap", False), capsys.readouterr().err

    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(2)))
    on, err = chosen()
    assert not on and "--tp-overlap-auto at tp4: off: 0.5 CPU cores per rank" in err, err
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(64)))
    longer = ["--micro-batch", "4", "--seq-len", "128"]  # tiny's GEMM per chunk: 108 µs at tp2, 27 µs at tp4
    on, err = chosen(longer)
    assert not on and "at tp4: off: exposed TP" in err, err
    argv[argv.index("4")] = "2"
    on, err = chosen(longer)
    assert on and "at tp2: on: exposed TP" in err, err
    plain = _train_cfg(argv[:-1])
    assert cli._tp_overlap_auto(plain, "cpu", None, True, "train") is plain
    assert cli.main(argv + ["--tp-overlap"]) == 2
    assert "give one" in capsys.readouterr().err


def test_verify_under_auto_equals_single_device(monkeypatch, capsys):
    """verify --tp 2 --sequence-parallel --tp-overlap-auto on a host with cores to spare: auto picks the overlap and
    the run matches the single-device model (loss, logits, gradients: verify's checks) on a fresh seed."""
    seed = fresh_seed()
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(64)))
    rc = cli.main(["verify", "--model", "tiny", "--tp", "2", "--dp", "1", "--sequence-parallel", "--tp-overlap-auto",
                   "--micro-batch", "4", "--seq-len", "128", "--steps", "2", "--seed", str(seed)])
    out = capsys.readouterr()
    assert "--tp-overlap-auto at tp2: on:" in out.err, out.err
    assert rc == 0 and json.loads(out.out.strip().splitlines()[-1])["passed"], (seed, out.out[-2000:])


def test_train_config_has_no_auto_without_the_flag():
    assert TrainConfig().tp_overlap_auto is False


def test_plan_explain_says_what_auto_picks(capsys):
    """plan's layout detail names --tp-overlap-auto's choice on the cluster it plans for, with its reason."""
    assert cli.main(["plan", "--model", "llama3-8b", "--gpus", "8", "--explain",
                     "dp=1,tp=2,pp=1,cp=4,ep=1,vp=1,schedule=1f1b,mb=1,m=1024,zero=1,recompute=selective,sp=true,"
                     "cp_impl=ring"]) == 0
    assert "--tp-overlap-auto: on: exposed TP" in capsys.readouterr().out


def test_tp_overlap_takes_on_off_and_auto():
    """The issue's spelling `--tp-overlap auto` sets --tp-overlap-auto; on/off and the bare and --no- forms set the
    toggle; anything else is one line naming the valid values."""
    from shardwise.cli import build_parser

    p = build_parser()
    base = ["train", "--tp", "2", "--sequence-parallel"]
    for extra, on, auto in [([], False, False), (["--tp-overlap"], True, False), (["--tp-overlap", "on"], True, False),
                            (["--tp-overlap", "off"], False, False), (["--no-tp-overlap"], False, False),
                            (["--tp-overlap", "auto"], False, True), (["--tp-overlap-auto"], False, True)]:
        args = p.parse_args(base + extra)
        assert (args.tp_overlap, args.tp_overlap_auto) == (on, auto), extra
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--tp-overlap", "maybe"])
