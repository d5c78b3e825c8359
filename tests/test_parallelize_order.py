"""The axes are applied in one visible order: `shardwise.parallelize.parallelize` makes each step's call once, in the
order its module docstring documents, and no other function of the package applies an axis (read with `ast`);
and the order it applies is the one that holds (DP last: ZeRO's buffers hold the initialised weights)."""
from __future__ import annotations

import ast
import pathlib

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardwise"

ORDER = ("apply_tp", "apply_ep", "apply_cp", "apply_pp", "init_weights", "apply_compile", "apply_recompute", "load",
         "apply_dp")
"""parallelize's steps, as a reader expects them: the model's axes, its weights, what wraps its forward, then DP."""

ONLY_FROM = {step: "parallelize" for step in ORDER if step != "load"} | {
    "build_reducer": "apply_dp",  # gradient reduction and ZeRO-3 gathers are installed by the reducer it builds
    "GradReducer": "build_reducer",
    "ParamUnits": "_build_units",
    "_expert_parallel_moe": "apply_ep",
    "ContextParallel": "apply_cp",
    "prune_to_stages": "apply_pp",
    "materialize": "init_weights",
    "store_fused": "init_weights",
    "torch.compile": "apply_compile",
}
"""A call that applies an axis (or a step of one), and the one function allowed to make it."""


def _name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f"torch.{f.attr}" if isinstance(f.value, ast.Name) and f.value.id == "torch" else f.attr
    return None


def _calls(tree: ast.AST):
    """(name called, innermost enclosing function's name or None) of every call, in source order."""
    out = []

    def visit(node, fn):
        if isinstance(node, ast.Call):
            out.append((node.lineno, node.col_offset, _name(node), fn))
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, None)
    return [(name, fn) for _, _, name, fn in sorted(out, key=lambda c: c[:2])]


def order_problems(source: str) -> list[str]:
    """What is wrong with the order in `source` (parallelize.py's text): its entry's step calls against ORDER, and
    the module docstring's list of steps against the same."""
    tree = ast.parse(source)
    entry = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parallelize")
    applied = [name for name, _ in _calls(entry) if name in ORDER]
    problems = [] if applied == list(ORDER) else [f"parallelize applies {applied}, documented: {list(ORDER)}"]
    doc = ast.get_docstring(tree) or ""
    where = {step: doc.find(f"`{step}`") for step in ORDER}
    if -1 in where.values() or sorted(ORDER, key=where.get) != list(ORDER):
        problems.append(f"the module docstring lists the steps as {sorted(where, key=where.get)}")
    return problems


def elsewhere_problems(sources: dict[str, str]) -> list[str]:
    """Calls of ONLY_FROM's names made outside their one function, in {module: source}."""
    problems = []
    for mod, source in sorted(sources.items()):
        for name, fn in _calls(ast.parse(source)):
            if name in ONLY_FROM and fn != ONLY_FROM[name]:
                problems.append(f"{mod}: {name} called in {fn or 'the module body'}, only {ONLY_FROM[name]} may")
    return problems


def _package() -> dict[str, str]:
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_parallelize_applies_the_documented_order():
    assert order_problems((ROOT / "parallelize.py").read_text()) == []


def test_no_axis_is_applied_elsewhere():
    assert elsewhere_problems(_package()) == []


def test_the_checks_catch_a_swap_and_a_step_moved_elsewhere():
    """The two checks on purpose-broken copies: two steps swapped; DP applied by the trainer; EP inside TP."""
    source = (ROOT / "parallelize.py").read_text()
    swapped = source.replace("    apply_cp(model, mesh, p)\n    apply_pp(", "    apply_pp(", 1).replace(
        "    init_weights(", "    apply_cp(model, mesh, p)\n    init_weights(", 1)
    assert swapped != source and order_problems(swapped)
    trainer = (ROOT / "training" / "trainer.py").read_text()
    dp_in_trainer = "        self.reducer = build_reducer(cfg, self.model, mesh, 1)\n"
    assert dp_in_trainer not in trainer
    moved = trainer.replace("        self.model.train()\n", "        self.model.train()\n" + dp_in_trainer, 1)
    assert moved != trainer
    assert elsewhere_problems({"training/trainer.py": moved}) == [
        "training/trainer.py: build_reducer called in __init__, only apply_dp may"]
    nested = source.replace("    cfg, tp = model.cfg, mesh[\"tp\"]\n",
                            "    cfg, tp = model.cfg, mesh[\"tp\"]\n    apply_ep(model, mesh, parallel)\n", 1)
    assert nested != source and elsewhere_problems({"parallelize.py": nested}) == [
        "parallelize.py: apply_ep called in apply_tp, only parallelize may"]


def test_dp_comes_after_the_weights():
    """ZeRO-1 on one device: every parameter is a view of its bucket's flat buffer, holding the seeded initial values
    (the model `build_model` makes without DP), and the reducer holds the model's parameters in order."""
    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.mesh import Mesh
    from shardwise.parallelize import build_model, parallelize

    cfg = TrainConfig(model="tiny-moe", parallel=ParallelConfig(zero=1))
    mesh = Mesh.single(torch.device("cpu"))
    model, reducer = parallelize(cfg.model_config(), mesh, cfg.seed, cfg.parallel, train=cfg, rounds=1)
    ref = dict(build_model(cfg.model_config(), mesh, cfg.seed).named_parameters())
    assert [n for n, _ in reducer.named] == [n for n, _ in model.named_parameters()]
    flats = {b.flat.untyped_storage().data_ptr() for b in reducer.buckets}
    for n, p in model.named_parameters():
        assert p.untyped_storage().data_ptr() in flats, n
        assert torch.equal(p, ref[n]), n
