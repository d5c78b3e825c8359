"""The package's structure, read from its own source with `ast`: no import circle, configuration at the
bottom, collectives that know no model; no branch for the fake world outside `simulate/`, no private name
taken from another module, no module that only passes another's names on; a warning for a long file.

A lazy import inside a function hides a dependency from a reader, not from the graph: it counts here.
Docstrings and comments are prose, not code: no rule reads them.
"""
from __future__ import annotations

import ast
import pathlib
import re
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
LONG_FILE = 500  # lines: a file past it usually holds two ideas (a warning, not a failure)

# shardwise.config is the bottom floor but for the torch-free rules layer, which reaches nothing of shardwise.
RULES = "shardwise.rules"
CONFIG_MAY_REACH: set[str] = set()
# The comm layer and the launcher must not reach a model, Hugging Face or data module, nor run assembly.
COMM_LAYER = ("shardwise.mesh", "shardwise.comm", "shardwise.training.launch")
NO_MODEL = ("shardwise.models", "shardwise.hf", "shardwise.data", "shardwise.training.assemble", "shardwise.training.loop",
            "shardwise.training.trainer", "shardwise.parallelize", "shardwise.expert_parallel",
            "shardwise.tensor_parallel", "shardwise.context_parallel", "shardwise.checkpoint")
