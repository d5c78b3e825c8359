"""`shardwise` command line: train, verify, plan, schedule.

Configuration errors are caught before any rank starts and exit with status 2 and one line (under
torchrun, from rank 0 alone when every rank would say the same); an unknown flag gets its subcommand's
usage and the nearest known flag. Flags that change nothing in the configuration get a one-line warning.
Without torchrun's environment the command forks the ranks it needs (gloo, CPU); under torchrun
each process joins the job.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys

from .config import AXES, ConfigError, ParallelConfig, TrainConfig
from .config.flags import GIVEN, RUN_FLAGS, config_fields, flag_default, flag_type
from .training.assemble import assemble, check_sources, read_model_config

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default; flags that default to off or to a value derived from others (None)
    say so in their own help instead."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


DEFAULT_LAYOUT = {"dp": 2, "tp": 2}  # `shardwise train` with no layout flags: a small 4-rank job
MAX_LOCAL_RANKS = 64


class StoreGiven(argparse.Action):
    """argparse's plain store, also noting the flag in `GIVEN`."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


def add_run_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The run flags (`config.flags.RUN_FLAGS`) on the parser of `command` (train, verify or simulate)."""
    groups: dict[str | None, object] = {None: p}
    exclusive: dict[str, object] = {}
    for flag in RUN_FLAGS:
        if flag.group not in groups:
            groups[flag.group] = p.add_argument_group(flag.group)
        where = groups[flag.group]
        if flag.exclusive is not None:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = where.add_mutually_exclusive_group()
            where = exclusive[flag.exclusive]
        kw = dict(default=flag_default(flag, command), help=flag.help)
        if flag.kind == "value":
            kw |= dict(type=flag_type(flag), choices=flag.choices, metavar=flag.metavar, action=StoreGiven)
        else:
            kw["action"] = argparse.BooleanOptionalAction if flag.kind == "toggle" else "store_true"
        where.add_argument(flag.name, **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runs = {"train": "train a model on a parallel layout", "verify": "check a layout against the single-device model"}
    for name, what in runs.items():
        p = sub.add_parser(name, help=what, formatter_class=HelpFormatter)
        add_run_flags(p, name)
        p.add_argument("--config", default=None, metavar="FILE.toml",
                       help="TOML file whose keys are these flags' names; flags given on the command line win")
        p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    parser._sw_runs = {name: sub.choices[name] for name in runs}
    for mod in ("shardwise.pipeline.cli", "shardwise.planner.cli", "shardwise.checkpoint.cli", "shardwise.training.report",
                "shardwise.hf.cli", "shardwise.data.cli", "shardwise.training.generate", "shardwise.simulate.cli"):
        importlib.import_module(mod).add_parser(sub)
    return parser


def train_parser() -> argparse.ArgumentParser:
    """`shardwise train`'s own parser (the planner reads train commands with it)."""
    return build_parser()._sw_runs["train"]


def _degrees(args, torchrun_world: int | None) -> dict:
    """dp, tp, pp, cp, ep: the flags given; none at all is train's small default job; under torchrun an
    omitted --dp is the rest of the world (-1)."""
    given = {a: getattr(args, a) for a in AXES if getattr(args, a) is not None}
    if not given and args.command == "train" and torchrun_world is None:
        given = dict(DEFAULT_LAYOUT)
    degrees = {a: given.get(a, 1) for a in AXES}
    if torchrun_world is not None and "dp" not in given:
        degrees["dp"] = -1
    return degrees


