"""`--config run.toml`: every command-line flag is also a config key (kebab or snake case).

Tables only group keys: `[moe]` prefixes its keys with `moe-`, any other table is flattened as is,
so `[layout] tp = 2` and a top-level `tp = 2` mean the same. A `[resolved_model]` table (what
`--print-config` appends for reading) is ignored. Values are checked against the flag's type;
unknown keys are errors that list the valid ones. Flags on the command line override the file.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import tomllib

from . import ConfigError
from .flags import GIVEN, ToggleOrAuto
from .schedule import lr_plan

_SKIP = {"help", "config", "print_config", "command"}
INFORMATIONAL = "resolved_model"


def _flatten(data: dict, path: str) -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key == INFORMATIONAL:
                continue
            prefix = "moe_" if key == "moe" else ""
            for k, v in value.items():
                if isinstance(v, dict):
                    raise ConfigError(f"{path}: table [{key}.{k}] is nested too deep; use flat keys")
                out[prefix + k.replace("-", "_")] = v
        else:
            out[key.replace("-", "_")] = value
    return out


def _check(action: argparse.Action, key: str, value, path: str):
    flag = action.option_strings[0]
    if isinstance(action, ToggleOrAuto):  # --tp-overlap: true/false, or "on"/"off"
        if isinstance(value, bool) or value in ("on", "off"):
            return value if isinstance(value, bool) else value == "on"
        raise ConfigError(f"{path}: {key} = {value!r} must be true or false (flag {flag}; for auto: "
                          f"{flag[2:]}-auto = true)")
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key} = {value!r} must be true or false (flag {flag})")
        return value
    typ = action.type or str
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is str and isinstance(value, list):  # e.g. pp-layers = [3, 3, 2]
        return ",".join(str(v) for v in value)
    if not isinstance(value, typ) or isinstance(value, bool):
        raise ConfigError(f"{path}: {key} = {value!r} must be of type {typ.__name__} (flag {flag})")
    return value


def apply_config_file(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, path: str, argv):
    """Parse again with the file's values as defaults, so explicit flags still win."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path!r}: not valid TOML: {e}") from None
    actions = {a.dest: a for a in sub._actions if a.dest not in _SKIP and a.option_strings}
    defaults = {}
    for key, value in _flatten(data, path).items():
        if key not in actions:
            names = sorted(k.replace("_", "-") for k in actions)
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {key.replace('_', '-')!r}{hint}; valid keys: {', '.join(names)}")
        defaults[key] = _check(actions[key], key, value, path)
    sub.set_defaults(**defaults)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    setattr(args, GIVEN, getattr(args, GIVEN, frozenset()) | set(defaults))
    return args


def _toml_value(v, derived: bool = False) -> str:
    """TOML for a value: a float as typed (its shortest round-tripping repr); a `derived` float (computed, e.g.
    --lr / 10) at 15 significant digits, so 0.003 / 10 reads 0.0003, not 0.00030000000000000003."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and derived:
        return repr(float(f"{v:.15g}"))
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_config(sub: argparse.ArgumentParser, args, cfg) -> str:
    """The resolved run as TOML that `--config` accepts, plus the model's shape for reading."""
    p = cfg.parallel
    resolved = vars(args) | {a: getattr(p, a) for a in ("dp", "pp", "cp", "tp", "ep")}
    # Pipeline-only settings change nothing on one stage (and --config would warn about them): left out there.
    resolved["vp"] = p.vp if p.pp > 1 else None
    resolved["schedule"] = p.schedule if p.pp > 1 else None
    # Flags whose default follows other flags stay defaults (a comment shows the value they take now).
    derived = {"min_lr": "--lr / 10", "warmup_steps": "10% of the schedule, 1..20",
               "lr_decay_steps": "--steps; on resume the checkpoint's"}
    plan = lr_plan(cfg)
    lines = []
    for a in sub._actions:
        if a.dest in _SKIP or not a.option_strings:
            continue
        key = a.option_strings[0][2:]
        if resolved.get(a.dest) is None:
            if a.dest in derived:
                lines.append(f"# {key} = {_toml_value(plan[a.dest], derived=True)}  (default: {derived[a.dest]})")
            continue
        lines.append(f"{key} = {_toml_value(resolved[a.dest])}")
    lines.append(f"\n[{INFORMATIONAL}]")
    model = cfg.model_config()
    for f in dataclasses.fields(model):  # the declared fields only: no internal bookkeeping, no None
        v = getattr(model, f.name)
        if v is not None:
            lines.append(f"{f.name} = {_toml_value(v)}")
    return "\n".join(lines)
