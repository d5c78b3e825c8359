"""Saving: DCP writes every rank's boxes into tmp-step-N, then checksums, manifest, the atomic rename and
`latest` publish it; `async_save` does the same from a background thread."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .. import comm, host
from ..config import ConfigError
from ..data.checksum import sha256_file
from .boxes import BoxSavePlanner, run_dcp, ensure_state, state_entries
from .files import (FORMAT_VERSION, LATEST, MANIFEST, META, SHARD_OWNER, to_b64, fsync_dir, write_json, write_text,
                    list_checkpoints)


def save_checkpoint(root: str, step: int, trainer, extra_state: dict | None = None, keep: int | None = None,
                    async_save: bool = False) -> str | None:
    """Collective. Save after `step` completed optimizer steps; returns the published directory.

    `extra_state` (JSON-serialisable, rank 0's copy) comes back from `load_checkpoint`; `keep`
    prunes all but the newest `keep` step directories. A save still pending from `async_save=True`
    is finished first. With `async_save=True` the tensors are copied to host memory now and written
    by `torch.distributed.checkpoint.async_save` while training continues; checksums, manifest,
    publish and `latest` follow in the background once every rank's write completed (None is
    returned; `wait_for_save` blocks until it is published).
    """
    wait_for_save(trainer)
    mesh, ckpt = trainer.mesh, trainer.mesh["ckpt"]
    debug = getattr(trainer.cfg, "debug", False)
    tmp, final = _begin_save(root, step, trainer, extra_state)
    entries = state_entries(trainer, True)
    if not async_save:
        with _failed_save(root, tmp, step, ckpt, mesh.rank, debug, collective=False):  # DCP's failure is every rank's
            run_dcp(dcp.save, mesh, storage_writer=dcp.FileSystemWriter(tmp), planner=BoxSavePlanner(entries))
        _publish(root, tmp, final, step, ckpt, mesh.rank, keep, debug)
        return final
    staged = _stage(trainer, entries)
    future = run_dcp(dcp.async_save, mesh, storage_writer=dcp.FileSystemWriter(tmp), planner=BoxSavePlanner(staged))
    # The publish's gathers run on the checkpoint group off the main thread: keep them out of the
    # ledger, whose per-step counts belong to the training loop.
    quiet = dataclasses.replace(ckpt, ledger=None)

    def finish():
        with _failed_save(root, tmp, step, quiet, mesh.rank, debug, collective=False):
            future.result()  # DCP's failure reaches every rank alike: no agreement needed
        return None, _publish(root, tmp, final, step, quiet, mesh.rank, keep, debug)

    trainer.pending_save = PendingSave(finish)
    return None


class SaveFailed(ConfigError):
    """A checkpoint the filesystem refused (full disk, read-only, quota): the same one line on every rank, no
    traceback (`--debug` shows the original error instead). Its partial tmp-step-N is gone, the earlier
    checkpoints stand."""


def _os_error(e: BaseException) -> OSError | None:
    """The OSError under `e`: itself, a DCP CheckpointException's per-rank failures, or a cause."""
    seen = set()
    todo = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        for failure in (getattr(x, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [x.__cause__, x.__context__]
    return None


def _agree(axis, problem: str | None) -> str | None:
    """Collective over the checkpoint group in place of a barrier (and, like it, outside the ledger): the first
    rank's problem, if any rank had one, so every rank raises or none does."""
    if not axis.active:
        return problem
    out = [None] * axis.size
    dist.all_gather_object(out, problem, group=axis.group)
    return next((p for p in out if p), None)


@contextlib.contextmanager
def _failed_save(root: str, tmp: str, step: int, axis, rank: int, debug: bool, collective: bool = True):
    """An environmental failure in the block becomes one SaveFailed line on every rank, with the partial
    tmp-step-N removed; anything else (a bug) keeps its traceback. `collective`: the ranks agree first (a rank
    that failed alone would leave the others waiting at the next collective)."""
    problem, original = None, None
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        err = _os_error(e)
        if err is None or debug:
            raise
        problem, original = _describe(err), e
    if collective:
        problem = _agree(axis, problem)
    if problem is None:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        if _latest(root) != f"step-{step}":  # renamed but never published: not a checkpoint a resume may load
            shutil.rmtree(os.path.join(root, f"step-{step}"), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(root, f"{LATEST}.tmp"))
    raise SaveFailed(f"checkpoint step-{step} was not saved: {problem}; the partial {os.path.basename(tmp)} was "
                     f"removed; {_intact(root)}") from original


def _describe(err: OSError) -> str:
    what = err.strerror or str(err)
    return f"{what} ({err.filename})" if err.filename else what


def _latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, LATEST)) as f:
            return f.read().strip()
    except OSError:
        return None


def _intact(root: str) -> str:
    """Which checkpoint a resume would load now."""
    last = _latest(root)
    if last is None:
        return f"no earlier checkpoint under {root}; free space (or fix the directory) and start again"
    return (f"{os.path.join(root, last)} is intact; free space (or fix the directory) and continue with "
            "--resume")


