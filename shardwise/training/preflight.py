"""What a run's surroundings must offer before any rank starts, each refused in one line (its directories are
`paths.check_writable`s): room for one checkpoint, no live run writing the same `--out` (a lock
file naming its host and PID), and a resumed checkpoint made by this model."""
from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import shutil
import socket

from ..config import ConfigError

LOCK = ".shardwise-lock"
"""In --out while a run writes it: {"host", "pid"} (and "job": SLURM_JOB_ID); a dead PID on this host, or the
same Slurm job requeued, is a stale lock, taken over."""


def checkpoint_bytes(model, optimizer: str) -> int:
    """A checkpoint's planned size: fp32 parameters and the optimizer's fp32 state (AdamW: two moments;
    Muon: one momentum, counted as two since its non-matrix parameters keep AdamW's)."""
    from ..rules.inventory import model as inventory

    params = sum(math.prod(p.shape) for p in inventory(model))
    return params * 4 * (1 + 2)


def check_free_space(root: str, model, optimizer: str) -> None:
    """Room for one more checkpoint where `root` is (or will be): older ones are pruned only after it is written."""
    probe = root
    while not os.path.isdir(probe) and os.path.dirname(os.path.abspath(probe)) != os.path.abspath(probe):
        probe = os.path.dirname(os.path.abspath(probe))
    need = checkpoint_bytes(model, optimizer)
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ConfigError(f"checkpoint directory {root}: one checkpoint of this run needs {_size(need)} but "
                          f"{probe} has {_size(free)} free; free space, choose another --checkpoint-dir, or "
                          "--no-checkpoint")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _read_lock(out: str) -> dict | None:
    try:
        with open(os.path.join(out, LOCK)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def check_lock(out: str) -> None:
    """Refuse an --out that a live run holds (on this host: its PID is alive; on another host it cannot be
    checked from here, so it is refused and the line says how to clear it)."""
    held = _read_lock(out)
    if not held or (held.get("host") == socket.gethostname() and held.get("pid") == os.getpid()):
        return
    host, pid = held.get("host"), held.get("pid")
    job = os.environ.get("SLURM_JOB_ID")
    if job and held.get("job") == job:
        return  # this job's earlier run (requeued, perhaps onto another node) is over: its lock is stale
    here = host == socket.gethostname()
    if here and isinstance(pid, int) and not _alive(pid):
        return  # stale: that run died; `take_lock` takes it over
    if here:
        raise ConfigError(f"--out {out} is in use by a running shardwise run (host {host}, PID {pid}); wait for "
                          "it to finish or choose another --out")
    raise ConfigError(f"--out {out} is locked by a shardwise run on host {host} (PID {pid}); choose another "
                      f"--out, or remove {os.path.join(out, LOCK)} if that run is gone")


def take_lock(out: str) -> None:
    """Hold --out for this process until it exits (a stale lock is replaced)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, LOCK)
    mine = {"host": socket.gethostname(), "pid": os.getpid()}
    if os.environ.get("SLURM_JOB_ID"):
        mine["job"] = os.environ["SLURM_JOB_ID"]
    if _read_lock(out) == mine:
        return
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(mine, f)
    os.replace(tmp, path)
    atexit.register(_release, path, mine)


def _release(path: str, mine: dict) -> None:
    if os.getpid() == mine["pid"] and _read_lock(os.path.dirname(path)) == mine:
        try:
            os.remove(path)
        except OSError:
            pass


def check_resumed_model(path: str, meta: dict, model, tokenizer: dict | None) -> None:
    """`--resume` of a checkpoint made by another model (a parameter of another shape) or with another
    tokenizer: the first difference, in one line, instead of a shape error deep in the load."""
    from ..rules.inventory import by_name
    from ..rules.inventory import model as inventory

    name = os.path.basename(path)
    saved = meta.get("model") or {}
    fields = {f.name for f in dataclasses.fields(model)}
    diffs = [k for k in (f.name for f in dataclasses.fields(model))
             if k in saved and _plain(saved[k]) != _plain(getattr(model, k))]
    try:
        old = dataclasses.replace(model, **{k: _typed(saved[k], getattr(model, k)) for k in diffs if k in fields})
        old_params, new_params = by_name(inventory(old)), by_name(inventory(model))
    except Exception:  # noqa: BLE001 - a config this version cannot rebuild: compare the fields alone
        old_params = new_params = None
    if old_params is not None:
        for pname in list(old_params) + [p for p in new_params if p not in old_params]:
            a, b = old_params.get(pname), new_params.get(pname)
            if a is None or b is None or tuple(a.shape) != tuple(b.shape):
                field = next((k for k in diffs if k not in ("name",)), "the architecture")
                there = f"{field} {_plain(saved.get(field))}" if field in saved else "another architecture"
                what = (f"{pname} has shape {tuple(a.shape)}, the model needs {tuple(b.shape)}"
                        if a is not None and b is not None else
                        f"{pname} is {'missing from' if a is None else 'not in'} "
                        f"{'the checkpoint' if a is None else 'this model'}")
                raise ConfigError(f"--resume: {name} was saved from another model ({there} there, "
                                  f"{_plain(getattr(model, field, None))} here: {what}); resume with the flags "
                                  "that made it, or start fresh with another --out or --overwrite")
    elif diffs:
        k = diffs[0]
        raise ConfigError(f"--resume: {name} was saved from another model ({k} {_plain(saved[k])} there, "
                          f"{_plain(getattr(model, k))} here); resume with the flags that made it, or start fresh")
    stored = (meta.get("extra_state") or {}).get("tokenizer") or {}
    was, now = stored.get("source"), (tokenizer or {}).get("source")
    if was and now and (was == "byte") != (now == "byte"):
        raise ConfigError(f"--resume: {name} was trained on {_tok(was)} but --data uses {_tok(now)}; resume "
                          "with data tokenized by the checkpoint's tokenizer")


def _tok(source: str) -> str:
    return "the byte tokenizer" if source == "byte" else f"the tokenizer {source}"


def _plain(v):
    return list(v) if isinstance(v, tuple) else v


def _typed(v, like):
    return tuple(v) if isinstance(like, tuple) and isinstance(v, list) else v
