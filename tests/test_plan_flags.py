"""`plan`'s train flags come from the flag table (`config.flags.PLAN_FLAGS`, plan's own defaults declared there):
plan's module declares none of them again (`test_a_planted_declaration_is_found` shows the check failing)."""
from __future__ import annotations

import argparse
import ast
import pathlib

from shardwise.commands.plan import add_parser
from shardwise.config.flags import PLAN_FLAGS, RUN_FLAGS

PLAN_SOURCE = pathlib.Path(__file__).resolve().parent.parent / "shardwise" / "commands" / "plan.py"
TRAIN_NAMES = {f.name for f in RUN_FLAGS}


def declared_train_flags(source: str) -> list[str]:
    """Train flag names passed to an `add_argument` call in `source` (plan must take them from the table)."""
    return [arg.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and arg.value in TRAIN_NAMES]


def _plan_parser() -> argparse.ArgumentParser:
    return add_parser(argparse.ArgumentParser(prog="shardwise").add_subparsers(dest="command"))


def test_plan_declares_no_train_flag_itself():
    assert declared_train_flags(PLAN_SOURCE.read_text()) == []


def test_a_planted_declaration_is_found():
    planted = PLAN_SOURCE.read_text() + '\n\ndef _more(p):\n    p.add_argument("--seq-len", type=int, default=2048)\n'
    assert declared_train_flags(planted) == ["--seq-len"]


def test_plan_takes_each_table_flag_with_its_plan_default():
    actions = {a.option_strings[0]: a for a in _plan_parser()._actions if a.option_strings}
    assert {f.name for f in PLAN_FLAGS} <= TRAIN_NAMES
    for flag in PLAN_FLAGS:
        action = actions[flag.name]
        names = [n for n in action.option_strings if n != flag.name.replace("--", "--no-", 1)]  # a toggle's --no-X
        assert names == [flag.name, *flag.also] and action.default == flag.default, flag.name
    train_like = {name for name in actions if name in TRAIN_NAMES}
    assert train_like == {f.name for f in PLAN_FLAGS}
