"""Device discipline: NCCL takes only tensors on the rank's GPU, gloo takes CPU tensors from anywhere.

A tensor made by a factory (torch.zeros, torch.tensor, ...) without `device=` lands on the CPU; if
it ever reaches a collective, every CPU test passes and the first GPU run fails. This test scans
shardwise/ (AST) for such calls. The only exceptions are listed below, each with the reason it is
on the host on purpose and never handed to comm.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardwise"
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "linspace", "logspace", "eye",
             "rand", "randn", "randint", "randperm", "normal", "empty_strided", "frombuffer", "from_numpy",
             "scalar_tensor", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"}

# (file, enclosing function, factory): why the tensor stays on the host and never reaches a collective.
ALLOWED = {
    ("optim/sharded.py", "Muon.__init__", "zeros"):
        "an empty placeholder parameter for a rank that holds no Muon matrix; never stepped nor communicated",
    ("verify/checks.py", "Values.__init__", "zeros"):
        "the per-parameter sum of update bounds: host arithmetic on norms already read back, never communicated",
    ("verify/fp64_budget.py", "first_grad_samples", "rand"):
        "which way each weight moves one ulp, drawn from a CPU generator seeded alike on every rank, then moved to "
        "the weights' device; never communicated",
    ("verify/routing_replay.py", "RoutingReplay._local_ids", "arange"):
        "host token-id bookkeeping, cut like the batch and then moved to the world's device",
    ("checkpoint/files.py", "from_b64", "frombuffer"):
        "RNG state bytes for torch.set_rng_state / Generator.set_state, which take CPU byte tensors",
    ("checkpoint/load.py", "load_global_tensors", "empty"):
        "full-shaped tensors read by one process for conversion/export; no process group involved",
    ("data/loader.py", "load_tokens", "tensor"):
        "the corpus on the host; Trainer.forward_backward checks ids and copies each microbatch to mesh.device",
    ("data/loader.py", "Loader._starts", "from_numpy"): "window starts for host-side batch assembly",
    ("data/loader.py", "Loader.batch_at", "from_numpy"):
        "the rank's rows read from the memmap on the host; the Trainer copies each microbatch to mesh.device",
    ("commands/hf.py", "compare", "randint"):
        "host token ids handed to every rank, which copies them to its device before the forward",
    ("mesh.py", "Mesh.build", "arange"): "the rank grid: integer bookkeeping that derives the group lists",
    ("parallelize.py", "global_init", "ones"):
        "the global initial tensor, built on the host so every layout draws the same numbers; "
        "materialize copies the rank's slice to mesh.device",
    ("parallelize.py", "global_init", "zeros"): "as global_init's ones",
    ("parallelize.py", "global_init", "empty"): "as global_init's ones (filled from a CPU generator)",
}


def _hostless_factory_calls(root: pathlib.Path = ROOT) -> set[tuple[str, str, str]]:
    """(file, enclosing function, factory) of every torch.<factory>(...) call without device=."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), rel)

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, [*scope, child.name])
                    continue
                if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                        and isinstance(child.func.value, ast.Name) and child.func.value.id == "torch"
                        and child.func.attr in FACTORIES and not child.func.attr.endswith("_like")
                        and not any(k.arg == "device" for k in child.keywords)):
                    found.add((rel, ".".join(scope) or "<module>", child.func.attr))
                visit(child, scope)

        visit(tree, [])
    return found


def test_every_factory_names_its_device():
    found = _hostless_factory_calls()
    unexplained = sorted(found - ALLOWED.keys())
    assert not unexplained, ("tensors created without device= (they land on the CPU, and NCCL refuses "
                             f"them in a collective): {unexplained}; pass device=mesh.device, or add an "
                             "entry with the reason to ALLOWED")
    stale = sorted(ALLOWED.keys() - found)
    assert not stale, f"ALLOWED entries that no longer match a call (remove them): {stale}"


def test_scan_catches_a_hostless_factory(tmp_path):
    """The scan itself must see a device-less factory (and accept the same call with device=)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("import torch\nclass A:\n    def f(self, d):\n"
                              "        a = torch.zeros(3, device=d)\n        return torch.zeros(3)\n")
    assert _hostless_factory_calls(pkg) == {("m.py", "A.f", "zeros")}


def test_embedding_reads_no_device_ids_on_the_host():
    """On an accelerator the embedding must not sync per microbatch: ids on a non-CPU device are not
    read back (meta stands in for CUDA: reading a meta tensor's values would raise)."""
    from shardwise.mesh import Axis
    from shardwise.tensor_parallel.layers import VocabParallelEmbedding

    emb = VocabParallelEmbedding(11, 4, Axis("tp"), device="meta")
    out = emb(torch.zeros(2, 3, dtype=torch.long, device="meta"))
    assert out.shape == (2, 3, 4) and out.device.type == "meta"
    cpu = VocabParallelEmbedding(11, 4, Axis("tp"))
    with pytest.raises(ValueError, match=r"token id 11 is outside the vocabulary \[0, 11\)"):
        cpu(torch.tensor([[0, 11]]))


def test_trainer_checks_token_ids_once_per_batch_on_the_host(monkeypatch):
    """The id check moved out of the per-microbatch hot path still names the bad id and the valid range
    (the embedding's own check is switched off here, as it is on an accelerator)."""
    import shardwise.tensor_parallel.layers as layers
    from shardwise.config import TrainConfig
    from shardwise.mesh import Mesh
    from shardwise.training.trainer import Trainer

    monkeypatch.setattr(layers, "check_token_ids", lambda ids, v: None)

    cfg = TrainConfig(model="tiny", steps=1, seq_len=16, micro_batch=1, global_batch=2, progress=False)
    vocab = cfg.model_config().vocab_size
    tokens = torch.full((200,), vocab + 5, dtype=torch.long)
    trainer = Trainer(cfg, Mesh.single("cpu"), tokens=tokens)
    with pytest.raises(ValueError, match=rf"token id {vocab + 5} is outside the vocabulary \[0, {vocab}\)"):
        trainer.forward_backward(0)
