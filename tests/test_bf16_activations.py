"""bf16 activations: under --dtype bf16 the residual stream and every TP/SP/PP/CP/EP payload are bf16.

One spawn per world size runs one training step of each layout in fp32, bf16 and bf16 with
--fp32-residual, and compares the ledgers op by op: every activation payload halves against fp32
(the vocab-parallel CE's statistics stay fp32, as Megatron's, and are checked to stay equal), and
--fp32-residual brings back the fp32 residual's payloads. --grad-reduce-dtype bf16 halves the dp
gradient reduction.
"""
from __future__ import annotations

import subprocess
import sys

import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks

KW = dict(seq_len=32, micro_batch=2, steps=1, progress=False)
LAYOUTS = {  # name: (model, ParallelConfig kwargs, global batch, axis)
    "tp2": ("tiny", dict(tp=2), 4, "tp"),
    "tp2-sp": ("tiny", dict(tp=2, sequence_parallel=True), 4, "tp"),
    "pp2": ("tiny", dict(pp=2), 4, "pp"),
    "cp2": ("tiny", dict(cp=2), 4, "cp"),
    "ep2": ("tiny-moe", dict(dp=2, ep=2), 4, "ep"),
}
MODES = {"fp32": dict(dtype="fp32"), "bf16": dict(dtype="bf16"), "bf16-fp32res": dict(dtype="bf16", fp32_residual=True),
         "bf16-gr": dict(dtype="bf16", grad_reduce_dtype="bf16")}
CE_OPS = 2  # vocab-parallel CE: MAX of the logits, SUM of exp-sums and target logits (fp32 [b, s] rows)


def _ledgers(names, seed):
    out = {}
    for name in names:
        model, par, gb, _ = LAYOUTS[name]
        for mode, kw in MODES.items():
            cfg = TrainConfig(model=model, parallel=ParallelConfig(**par), seed=seed, global_batch=gb, **KW, **kw)
            cfg = cfg.resolved()
            mesh = make_mesh(cfg, torch.device("cpu"))
            trainer = Trainer(cfg, mesh)
            dtypes = set()
            hooks = [b.register_forward_hook(lambda m, a, o: dtypes.add(o.dtype)) for b in trainer.model.layers.values()]
            mesh.ledger.reset()
            trainer.train_step(0)
            for h in hooks:
                h.remove()
            out[(name, mode)] = (mesh.ledger.steps[-1]["axes"], sorted(map(str, dtypes)))
    return out


def _payload(axes, axis):
    return {op: v["bytes"] for op, v in axes.get(axis, {}).items() if ":" not in op or op.startswith("all_to_all:")}


def test_bf16_activations_halve_payloads():
    seed = fresh_seed()
    runs = {}
    for world, names in ((2, ["tp2", "tp2-sp", "pp2", "cp2"]), (2, ["ep2"])):
        for r in run_ranks(world, _ledgers, names, seed):
            for k, v in r.items():
                runs.setdefault(k, []).append(v)
    for name, (_, _, _, axis) in LAYOUTS.items():
        for rank, ((f32, d32), (b16, db), (res, dres), (gr, _)) in enumerate(zip(
                *(runs[(name, m)] for m in MODES))):
            where = f"{name} rank {rank} (seed {seed})"
            assert d32 == ["torch.float32"] and dres == ["torch.float32"] and db == ["torch.bfloat16"], where
            p32, p16, pres = _payload(f32, axis), _payload(b16, axis), _payload(res, axis)
            assert p32 and set(p32) == set(p16) == set(pres), where
            for op in p32:
                if op == "all_to_all:counts":  # int64 split sizes
                    assert p16[op] == p32[op], where
                    continue
                if axis == "tp" and op == "all_reduce":
                    if name.endswith("sp"):  # only the norms' fp32 gradient reduction (a DP-like sync)
                        assert p16[op] == p32[op], where
                        continue
                    ce = 2 * 12 * 64  # CE rows stay fp32: 2 microbatches of n·4 (max) + n·8 (sums), n = 64 tokens
                    assert p16[op] - ce == (p32[op] - ce) // 2, (where, op, p16[op], p32[op])
                    continue
                if axis == "ep":  # routed payloads follow each rank's routing: compare the ep group's total
                    continue
                assert 2 * p16[op] == p32[op], (where, op, p16[op], p32[op])
            if axis != "cp":  # ring attention's K/V blocks were bf16 already (the q/k/v projections' outputs)
                assert pres != p16, where
            for op in ("all_reduce", "reduce_scatter"):
                if op in f32.get("dp_cp", {}):
                    assert 2 * gr["dp_cp"][op]["bytes"] == f32["dp_cp"][op]["bytes"], where
    # ep: routed payloads follow each rank's routing, but the ep group's total is every row sent once
    for op in ("all_to_all:dispatch", "all_to_all:combine", "all_to_all:combine_grad", "all_to_all:dispatch_grad"):
        tot = {m: sum(r[0]["ep"][op]["bytes"] for r in runs[("ep2", m)]) for m in ("fp32", "bf16", "bf16-fp32res")}
        assert 2 * tot["bf16"] == tot["fp32"], (op, tot, seed)
    assert sum(r[0]["ep"]["all_to_all:dispatch"]["bytes"] for r in runs[("ep2", "bf16-fp32res")]) == \
        sum(r[0]["ep"]["all_to_all:dispatch"]["bytes"] for r in runs[("ep2", "fp32")]), seed


def test_bad_grad_reduce_dtype_exits_2():
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--tp", "2", "--grad-reduce-dtype", "fp8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "fp8" in lines[0] and "bf16" in lines[0], r.stderr
