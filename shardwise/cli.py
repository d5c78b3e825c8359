"""`shardwise` command line: train, verify, plan, schedule.

Configuration errors are caught before any rank starts and exit with status 2 and one line (under
torchrun, from rank 0 alone when every rank would say the same); an unknown flag gets its subcommand's
usage and the nearest known flag. Flags that change nothing in the configuration get a one-line warning.
Without torchrun's environment the command forks the ranks it needs (gloo, CPU); under torchrun
each process joins the job.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys

from .config import ConfigError, TrainConfig
from .config.args import add_run_command, unknown_flags_message
from .config.flags import GIVEN
from .training.assemble import check_sources, config_from_args

MAX_LOCAL_RANKS = 64

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runs = {"train": "train a model on a parallel layout", "verify": "check a layout against the single-device model"}
    for name, what in runs.items():
        add_run_command(sub, name, what)
    parser._sw_runs = {name: sub.choices[name] for name in runs}
    for mod in ("shardwise.pipeline.cli", "shardwise.commands.plan", "shardwise.commands.checkpoint", "shardwise.training.report",
                "shardwise.commands.hf", "shardwise.data.cli", "shardwise.training.generate", "shardwise.simulate.cli"):
        importlib.import_module(mod).add_parser(sub)
    return parser


def _run(kind: str, cfg: TrainConfig, device=None):
    if kind == "train":
        from .planner.run_figures import predicted_activation_bytes
        from .training.loop import train_main

        return train_main(cfg, device, predicted_activation_bytes(cfg))
    from .verify.main import verify_main

    return verify_main(cfg, device)


def _check_tp_within_node(cfg: TrainConfig) -> list[str]:
    """TP is innermost, so a TP group is `tp` consecutive ranks: it stays on one node (NVLink) exactly
    when the processes per node are a multiple of tp. On GPUs anything else is refused; on CPU, a warning."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    tp = cfg.parallel.tp
    if local and local % tp:
        msg = (f"--tp {tp} does not fit the {local} processes per node: TP groups would span nodes; "
               f"use a tp that divides {local}")
        import torch

        if torch.cuda.is_available():
            raise ConfigError(msg)
        return [msg]
    return []


def _torchrun() -> bool:
    from .training.launch import under_torchrun

    return under_torchrun()


