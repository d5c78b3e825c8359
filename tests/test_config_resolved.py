"""Configuration resolved once: parsing and resolution return a new, frozen config that nothing downstream changes;
the planner's `Layout` is frozen and hashable with every field and carries every `ParallelConfig` field of a run;
the flags it does not model are named by one function, which `simulate` (and so `plan --trace`) refuses.

`test_no_config_field_is_assigned` reads the package's source: an assignment to a config field anywhere (`cfg.out =
...`, `cfg.parallel.vp = ...`) fails it, and `test_a_planted_mutation_is_found` shows it failing on purpose.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.planner.layout import Layout, from_train_config, unmodeled
from shardwise.rules.partition import balanced_counts
from shardwise.training.assemble import assemble

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
FIELDS = {f.name for f in dataclasses.fields(TrainConfig)} | {f.name for f in dataclasses.fields(ParallelConfig)}
CONFIG_NAMES = {"cfg", "config", "train_cfg", "run_cfg", "parallel"}


def _is_config(node: ast.expr) -> bool:
    """`cfg`, `self.cfg`, `cfg.parallel`, `parallel` and the like: an expression naming a config."""
    if isinstance(node, ast.Name):
        return node.id in CONFIG_NAMES
    return isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES


def mutations(sources: dict[str, str]) -> list[str]:
    """Every assignment to a config field (plain, augmented or by setattr) in `sources`."""
    found = []
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            targets = []
            if isinstance(node, ast.Assign):
                targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                if _is_config(node.args[0]):
                    found.append(f"shardwise/{path}:{node.lineno}: setattr on a config")
            found += [f"shardwise/{path}:{t.lineno}: assigns {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in FIELDS and _is_config(t.value)]
    return found


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_no_config_field_is_assigned():
    assert mutations(package_sources()) == []


def test_a_planted_mutation_is_found():
    planted = dict(package_sources())
    planted["cli.py"] += "\n\ndef _late(cfg, args):\n    cfg.out = args.out\n    cfg.parallel.vp = 2\n"
    assert [line.split(": ", 1)[1] for line in mutations(planted)] == ["assigns cfg.out", "assigns cfg.parallel.vp"]


def test_configs_are_frozen():
    cfg = TrainConfig(parallel=ParallelConfig(dp=2, tp=2))
    for owner, name, value in ((cfg, "out", "elsewhere"), (cfg.parallel, "vp", 2), (Layout(), "dp", 4)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(owner, name, value)


def test_resolution_returns_a_new_config():
    """dp=-1 and dualpipev's two chunks per rank are filled in a new config; the one given is unchanged."""
    given = TrainConfig(parallel=ParallelConfig(dp=-1, pp=2, schedule="dualpipev"), global_batch=32, micro_batch=1,
                        steps=2)
    done = assemble(given, 8)
    assert (done.parallel.dp, done.parallel.vp, done.resolved_model is not None) == (4, 2, True)
    assert (given.parallel.dp, given.parallel.vp, given.resolved_model) == (-1, 1, None)
    assert assemble(done, 8) == done  # idempotent
    assert given.resolve_world(8) == 8 and given.parallel.dp == -1  # the world size alone, nothing changed


def test_layout_is_hashable_with_every_field():
    a = Layout(pp=2, vp=2, schedule="interleaved", pp_layers=[3, 1, 2, 2])
    assert a.pp_layers == (3, 1, 2, 2) and hash(a) == hash(dataclasses.replace(a))
    for f in dataclasses.fields(Layout):  # every field takes part in equality and the hash
        assert f.compare and f.hash is not False, f.name
    assert len({a, dataclasses.replace(a, pp_scatter_gather=True), dataclasses.replace(a, fused_projections=True)}) == 3
    assert ParallelConfig(pp_layers=[1, 2]).as_dict() == ParallelConfig(pp_layers=(1, 2)).as_dict()


# Every ParallelConfig field away from its default, in two runs (--pp-scatter-gather excludes SP).
ROUND_TRIP = (
    dict(dp=4, pp=2, cp=2, tp=2, ep=2, sequence_parallel=True, tp_overlap=True, fused_projections=True, zero=3,
         dp_shard=2, schedule="interleaved", vp=2, pp_layers=(3, 1, 2, 2), cp_order="contiguous", cp_impl="ulysses",
         recompute="full", recompute_layers=1, compile=True),
    dict(dp=2, pp=2, tp=2, schedule="zb", pp_scatter_gather=True, recompute="selective"),
    dict(dp=4, ep=4, expert_placement="balanced", expert_routing="RUN_DIR", expert_replicas=2),
)


def test_from_train_config_carries_every_parallel_field():
    defaults = ParallelConfig()
    untouched = {f.name for f in dataclasses.fields(ParallelConfig)} - {k for run in ROUND_TRIP for k in run}
    assert not untouched, f"add {sorted(untouched)} to ROUND_TRIP"
    for run in ROUND_TRIP:
        parallel = ParallelConfig(**run)
        assert all(getattr(parallel, k) != getattr(defaults, k) for k in run), run
        cfg = TrainConfig(model="tiny-moe", parallel=parallel, seq_len=64, micro_batch=1, global_batch=8)
        _, lay, _ = from_train_config(cfg)
        for f in dataclasses.fields(ParallelConfig):
            assert getattr(lay, f.name) == getattr(parallel, f.name), f.name


def test_unmodeled_names_the_flags_the_planner_does_not_model():
    def named(**parallel):
        return unmodeled(TrainConfig(model="tiny", parallel=ParallelConfig(**parallel)))

    assert named(dp=2, tp=2, pp=2, schedule="interleaved", vp=2, pp_layers=tuple(balanced_counts(8, 4))) == []
    assert named(pp=2, pp_layers=(5, 3)) == ["--pp-layers 5,3"]
    assert named(pp=2, tp=2, pp_scatter_gather=True, fused_projections=True) == ["--pp-scatter-gather",
                                                                                "--fused-projections"]


@pytest.mark.parametrize("flags, line", [
    (["--pp", "2", "--pp-layers", "5,3"], "--pp-layers 5,3: not modelled by the planner"),
    (["--tp", "2", "--fused-projections"], "--fused-projections: not modelled by the planner"),
])
def test_simulate_refuses_what_the_planner_does_not_model(capsys, flags, line):
    from shardwise.cli import main

    assert main(["simulate", "--seq-len", "32", "--micro-batch", "1", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise simulate: error: {line}") and len(err.splitlines()) == 1, err