def _stage(trainer, entries: dict) -> dict:
    """Compact host copies of this rank's boxes, so training may overwrite the live tensors while the
    background thread writes. The host buffers are kept on the trainer and reused by the next save (the
    previous one has finished by then: `save_checkpoint` waits for it first); on CUDA they are pinned,
    so the copies are asynchronous DMA, waited for once."""
    pin = trainer.mesh.device.type == "cuda" and torch.cuda.is_available()
    old = getattr(trainer, "_ckpt_staging", {})
    staged, reuse = {}, 0
    for k, (size, boxes) in entries.items():
        bufs = old.get(k, (None, []))[1]
        out = []
        for i, (off, t) in enumerate(boxes):
            buf = bufs[i][1] if i < len(bufs) else None
            if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
                reuse += 1
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            buf.copy_(t.detach(), non_blocking=pin)
            out.append((off, buf))
        staged[k] = (size, out)
    if pin:
        torch.cuda.current_stream(trainer.mesh.device).synchronize()  # the copies have landed before DCP reads
    trainer._ckpt_staging, trainer._ckpt_staging_reused = staged, reuse
    return staged


class PendingSave:
    """A checkpoint being written and published by a background thread; `wait` returns its directory."""

    def __init__(self, work):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(work,), name="shardwise-async-save", daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            self.result = work()[1]
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
            self.error = e

    def wait(self) -> str:
        self.thread.join()
        if isinstance(self.error, SaveFailed):
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"asynchronous checkpoint save failed: {self.error}") from self.error
        return self.result


def wait_for_save(trainer) -> str | None:
    """Block until the trainer's pending asynchronous save is published (before the next save, at the end)."""
    pending, trainer.pending_save = getattr(trainer, "pending_save", None), None
    return pending.wait() if pending is not None else None


def _begin_save(root: str, step: int, trainer, extra_state: dict | None) -> tuple[str, str]:
    """Collective. A fresh tmp-step-N holding this rank's RNG states and rank 0's metadata, as of now."""
    mesh, ckpt = trainer.mesh, trainer.mesh["ckpt"]
    rank0 = mesh.rank == 0
    debug = getattr(trainer.cfg, "debug", False)
    tmp, final = os.path.join(root, f"tmp-step-{step}"), os.path.join(root, f"step-{step}")
    with _failed_save(root, tmp, step, ckpt, mesh.rank, debug):
        if rank0:
            os.makedirs(root, exist_ok=True)
            for d in os.listdir(root):  # saves are collective and sequential: any tmp dir is from a save that died
                if d.startswith("tmp-step-"):
                    shutil.rmtree(os.path.join(root, d))
            os.makedirs(tmp)
    ensure_state(trainer.reducer)
    state = next(iter(trainer.reducer.optimizer.state.values()))
    tracker = trainer.model.rng_tracker
    with _failed_save(root, tmp, step, ckpt, mesh.rank, debug):
        # RNG streams by device type: the host generator applies on any device; the tracker's generators
        # live on the training device (a CUDA state is 16 bytes, a CPU one 5,056) and apply only there.
        write_json(os.path.join(tmp, f"rank{mesh.rank}.json"), {
            "rank": mesh.rank, "coords": mesh.coords, "device": mesh.device.type,
            "torch_cpu_rng": to_b64(torch.get_rng_state()),
            "tracker_rng": {k: to_b64(g.get_state()) for k, g in tracker.generators.items()}})
        if rank0:
            layout = trainer.cfg.parallel.as_dict() | {"world": ckpt.size, "device": mesh.device.type}
            write_json(os.path.join(tmp, META), {
                "format": FORMAT_VERSION, "step": step, "optimizer_step": int(host.read(state["step"], "checkpoint step")), "layout": layout,
                "model": vars(trainer.model_cfg), "optimizer": trainer.cfg.optimizer, "extra_state": extra_state or {},
                "bad_steps": getattr(trainer, "bad_steps", 0)})
    return tmp, final


def _publish(root: str, tmp: str, final: str, step: int, ckpt, rank: int, keep: int | None,
             debug: bool = False) -> str:
    """Collective over `ckpt`, once every rank's DCP write finished: checksums, manifest, rename, `latest`."""
    rank0 = rank == 0
    # Each rank hashes what it wrote (DCP names data files __<rank>_<n>.distcp); rank 0 merges the
    # small per-rank dicts, so no rank reads the whole checkpoint while the others wait.
    mine = [f for f in os.listdir(tmp) if (m := SHARD_OWNER.match(f)) and int(m.group(1)) == rank]
    mine += [f"rank{rank}.json"] + ([META, ".metadata"] if rank0 else [])
    sums = {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "sha256": sha256_file(os.path.join(tmp, f))} for f in mine}
    merged = comm.all_gather_object(sums, ckpt)
    with _failed_save(root, tmp, step, ckpt, rank, debug):
        if rank0:
            files = {f: v for part in merged for f, v in part.items()}
            unowned = sorted(set(os.listdir(tmp)) - set(files) - {f for f in os.listdir(tmp) if f.endswith(".tmp")})
            if unowned:
                raise RuntimeError(f"checkpoint {tmp}: files no rank hashed: {unowned}")
            write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT_VERSION, "step": step, "files": files})
            fsync_dir(tmp)
            shutil.rmtree(final, ignore_errors=True)  # saved this step before (a resume): the older steps still stand
            os.replace(tmp, final)
            write_text(os.path.join(root, LATEST), f"step-{step}\n")
            fsync_dir(root)
            if keep:
                for old_step, path in list_checkpoints(root)[keep:]:
                    shutil.rmtree(path)
    return final