def _subcommand(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices.get(name, parser)


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """parse_args, except that an unknown flag is reported by its subcommand's parser (its usage, not the
    top-level one) with a "did you mean" suggestion; exits 2 like any argparse error."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub = _subcommand(parser, getattr(args, "command", None))
        sub.error(unknown_flags_message(sub, extras))
    return args


def main(argv=None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if hasattr(args, "func"):
        return args.func(args)
    torchrun_world = int(os.environ["WORLD_SIZE"]) if _torchrun() else None
    rank0 = torchrun_world is None or int(os.environ["RANK"]) == 0
    try:
        args, cfg = _configure(parser, args, argv, torchrun_world, rank0)
    except ConfigError as e:  # flags and world size: the same on every rank, so rank 0 alone says it
        return _refuse(args.command, e, rank0, torchrun_world is not None)
    try:
        if args.print_config:
            from .config.file import render_config

            print(render_config(parser._sw_runs[args.command], args, cfg))
            return 0
        cfg, done = _before_ranks(args, cfg)
        if done is not None:
            if rank0:
                print(f"shardwise train: {done}", file=sys.stderr)
            return 0
        launch = _plan_launch(args, cfg, torchrun_world)
        cfg = _tp_overlap_auto(cfg, launch.device, torchrun_world, rank0, args.command)
    except ConfigError as e:  # may differ between nodes (files, devices): every rank says its own
        return _refuse(args.command, e, True, torchrun_world is not None)
    p = cfg.parallel
    if p.pp > 1 and cfg.grad_accum < p.pp and rank0:
        print(f"shardwise {args.command}: warning: {cfg.grad_accum} microbatch(es) per step for {p.pp} pipeline "
              f"stages: most stages idle most of the step; set --microbatches {p.pp} or more", file=sys.stderr)
    from .training.launch import RankError

    try:
        result = _launch(args.command, cfg, launch, torchrun_world)
    except RankError as e:
        print(f"shardwise {args.command}: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:  # decided by the ranks together (a resume whose every checkpoint fails its checksum),
        # or by one rank alone (a shard it can no longer read: `every_rank_alike` False), which then says it itself
        return _refuse(args.command, e, rank0 or not getattr(e, "every_rank_alike", True), torchrun_world is not None)
    except KeyboardInterrupt:  # SIGINT stops at once; --save-on-signal's signal stops after a save (`_preempted`)
        if rank0:
            start = "\n" if sys.stderr.isatty() else ""  # on its own line, not after a progress bar or ^C
            print(f"{start}shardwise {args.command}: {_interrupted_line(cfg)}", file=sys.stderr)
        return 130
    if isinstance(result, dict) and result.get("preempted"):
        return _preempted(args.command, result["preempted"], rank0, torchrun_world is not None)
    return _report(args.command, result) if rank0 else 0


def _preempted(command: str, stopped: dict, speak: bool, torchrun: bool) -> int:
    """--save-on-signal stopped every rank after the same step: one line (also for torchrun's failure summary)
    and the documented exit status, on every rank."""
    from .training.preemption import PREEMPTED_EXIT_CODE, preempted_line

    line = f"shardwise {command}: {preempted_line(stopped)}"
    if speak:
        print(line, file=sys.stderr)
    if torchrun:
        from .training.launch import note_torchrun_failure

        note_torchrun_failure(line)
    return PREEMPTED_EXIT_CODE


def _refuse(command: str, error: ConfigError, speak: bool, torchrun: bool) -> int:
    """Exit status 2 and one line, before any collective; under torchrun the line also goes to torchrun's error
    file, so its failure summary names the cause instead of pointing at a traceback."""
    line = f"shardwise {command}: error: {error}"
    if speak:
        print(line, file=sys.stderr)
    if torchrun:
        from .training.launch import note_torchrun_failure

        note_torchrun_failure(line)
    return 2


def _configure(parser, args, argv, torchrun_world: int | None, rank0: bool):
    """(args with --config's TOML applied, the assembled TrainConfig); rank 0 prints the warnings."""
    if args.config:
        from .config.file import apply_config_file

        args = apply_config_file(parser, parser._sw_runs[args.command], args.config, argv)
    cfg = config_from_args(args, torchrun_world)
    warnings = config_warnings(args, cfg) + (_check_tp_within_node(cfg) if torchrun_world is not None else [])
    if rank0:
        for line in warnings:
            print(f"shardwise {args.command}: warning: {line}", file=sys.stderr)
    return args, cfg


def config_warnings(args, cfg: TrainConfig) -> list[str]:
    """Flags that were given but change nothing in this configuration."""
    given = getattr(args, GIVEN, frozenset())
    idle = [f"--{d} {getattr(args, d)}" for d in ("schedule", "vp") if d in given and cfg.parallel.pp == 1]
    return [f"{' and '.join(idle)} {'has' if len(idle) == 1 else 'have'} no effect without --pp > 1"] if idle else []


def _before_ranks(args, cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """The command's own checks before any rank: the config the ranks run and, for train, the line to print when
    nothing is left to run."""
    if args.command == "verify":
        from .verify.main import check_verifiable

        check_verifiable(cfg)
    if args.command == "train":
        return _prepare_run_dir(args, cfg)
    return cfg, None


def _plan_launch(args, cfg: TrainConfig, torchrun_world: int | None):
    """Sources checked once (manifests, shard checksums, --init-from-hf), then the device and backend."""
    check_sources(cfg)
    world = cfg.parallel.world_size
    import torch

    from .training.launch import plan_launch

    launch = plan_launch(world, args.device, torch.cuda.device_count() if args.device != "cpu" else 0,
                         torchrun_world is not None)
    if torchrun_world is not None or args.gloo_ifname:
        from .training.launch import configure_gloo

        configure_gloo(args.gloo_ifname)
    if torchrun_world is None and world > MAX_LOCAL_RANKS:
        raise ConfigError(f"the layout needs {world} ranks; the local launcher starts at most "
                          f"{MAX_LOCAL_RANKS} (use torchrun for more)")
    return launch


def _tp_overlap_auto(cfg: TrainConfig, device: str, torchrun_world: int | None, rank0: bool, command: str) -> TrainConfig:
    """--tp-overlap-auto: `parallel.tp_overlap` set by the planner's rule (planner/tp_overlap.py `choose`) for this
    layout and host, once before the ranks start, the choice and why printed (config.json records tp_overlap_auto and
    the resulting parallel.tp_overlap); every rank of a node computes the same (nodes are assumed alike)."""
    p = cfg.parallel
    if not cfg.tp_overlap_auto:
        return cfg
    if p.tp_overlap:
        raise ConfigError("--tp-overlap and --tp-overlap-auto: give one (--tp-overlap-auto decides it)")
    from .planner.hardware import get_gpu
    from .planner.tp_overlap import LATENCY_S, Host, choose_for_run, cpu_host

    if cfg.fp8:
        on, why = False, f"off: --fp8 {cfg.fp8} does not run with --tp-overlap yet"
    else:
        if device == "cpu":
            here = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or (1 if torchrun_world is not None else p.world_size)
            host = cpu_host(len(os.sched_getaffinity(0)), here)
        else:  # the planner's default GPU at its default efficiencies: collectives progress on the device
            gpu = get_gpu("h100-80gb")
            host = Host(gpu.name, 0.6 * gpu.peak_bf16_flops, 0.8 * gpu.nvlink_bytes_per_s, LATENCY_S["nvlink"])
        on, why = choose_for_run(cfg.model_config(), p.tp, p.sequence_parallel, p.cp, cfg.micro_batch, cfg.seq_len,
                                 2 if cfg.dtype == "bf16" else 4, host)
    if rank0:
        print(f"shardwise {command}: --tp-overlap-auto at tp{p.tp}: {why}", file=sys.stderr)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, tp_overlap=on))


def _launch(kind: str, cfg: TrainConfig, launch, torchrun_world: int | None):
    """Run the ranks: join torchrun's job, run in this process (one rank), or fork the local ranks; rank 0's result."""
    save_signal = cfg.save_on_signal if kind == "train" else None
    if torchrun_world is not None:
        from .training.launch import init_distributed
        from .training.preemption import die_with_parent

        die_with_parent(save_signal, os.getppid())  # torchrun's agent: its death is this worker's stop request
        return _run(kind, cfg, init_distributed(cfg.timeout_s, launch.device, cfg.out))
    world = cfg.parallel.world_size
    if world == 1:
        import torch

        return _run(kind, cfg, torch.device("cuda", 0) if launch.device == "cuda" else None)
    from .training.launch import run_local

    from .resilience.elastic import survivor_rule

    train = kind == "train"
    return run_local(_rank_run, world, kind, cfg, timeout_s=cfg.timeout_s, backend=launch.backend,
                     run_dir=cfg.out, save_signal=save_signal, max_restarts=cfg.max_restarts if train else 0,
                     ranks_per_node=cfg.ranks_per_node, node_stores=train and bool(cfg.mem_ckpt_every),
                     elastic=survivor_rule(cfg) if train and cfg.min_dp else None)[0]


def _report(kind: str, result) -> int:
    if kind == "verify":
        losses = result.pop("losses")
        print(f"losses: {' '.join(f'{x:.6f}' for x in losses)}", file=sys.stderr)
        print(json.dumps(result))
        return 0 if result["passed"] else 1
    from .training.report import summary_lines

    print("\n".join(summary_lines(result)))
    return 0


def _prepare_run_dir(args, cfg: TrainConfig) -> tuple[TrainConfig, str | None]:
    """Before any rank: the run directory (newest run for a bare --resume), fresh vs resume, and protection of
    a non-empty --out. Returns the config with them and the line to print when the checkpoint already reaches --steps."""
    from .training.assemble import check_run_dir
    from .training.run_dir import default_out_dir, newest_run_with_checkpoints

    if cfg.out is None:
        out = None
        if (cfg.resume or args.auto_resume) and cfg.checkpoint_dir is None:
            out = newest_run_with_checkpoints()
            if out is None and cfg.resume:
                raise ConfigError("--resume found no run with checkpoints under runs/; pass --out RUN_DIR "
                                  "or --checkpoint-dir DIR")
        cfg = dataclasses.replace(cfg, out=out or default_out_dir())
    return check_run_dir(cfg, auto_resume=args.auto_resume, overwrite=args.overwrite)


def _rank_run(kind: str, cfg: TrainConfig, device=None):
    """A local rank: Ctrl-C is the parent's to handle (it stops every rank and prints one line), so a rank
    ignores SIGINT and is terminated by the launcher instead of printing its own traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _run(kind, cfg, device)


def _interrupted_line(cfg: TrainConfig) -> str:
    """`interrupted at step N; last checkpoint step-M; continue with --resume`, from the run directory."""
    step = 0
    try:
        with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
            for line in f:
                if line.strip():
                    step = json.loads(line)["step"]
    except (OSError, ValueError, KeyError):
        pass
    from .training.assemble import checkpoint_root

    try:
        with open(os.path.join(checkpoint_root(cfg), "latest")) as f:
            last = f.read().strip()
    except OSError:
        last = None
    if last is None:
        return f"interrupted at step {step}; no checkpoint written (use --save-every N to resume later)"
    return f"interrupted at step {step}; last checkpoint {last}; continue with --resume"


if __name__ == "__main__":
    sys.exit(main())
