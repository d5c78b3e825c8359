"""Checkpoint I/O off the training communicator, and resume across device types.

* One 2-rank fork: every DCP save / async_save / load and resume's checksum agreement run on the mesh's
  `ckpt` group (gloo, long timeout), never on the training group (on NCCL a slow filesystem would trip
  the watchdog); async saves stage into host buffers that the next save reuses.
* One process: a checkpoint recorded as saved on `cuda` (16-byte generator states in its rank file) resumes
  on CPU — parameters, optimizer state and host RNG restored, the device RNG re-seeded from (seed, step)
  with one warning. Before, a device-type change raised "RNG state is wrong size".
"""
from __future__ import annotations

import base64
import json
import logging
import os

import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.data.checksum import sha256_file
from shardwise.mesh import Mesh
from shardwise.training.trainer import Trainer

from _dist import fresh_seed, run_ranks


def _cfg(seed, **par) -> TrainConfig:
    cfg = TrainConfig(model="tiny", parallel=ParallelConfig(**par), steps=3, seq_len=16, micro_batch=2,
                      global_batch=4, seed=seed, progress=False, report=False)
    cfg = cfg.resolved()
    return cfg


def _io_groups(root: str, seed: int):
    import torch.distributed.checkpoint as dcp

    from shardwise import comm
    from shardwise.checkpoint import load_checkpoint, save_checkpoint, wait_for_save
    from shardwise.training.trainer import make_mesh

    cfg = _cfg(seed, dp=2, zero=1)
    t = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
    seen = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            seen.append((name, kw.get("process_group")))
            return fn(*a, **kw)
        return wrapped

    gathers = []
    real_gather = comm.all_gather_object
    for name in ("save", "async_save", "load"):  # spies that call through: the saves and the load are real
        setattr(dcp, name, spy(name, getattr(dcp, name)))
    t.train_step(0)
    try:
        save_checkpoint(root, 1, t)
        t.train_step(1)
        save_checkpoint(root, 2, t, async_save=True)
        first = {k: [id(b) for _, b in boxes] for k, (_, boxes) in t._ckpt_staging.items()}
        t.train_step(2)
        save_checkpoint(root, 3, t, async_save=True)
        wait_for_save(t)
        again = {k: [id(b) for _, b in boxes] for k, (_, boxes) in t._ckpt_staging.items()}
        fresh = Trainer(cfg, t.mesh)
        comm.all_gather_object = lambda obj, axis: gathers.append(axis.name) or real_gather(obj, axis)
        info = load_checkpoint(root, fresh)
    finally:
        comm.all_gather_object = real_gather
    ckpt = t.mesh["ckpt"].group
    return {"calls": [n for n, _ in seen], "on_ckpt": [pg is ckpt for _, pg in seen],
            "not_world": ckpt is not t.mesh["world"].group, "gathers": gathers, "step": info["step"],
            "reused": first == again and t._ckpt_staging_reused == sum(map(len, again.values())) > 0}


def test_checkpoint_io_runs_on_the_ckpt_group(tmp_path):
    for r in run_ranks(2, _io_groups, str(tmp_path), fresh_seed()):
        assert r["calls"] == ["save", "async_save", "async_save", "load"], r
        assert all(r["on_ckpt"]) and r["not_world"], r
        assert r["gathers"] and set(r["gathers"]) == {"ckpt"}, r  # newest_intact's agreement
        assert r["step"] == 3 and r["reused"], r


def _retag_as_cuda(path: str) -> None:
    """Make a CPU checkpoint look saved on CUDA: 16-byte tracker states, device cuda; manifest updated."""
    rank_file, meta_file = os.path.join(path, "rank0.json"), os.path.join(path, "meta.json")
    rng = json.load(open(rank_file))
    cuda_state = base64.b64encode(bytes(range(16))).decode()  # a CUDA generator's state: seed + offset
    rng["device"], rng["tracker_rng"] = "cuda", {k: cuda_state for k in rng["tracker_rng"]}
    json.dump(rng, open(rank_file, "w"))
    meta = json.load(open(meta_file))
    meta["layout"]["device"] = "cuda"
    json.dump(meta, open(meta_file, "w"))
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    for name in ("rank0.json", "meta.json"):
        manifest["files"][name] = {"bytes": os.path.getsize(os.path.join(path, name)),
                                   "sha256": sha256_file(os.path.join(path, name))}
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))


def test_cuda_checkpoint_resumes_on_cpu(tmp_path, caplog):
    from shardwise.checkpoint import load_checkpoint, save_checkpoint

    seed = fresh_seed()
    mesh = Mesh.single(torch.device("cpu"))
    t = Trainer(_cfg(seed), mesh)
    t.train_step(0)
    t.train_step(1)
    path = save_checkpoint(str(tmp_path), 2, t)
    assert json.load(open(os.path.join(path, "meta.json")))["layout"]["device"] == "cpu"
    host_rng = torch.get_rng_state()
    same = Trainer(_cfg(seed), mesh)  # same device: every stream replays
    load_checkpoint(str(tmp_path), same)
    for k, g in same.model.rng_tracker.generators.items():
        assert torch.equal(g.get_state(), t.model.rng_tracker.generators[k].get_state()), (k, seed)

    _retag_as_cuda(path)
    torch.manual_seed(seed + 1)  # the host stream must come back from the checkpoint
    fresh = Trainer(_cfg(seed), mesh)
    built = {k: g.initial_seed() for k, g in fresh.model.rng_tracker.generators.items()}
    with caplog.at_level(logging.WARNING, logger="shardwise.checkpoint"):
        info = load_checkpoint(str(tmp_path), fresh)
    assert info["step"] == 2 and info["layout"]["device"] == "cuda"
    assert torch.equal(torch.get_rng_state(), host_rng), seed
    for (n, p), (_, q) in zip(t.model.named_parameters(), fresh.model.named_parameters()):
        assert torch.equal(p, q), (n, seed)
    for p, q in zip(t.reducer.optimizer.param_groups[0]["params"], fresh.reducer.optimizer.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(t.reducer.optimizer.state[p][key], fresh.reducer.optimizer.state[q][key]), seed
    for k, g in fresh.model.rng_tracker.generators.items():  # re-seeded deterministically from (seed, step)
        want = torch.Generator().manual_seed((built[k] + 1_000_003 * 2) % 2**63)
        assert torch.equal(g.get_state(), want.get_state()), (k, seed)
    lines = [r.getMessage() for r in caplog.records if "saved on cuda and resumes on cpu" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert t.train_step(2)["loss"] == fresh.train_step(2)["loss"], seed  # the run goes on identically
