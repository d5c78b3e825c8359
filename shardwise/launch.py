"""Starting ranks: join a torchrun job, or start N local ranks ourselves (gloo CPU forks, or one NCCL process per GPU).

The local launcher forks (30–50× cheaper than spawn on CPU), gives each rank one thread, a
loopback rendezvous on a free port and a collective timeout, and tears every rank down as soon as
one fails, so a failure surfaces as an error naming the rank rather than a hang.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank failed; the message names it and carries its traceback."""


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class LaunchPlan:
    """How the ranks of one run start: on which device type, which backend, and how processes are made."""

    device: str
    backend: str
    start_method: str | None
    """'fork' for CPU ranks (cheap), 'spawn' for GPU ranks (CUDA cannot survive a fork), None in-process/torchrun."""


def plan_launch(world: int, device: str, cuda_count: int, torchrun: bool) -> LaunchPlan:
    """Pure: the launch decision for `world` ranks, `--device`, the visible GPUs and torchrun's presence.

    Raises ConfigError (one line) for --device cuda without CUDA, or more local ranks than GPUs.
    """
    from .config import ConfigError

    if device not in DEVICES:
        raise ConfigError(f"--device {device!r} is unknown; valid: {', '.join(DEVICES)}")
    if device == "cuda" and cuda_count == 0:
        raise ConfigError("--device cuda: no CUDA device is visible (torch.cuda.device_count() == 0); use --device cpu")
    if device == "cpu" or cuda_count == 0:
        return LaunchPlan("cpu", "gloo", None if torchrun or world == 1 else "fork")
    if not torchrun and world > cuda_count:
        raise ConfigError(f"the layout needs {world} ranks but this machine has {cuda_count} GPUs; use torchrun "
                          "(--nnodes/--nproc-per-node) for more, or --device cpu")
    return LaunchPlan("cuda", "nccl", None if torchrun or world == 1 else "spawn")


def nccl_env_defaults(environ) -> dict[str, str]:
    """The flight-recorder settings to add (never overriding the user's): a hang then leaves a trace on timeout."""
    want = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    return {k: v for k, v in want.items() if k not in environ}


def pick_device(device: str = "auto") -> torch.device:
    if device != "cpu" and torch.cuda.is_available() and under_torchrun():
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(timeout_s: float, device: str = "auto") -> torch.device:
    """Join the process group described by the environment (torchrun or our launcher)."""
    dev = pick_device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "gloo" and os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        os.environ.update(nccl_env_defaults(os.environ))
    # The timeout drives NCCL's watchdog too: a collective stuck past it aborts the communicator.
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            device_id=dev if dev.type == "cuda" else None)
    return dev


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, timeout_s, fn, args, results, backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    try:
        device = None
        if backend == "nccl":  # one GPU per rank; fn receives its device as a keyword
            os.environ.update(nccl_env_defaults(os.environ))
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                device_id=device)
        out = fn(*args) if device is None else fn(*args, device=device)
        # Plain pickle copies tensor bytes into the message: torch's queue reducer would pass a shared-memory
        # fd that the parent can no longer open once this process has exited (connection reset).
        results.put((rank, True, pickle.dumps(out)))
        dist.destroy_process_group()
    except BaseException as e:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()  # the report must reach the parent before this process vanishes
        sys.stdout.flush()
        os._exit(1)


def run_local(fn, world: int, *args, timeout_s: float = 300.0, wall_timeout_s: float | None = None,
              grace_s: float = 5.0, backend: str = "gloo"):
    """Run `fn(*args)` on `world` local ranks; return the per-rank results in rank order.

    gloo: forked CPU ranks. nccl: spawned ranks, rank r on cuda:r, `fn(*args, device=cuda:r)`.

    On the first failure the other ranks get `grace_s` to report theirs, then all are torn down and
    a RankError names the culprit: a rank that died (its exit code), or a rank still alive that
    reported nothing while its peers failed (hung), and what each failing rank was doing.
    """
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, fn, args, results, backend), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + (wall_timeout_s or float("inf"))
    failed_at = None
    try:
        while len(out) + len(errors) < world:
            now = time.monotonic()
            if failed_at is not None and now > failed_at + grace_s:
                break
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out
                        and r not in errors]
                if dead and results.empty() and failed_at is None:
                    failed_at = now
                if now > deadline and failed_at is None:
                    raise RankError(f"ranks {sorted(set(range(world)) - set(out))} did not finish within "
                                    f"{wall_timeout_s:.0f} s")
                continue
            if ok:
                out[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                failed_at = failed_at or time.monotonic()
        if errors or len(out) < world:
            raise RankError(_failure_report(procs, out, errors))
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def _failure_report(procs, out, errors) -> str:
    dead = [r for r, p in enumerate(procs) if r not in out and r not in errors and p.exitcode not in (None, 0)]
    hung = [r for r, p in enumerate(procs) if r not in out and r not in errors and p.exitcode is None]
    lines = []
    for r in dead:
        lines.append(f"rank {r} died with exit code {procs[r].exitcode}")
    for r in hung:
        lines.append(f"rank {r} hung: alive but reported nothing while its peers failed")
    for r, msg in sorted(errors.items()):
        lines.append(f"rank {r} failed: {msg.splitlines()[0]}")
    first_tb = next(iter(sorted(errors.items())), (None, ""))[1]
    return "; ".join(lines) + ("\n" + first_tb if first_tb and not dead and not hung else "")
