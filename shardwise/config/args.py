"""The run flags on an argument parser, and the flag values a run's configuration starts from.

Torch-free and below everything that parses a train command: the CLI, `simulate`, and `plan` (which reads and
prints train commands with train's own parser, so its rows say exactly what `shardwise train` accepts).
Turning the values into the final configuration (a Hugging Face config.json, a data manifest) is run assembly's
(`shardwise.training.assemble.config_from_args`).
"""
from __future__ import annotations

import argparse
import difflib
import re

from .flags import GIVEN, RUN_FLAGS, ToggleOrAuto, flag_default, flag_type
from ..rules.validation import REST, rest_of_world
from .parallel import AXES
from .errors import ConfigError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default; flags that default to off or to a value derived from others (None)
    say so in their own help instead."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


DEFAULT_LAYOUT = {"dp": 2, "tp": 2}  # `shardwise train` with no layout flags: a small 4-rank job


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
        elif flag.kind == "toggle-auto":
            kw |= dict(action=ToggleOrAuto, metavar="{on,off,auto}")
        else:
            kw["action"] = argparse.BooleanOptionalAction if flag.kind == "toggle" else "store_true"
        where.add_argument(flag.name, **kw)


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
"""argparse's own pattern misses exponents, so `-1e-3` read as a flag and printed the whole usage."""


def add_run_command(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A run subcommand (train, verify): the run flags, --config and --print-config."""
    p = sub.add_parser(name, help=help, formatter_class=HelpFormatter)
    _run_command_flags(p, name)
    return p


def train_parser() -> argparse.ArgumentParser:
    """`shardwise train`'s own parser, standing alone (the planner reads and prints train commands with it)."""
    p = argparse.ArgumentParser(prog="shardwise train", formatter_class=HelpFormatter)
    _run_command_flags(p, "train")
    return p


def _run_command_flags(p: argparse.ArgumentParser, name: str) -> None:
    p._negative_number_matcher = NEGATIVE_NUMBER  # `--lr -1e-3` reaches the range check's one line
    add_run_flags(p, name)
    p.add_argument("--config", default=None, metavar="FILE.toml",
                   help="TOML file whose keys are these flags' names; flags given on the command line win")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")


def degrees(args, torchrun_world: int | None) -> dict:
    """dp, tp, pp, cp, ep: the flags given; none at all is train's small default job; under torchrun an
    omitted --dp is the rest of the world (-1)."""
    given = {a: getattr(args, a) for a in AXES if getattr(args, a) is not None}
    if not given and args.command == "train" and torchrun_world is None:
        given = dict(DEFAULT_LAYOUT)
    degrees = {a: given.get(a, 1) for a in AXES}
    if torchrun_world is not None and "dp" not in given:
        degrees["dp"] = REST
    return degrees


def global_batch(args, degrees: dict, torchrun_world: int | None) -> int | None:
    """--global-batch, or --microbatches M as M × micro-batch × dp; `verify` under pp with neither runs
    `verify_microbatches`."""
    microbatches = args.microbatches
    if microbatches is None and args.global_batch is None and args.command == "verify" and degrees["pp"] > 1:
        microbatches = verify_microbatches(args.schedule, degrees["pp"])
    if microbatches is None:
        return args.global_batch
    if microbatches <= 0 or (args.global_batch is not None):
        raise ConfigError(f"--microbatches {microbatches} must be positive and not combined with "
                          "--global-batch")
    dp = degrees["dp"]
    if dp == REST:  # under torchrun: the rest of the world (resolution reports a bad split)
        dp = rest_of_world(torchrun_world, degrees["pp"], degrees["cp"], degrees["tp"]) or 1
    return microbatches * args.micro_batch * dp


def verify_microbatches(schedule: str, pp: int) -> int:
    """verify's microbatches per step under pp when no batch flag is given: the fewest that keep every stage busy
    in the steady phase (one per stage; dualpipev's V needs two), so the check runs the schedule a pipeline layout
    trains with. train keeps its default of one microbatch, and warns."""
    return 2 * pp if schedule == "dualpipev" else pp


def default_vp(args) -> int:
    """--vp, by default 2 chunks per rank under --schedule interleaved (which needs at least 2), else 1."""
    if args.vp is not None:
        return args.vp
    return 2 if args.schedule == "interleaved" and (args.pp or 1) > 1 else 1




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
