"""The parameter inventory (`shardwise/rules/inventory.py`) is the runtime's parameters, and the only list of them.

A tiny model of each family has, parameter for parameter and in order, the inventory's names, shapes, init rules,
head-partial and expert flags; on a fake world its TP/EP shards are the inventory's split dimensions and local
shapes, and the TP reduction each gradient gets is the one the inventory's flags imply. A scan of the source fails
when a parameter list or one of the inventory's constants is written in a second place.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from shardwise.config import MODEL_PRESETS, ModelConfig
from shardwise.rules import inventory

TINY, TINY_MOE = MODEL_PRESETS["tiny"], MODEL_PRESETS["tiny-moe"]
FAMILIES = {
    "llama": TINY,
    "llama-moe": TINY_MOE,
    "qwen3": dataclasses.replace(TINY_MOE, qk_norm=True, attention_bias=True, tie_embeddings=True),
    "qwen3-next": dataclasses.replace(  # Gated DeltaNet, gated attention, shared-expert gate
        TINY_MOE, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, attn_output_gate=True,
        partial_rotary=0.5, linear_layers=(0, 1, 2), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
        linear_v_dim=8, moe_every=1, moe_shared_gate=True),
    "deepseek-v3": ModelConfig(  # MLA with a query latent, sigmoid-routed experts, dense first layer, MTP
        name="deepseek-mtp", vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=96,
        max_seq_len=64, q_lora_rank=32, kv_lora_rank=24, qk_rope_dim=8, v_head_dim=12, moe_experts=8, moe_topk=2,
        moe_ffn_dim=32, moe_shared_experts=1, moe_dense_layers=(0,), moe_score="sigmoid", mtp_layers=2),
    "mla-no-q-latent": ModelConfig(name="mla", vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=4,
                                   head_dim=16, ffn_dim=96, max_seq_len=64, kv_lora_rank=24, qk_rope_dim=8,
                                   v_head_dim=12),
    "gpt-oss": dataclasses.replace(  # sinks, attention and expert biases, sliding layers
        TINY_MOE, attention_sinks=True, attention_bias=True, attention_out_bias=True, moe_router_bias=True,
        moe_expert_bias=True, moe_swiglu_limit=7.0, moe_shared_experts=0, sliding_window=8, sliding_layers=(0, 2)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_runtimes_parameters_are_the_inventory(family):
    from shardwise.models.params import head_partial, init_of
    from shardwise.parallelize import plain_model
    from shardwise.planner.models import ModelSpec, total_params

    cfg = FAMILIES[family]
    with torch.device("meta"):
        model = plain_model(cfg)
    got = [(n, tuple(p.shape), init_of(p, n), head_partial(p), getattr(p, "_sw_expert", False))
           for n, p in model.named_parameters()]
    want = [(p.name, p.shape, p.init, p.head_partial, p.expert) for p in inventory.model(cfg)]
    assert got == want
    assert [p.matrix for p in inventory.model(cfg)] == [p.ndim >= 2 for p in model.parameters()]
    assert total_params(ModelSpec.of(cfg)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_zero3_units_are_the_inventorys(family):
    """The reducer's ZeRO-3 units are the inventory's, in order, each holding the parameters `unit_of` assigns it."""
    from shardwise.data_parallel.reducer import model_units
    from shardwise.parallelize import plain_model

    cfg = FAMILIES[family]
    with torch.device("meta"):
        model = plain_model(cfg)
    model.chunks = None
    names = {id(m): n for n, m in model.named_modules()}
    units = [names[id(m)] for _, m in model_units(model)]
    assert units == inventory.zero_units(range(cfg.n_layers), True, True, cfg.mtp_layers)
    owner = {id(p): u for u in units for p in model.get_submodule(u).parameters()}
    assert all(owner[id(p)] == inventory.unit_of(n) for n, p in model.named_parameters())


SHARDED = {  # family, layout: TP with SP and EP; K/V heads kept whole (n_kv_heads < tp); MLA and MTP; Gated DeltaNet
    "gpt-oss tp2 ep2": ("gpt-oss", dict(dp=2, tp=2, ep=2)),
    "llama kv2 tp4": ("llama", dict(tp=4)),
    "deepseek-v3 tp2 ep2": ("deepseek-v3", dict(dp=2, tp=2, ep=2)),
    "qwen3-next tp2": ("qwen3-next", dict(tp=2)),
}


@pytest.mark.parametrize("case", SHARDED)
def test_split_dims_are_the_runtimes_tensor_and_expert_plans(case):
    """One rank of a fake world builds the model: each parameter's shard (split dim, local shape) and the TP
    reduction its gradient gets are what the inventory's entry says."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.parallelize import build_model
    from shardwise.simulate.dispatch_key import fake_mode
    from shardwise.simulate.world import fake_mesh
    from shardwise.tensor_parallel.layers import get_spec
    from shardwise.training.assemble import assemble

    family, layout = SHARDED[case]
    model_cfg = FAMILIES[family]
    if family == "llama":
        model_cfg = dataclasses.replace(model_cfg, n_kv_heads=2)
    parallel = ParallelConfig(sequence_parallel=True, **layout)
    cfg = assemble(TrainConfig(model=model_cfg, parallel=parallel, seq_len=16, micro_batch=1, steps=1,
                               global_batch=parallel.dp, progress=False, report=False))
    tp, ep = parallel.tp, parallel.ep
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=parallel.world_size)
    try:
        with fake_mode(True):
            model = build_model(cfg.model_config(), fake_mesh(cfg), 0, cfg.parallel)
            runtime = {n: (tuple(p.shape), get_spec(p)) for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    entries = inventory.model(cfg.model_config())
    assert list(runtime) == [e.name for e in entries]
    for e in entries:
        shape, spec = runtime[e.name]
        dim = 0 if e.expert else {"col": 0, "vocab": 0, "row": 1, "rep": None}[e.tp]
        reduce = ("tp_kv" if e.whole_heads(tp) else "tp_sum" if e.sp_replicated or e.head_partial else None)
        assert (shape, spec.dim, spec.global_shape, spec.grad_reduce) == (
            e.local_shape(tp, ep), dim, e.shape, reduce), e.name


# ------------------------------------------------------------------------- no second copy
ROOT = Path(__file__).resolve().parents[1] / "shardwise"
CONSTANTS = ("CHUNK", "INITS", "TP_SPLITS")
"""The inventory's constants: assigned in rules/inventory.py only."""
CREATORS = {("models/params.py", "create"), ("models/params.py", "linear_of"),
            ("expert_parallel/experts.py", "_expert_param")}
"""The only functions that make a parameter or a linear layer in the model packages: each from an inventory entry."""
MODEL_PACKAGES = ("models", "expert_parallel")


def _functions(tree):
    """(node, enclosing function name) for every node of a module."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            yield child, name
            yield from walk(child, name)
    return walk(tree, None)


def _call_name(node) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def second_copies(root: Path = ROOT) -> list[str]:
    """Where a parameter inventory or one of its constants is written outside rules/inventory.py: an assignment
    of an inventory constant; a parameter or linear layer made in the model packages other than from an entry; a
    planner tensor or Muon matrix made other than from an entry (in an `of` constructor); a literal list of the runtime's parameter names in the planner
    or the model packages."""
    names = {p.name.split(".")[-2] if p.name.endswith((".weight", ".bias")) else p.name.split(".")[-1]
             for cfg in FAMILIES.values() for p in inventory.model(cfg)}
    names -= {"weight", "bias"}
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("rules/"):
            continue
        package = rel.split("/")[0]
        for node, fn in _functions(ast.parse(path.read_text(), rel)):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out += [f"{where}: {t.id} =" for t in targets if isinstance(t, ast.Name) and t.id in CONSTANTS]
            if isinstance(node, ast.Call):
                call = _call_name(node)
                if package in MODEL_PACKAGES and call in ("Parameter", "Linear") and (rel, fn) not in CREATORS:
                    out.append(f"{where}: nn.{call}(...) not from an inventory entry")
                if package == "planner" and call in ("Tensor", "Matrix") and fn != "of":
                    out.append(f"{where}: {call}(...) not from an inventory entry")
            if package in ("planner", *MODEL_PACKAGES) and isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if sum(x in names for x in listed) >= 2:
                    out.append(f"{where}: parameter names {listed}")
    return out


def test_the_inventory_is_written_once():
    assert second_copies() == []


def test_a_second_copy_is_found(tmp_path):
    """The scan sees each kind of copy (the check above is not vacuous)."""
    pkg = tmp_path / "shardwise"
    for sub in ("planner", "models", "rules"):
        (pkg / sub).mkdir(parents=True)
    (pkg / "rules" / "inventory.py").write_text("CHUNK = 64\n")
    (pkg / "planner" / "linear_attention.py").write_text("CHUNK = 64\n")
    (pkg / "planner" / "models.py").write_text("def attention_tensors(h):\n    return [Tensor(h * h)] * 4\n")
    (pkg / "planner" / "muon.py").write_text("def attention_matrices(h, tp):\n"
                                             "    return [Matrix(h, h, h * h // tp, tp_split=tp > 1)] * 4\n")
    (pkg / "models" / "mla.py").write_text("ORDER = ('wq_a', 'wkv_a', 'wkv_b')\n"
                                           "def make(d):\n    return nn.Parameter(torch.empty(d))\n")
    found = second_copies(pkg)
    assert [f.split(":")[0] for f in found] == ["models/mla.py", "models/mla.py", "planner/linear_attention.py",
                                                "planner/models.py", "planner/muon.py"], found
