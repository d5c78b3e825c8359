"""Wire bytes are a fact of `shardwise.rules.wire`: the comm layer's ledger records them, the planner predicts with
them, and no second formula for them lives anywhere else in the package."""
import ast
import importlib

import pytest
import torch
import torch.distributed as dist

from shardwise import comm
from shardwise.comm import collectives
from shardwise.mesh import Axis
from shardwise.planner.comm_model import CommLedger
from shardwise.rules import wire

from test_structure import ROOT, import_graph

GROUPS = (2, 3, 4, 6, 8)
P2P = importlib.import_module("shardwise.comm.p2p")  # the package's `p2p` attribute is the function


@pytest.fixture
def no_transfer(monkeypatch):
    """Every raw op up to its ledger record, with no process group: the torch.distributed call is skipped."""
    monkeypatch.setattr(collectives, "guarded", lambda *args, **kwargs: None)
    monkeypatch.setattr(P2P, "guarded", lambda *args, **kwargs: [])
    monkeypatch.setattr(dist, "P2POp", lambda *args, **kwargs: None)


def _axis(n: int, rank: int = 0) -> Axis:
    return Axis("dp", n, rank, None, tuple(range(n)), comm.Ledger())


def _recorded(axis: Axis, op: str) -> list:
    return list(axis.ledger.current[(axis.name, op)])


