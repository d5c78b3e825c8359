"""The planner's bf16 autocast weight casts (`activations.layer_cast_terms`) equal the casts a real layer holds, per
layer type: attention, gated attention, Gated DeltaNet, MLA, MoE with shared experts (and Qwen3-Next's shared gate).

Two moments, on tiny models in one 2-rank fork (tp 1, tp 2, tp 2 + SP), fp32 master weights under bf16 autocast:
* without recompute, what each layer's forward leaves saved once its autocast region has closed (the cache is gone,
  the casts its ops saved stay): `autocast_weight_bytes` of a one-layer stage;
* under full recompute (autocast's cache off), the casts of the rebuilt layer alive at the moment the planner's
  peak takes them: a dense MLP's backward once the down-projection's has run, an MoE block's routed experts' GEMMs
  once the shared experts' backward has run: `rebuilt_weight_copies`.
A cast is followed by its storage (a matmul saves a transposed view of it), named by the parameters it was made
from (the Gated DeltaNet kernels are concatenated before conv1d casts them)."""
from __future__ import annotations

import weakref

import pytest
import torch
import torch.utils.weak
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.planner import activations
from shardwise.planner.layout import Stage, from_train_config, stages

from _dist import run_ranks

HYBRID = dict(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, attn_output_gate=True,
              partial_rotary=0.5, linear_layers=(0, 1, 2), linear_k_heads=2, linear_v_heads=4, linear_k_dim=8,
              linear_v_dim=8)
HYBRID_MOE = dict(HYBRID, n_layers=2, linear_layers=(0,), moe_experts=4, moe_topk=2, moe_ffn_dim=16,
                  moe_shared_experts=1, moe_shared_gate=True)
DEEPSEEK = ModelConfig(name="deepseek-tiny", vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=4,
                       head_dim=16, ffn_dim=96, max_seq_len=64, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=24,
                       qk_rope_dim=8, v_head_dim=12, moe_experts=8, moe_topk=2, moe_ffn_dim=32, moe_shared_experts=1,
                       moe_dense_layers=(0,), moe_score="sigmoid", moe_n_group=4, moe_topk_group=2,
                       moe_routed_scaling=2.5)
MODELS = {"tiny": ("tiny", dict(n_layers=2)), "hybrid": ("tiny", HYBRID), "hybrid-moe": ("tiny", HYBRID_MOE),
          "deepseek": (DEEPSEEK, {})}
