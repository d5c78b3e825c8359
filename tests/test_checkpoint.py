"""Resharding checkpoints: save under tp=2 × dp=2, load under tp=4, dp=2 × ZeRO-1 and one device; pp=2.

Three spawns in all (4, 4 and 2 ranks); the module-scoped `saved` fixture trains and saves once.
Parameters and AdamW state are compared exactly against the saved global tensors (ZeRO-1 state
is all-gathered over dp independently of the checkpoint code); logits across layouts to fp32
reduction-order tolerance; the resumed next-step loss on the saving layout bit for bit.
"""
import argparse
import dataclasses
import os
import shutil

import pytest
import torch

from shardwise import comm
from shardwise.checkpoint import (STATE_KEYS, flat_boxes, list_checkpoints, load_checkpoint, load_global_tensors,
                                  save_checkpoint)
from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.tensor_parallel.layers import get_spec
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks

# n_kv_heads=2 < tp=4 shares K/V heads between ranks; vocab 257 pads under tp=2 and tp=4; tied embeddings
# make the ZeRO-1 dp=2 split fall mid-row (partial-row boxes).
MODEL = ModelConfig(name="ckpt", vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    max_seq_len=64, tie_embeddings=True)
LOGIT_TOL = dict(atol=2e-5, rtol=1e-5)


def _cfg(seed, **degrees) -> TrainConfig:
    return TrainConfig(model=MODEL, parallel=ParallelConfig(**degrees), steps=6, warmup_steps=2, seq_len=32,
                       micro_batch=2, global_batch=4, seed=seed, dropout=0.1, attn_dropout=0.1, progress=False)


def _trainer(cfg) -> Trainer:
    return Trainer(cfg, make_mesh(cfg, torch.device("cpu")))


def _logits(trainer) -> torch.Tensor:
    """Full-vocabulary eval logits on a fixed batch (vocab shards gathered over TP, padding dropped)."""
    x, _ = trainer.loader.global_batch_at(0)
    trainer.model.eval()
    with torch.no_grad():
        out = comm.all_gather(trainer.model(x[:2]), trainer.mesh["tp"], dim=-1)[..., :MODEL.vocab_size]
    trainer.model.train()
    return out


def _state_mismatch(trainer, path) -> float:
    """Max |local - saved| over every parameter and AdamW state slice this rank holds (padding must be 0)."""
    red = trainer.reducer
    saved = load_global_tensors(path, "model.")
    saved |= {f"optim.{k}": v for k, v in load_global_tensors(path, "optim.").items()}
    local = {n: p.detach() for n, p in red.named}
    if red.zero:
        for g in red.flat:
            for key in STATE_KEYS:
                full = comm.all_gather(red.optimizer.state[g["shard"]][key], g["axis"])
                local |= {f"optim.{n}.{key}": full[off:off + k].view(p.shape) for n, p, off, k in g["offsets"]}
    else:
        local |= {f"optim.{n}.{key}": red.optimizer.state[p][key] for n, p in red.named for key in STATE_KEYS}
    specs = {n: get_spec(p) for n, p in red.named} | {f"optim.{n}.{key}": get_spec(p) for n, p in red.named
                                                        for key in STATE_KEYS}
    assert sorted(local) == sorted(specs) and set(local) <= set(saved)
    return max(float((mine - specs[k].local_slice(saved[k])).abs().max()) for k, mine in local.items())


def _train_and_save(cfg, root):
    """tp=2 × dp=2: train 3 steps saving after each (keep=2); logits after steps 2 and 3; loss of step 4."""
    t = _trainer(cfg)
    logits = {}
    for step in range(3):
        t.train_step(step)
        save_checkpoint(root, step + 1, t, {"completed": step + 1}, keep=2)
        logits[step + 1] = _logits(t)
    return {"logits": logits, "next_loss": t.train_step(3)["loss"]}


def _untied(cfg) -> TrainConfig:
    """PP refuses tied embeddings; no dropout, so another layout can match its losses."""
    return dataclasses.replace(cfg, model=dataclasses.replace(MODEL, tie_embeddings=False), dropout=0.0,
                               attn_dropout=0.0)


