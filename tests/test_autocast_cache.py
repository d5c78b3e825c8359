"""Full recompute runs its blocks with autocast's weight cache off: the same losses, gradients and weights bit
for bit as with the cache, and at the end of a bf16 forward no bf16 copy of a recomputed block's weight is
alive (the cache would hold every one of them until the forward's autocast region ends); `shardwise
simulate` measures the live peak the planner now plans (one weight copy in a forward), and the cached
runtime's peak beyond it."""
from __future__ import annotations

import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise.recompute as recompute
from shardwise.cli import main
from shardwise.config import ParallelConfig, TrainConfig
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks


class _Copies(TorchDispatchMode):
    """Weak references to every bf16 copy made of a parameter, by parameter name."""

    def __init__(self, params: dict):
        super().__init__()
        self.by_ptr = {p.data_ptr(): n for n, p in params.items()}
        self.copies: list[tuple[str, weakref.ref]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor)
                and out.dtype == torch.bfloat16 and args[0].data_ptr() in self.by_ptr):
            self.copies.append((self.by_ptr[args[0].data_ptr()], weakref.ref(out)))
        return out

    def alive(self) -> set[str]:
        return {n for n, ref in self.copies if ref() is not None}


def _trainer(seed, layers=None):
    cfg = TrainConfig(model="tiny", parallel=ParallelConfig(recompute="full", recompute_layers=layers), steps=3,
                      seed=seed, progress=False, seq_len=32, micro_batch=2, global_batch=4, dtype="bf16")
    cfg = cfg.resolved()
    return Trainer(cfg, make_mesh(cfg, torch.device("cpu")))


def _run(seed, cached: bool, layers=None):
    """Losses of 3 steps, then the 4th step's gradients and the weights: with the cache on or off."""
    uncached = recompute._uncached
    if cached:
        recompute._uncached = lambda fn: fn
    try:
        t = _trainer(seed, layers)
        losses = [t.train_step(step)["loss"] for step in range(3)]
        losses.append(t.forward_backward(3))
        t.finish_gradients()
    finally:
        recompute._uncached = uncached
    return (losses, {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None},
            {n: p.detach().clone() for n, p in t.model.named_parameters()})


def _alive_after_forward(seed, layers, cached: bool) -> set[str]:
    """Names of the parameters whose bf16 copy is alive at the end of one forward (inside its autocast region)."""
    uncached = recompute._uncached
    if cached:
        recompute._uncached = lambda fn: fn
    try:
        t = _trainer(seed, layers)
        xs, _, side = t.microbatches(t.loader, 0)
        mode = _Copies(dict(t.model.named_parameters()))
        with t._autocast(), mode:
            logits = t.model(xs[0], **(side[0] if side else {}))
            alive = mode.alive()
        del logits
    finally:
        recompute._uncached = uncached
    return alive


def _checks(seed):
    bad = []
    for layers in (None, 1):  # every block recomputed; --recompute-layers 1 (the first block only)
        off, on = _run(seed, False, layers), _run(seed, True, layers)
        if off[0] != on[0]:
            bad.append((layers, f"losses {off[0]} != {on[0]}"))
        for i, what in ((1, "grad"), (2, "weight")):
            if off[i].keys() != on[i].keys() or not off[i]:
                bad.append((layers, f"different {what}s"))
            bad += [(layers, what, n) for n, g in off[i].items() if not torch.equal(g, on[i][n])]
    blocks = {int(i) for i in _trainer(seed).model.layers}
    for layers, recomputed in ((None, blocks), (1, {min(blocks)})):
        cached, now = _alive_after_forward(seed, layers, True), _alive_after_forward(seed, layers, False)
        was = {n for n in cached if n.startswith("layers.") and int(n.split(".")[1]) in recomputed}
        left = {n for n in now if n.startswith("layers.") and int(n.split(".")[1]) in recomputed}
        if not was:
            bad.append((layers, "no cached copy of a recomputed block seen: the check cannot fail"))
        if left:
            bad.append((layers, f"copies of recomputed blocks alive after the forward: {sorted(left)}"))
        if now != cached - was:  # the LM head's copy and the other blocks' (saved for backward) stay
            bad.append((layers, f"alive {sorted(now)}, expected {sorted(cached - was)}"))
    return bad


def test_uncached_full_recompute_is_exact_and_frees_the_copies():
    seed = fresh_seed()
    bad = run_ranks(1, _checks, seed)[0]
    assert bad == [], f"seed {seed}: {bad}"


def _simulate(capsys) -> tuple[int, dict]:
    rc = main(["simulate", "--tp", "2", "--sequence-parallel", "--recompute", "full", "--dtype", "bf16",
               "--seq-len", "64", "--micro-batch", "2", "--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ranks"][0]


def test_simulated_peak_is_planned_and_the_cache_would_exceed_it(capsys, monkeypatch):
    """tiny tp2 SP, full recompute, bf16: every figure within simulate's bounds; with the cache back on
    (every block's copies alive at the end of the forward) the measured peak is beyond the planned one."""
    rc, r = _simulate(capsys)
    assert rc == 0 and r["passed"], r
    monkeypatch.setattr(recompute, "_uncached", lambda fn: fn)
    rc, cached = _simulate(capsys)
    assert rc == 1 and cached["peak_phase"] == "forward", cached
    assert cached["peak_bytes"]["planned"] == r["peak_bytes"]["planned"]  # the plan does not depend on the runtime
    assert cached["peak_bytes"]["measured"] > 1.03 * cached["peak_bytes"]["planned"]
