"""The package's structure, read from its own imports (module level and inside functions) with `ast`:
no import circle, configuration at the bottom, collectives that know no model, no oversized file.

A lazy import inside a function hides a dependency from a reader, not from the graph: it counts here.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
MAX_LINES = 450

# shardwise.config is the bottom floor: it may reach only these (importing pipeline.schedules runs the
# pipeline package's __init__, which imports the pure simulator).
CONFIG_MAY_REACH = {"shardwise.partition", "shardwise.pipeline", "shardwise.pipeline.schedules",
                    "shardwise.pipeline.simulate"}
# The comm layer and the launcher must not reach a model, Hugging Face or data module, nor run assembly.
COMM_LAYER = ("shardwise.mesh", "shardwise.comm", "shardwise.launch")
NO_MODEL = ("shardwise.models", "shardwise.hf", "shardwise.hf_config", "shardwise.hf_init", "shardwise.hf_cli",
            "shardwise.data", "shardwise.run", "shardwise.train", "shardwise.parallelize", "shardwise.expert_parallel",
            "shardwise.tensor_parallel", "shardwise.context_parallel", "shardwise.checkpoint")
# The models know only their math: a layout reaches them through their ParallelContext, never an import.
AXIS_PACKAGES = ("shardwise.mesh", "shardwise.tensor_parallel", "shardwise.context_parallel",
                 "shardwise.expert_parallel", "shardwise.pipeline", "shardwise.data_parallel")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, every import statement counted, wherever it stands.

    `from .x import name` names module x, or x.name when that is a submodule. Importing a.b.c also runs the
    __init__ of a.b and a (unless the importer lives inside them, where they are already running)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    packages = {_module_name(p, root) for p in root.rglob("__init__.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        own_pkg = mod if mod in packages else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = own_pkg.split(".")
                    base = base[:len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                names = [stem] + [f"{stem}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # `import a.b.c` of a package's attribute: the module part
                    name = name.rpartition(".")[0]
                if name.startswith(root.name):
                    targets.add(name)
        # the importer's own ancestors are already running: `from . import x` adds only x
        targets = {t for t in targets if not mod.startswith(t + ".")}
        implied = set()
        for t in targets:
            parts = t.split(".")
            for i in range(1, len(parts)):
                anc = ".".join(parts[:i])
                if anc in files and not (mod == anc or mod.startswith(anc + ".")):
                    implied.add(anc)
        graph[mod] = (targets | implied) - {mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _in(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def structure_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    for mod in sorted(graph):
        if _in(mod, ("shardwise.config",)):
            bad = sorted(m for m in reach(graph, mod) if not _in(m, ("shardwise.config",)) and m not in CONFIG_MAY_REACH)
            if bad:
                problems.append(f"{mod} reaches {bad}: configuration must sit at the bottom")
        if _in(mod, ("shardwise.models",)) and (bad := sorted(m for m in graph[mod] if _in(m, AXIS_PACKAGES))):
            problems.append(f"{mod} imports {bad}: the models import no axis package")
        if _in(mod, COMM_LAYER):
            bad = sorted(m for m in reach(graph, mod) if _in(m, NO_MODEL))
            if bad:
                problems.append(f"{mod} reaches {bad}: the comm layer must know no model, HF or data module")
    return problems


def test_package_structure():
    assert structure_problems(import_graph()) == []


def test_no_file_past_the_size_guideline():
    long = {p.relative_to(ROOT).as_posix(): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by idea: {long}"


def test_the_checks_catch_what_they_guard(tmp_path):
    """Each rule fails when broken on purpose: a circle, config reaching data, comm reaching a model."""
    graph = import_graph()
    assert graph["shardwise.cli"] >= {"shardwise.run", "shardwise.config"}  # the walker sees real imports
    assert "shardwise.hf_init" in graph["shardwise.run"]  # ... including those inside functions
    for extra, message in ((("shardwise.partition", "shardwise.run"), "import circle"),
                           (("shardwise.config.training", "shardwise.data.shards"), "configuration must sit"),
                           (("shardwise.comm.collectives", "shardwise.models.llama"), "comm layer must know"),
                           (("shardwise.models.llama", "shardwise.mesh"), "no axis package")):
        broken = {k: set(v) for k, v in graph.items()}
        broken[extra[0]].add(extra[1])
        assert any(message in p for p in structure_problems(broken)), extra
    # a lazy, relative, function-level import closing a circle in a package of its own
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