# The models know only their math: a layout reaches them through their ParallelContext, never an import.
AXIS_PACKAGES = ("shardwise.mesh", "shardwise.tensor_parallel", "shardwise.context_parallel",
                 "shardwise.expert_parallel", "shardwise.pipeline", "shardwise.data_parallel")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _stem(node: ast.ImportFrom, mod: str, is_package: bool) -> str:
    """The module a `from ... import` names, absolute."""
    if not node.level:
        return node.module or ""
    base = (mod if is_package else mod.rpartition(".")[0]).split(".")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _sources(root: pathlib.Path):
    """(module name, path, is a package __init__, parsed tree) of every file under `root`."""
    for path in sorted(root.rglob("*.py")):
        yield _module_name(path, root), path, path.name == "__init__.py", ast.parse(path.read_text(), str(path))


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, every import statement counted, wherever it stands.

    `from .x import name` names module x, or x.name when that is a submodule. Importing a.b.c also runs the
    __init__ of a.b and a (unless the importer lives inside them, where they are already running)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    packages = {_module_name(p, root) for p in root.rglob("__init__.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                stem = _stem(node, mod, mod in packages)
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


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{package: packages it imports}, each module folded into its top-level package (`shardwise.X`): a circle
    here is one a reader meets as "training needs hf needs training", even when no two modules close it."""
    def top(m: str) -> str:
        return ".".join(m.split(".")[:2])
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        out.setdefault(top(mod), set()).update(top(t) for t in targets if top(t) != top(mod))
    return out


def rules_problems(graph: dict[str, set[str]], root: pathlib.Path = ROOT) -> list[str]:
    """The rules layer is torch-free and imports nothing of shardwise outside itself: both sides read it."""
    problems = [f"{mod} imports {bad}: the rules layer reads nothing of shardwise outside itself"
                for mod in sorted(graph) if _in(mod, (RULES,))
                and (bad := sorted(m for m in graph[mod] if not _in(m, (RULES,))))]
    for mod, path, _, tree in _sources(root):
        if not _in(mod, (RULES,)):
            continue
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            problems += [f"{mod} imports {n}: the rules layer is torch-free" for n in names
                         if n.split(".")[0] in ("torch", "numpy")]
    return problems


# The planner counts from the rules layer and reads config.json shapes; it reaches no module that runs a model.
PLANNER = "shardwise.planner"
PLANNER_MAY_REACH = ("shardwise.planner", "shardwise.rules", "shardwise.config", "shardwise.hf.config",
                     "shardwise.hf.shapes")
# The runtime: everything a training or verify rank executes. It is handed the planner's figures, never imports them.
RUNTIME = ("shardwise.models", "shardwise.tensor_parallel", "shardwise.context_parallel", "shardwise.expert_parallel",
           "shardwise.data_parallel", "shardwise.pipeline", "shardwise.optim", "shardwise.training",
           "shardwise.checkpoint", "shardwise.hf", "shardwise.comm", "shardwise.mesh", "shardwise.parallelize",
           "shardwise.recompute", "shardwise.verify", "shardwise.data")


def planner_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for mod in sorted(graph):
        if _in(mod, (PLANNER,)) and (bad := sorted(m for m in reach(graph, mod)
                                                   if not _in(m, PLANNER_MAY_REACH) and m != "shardwise.hf")):
            problems.append(f"{mod} reaches {bad}: the planner counts from rules/, it imports no runtime module")
        if _in(mod, RUNTIME) and (bad := sorted(m for m in graph[mod] if _in(m, (PLANNER,)))):
            problems.append(f"{mod} imports {bad}: the runtime imports no planner module")
    return problems


def structure_problems(graph: dict[str, set[str]]) -> list[str]:
    problems = [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    problems += planner_problems(graph)
    problems += [f"package circle: {' -> '.join(c)}" for c in circles(package_graph(graph))]
    problems += [p for p in rules_problems(graph) if "outside itself" in p]
    for mod in sorted(graph):
        if _in(mod, ("shardwise.config",)):
            bad = sorted(m for m in reach(graph, mod)
                         if not _in(m, ("shardwise.config", "shardwise.rules")) and m not in CONFIG_MAY_REACH)
            if bad:
                problems.append(f"{mod} reaches {bad}: configuration must sit at the bottom")
        if _in(mod, ("shardwise.models",)) and (bad := sorted(m for m in graph[mod] if _in(m, AXIS_PACKAGES))):
            problems.append(f"{mod} imports {bad}: the models import no axis package")
        if _in(mod, COMM_LAYER):
            bad = sorted(m for m in reach(graph, mod) if _in(m, NO_MODEL))
            if bad:
                problems.append(f"{mod} reaches {bad}: the comm layer must know no model, HF or data module")
    return problems


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


_FAKE = re.compile("fake", re.IGNORECASE)


def fake_branches(root: pathlib.Path = ROOT) -> list[str]:
    """Code outside `<root>/simulate/` that knows of the fake world: a name, attribute, parameter, keyword or
    import mentioning "fake" (`is_fake`, `FakeTensor`, `fake_mode=`, torch's fake_tensor module), or a string
    holding "fake" that a value is compared with (`dist.get_backend() == "fake"`). The fake world enters
    through what the simulator hands in."""
    problems = []
    for mod, path, _, tree in _sources(root):
        if mod == f"{root.name}.simulate" or mod.startswith(f"{root.name}.simulate."):
            continue
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            said = None
            if isinstance(node, ast.Name):
                said = node.id
            elif isinstance(node, ast.Attribute):
                said = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                said = node.name
            elif isinstance(node, ast.arg):
                said = node.arg
            elif isinstance(node, ast.keyword):
                said = node.arg
            elif isinstance(node, ast.alias):
                said = f"{node.name} {node.asname or ''}"
            elif isinstance(node, ast.ImportFrom):
                said = node.module
            elif isinstance(node, ast.Compare):
                said = " ".join(c.value for side in (node.left, *node.comparators)
                                for c in ast.walk(side)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str) and id(c) not in prose)
            if said and _FAKE.search(said):
                problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: fake-world branch ({said.strip()!r})"
                                if hasattr(node, "lineno") else f"{path.relative_to(root.parent)}: {said!r}")
    return sorted(set(problems))


def _shardwise_imports(mod: str, is_package: bool, tree: ast.AST, root: pathlib.Path):
    """(node, module it names, alias) of every import of a module of the package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            stem = _stem(node, mod, is_package)
            if stem == root.name or stem.startswith(root.name + "."):
                for alias in node.names:
                    yield node, stem, alias
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == root.name or alias.name.startswith(root.name + "."):
                    yield node, alias.name, alias


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(root: pathlib.Path = ROOT) -> list[str]:
    """Underscore names one module takes from another: imported (`from .x import _y`) or reached through an
    imported module (`from . import x` ... `x._y`). A private name is private to its module; a split that
    needs one across modules is a split by size (make the name public, or move the code)."""
    problems = []
    for mod, path, is_package, tree in _sources(root):
        where = path.relative_to(root.parent)
        bound = {}
        for node, stem, alias in _shardwise_imports(mod, is_package, tree, root):
            if isinstance(node, ast.ImportFrom):
                if _private(alias.name) and stem != mod:
                    problems.append(f"{where}:{node.lineno}: imports {alias.name} from {stem}")
                bound[alias.asname or alias.name] = f"{stem}.{alias.name}"
            elif alias.asname:
                bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and _private(node.attr)):
                problems.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr} of {bound[node.value.id]}")
    return sorted(set(problems))


def _annotation_words(tree: ast.AST) -> set[str]:
    """Identifiers inside string annotations (`"Trainer"`), which name an import as much as code does."""
    words = set()
    annotations = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation]
    annotations += [n.returns for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.returns]
    for a in annotations:
        for c in ast.walk(a):
            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                words.update(re.findall(r"[A-Za-z_]\w*", c.value))
    return words


def _dunder_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and isinstance(node.value, (ast.List, ast.Tuple))):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def reexport_shims(root: pathlib.Path = ROOT) -> list[str]:
    """Modules that take names from another module of the package only to expose them: a name imported and
    never used (`from .x import a  # re-export`), or one in `__all__` that the module does not define. A
    package's `__init__.py` is its face and may gather its submodules' names; any other module is one idea,
    and its readers import a name from where it is defined."""
    problems = []
    for mod, path, is_package, tree in _sources(root):
        if is_package:
            continue
        where = path.relative_to(root.parent)
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | _annotation_words(tree)
        imported = {}
        for node, stem, alias in _shardwise_imports(mod, is_package, tree, root):
            if isinstance(node, ast.ImportFrom) and alias.name != "*":
                name = alias.asname or alias.name
                imported[name] = stem
                if name not in used:
                    problems.append(f"{where}:{node.lineno}: imports {alias.name} from {stem} only to expose it")
        for name in _dunder_all(tree):
            if name in imported:
                problems.append(f"{where}: __all__ exposes {name}, defined in {imported[name]}")
    return sorted(set(problems))


