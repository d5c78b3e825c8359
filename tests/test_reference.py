"""docs/reference.md is the parser's own account of every command and flag, so it cannot drift."""
import pathlib

from shardwise.cli import build_parser
from shardwise.reference import render

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def test_reference_is_current_and_complete():
    parser = build_parser()
    text = render(parser)
    assert DOC.read_text() == text, "regenerate it: python -m shardwise.reference > docs/reference.md"
    for command in ("train", "verify", "plan", "simulate", "generate", "prepare-data", "hf-export", "hf-compare"):
        assert f"## shardwise {command}\n" in text, command
    for flag in ("`--lr-schedule`", "`--eval-data`", "`--gloo-ifname`", "`--profile-steps`", "`--overwrite`"):
        assert flag in text, flag
    assert "| `--lr-schedule` LR_SCHEDULE | `cosine` |" in text  # with its default
