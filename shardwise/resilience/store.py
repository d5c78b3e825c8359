"""A node's memory copies, in shared memory (tmpfs) that outlives the worker processes.

A restarted process has lost its own memory, so the copies cannot live in the workers: they live in files under
/dev/shm (host RAM), in one directory per node that the node's launcher owns — the built-in launcher creates
`<shm>/shardwise-mem-<pid>/node<k>` and removes it when it exits; under torchrun the directory is named after
the job and the node's agent (`<shm>/shardwise-mem-<run id>/agent-<host>-<agent pid>`), so a replacement agent
starts with an empty one, as a replacement node would, and local rank 0 removes it when the run finishes.
A copy is written to a temporary name and renamed, so a copy that is listed is whole. Each rank also keeps a
128-byte progress record there (steps completed, phase), which outlives a SIGKILL: the launcher and the
recovery read how far the group had got.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

COPY = re.compile(r"copy-r(\d+)-s(\d+)-w(\d+)\.bin$")
KEEP = 2
"""Copies kept per owner: the newest may be half-exchanged on some ranks when a rank dies; the one before is whole
on every rank."""


def shm_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class NodeInfo:
    """Where this rank's node keeps its copies, how ranks map to nodes, and which restart of the group this is."""

    store: str
    ranks_per_node: int
    restart: int


def node_info(world: int, memory: bool, environ=None) -> NodeInfo | None:
    """This rank's node: the built-in launcher's variables (set when it may restart the group or keep memory
    copies), else torchrun's when `memory` copies are on or its agent may restart the group; None otherwise."""
    env = os.environ if environ is None else environ
    if "SHARDWISE_NODE_STORE" in env:
        return NodeInfo(env["SHARDWISE_NODE_STORE"], int(env.get("SHARDWISE_RANKS_PER_NODE", world)),
                        int(env.get("SHARDWISE_RESTART_COUNT", "0")))
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if "TORCHELASTIC_RUN_ID" in env and "LOCAL_WORLD_SIZE" in env and (memory or restarts > 0):
        agent = f"agent-{socket.gethostname()}-{os.getppid()}"  # the agent outlives its workers' restarts
        store = os.path.join(shm_root(), f"shardwise-mem-{env['TORCHELASTIC_RUN_ID']}", agent)
        return NodeInfo(store, int(env["LOCAL_WORLD_SIZE"]), int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
    return None


class NodeStore:
    """The copies in one node's directory made under a world of `world` ranks: `copy-r<owner>-s<step>-w<world>.bin`.
    The world is in the name because an elastic change of dp (`elastic`) renumbers the ranks: the copies of the
    layout before it (which a recovery may still re-cut from) and after it share the directory."""

    def __init__(self, path: str, world: int):
        self.path, self.world = path, world
        os.makedirs(path, exist_ok=True)

    def _file(self, owner: int, step: int) -> str:
        return os.path.join(self.path, f"copy-r{owner}-s{step}-w{self.world}.bin")

    def worlds(self) -> list[int]:
        """The world sizes that have copies here."""
        return sorted({int(m.group(3)) for name in os.listdir(self.path) if (m := COPY.match(name))})

    def under(self, world: int) -> "NodeStore":
        """The same directory's copies of another world size."""
        return NodeStore(self.path, world)

    def write(self, owner: int, step: int, data) -> None:
        """Keep `data` (a uint8 tensor) as `owner`'s copy at `step`; drop that owner's copies of later steps (a run
        that went back) and all but the KEEP newest up to `step`."""
        final = self._file(owner, step)
        tmp = f"{final}.tmp"
        data.numpy().tofile(tmp)
        os.replace(tmp, final)
        steps = sorted(s for o, s in self._names() if o == owner)
        for old in [s for s in steps if s > step] + [s for s in steps if s <= step][:-KEEP]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._file(owner, old))

    def _names(self) -> list[tuple[int, int]]:
        return [(int(m.group(1)), int(m.group(2))) for name in os.listdir(self.path)
                if (m := COPY.match(name)) and int(m.group(3)) == self.world]

    def inventory(self) -> dict[tuple[int, int], int]:
        """{(owner, step): bytes} of the whole copies here (the node's other ranks may be pruning meanwhile)."""
        out = {}
        for owner, step in self._names():
            with contextlib.suppress(FileNotFoundError):
                out[(owner, step)] = os.path.getsize(self._file(owner, step))
        return out

    def read(self, owner: int, step: int):
        import torch

        path = self._file(owner, step)
        return torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8, device="cpu")

    def wipe(self) -> None:
        """The node's memory is gone (a lost node; the fault injection's `node`)."""
        shutil.rmtree(self.path, ignore_errors=True)


class Progress:
    """A rank's steps completed and phase, in a 128-byte page of the node store that survives the process."""

    SIZE = 128

    def __init__(self, directory: str, rank: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"progress-r{rank}")
        with open(self.path, "wb") as f:
            f.write(b" " * self.SIZE)
        self._f = open(self.path, "r+b")
        self._mm = mmap.mmap(self._f.fileno(), self.SIZE)
        self.completed, self.phase = 0, "setup"

    def note(self, completed: int | None = None, phase: str | None = None) -> None:
        """Steps completed so far and what the rank does now (either kept when not given)."""
        if completed is not None:
            self.completed = completed
        if phase is not None:
            self.phase = phase
        line = f"{self.completed}\t{os.getpid()}\t{time.time():.3f}\t{self.phase}"  # the phase last: it is what 128 bytes cut
        self._mm[:] = line.encode()[:self.SIZE].ljust(self.SIZE)

    @staticmethod
    def read_all(directory: str) -> dict[int, tuple[int, str, float, int]]:
        """{rank: (steps completed, phase, time, pid)} of every record in `directory`."""
        out = {}
        try:
            names = os.listdir(directory)
        except OSError:
            return out
        for name in names:
            if not name.startswith("progress-r"):
                continue
            try:
                with open(os.path.join(directory, name), "rb") as f:
                    parts = f.read().decode(errors="replace").strip().split("\t", 3)
                out[int(name[len("progress-r"):])] = (int(parts[0]), parts[3], float(parts[2]), int(parts[1]))
            except (OSError, ValueError, IndexError):
                continue
        return out


def release(info: NodeInfo | None, environ=None) -> None:
    """At the end of a finished run under torchrun, local rank 0 removes its node's copies (the built-in launcher
    removes its own directory)."""
    env = os.environ if environ is None else environ
    if info is None or "SHARDWISE_NODE_STORE" in env or env.get("LOCAL_RANK") != "0":
        return
    shutil.rmtree(info.store, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(info.store))  # the job's directory, once no agent's is left in it
    except OSError:
        pass