LAYOUTS = {"tp1": dict(dp=2), "tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True)}


def _config(model: str, layout: str, recompute: str) -> TrainConfig:
    name, overrides = MODELS[model]
    p = ParallelConfig(recompute=recompute, **LAYOUTS[layout])
    cfg = TrainConfig(model=name, model_overrides=dict(overrides), parallel=p, steps=1, seed=0, progress=False,
                      seq_len=32, micro_batch=2, global_batch=2 * (2 // p.tp), dtype="bf16")
    cfg = cfg.resolved()
    return cfg


class _Casts(TorchDispatchMode):
    """Every bf16 copy made of a parameter (or of a tensor made from parameters alone, named after them), followed by
    its storage; `trace` holds, per op, the indices of the live casts and how many casts were made by then."""

    def __init__(self, params: dict):
        super().__init__()
        self.source = torch.utils.weak.WeakIdKeyDictionary()
        for n, p in params.items():
            self.source[p] = n
        self.casts: list[list] = []  # [name, bytes, data_ptr, weak refs to every tensor on that storage]
        self.trace: list[tuple[frozenset, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        names = [self.source.get(a) for a in tensors]
        if isinstance(out, torch.Tensor) and tensors and all(names):
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
                self.casts.append([names[0], out.untyped_storage().nbytes(), out.data_ptr(), [weakref.ref(out)]])
            else:  # a concatenation or view of parameters
                self.source[out] = "+".join(sorted(set(names)))
        for t in (o for o in tree_leaves(out) if isinstance(o, torch.Tensor)):
            for c in self.casts:  # a view of a cast (a matmul saves its transpose) keeps the cast's storage
                if t.data_ptr() == c[2] and _live(c):
                    c[3].append(weakref.ref(t))
        self.trace.append((frozenset(j for j, c in enumerate(self.casts) if _live(c)), len(self.casts)))
        return out


def _live(c) -> bool:
    return any(r() is not None for r in c[3])


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def _measure(cases):
    """In a rank, per case: {layer: bytes of its casts saved past the forward's autocast region} and, under full
    recompute, {layer: bytes of its rebuilt casts alive at its MLP's backward moment}."""
    from shardwise.training.trainer import Trainer, make_mesh

    out = []
    for model, layout, recompute in cases:
        cfg = _config(model, layout, recompute)
        t = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        xs, _, side = t.microbatches(t.loader, 0)
        mode = _Casts(dict(t.model.named_parameters()))
        with mode:
            with t._autocast():
                logits = t.model(xs[0], **(side[0] if side else {}))
            ops, made = len(mode.trace), len(mode.casts)
            saved: dict[int, int] = {}
            for c in mode.casts:
                if _live(c) and _layer(c[0]) is not None:
                    saved[_layer(c[0])] = saved.get(_layer(c[0]), 0) + c[1]
            logits.float().square().mean().backward()
            del logits
        rebuilt: dict[int, int] = {}
        for i in range(cfg.model_config().n_layers) if recompute == "full" else ():
            again = [j for j in range(made, len(mode.casts)) if _layer(mode.casts[j][0]) == i]
            experts = {j for j in again if ".experts." in mode.casts[j][0]}
            # the rebuilt block's casts whose backward precedes the moment: an MoE block's shared experts (and
            # gate), a dense MLP's down-projection
            gone = {j for j in again if (".shared" in mode.casts[j][0] if experts
                                         else mode.casts[j][0].endswith("w2.weight"))}
            assert gone, (model, layout, i, [mode.casts[j][0] for j in again])
            k = next(k for k in range(ops, len(mode.trace))
                     if mode.trace[k][1] > max(gone) and not mode.trace[k][0] & gone)
            alive = mode.trace[k][0]
            assert experts <= alive, (model, layout, i, "the routed experts' casts are gone before the moment")
            rebuilt[i] = sum(mode.casts[j][1] for j in alive & set(again) - experts)
        out.append({"saved": saved, "rebuilt": rebuilt})
    return out


CASES = [(m, lay, rec) for m in MODELS for lay in LAYOUTS for rec in ("none", "full")]

GATED = dict(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, partial_rotary=0.5, moe_experts=4,
             moe_topk=2, moe_ffn_dim=16, moe_shared_experts=1)
GATES = [(gate, fp32) for gate in ({}, dict(attn_output_gate=True), dict(moe_shared_gate=True))
         for fp32 in (False, True)]
"""One gated-attention + MoE layer without either gate, with gated attention, with Qwen3-Next's shared-expert gate;
bf16 and fp32 residual: what each gate adds to the saved tensors (the casts' neighbours outside the mixer)."""


def _gate_config(gate: dict, fp32: bool) -> TrainConfig:
    cfg = TrainConfig(model="tiny", model_overrides=dict(GATED, **gate), parallel=ParallelConfig(dp=2), steps=1,
                      seed=0, progress=False, seq_len=32, micro_batch=2, global_batch=4, dtype="bf16",
                      fp32_residual=fp32)
    cfg = cfg.resolved()
    return cfg


def _saved(gates) -> list[int]:
    """In a rank: the bytes of the distinct non-parameter storages one microbatch's forward saves, per config."""
    from shardwise.training.trainer import Trainer, make_mesh

    out = []
    for gate, fp32 in gates:
        cfg = _gate_config(gate, fp32)
        t = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        skip = {p.untyped_storage()._cdata for p in t.model.parameters()}
        seen: dict[int, int] = {}

        def pack(x):
            if x.untyped_storage()._cdata not in skip:
                seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        xs, _, _ = t.microbatches(t.loader, 0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), t._autocast():
            t.model(xs[0])
        out.append(sum(seen.values()))
    return out


def _both(cases, gates):
    return _measure(cases), _saved(gates)


def _planned(model: str, layout: str, recompute: str) -> tuple[dict, dict]:
    """The planner's figures of `_measure` for the same runs: per layer, a one-layer stage of its kind."""
    spec, lay, wl = from_train_config(_config(model, layout, recompute))
    saved, rebuilt = {}, {}
    for i in range(spec.n_layers):
        moe, linear = spec.is_moe_layer(i), spec.is_linear_layer(i)
        one = Stage(0, int(not moe), int(moe), False, False, (moe,), linear=(linear,))
        saved[i] = activations.autocast_weight_bytes(spec, one, lay, wl)
        if recompute == "full":
            rebuilt[i] = activations.rebuilt_weight_copies(spec, one, lay, wl, moe=moe)
    return {k: v for k, v in saved.items() if v}, rebuilt


@pytest.mark.slow
def test_casts_equal_the_runtimes():
    """Both cast figures equal the real layers' at every layer of every case; and (same fork) each gate adds to the
    saved tensors what the planner adds: gated attention sigmoid's output and the product (2·e·n·hq·d_v), the shared
    gate the shared experts' output and sigmoid's (e·n·(h + 1)) and, over an fp32 residual, its input's own cast."""
    measured, saved = run_ranks(2, _both, CASES, GATES, timeout_s=300)[0]
    planned = []
    for gate, fp32 in GATES:
        spec, lay, wl = from_train_config(_gate_config(gate, fp32))
        planned.append(activations.microbatch_activation_bytes(spec, stages(spec, lay)[0], lay, wl)["total"])
    for j in range(2, len(GATES)):  # against the same residual's ungated layer
        got, want = saved[j] - saved[j % 2], planned[j] - planned[j % 2]
        assert got == want and got > 0, (GATES[j], "traced", got, "planned", want)
    bad = []
    for case, got in zip(CASES, measured):
        saved, rebuilt = _planned(*case)
        if got["saved"] != saved or got["rebuilt"] != rebuilt:
            bad.append((case, "traced", got, "planned", saved, rebuilt))
    assert not bad, bad
    # every layer type was checked at both moments, with casts to count
    assert all(measured[CASES.index((m, "tp1", "full"))]["rebuilt"].values() for m in MODELS)
    assert all(measured[CASES.index((m, "tp1", "none"))]["saved"] for m in MODELS)
