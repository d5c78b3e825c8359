"""The command-line reference (docs/reference.md), rendered from the parser itself so it cannot drift:
every command, every flag, its default and its help. `python -m shardwise.reference > docs/reference.md`
rewrites it; a test fails when the file and the parser disagree."""
from __future__ import annotations

import argparse


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    d = action.default
    if d is None or d is argparse.SUPPRESS:
        return "—"
    if d is False and action.nargs == 0:
        return "off"
    if d is True and action.nargs == 0:
        return "on"
    return f"`{d}`"


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs != 0:
        meta = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices else
                                  action.dest.upper())
        names += f" {meta}" if isinstance(meta, str) else ""
    return names


def _cell(text: str | None) -> str:
    return " ".join((text or "").replace("|", "\\|").split()).replace("%%", "%")


def render(parser: argparse.ArgumentParser) -> str:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = ["# Command-line reference", "",
           "Generated from the parser (`python -m shardwise.reference > docs/reference.md`); "
           "`shardwise COMMAND --help` prints the same.", ""]
    out += [f"- [`shardwise {name}`](#shardwise-{name}) — {_cell(helps.get(name))}" for name in sub.choices]
    for name, p in sub.choices.items():
        out += ["", f"## shardwise {name}", "", _cell(helps.get(name)), "", "| flag | default | meaning |", "|---|---|---|"]
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            out.append(f"| {_flag(a)} | {_default(a)} | {_cell(a.help)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    from .cli import build_parser

    print(render(build_parser()), end="")


if __name__ == "__main__":
    main()