def _load_tp4_then_resume(cfg_tp4, cfg_same, cfg_pp, root, root_pp):
    """Three layouts in one process group: load under tp=4; resume the saving layout; save under pp=2 × tp=2."""
    t = _trainer(cfg_tp4)
    info = load_checkpoint(root, t)
    out = {"info": info, "step": t.step, "logits": _logits(t), "mismatch": _state_mismatch(t, info["path"])}
    t_same = _trainer(cfg_same)
    load_checkpoint(root, t_same)
    out["resumed_loss"] = t_same.train_step(3)["loss"]
    t_pp = _trainer(cfg_pp)
    t_pp.train_step(0)
    path = save_checkpoint(root_pp, 1, t_pp)
    return out | {"pp_mismatch": _state_mismatch(t_pp, path), "pp_next_loss": t_pp.train_step(1)["loss"]}


def _zero1_load_train_save(cfg, root, root2):
    t = _trainer(cfg)
    info = load_checkpoint(root, t)
    out = {"step": info["step"], "logits": _logits(t), "mismatch": _state_mismatch(t, info["path"])}
    g2d = next(g for g in t.reducer.flat if g["offsets"][0][1].ndim == 2)
    lo = g2d["axis"].rank * g2d["per"]  # where this rank's ZeRO range starts in the 2-D group
    out["mid_row"] = any(off < lo < off + k and (lo - off) % p.shape[-1] for _, p, off, k in g2d["offsets"])
    t.train_step(3)
    path = save_checkpoint(root2, 4, t)
    out |= {"logits_after": _logits(t), "mismatch_after": _state_mismatch(t, path)}
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    seed = fresh_seed()
    root = str(tmp_path_factory.mktemp("ckpt") / "run")
    result = run_ranks(4, _train_and_save, _cfg(seed, tp=2, dp=2), root)[0]
    return dict(result, seed=seed, root=root)


def test_flat_boxes_cover_ranges_exactly():
    for shape, lo, hi in [((5, 7), 3, 30), ((5, 7), 0, 35), ((5, 7), 7, 14), ((4, 3, 5), 2, 57), ((9,), 2, 6),
                          ((3, 4), 5, 6), ((3, 4), 4, 4)]:
        seen = torch.zeros(shape, dtype=torch.long)
        for idx, sizes, start in flat_boxes(shape, lo, hi):
            flat = torch.arange(torch.Size(shape).numel()).view(shape)
            box = flat[tuple(slice(i, i + s) for i, s in zip(idx, sizes))]
            assert box.flatten().tolist() == list(range(start, start + box.numel())), (shape, idx, sizes)
            seen[tuple(slice(i, i + s) for i, s in zip(idx, sizes))] += 1
        assert seen.flatten().tolist() == [int(lo <= i < hi) for i in range(seen.numel())], (shape, lo, hi)


def test_keep_prunes_and_latest_points_at_newest(saved):
    assert sorted(os.listdir(saved["root"])) == ["latest", "step-2", "step-3"]
    assert open(os.path.join(saved["root"], "latest")).read().strip() == "step-3"
    assert [s for s, _ in list_checkpoints(saved["root"])] == [3, 2]


def test_load_under_tp4_resume_bitwise_and_pipeline_save(saved, tmp_path):
    seed = saved["seed"]
    root_pp = str(tmp_path / "pp")
    out = run_ranks(4, _load_tp4_then_resume, _cfg(seed, tp=4), _cfg(seed, tp=2, dp=2),
                    _untied(_cfg(seed, pp=2, tp=2)), saved["root"], root_pp)
    for r in out:
        assert r["step"] == 3 and r["info"]["extra_state"] == {"completed": 3} and not r["info"]["skipped"]
        assert r["mismatch"] == 0.0 and r["pp_mismatch"] == 0.0, (seed, r)
        torch.testing.assert_close(r["logits"], saved["logits"][3], **LOGIT_TOL)
    # Same layout, RNG streams restored: CPU fp32 with fixed gloo reduction order is bitwise reproducible.
    assert out[0]["resumed_loss"] == saved["next_loss"], (seed, out[0]["resumed_loss"], saved["next_loss"])
    # Pipeline stages hold disjoint layers under global names: one device picks them all up.
    single = _trainer(_untied(_cfg(seed)))
    assert load_checkpoint(root_pp, single)["step"] == 1
    assert _state_mismatch(single, os.path.join(root_pp, "step-1")) == 0.0
    assert abs(single.train_step(1)["loss"] - out[0]["pp_next_loss"]) < 1e-5, seed