def long_files(root: pathlib.Path = ROOT) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): n for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > LONG_FILE}


def test_package_structure():
    assert structure_problems(import_graph()) == []


def test_rules_layer_is_torch_free():
    assert rules_problems(import_graph()) == []


def test_no_fake_world_outside_simulate():
    assert fake_branches() == []


def test_no_private_name_across_modules():
    assert private_imports() == []


def test_no_reexport_shim():
    assert reexport_shims() == []


def test_long_files_are_flagged_not_failed():
    """Split files by idea, not by length: a long file is worth a look, never a failure on its own."""
    long = long_files()
    if long:
        warnings.warn(f"files past ~{LONG_FILE} lines (often two ideas in one): {long}", stacklevel=1)


def test_the_checks_catch_what_they_guard(tmp_path):
    """Each rule fails when broken on purpose: a circle, config reaching data, comm reaching a model."""
    graph = import_graph()
    assert graph["shardwise.cli"] >= {"shardwise.training.assemble", "shardwise.config"}  # the walker sees real imports
    assert "shardwise.hf.init" in graph["shardwise.training.assemble"]  # ... including those inside functions
    for extra, message in ((("shardwise.rules.partition", "shardwise.training.assemble"), "import circle"),
                           (("shardwise.config.training", "shardwise.data.shards"), "configuration must sit"),
                           (("shardwise.comm.collectives", "shardwise.models.llama"), "comm layer must know"),
                           (("shardwise.models.llama", "shardwise.mesh"), "no axis package"),
                           (("shardwise.models.llama", "shardwise.training.trainer"), "package circle"),
                           (("shardwise.rules.buckets", "shardwise.config.errors"), "rules layer reads nothing"),
                           (("shardwise.optim.sharded", "shardwise.planner.muon"), "runtime imports no planner"),
                           (("shardwise.planner.estimate", "shardwise.models.llama"), "planner counts from rules/")):
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


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# A package face gathering a name, prose about fakes, a string annotation, and the fake world in simulate/.
CLEAN = {"__init__.py": "from .a import f\n__all__ = ['f']\n",
         "a.py": '"""Prose may say fake tensors."""\nimport torch\n\n\ndef f(t):\n    # a comment on fake worlds\n'
                 '    return t.tolist()\n',
         "b.py": "from .a import f\n\n\ndef g(t) -> \"int\":\n    return f(t)\n",
         "sub/__init__.py": "",
         "simulate/__init__.py": "",
         "simulate/world.py": "from torch._subclasses.fake_tensor import is_fake\n\n\ndef fake_only(t):\n"
                              "    return is_fake(t)\n"}


def test_the_new_rules_catch_what_they_guard(tmp_path):
    """A clean synthetic package passes every rule; each break on purpose is caught, and only by its rule."""
    clean = _tree(tmp_path / "clean" / "pkg", CLEAN)
    assert fake_branches(clean) == private_imports(clean) == reexport_shims(clean) == []
    breaks = {
        "fake name": ({"a.py": "from torch._subclasses.fake_tensor import is_fake\n\n\ndef f(t):\n"
                               "    return 0 if is_fake(t) else t.tolist()\n"}, fake_branches),
        "fake backend": ({"a.py": "import torch.distributed as dist\n\n\ndef f(t):\n"
                                  "    return None if dist.get_backend() == 'fake' else t.tolist()\n"}, fake_branches),
        "fake keyword": ({"b.py": "from .a import f\n\n\ndef g(t, mode=None):\n    return f(t) if mode else t\n\n"
                                  "\ndef h(x):\n    return g(x, fake_mode=1)\n"}, fake_branches),
        "private import": ({"b.py": "from .a import _helper, f\n\n\ndef g(t):\n    return _helper(f(t))\n"},
                           private_imports),
        "private attribute": ({"b.py": "from . import a\n\n\ndef g(t):\n    return a._helper(t)\n"},
                              private_imports),
        "unused import": ({"sub/c.py": "from ..a import f  # re-export\n"}, reexport_shims),
        "__all__ of another's name": ({"sub/c.py": "from ..a import f\n\n__all__ = ['f']\nf(1)\n"}, reexport_shims),
    }
    rules = (fake_branches, private_imports, reexport_shims)
    for i, (name, (files, rule)) in enumerate(breaks.items()):
        root = _tree(tmp_path / f"broken{i}" / "pkg", {**CLEAN, **files})
        for other in rules:
            assert bool(other(root)) == (other is rule), (name, other.__name__, other(root))


def test_a_long_file_warns(tmp_path):
    root = _tree(tmp_path / "pkg", {"__init__.py": "", "long.py": "x = 1\n" * (LONG_FILE + 1)})
    assert long_files(root) == {"long.py": LONG_FILE + 1}