def _global_batch(args, degrees: dict, torchrun_world: int | None) -> int | None:
    """--global-batch, or --microbatches M as M × micro-batch × dp."""
    if args.microbatches is None:
        return args.global_batch
    if args.microbatches <= 0 or (args.global_batch is not None):
        raise ConfigError(f"--microbatches {args.microbatches} must be positive and not combined with "
                          "--global-batch")
    dp = degrees["dp"]
    if dp == -1:  # under torchrun: the rest of the world (resolve_world reports a bad split)
        dp = max(1, torchrun_world // (degrees["pp"] * degrees["cp"] * degrees["tp"]))
    return args.microbatches * args.micro_batch * dp


def config_from_args(args, torchrun_world: int | None) -> TrainConfig:
    run, parallel, overrides = config_fields(args)
    degrees = _degrees(args, torchrun_world)
    parallel = ParallelConfig(**(parallel | degrees | {"vp": _vp(args)}))
    model = args.model if args.model is not None or args.init_from_hf else "tiny"
    if args.model_config:
        model = read_model_config(args.model_config)
    run |= dict(global_batch=_global_batch(args, degrees, torchrun_world),
                final_checkpoint=args.command == "train" and not args.no_checkpoint)
    return assemble(TrainConfig(model=model, parallel=parallel, model_overrides=overrides, **run), torchrun_world)


def _vp(args) -> int:
    """--vp, by default 2 chunks per rank under --schedule interleaved (which needs at least 2), else 1."""
    if args.vp is not None:
        return args.vp
    return 2 if args.schedule == "interleaved" and (args.pp or 1) > 1 else 1


def _run(kind: str, cfg: TrainConfig, device=None):
    if kind == "train":
        from .training.loop import train_main

        return train_main(cfg, device)
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


def unknown_flags_message(sub: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" line, with the nearest flag the subcommand knows for each unknown one."""
    known = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for token in extras:
        if token.startswith("--"):
            close = difflib.get_close_matches(token.split("=", 1)[0], known, n=1)
            hints += [(token.split("=", 1)[0], close[0])] if close else []
    message = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{message}; did you mean {hints[0][1]}?"
    if hints:
        return f"{message}; did you mean {', '.join(f'{good} for {bad}' for bad, good in hints)}?"
    return message


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
        done = _before_ranks(args, cfg)
        if done is not None:
            if rank0:
                print(f"shardwise train: {done}", file=sys.stderr)
            return 0
        launch = _plan_launch(args, cfg, torchrun_world)
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
    except ConfigError as e:  # decided by the ranks together (a resume whose every checkpoint fails its checksum)
        return _refuse(args.command, e, rank0, torchrun_world is not None)
    except KeyboardInterrupt:
        if rank0:
            start = "\n" if sys.stderr.isatty() else ""  # on its own line, not after a progress bar or ^C
            print(f"{start}shardwise {args.command}: {_interrupted_line(cfg)}", file=sys.stderr)
        return 130
    return _report(args.command, result) if rank0 else 0


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


def _before_ranks(args, cfg: TrainConfig) -> str | None:
    """The command's own checks before any rank; for train, the line to print when nothing is left to run."""
    if args.command == "verify":
        from .verify.main import check_verifiable

        check_verifiable(cfg)
    if args.command == "train":
        return _prepare_run_dir(args, cfg)
    return None


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


def _launch(kind: str, cfg: TrainConfig, launch, torchrun_world: int | None):
    """Run the ranks: join torchrun's job, run in this process (one rank), or fork the local ranks; rank 0's result."""
    if torchrun_world is not None:
        from .training.launch import init_distributed

        return _run(kind, cfg, init_distributed(cfg.timeout_s, launch.device, cfg.out))
    world = cfg.parallel.world_size
    if world == 1:
        import torch

        return _run(kind, cfg, torch.device("cuda", 0) if launch.device == "cuda" else None)
    from .training.launch import run_local

    return run_local(_rank_run, world, kind, cfg, timeout_s=cfg.timeout_s, backend=launch.backend,
                     run_dir=cfg.out)[0]


def _report(kind: str, result) -> int:
    if kind == "verify":
        losses = result.pop("losses")
        print(f"losses: {' '.join(f'{x:.6f}' for x in losses)}", file=sys.stderr)
        print(json.dumps(result))
        return 0 if result["passed"] else 1
    from .training.report import summary_lines

    print("\n".join(summary_lines(result)))
    return 0


def _prepare_run_dir(args, cfg: TrainConfig) -> str | None:
    """Before any rank: the run directory (newest run for a bare --resume), fresh vs resume, and protection of
    a non-empty --out. Returns the line to print when the checkpoint already reaches --steps."""
    from .training.assemble import check_run_dir
    from .training.run_dir import default_out_dir, newest_run_with_checkpoints

    if cfg.out is None:
        if (cfg.resume or args.auto_resume) and cfg.checkpoint_dir is None:
            cfg.out = newest_run_with_checkpoints()
            if cfg.out is None and cfg.resume:
                raise ConfigError("--resume found no run with checkpoints under runs/; pass --out RUN_DIR "
                                  "or --checkpoint-dir DIR")
        cfg.out = cfg.out or default_out_dir()
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