@pytest.mark.parametrize("n", GROUPS)
@pytest.mark.parametrize("rows", [1, 5])
def test_ledger_records_the_rules(no_transfer, n, rows):
    """Each collective's ledger row (count, payload, unrounded wire bytes) is rules.wire's for its payload and
    group, at several sizes and group sizes, and the planner books the same row for the same op."""
    t = torch.ones(n * rows, 3)  # divisible by every group: reduce-scatter needs it
    nb = t.numel() * t.element_size()
    cases = [
        ("all_reduce", lambda ax: comm.all_reduce(t.clone(), ax), nb, wire.all_reduce(nb, n)),
        ("all_reduce", lambda ax: comm.all_reduce_async(t.clone(), ax), nb, wire.all_reduce(nb, n)),
        ("reduce_scatter", lambda ax: comm.reduce_scatter(t, ax), nb, wire.reduce_scatter(nb, n)),
        ("reduce_scatter", lambda ax: comm.reduce_scatter_into(torch.empty(t.numel() // n), t.view(-1), ax), nb,
         wire.reduce_scatter(nb, n)),
        ("reduce_scatter", lambda ax: comm.reduce_scatter_into_async(torch.empty(t.numel() // n), t.view(-1), ax),
         nb, wire.reduce_scatter(nb, n)),
        ("all_gather", lambda ax: comm.all_gather(t, ax), nb, wire.all_gather(nb, n)),
        ("all_gather", lambda ax: comm.all_gather_into(torch.empty(n * t.numel()), t.view(-1), ax), nb,
         wire.all_gather(nb, n)),
        ("all_gather", lambda ax: comm.all_gather_into_async(torch.empty(n * t.numel()), t.view(-1), ax), nb,
         wire.all_gather(nb, n)),
        ("all_to_all", lambda ax: comm.all_to_all(t, ax), nb, wire.all_to_all(nb, n)),
        ("send", lambda ax: comm.p2p([("send", t, ax, 1)]), nb, wire.send(nb)),
        ("recv", lambda ax: comm.p2p([("recv", t, ax, 1)]), 0, wire.recv(nb)),
    ]
    for op, run, payload, expected in cases:
        ax = _axis(n)
        run(ax)
        assert _recorded(ax, op) == [1, payload, expected], (op, n, rows)
        planned = CommLedger()
        planned.add("dp", op, payload, n)
        assert planned.ops["dp"][op] == [1, payload, expected], (op, n, rows)


def test_the_rules_are_the_ring_convention():
    """The numbers themselves, written out: all-reduce 2(n−1)/n·N, reduce-scatter and equal all-to-all (n−1)/n·N,
    all-gather (n−1)·N_shard, all-to-all-v the rows addressed to others, broadcast and send N from the source."""
    assert wire.all_reduce(48, 3) == 64 and wire.all_reduce(1024, 8) == 1792
    assert wire.reduce_scatter(48, 3) == 32 and wire.all_to_all(48, 6) == 40
    assert wire.all_gather(16, 3) == 32
    assert wire.all_to_all_v(8, [1, 3, 2], 1) == 24
    assert wire.broadcast(12, True) == 12 and wire.broadcast(12, False) == 0
    assert wire.send(12) == 12 and wire.recv(12) == 0
    assert wire.wire_bytes("all_to_all:dispatch", 48, 3) == 32
    with pytest.raises(ValueError, match="broadcast"):
        wire.wire_bytes("broadcast", 12, 2)


def test_variable_all_to_all_and_broadcast(no_transfer):
    """The ops whose bytes depend on the rank: all-to-all with splits, and broadcast (only the source books)."""
    for rank, splits in ((0, [1, 3, 2]), (2, [4, 0, 2])):
        ax = _axis(3, rank)
        inp = torch.ones(sum(splits), 5, dtype=torch.bfloat16)
        comm.all_to_all(inp, ax, splits, splits)
        assert _recorded(ax, "all_to_all") == [1, inp.numel() * 2, wire.all_to_all_v(10, splits, rank)]
        comm.broadcast(inp, ax, src_rank=0)
        sent = wire.broadcast(inp.numel() * 2, rank == 0)
        assert _recorded(ax, "broadcast") == [1, sent, sent]


# ---------------------------------------------------------------- the formula is written once

def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


def _minus_one(node: ast.AST) -> ast.AST | None:
    """X of `X - 1`, else None."""
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.right, ast.Constant)
            and node.right.value == 1):
        return node.left
    return None


def _factors(node: ast.AST):
    """The factors of a product (`a * b * c`: a, b, c); a non-product is its own one factor."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        yield from _factors(node.left)
        yield from _factors(node.right)
    else:
        yield node


def _says_bytes(node: ast.AST) -> bool:
    """A byte count: a name, attribute or call whose name says bytes (`nbytes(t)`, `shard_bytes`, `wl.act_bytes`)."""
    if isinstance(node, ast.Call):
        node = node.func
    word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "bytes" in word.lower()


def wire_formulas(source: str) -> list[int]:
    """Lines of `source` that compute a ring collective's wire bytes themselves:
    (a) a quotient by X of a product with the factor `X - 1` — the (n−1)/n share of all-reduce, reduce-scatter,
        all-to-all (`2 * (n - 1) / n * b`, `(n - 1) * b / n`, `b * (n - 1) / n`);
    (b) `X - 1` times a byte count — all-gather's (n−1)·N_shard (`(n - 1) * nbytes(t)`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.BinOp):
            continue
        if isinstance(node.op, (ast.Div, ast.FloorDiv)):
            if any((x := _minus_one(f)) is not None and _same(x, node.right) for f in _factors(node.left)):
                lines.append(node.lineno)
        elif isinstance(node.op, ast.Mult):
            for a, b in ((node.left, node.right), (node.right, node.left)):
                if _minus_one(a) is not None and _says_bytes(b):
                    lines.append(node.lineno)
    return sorted(set(lines))


def test_the_scan_catches_each_form():
    """Every way the formulas were written before they moved is caught; the package's other `X − 1` are not."""
    for formula in ("2 * (n - 1) / n * nbytes(t)", "(n - 1) / n * nbytes(src)", "2 * (n - 1) * nbytes / n",
                    "nbytes(inp) * (n - 1) / n", "(axis.size - 1) * nbytes(shard)", "float((n - 1) * nbytes)",
                    "k * (tp - 1) / tp * tokens * dim * act_bytes / rate", "(lay.cp - 1) * shard_bytes"):
        assert wire_formulas(f"w = {formula}\n") == [1], formula
    for other in ("(p - 1) / (m + p - 1)", "k * (tp - 1) * max(0.0, chunk - beside)", "e * cc * kw * (per - 1)",
                  "attention_layers * (lay.cp - 1)", "(mats - 1) * e * n * ffn", "min(len(tails) - 1, 3)",
                  "min(v * m, 2 * (p - k - 1) + (v - 1) * p + 1) / v"):
        assert wire_formulas(f"w = {other}\n") == [], other


def test_wire_bytes_are_written_only_in_rules():
    """No module outside rules/ computes a collective's wire bytes itself: the comm layer and the planner call
    rules.wire (a second formula fails here, naming its file and line)."""
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for path in sorted(ROOT.rglob("*.py"))
             if "rules" not in path.relative_to(ROOT).parts for line in wire_formulas(path.read_text())]
    assert found == []


def test_the_runtime_loads_no_planner():
    """Muon's deal lives in rules/: no optimizer, comm or axis module imports the planner."""
    runtime = ("optim", "comm", "data_parallel", "tensor_parallel", "pipeline", "context_parallel",
               "expert_parallel", "models", "mesh")
    graph = import_graph()
    bad = {mod: sorted(t for t in targets if t.startswith("shardwise.planner"))
           for mod, targets in graph.items() if mod.split(".")[1:2] and mod.split(".")[1] in runtime}
    assert {mod: t for mod, t in bad.items() if t} == {}