def test_zero1_loads_tp_checkpoint_and_saves_one_that_reshards(saved, tmp_path):
    root2 = str(tmp_path / "zero1")
    out = run_ranks(2, _zero1_load_train_save, _cfg(saved["seed"], dp=2, zero=1), saved["root"], root2)
    for r in out:
        assert r["step"] == 3 and r["mismatch"] == 0.0 and r["mismatch_after"] == 0.0, (saved["seed"], r)
        torch.testing.assert_close(r["logits"], saved["logits"][3], **LOGIT_TOL)
    assert out[1]["mid_row"]  # the dp split cuts a weight mid-row: partial-row boxes are exercised
    single = _trainer(_cfg(saved["seed"]))  # no process group here: the single-device mesh
    assert load_checkpoint(root2, single)["step"] == 4 and single.step == 4
    assert _state_mismatch(single, os.path.join(root2, "step-4")) == 0.0
    torch.testing.assert_close(_logits(single), out[0]["logits_after"], **LOGIT_TOL)


def test_single_device_load_and_safetensors_round_trip(saved, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    from shardwise.commands import checkpoint as checkpoint_cli

    t = _trainer(_cfg(saved["seed"]))
    info = load_checkpoint(saved["root"], t)
    assert info["step"] == 3 and info["layout"]["tp"] == 2 and info["layout"]["world"] == 4
    assert _state_mismatch(t, info["path"]) == 0.0
    torch.testing.assert_close(_logits(t), saved["logits"][3], **LOGIT_TOL)
    parser = argparse.ArgumentParser()
    checkpoint_cli.add_parser(parser.add_subparsers(dest="command"))
    out = str(tmp_path / "model.safetensors")
    args = parser.parse_args(["checkpoint", "convert", saved["root"], "--to-safetensors", out])
    assert args.func(args) == 0
    weights = safetensors.load_file(out)
    state = t.model.state_dict()
    assert sorted(weights) == sorted(set(state) - {"output.weight"})  # tied to tok_embeddings.weight: stored once
    for name, w in weights.items():
        assert w.shape == state[name].shape and torch.equal(w, state[name]), name
    again = str(tmp_path / "again")  # a single-process save, twice at one step (as after a resume)
    for _ in range(2):
        save_checkpoint(again, 3, t, keep=1)
    assert sorted(os.listdir(again)) == ["latest", "step-3"]
    t2 = _trainer(_cfg(saved["seed"]))
    assert load_checkpoint(again, t2)["step"] == 3 and _state_mismatch(t2, os.path.join(again, "step-3")) == 0.0


def test_corrupt_or_incomplete_checkpoints_fall_back(saved, tmp_path, caplog):
    root = str(tmp_path / "copy")
    shutil.copytree(saved["root"], root)
    data = sorted(f for f in os.listdir(os.path.join(root, "step-3")) if f.endswith(".distcp"))[-1]
    with open(os.path.join(root, "step-3", data), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    shutil.copytree(os.path.join(root, "step-2"), os.path.join(root, "step-7"))  # as if it died before the manifest
    os.remove(os.path.join(root, "step-7", "manifest.json"))
    os.makedirs(os.path.join(root, "tmp-step-9"))  # an unpublished save is never a candidate
    os.rename(os.path.join(root, "latest"), os.path.join(root, "latest.kept"))  # no `latest`: every step-N, newest first
    t = _trainer(_cfg(saved["seed"]))
    with caplog.at_level("WARNING", logger="shardwise.checkpoint"):
        info = load_checkpoint(root, t)
    assert info["step"] == 2 and t.step == 2
    reasons = dict(info["skipped"])
    assert list(reasons) == [os.path.join(root, "step-7"), os.path.join(root, "step-3")]
    assert "no manifest.json" in reasons[os.path.join(root, "step-7")]
    assert data in reasons[os.path.join(root, "step-3")] and "truncated" in reasons[os.path.join(root, "step-3")]
    assert "step-3" not in caplog.text  # the caller reports the skipped ones, once (`info["skipped"]`)
    torch.testing.assert_close(_logits(t), saved["logits"][2], **LOGIT_TOL)
    os.rename(os.path.join(root, "latest.kept"), os.path.join(root, "latest"))  # names step-3: step-7 is no candidate
    info = load_checkpoint(root, _trainer(_cfg(saved["seed"])))
    assert info["step"] == 2 and [p for p, _ in info["skipped"]] == [os.path.join(root, "step-3")]
    assert load_checkpoint(str(tmp_path / "empty"), _trainer(_cfg(saved["seed"]))) is None
