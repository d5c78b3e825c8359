"""--async-save: checkpoints written by torch.distributed.checkpoint.async_save while training goes on.

One 2-rank fork trains the same run with synchronous and asynchronous saves (their checkpoints must
hold the same tensors and metadata) and resumes from an async-saved checkpoint (bitwise); a second
fork crashes a rank while a save is pending, which must leave the previous checkpoint as `latest`.
"""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from shardwise import checkpoint
from shardwise.config import ParallelConfig, TrainConfig
from shardwise.training.launch import RankError

from _dist import fresh_seed, run_ranks


def _cfg(out, seed, **kw) -> TrainConfig:
    cfg = TrainConfig(parallel=ParallelConfig(dp=2, zero=1), steps=4, seq_len=32, micro_batch=2, seed=seed,
                      progress=False, report=False, out=str(out), **dict(save_every=2) | kw)
    cfg = cfg.resolved()
    return cfg


def _train_three_ways(root: str, seed: int):
    import torch.distributed as dist

    from shardwise.training.loop import train_main

    train_main(_cfg(f"{root}/sync", seed))
    train_main(_cfg(f"{root}/async", seed, async_save=True))
    if dist.get_rank() == 0:  # resume from the async run's step-2 checkpoint alone
        shutil.copytree(f"{root}/async/checkpoints/step-2", f"{root}/from2/step-2")
        with open(f"{root}/from2/latest", "w") as f:
            f.write("step-2\n")
    dist.barrier()
    train_main(_cfg(f"{root}/resumed", seed, async_save=True, resume=True, checkpoint_dir=f"{root}/from2"))


def _content(path: str) -> tuple[dict, dict, list]:
    tensors = checkpoint.load_global_tensors(path, prefix="")
    meta = json.load(open(os.path.join(path, checkpoint.META)))
    ranks = [json.load(open(os.path.join(path, f"rank{r}.json"))) for r in range(2)]
    return tensors, meta, ranks


def _losses(run: str) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(run, "metrics.jsonl"))]


def test_async_save_equals_sync_and_resumes_bitwise(tmp_path):
    seed = fresh_seed()
    run_ranks(2, _train_three_ways, str(tmp_path), seed)
    for step in (2, 4):
        a, b = (str(tmp_path / run / "checkpoints" / f"step-{step}") for run in ("sync", "async"))
        assert checkpoint.checkpoint_problems(b) == []  # published with a manifest whose checksums hold
        (ta, ma, ra), (tb, mb, rb) = _content(a), _content(b)
        assert ta.keys() == tb.keys() and any(k.startswith("optim.") for k in ta)
        for k in ta:
            assert torch.equal(ta[k], tb[k]), (k, seed)
        assert ma == mb and ra == rb
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text() == "step-4\n"
    assert _losses(str(tmp_path / "resumed")) == _losses(str(tmp_path / "async"))[2:]
    ta, tb = (_content(str(path / "step-4"))[0] for path in (tmp_path / "async" / "checkpoints", tmp_path / "from2"))
    assert all(torch.equal(ta[k], tb[k]) for k in ta), seed


def _crash_while_pending(root: str, seed: int):
    from shardwise.training.loop import train_main

    publish = checkpoint.save._publish

    def slow_publish(*args):  # a slow file system: the save of step 2 is still pending at step 3
        time.sleep(2.0)
        return publish(*args)

    checkpoint.save._publish = slow_publish
    cfg = _cfg(root, seed, async_save=True, fault_inject="1:3:crash", save_every=1)
    train_main(cfg)


def test_crash_while_async_save_pending_keeps_previous_latest(tmp_path):
    with pytest.raises(RankError, match="rank 1 died with exit code 13"):
        run_ranks(2, _crash_while_pending, str(tmp_path), fresh_seed(), timeout_s=60)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step-1\n"
    assert not (root / "step-2").exists() and (root / "tmp-step-2").exists()
    assert checkpoint.newest_intact(str(root))[0] == str(root / "step-1")


def test_async_save_without_save_every_is_a_config_error():
    from shardwise.config import ConfigError

    with pytest.raises(ConfigError, match="--async-save needs --save-every N"):
        TrainConfig(async_save=True).resolve_world()
