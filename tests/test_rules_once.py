"""The rank geometry and the layout rules are written once, in `shardwise/rules/`: the mesh, the trainer's validation
and the planner call them. A rule's arithmetic (or its message) written again anywhere else in the package fails
here; `test_a_planted_copy_is_found` shows the check failing on a copy planted on purpose.

Code only: docstrings and comments are prose and may describe a rule. Attribute owners (`p.`, `lay.`, `self.`, ...)
and the spaces beside operators are dropped before matching, so `(lay.dp * lay.cp) % lay.ep` and `(dp*cp)%ep` are the same copy.
"""
from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardwise"

RULES = {
    # rank geometry: rank = ((d·pp + p)·cp + c)·tp + t and the groups carved from the dp×cp lines
    "rank of grid coordinates": ("rules/geometry.py", r"\*pp\+|\*tp\+"),
    "ep blocks and edp strides of a dp×cp line": ("rules/geometry.py", r"\[\w+\*ep:|\[\w+::ep\]"),
    "hybrid-sharding blocks": ("rules/geometry.py", r"\[\w+::block\]"),
    # validation rules shared by TrainConfig.validate and the planner
    "dp=-1: the rest of the world": ("rules/validation.py", r"(?:world\w*|gpus)(?:%|//)\(?(?:inner|others|pp\b|degrees)"),
    "ulysses head split": ("rules/validation.py", r"K/V heads per"),
    "K/V heads and tp divide one another": ("rules/validation.py", r"\b(?:tp|t)%(?:n_kv_heads|kv|attn_kv_heads)\b"),
    "ep divides dp×cp": ("rules/validation.py", r"\(dp\*cp\)%ep"),
    "SP splits each cp rank's tokens over tp": ("rules/validation.py", r"\(seq_len//cp\)%(?:tp|t)\b"),
    "dp_shard divides dp": ("rules/validation.py", r"dp%dp_shard"),
    "hybrid sharding needs ZeRO 2/3": ("rules/validation.py", r"hsdp and zero<2"),
    "tp splits the query heads whole": ("rules/validation.py", r"\bn_heads%(?:tp|t)\b"),
    "every pipeline chunk holds whole layers": ("rules/validation.py", r"\bn_layers%chunks\b"),
    "cp splits each sequence evenly": ("rules/validation.py", r"\bseq_len%cp\b"),
    # the pipeline schedules' names (the runtime's builders and the planner's layouts read the same tuple)
    "pipeline schedule names": ("rules/schedules.py", r"\(\"(?:gpipe|1f1b)\",\"(?:gpipe|1f1b)\",\"interleaved\""),
}
OWNERS = {"dims", "lay", "self", "p", "m", "spec", "cfg", "parallel", "args"}


def code_of(source: str) -> str:
    """`source` without comments and docstrings, attribute owners, and spaces beside operators."""
    tree = ast.parse(source)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:  # a module's, class's or function's docstring, and attribute docstrings after fields
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                    doc_lines |= set(range(stmt.lineno, stmt.end_lineno + 1))
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type != tokenize.COMMENT and t.start[0] not in doc_lines]
    kept = [t.string for i, t in enumerate(toks)
            if not (t.type == tokenize.NAME and t.string in OWNERS and i + 1 < len(toks) and toks[i + 1].string == ".")
            and not (t.string == "." and i and toks[i - 1].string in OWNERS)]
    return re.sub(r"\s*([^\w\s])\s*", r"\1", re.sub(r"\s+", " ", " ".join(kept)))


def copies(sources: dict[str, str]) -> list[str]:
    """Each rule found outside its home module, or missing from it."""
    code = {path: code_of(text) for path, text in sources.items()}
    problems = []
    for rule, (home, pattern) in RULES.items():
        found = sorted(path for path, text in code.items() if re.search(pattern, text))
        problems += [f"{rule}: written again in shardwise/{path} (its home is shardwise/{home})"
                     for path in found if path != home]
        if home not in found:
            problems.append(f"{rule}: not found in its home shardwise/{home}")
    return problems


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_each_rule_is_written_once():
    assert copies(package_sources()) == []


def test_a_planted_copy_is_found():
    sources = package_sources()
    planted = dict(sources)
    planted["planner/search.py"] += ("\n\ndef _ulysses(q_local, kv_local, cp):\n"
                                     "    return f'ulysses needs the {q_local} K/V heads per tp rank'\n"
                                     "\n\ndef _dp(lay, gpus):\n    inner = lay.pp * lay.cp * lay.tp\n"
                                     "    return gpus // inner\n")
    planted["mesh.py"] += "\n\ndef _rank(d, p, c, t, pp, cp, tp):\n    return ((d * pp + p) * cp + c) * tp + t\n"
    found = copies(planted)
    assert [line.split(": written")[0] for line in found] == ["rank of grid coordinates", "dp=-1: the rest of the world",
                                                      "ulysses head split"], found
    prose = dict(sources)  # a docstring may state a rule
    prose["mesh.py"] += '\n\ndef _doc():\n    """rank = ((d * pp + p) * cp + c) * tp + t"""\n'
    assert copies(prose) == []
