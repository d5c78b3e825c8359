"""Starting ranks: join a torchrun job, or start N local ranks ourselves (gloo CPU forks, or one NCCL process per GPU).

The local launcher forks (30–50× cheaper than spawn on CPU), gives each rank one thread, a
loopback rendezvous on a port rank 0 binds and a collective timeout, and tears every rank down as soon as
one fails, so a failure surfaces as an error naming the rank rather than a hang. On NCCL a hang ends
in the watchdog's abort, not an exception, so every local rank keeps a tiny host-side record of its
last collective call (`LastOp`) that the launcher reads to say which rank stopped where; the flight
recorder's dumps go to the run directory. On clusters: each process takes the GPU it can see
(one visible GPU → cuda:0), and gloo groups bind the interface that reaches the rendezvous host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import json
import mmap
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank failed; the message names it and carries its traceback. `failure`: what the launcher saw
    (`_failure_event`), or None."""

    failure: dict | None = None


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def note_torchrun_failure(message: str) -> None:
    """Leave `message` in the error file torchrun's agent reads for this rank (TORCHELASTIC_ERROR_FILE), so its
    failure summary shows it instead of "To enable traceback see ..."; nothing without torchrun's agent."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        pass


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
    from ..config import ConfigError

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


def nccl_env_defaults(environ, run_dir: str | None = None) -> dict[str, str]:
    """Flight-recorder settings to add (never overriding the user's, under the current or the pre-2.9 name).

    A collective stuck past the timeout then leaves a trace per rank in <run_dir>/flight_recorder/rank_<r>
    (torch appends the rank) instead of node-local /tmp.
    """
    want = {("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",
            ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1"}
    if run_dir is not None:
        want[("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")] = os.path.join(
            os.path.abspath(run_dir), "flight_recorder", "rank_")
    return {names[0]: v for names, v in want.items() if not any(n in environ for n in names)}


def _apply_nccl_env(run_dir: str | None) -> None:
    add = nccl_env_defaults(os.environ, run_dir)
    if "TORCH_FR_DUMP_TEMP_FILE" in add:
        os.makedirs(os.path.dirname(add["TORCH_FR_DUMP_TEMP_FILE"]), exist_ok=True)
    os.environ.update(add)


def local_cuda_index(local_rank: int, visible: int, visible_devices: str | None = None) -> int:
    """Pure: the CUDA index this process uses, given LOCAL_RANK and how many GPUs it sees.

    One visible GPU (SLURM's --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per process) is cuda:0
    whatever the local rank; with the node's GPUs all visible, local rank r takes cuda:r.
    """
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    from ..config import ConfigError

    raise ConfigError(f"LOCAL_RANK {local_rank} but this process sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
                      f"{visible_devices!r}): give each process one GPU or all of the node's")


def pick_device(device: str = "auto") -> torch.device:
    if device != "cpu" and torch.cuda.device_count() > 0 and under_torchrun():
        index = local_cuda_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count(),
                                 os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(timeout_s: float, device: str = "auto", run_dir: str | None = None) -> torch.device:
    """Join the process group described by the environment (torchrun or our launcher)."""
    dev = pick_device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    configure_gloo(None)  # gloo groups exist on NCCL runs too (checkpoint I/O)
    if backend == "nccl":
        _apply_nccl_env(run_dir)
    # The timeout drives NCCL's watchdog too: a collective stuck past it aborts the communicator.
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            device_id=dev if dev.type == "cuda" else None)
    return dev


# ---------------------------------------------------------------- gloo's network interface
def interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def _address_of(name: str) -> str | None:
    """IPv4 address of an interface (Linux SIOCGIFADDR), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def interface_towards(host: str) -> tuple[str, str] | None:
    """(interface, local address) the kernel routes to `host` through; None if it cannot tell.

    A UDP connect sends nothing: it only asks the routing table.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    name = next((n for n in interfaces() if _address_of(n) == local), None)
    return None if name is None else (name, local)


def choose_gloo_ifname(flag: str | None, environ, available: list[str], towards) -> str | None:
    """Pure: the interface gloo binds (None: leave it to gloo's hostname lookup).

    --gloo-ifname, else GLOO_SOCKET_IFNAME, else the interface that reaches MASTER_ADDR. On the
    rendezvous host itself that route is loopback, which other nodes cannot reach: a multi-node job
    then takes the interface of the default route instead. Raises ConfigError for a name that is no
    interface here (gloo would fail later, in every rank, with a less clear message).
    """
    from ..config import ConfigError

    for source, value in (("--gloo-ifname", flag), ("GLOO_SOCKET_IFNAME", environ.get("GLOO_SOCKET_IFNAME"))):
        if value:
            missing = [n for n in value.split(",") if n not in available]
            if missing:
                raise ConfigError(f"{source} {value!r} names no network interface on this host "
                                  f"({missing[0]!r}); available: {', '.join(available)}")
            return value
    host = environ.get("MASTER_ADDR")
    route = towards(host) if host else None
    multi_node = environ.get("LOCAL_WORLD_SIZE", environ.get("WORLD_SIZE")) != environ.get("WORLD_SIZE")
    if route is not None and route[1].startswith("127.") and multi_node:
        route = towards("192.0.2.1")  # TEST-NET-1: whatever the default route uses
    return None if route is None else route[0]


def configure_gloo(flag: str | None, environ=None) -> str | None:
    """Validate and export GLOO_SOCKET_IFNAME (read by every gloo group this process creates)."""
    environ = os.environ if environ is None else environ
    name = choose_gloo_ifname(flag, environ, interfaces(), interface_towards)
    if name is not None:
        environ["GLOO_SOCKET_IFNAME"] = name
    return name


# ---------------------------------------------------------------- last collective per rank
class LastOp:
    """A rank's latest collective call, kept in a 128-byte memory-mapped file the launcher can read.

    An NCCL hang ends in the watchdog's SIGABRT, which no Python handler survives; a page the kernel
    owns does. Writing it costs a memcpy per collective. Format: count, axis and op separated by tabs,
    because an op names its tensor in words ("recv of act for microbatch 0, stage 1"); the axis comes before
    the op so that a long op is what the 128 bytes cut.
    """

    SIZE = 128

    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, f"rank{rank}.lastop")
        with open(self.path, "wb") as f:
            f.write(b" " * self.SIZE)
        self._f = open(self.path, "r+b")
        self._mm = mmap.mmap(self._f.fileno(), self.SIZE)
        self.count = 0

    def note(self, op: str, axis: str) -> None:
        self.count += 1
        self._mm[:] = f"{self.count}\t{axis}\t{op}".encode()[:self.SIZE].ljust(self.SIZE)

    @staticmethod
    def read(directory: str, rank: int) -> tuple[int, str, str] | None:
        try:
            with open(os.path.join(directory, f"rank{rank}.lastop"), "rb") as f:
                parts = f.read().decode(errors="replace").strip().split("\t")
        except OSError:
            return None
        return (int(parts[0]), parts[2], parts[1]) if len(parts) == 3 else None


def _last_ops_report(records: dict[int, tuple[int, str, str]]) -> str:
    """One clause naming the rank(s) that posted the fewest collective calls: the likely place of a hang."""
    if not records:
        return ""
    counts = {r: rec[0] for r, rec in records.items()}
    low, high = min(counts.values()), max(counts.values())
    if low == high:
        return ""
    behind = sorted(r for r, n in counts.items() if n == low)
    n, op, axis = records[behind[0]]
    return (f"; rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} stopped earliest, at "
            f"collective call #{n} ({op} on axis '{axis}'), while others reached #{high}")


def _rendezvous(rank: int, world: int, port, timeout_s: float):
    """The local group's store. Rank 0 binds it on a port the kernel picks and publishes the port in `port` (shared
    memory the launcher made); the others wait for it and connect. A port picked free and released, then bound by
    rank 0, could be taken in between by another run's group (two test workers' ranks met in one store)."""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        port.value = store.port
    else:
        deadline = time.monotonic() + timeout_s
        while port.value == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 published no rendezvous port within {timeout_s:.0f} s")
            time.sleep(0.002)
        store = dist.TCPStore("127.0.0.1", port.value, world, is_master=False, timeout=timeout)
    os.environ["MASTER_PORT"] = str(port.value)
    return dist.PrefixStore("default_pg", store)  # as init_process_group wraps a store it makes itself


class ForkAfterCudaError(RuntimeError):
    """run_local would fork ranks from a process that already initialised CUDA (the children could not use it)."""


def _worker(rank, world, port, timeout_s, fn, args, results, backend="gloo", lastop_dir=None, run_dir=None,
            save_signal=None, launcher=None, group=None):
    from .preemption import die_with_parent, install

    if save_signal:
        install(save_signal)  # before the launcher's block is lifted: a signal now is a stop request, not death
    if launcher is not None:
        die_with_parent(save_signal, launcher)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME="lo")
    if group is not None:
        os.environ.update(group.env(rank))
    torch.set_num_threads(1)
    try:
        if lastop_dir is not None:
            from ..comm import set_call_hook

            set_call_hook(LastOp(lastop_dir, rank).note)
        device = None
        if backend == "nccl":  # one GPU per rank; fn receives its device as a keyword
            _apply_nccl_env(run_dir)
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, store=_rendezvous(rank, world, port, timeout_s), rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), device_id=device)
        out = fn(*args) if device is None else fn(*args, device=device)
        # Plain pickle copies tensor bytes into the message: torch's queue reducer would pass a shared-memory
        # fd that the parent can no longer open once this process has exited (connection reset).
        if launcher is None or os.getppid() == launcher:  # a rank that saved after its launcher died has no one to tell
            results.put((rank, True, pickle.dumps(out)))
        dist.destroy_process_group()
    except BaseException as e:  # report everything, including KeyboardInterrupt, to the parent
        from ..config import ConfigError  # the user's input, said in one line: no traceback to read past

        tb = "" if isinstance(e, ConfigError) else f"\n{traceback.format_exc()}"
        results.put((rank, False, f"{type(e).__name__}: {e}{tb}"))
        results.close()
        results.join_thread()  # the report must reach the parent before this process vanishes
        sys.stdout.flush()
        os._exit(1)


def run_local(fn, world: int, *args, timeout_s: float = 300.0, wall_timeout_s: float | None = None,
              grace_s: float = 5.0, backend: str = "gloo", run_dir: str | None = None, save_signal: str | None = None,
              max_restarts: int = 0, ranks_per_node: int | None = None, node_stores: bool = False, elastic=None):
    """Run `fn(*args)` on `world` local ranks; return the per-rank results in rank order.

    `max_restarts`: after a failure, the whole group is torn down and started again (each rank sees
    SHARDWISE_RESTART_COUNT and the launcher's account of the failure, and resumes: `shardwise.resilience`), at
    most that many times; the last failure is raised. `node_stores` (or any restarts): every `ranks_per_node`
    consecutive ranks (default all) share a node's directory of memory copies in shared memory, removed at the end.
    `elastic(world, lost ranks)` (--min-dp): the ranks that go on without the lost ones (whole DP replicas; a
    ConfigError when too few are left); called when a lost node does not come back (marked gone) or the restarts
    are spent, and the group restarts on those ranks only (each rank derives its layout from the world size). When
    the marks of the nodes gone are removed (the nodes are back), the shrunk group gets `save_signal` — it stops at
    a step boundary — and the whole group restarts: it re-cuts the shrunk layout's copies back to the full one.
    """
    if not (max_restarts or node_stores):
        return _run_group(fn, world, *args, timeout_s=timeout_s, wall_timeout_s=wall_timeout_s, grace_s=grace_s,
                          backend=backend, run_dir=run_dir, save_signal=save_signal)
    from ..resilience.group import WorkerGroup, forget_progress
    from ..resilience.store import shm_root

    stores = tempfile.mkdtemp(prefix=f"shardwise-mem-{os.getpid()}-", dir=shm_root())
    group = first = WorkerGroup(stores, ranks_per_node or world)
    full = world
    try:
        while True:
            marks = [first.node_store(r) + ".gone" for r in first.gone(full)] if group.ranks is not None else []
            back = (lambda: not any(os.path.exists(m) for m in marks)) if marks else None
            try:
                out = _run_group(fn, world, *args, timeout_s=timeout_s, wall_timeout_s=wall_timeout_s,
                                 grace_s=grace_s, backend=backend, run_dir=run_dir, save_signal=save_signal,
                                 group=group, stop_when=back)
                if back is None or not back() or not any(isinstance(r, dict) and r.get("preempted") for r in out):
                    return out
                # the lost node is back: the shrunk group stopped at a step boundary; the whole layout resumes
                failure = {"restart": group.restart + 1, "lost_ranks": [], "why": {},
                           "rejoined": sorted(set(range(full)) - set(group.ranks)),
                           "elastic": {"old_world": world, "new_world": full}, "detected_at": time.time()}
                print(f"shardwise: ranks {failure['rejoined']} are back: the group stopped at a step boundary and "
                      f"restarts on all {full} ranks (elastic data parallelism)", file=sys.stderr, flush=True)
                forget_progress(stores, 0)
                group, world = dataclasses.replace(first, restart=group.restart + 1, failure=failure), full
                continue
            except RankError as e:
                if e.failure is None:
                    raise
                gone = group.gone(world)
                spent = group.restart >= max_restarts
                died = [int(r) for r, why in e.failure["why"].items() if why.startswith("exit code") or why == "hung"]
                if elastic is not None and (gone or (spent and died)):  # every rank raising is no lost node
                    # a node gone for good names its ranks; a survivor too slow to report within the grace period
                    # reads as hung in the failure, and must not take its replica with it
                    lost = gone or died
                    keep = elastic(world, lost)
                    failure = e.failure | {"restart": group.restart + 1, "lost_for_good": lost,
                                           "elastic": {"old_world": world, "new_world": len(keep)}}
                    print(f"shardwise: {_failure_line(failure)}; the lost node does not come back: going on with "
                          f"{len(keep)} of {world} ranks (elastic data parallelism)", file=sys.stderr, flush=True)
                    group, world = group.shrunk(keep, failure), len(keep)
                    continue
                if spent:
                    raise
                failure = e.failure | {"restart": group.restart + 1}
                print(f"shardwise: {_failure_line(failure)}; restarting the worker group "
                      f"({group.restart + 1} of {max_restarts})", file=sys.stderr, flush=True)
                group = dataclasses.replace(group, restart=group.restart + 1, failure=failure)
    finally:
        shutil.rmtree(stores, ignore_errors=True)


def _failure_line(f: dict) -> str:
    """`lost rank 1 (exit code -9) after step 3, in train step (all_reduce on axis 'dp_cp')`."""
    who = ", ".join(f"rank {r} ({why})" for r, why in f["why"].items())
    where = f" after step {f['failed_after_step']}" if f.get("failed_after_step") is not None else ""
    phase = f", in {f['phase']}" if f.get("phase") else ""
    return f"lost {who}{where}{phase}"


def _failure_event(procs, out, errors, lastops: str | None, group, detected_at: float) -> dict:
    """What the launcher saw: the lost ranks and why, how far the group had got and where the first lost rank was
    (its progress record's phase and its last collective call)."""
    why = {}
    for r, p in enumerate(procs):
        if r in out or r in errors:
            continue
        why[r] = f"exit code {p.exitcode}" if p.exitcode not in (None, 0) else "hung"
    if not why:  # every rank reported: the ones that raised first are the cause
        why = {r: msg.splitlines()[0][:200] for r, msg in sorted(errors.items())}
    progress = {}
    if group is not None:
        from ..resilience.store import Progress

        for node in sorted({group.node_store(r) for r in range(len(procs))}):
            progress |= Progress.read_all(node)
    first = min(why)
    rec = progress.get(first)
    op = LastOp.read(lastops, first) if lastops else None
    phase = (rec[1] if rec else "") + (f" ({op[1]} on axis '{op[2]}')" if op else "")
    return {"lost_ranks": sorted(why), "why": {str(r): w for r, w in why.items()},
            "failed_after_step": max((c for c, *_ in progress.values()), default=None),
            "phase": phase.strip(), "detected_at": detected_at}


def _run_group(fn, world: int, *args, timeout_s: float = 300.0, wall_timeout_s: float | None = None,
               grace_s: float = 5.0, backend: str = "gloo", run_dir: str | None = None, save_signal: str | None = None,
               group=None, stop_when=None):
    """One start of the ranks (`run_local` without restarts; `group`: its `resilience.group.WorkerGroup`); the
    RankError it raises carries `failure`, what the launcher saw (`_failure_event`), when the ranks failed rather
    than refused. `stop_when()` (polled): once true, every rank gets `save_signal`, the preemption request, so the
    group stops together at a step boundary.

    gloo: forked CPU ranks. nccl: spawned ranks, rank r on cuda:r, `fn(*args, device=cuda:r)`, flight
    recorder dumps under `run_dir`. Forking after this process initialised CUDA is refused
    (ForkAfterCudaError): every forked rank would fail at its first CUDA call.

    On the first failure the other ranks get `grace_s` to report theirs, then all are torn down and
    a RankError names the culprit: a rank that died (its exit code), or a rank still alive that
    reported nothing while its peers failed (hung), what each failing rank was doing, and each
    rank's last collective call (which rank stopped earliest, on which op and axis).

    `save_signal` (--save-on-signal): this process forwards it to every rank, and each rank catches it from its
    first instruction on (the signal stays blocked while they start). Whatever `save_signal`, a rank gets it
    (else SIGKILL) from the kernel when this process dies: no rank outlives its launcher.
    """
    fork = backend == "gloo"
    if fork and torch.cuda.is_initialized():
        raise ForkAfterCudaError("run_local: this process has already initialised CUDA, so forked ranks cannot "
                                 "use it (\"Cannot re-initialize CUDA in forked subprocess\"); start the ranks "
                                 "before any CUDA call, or use backend='nccl' (spawned ranks)")
    if fork:
        # Building a model under a device context imports torch._dynamo (via torch.nn.init): once here
        # (~1.5 CPU-s) instead of in every forked rank of every run (4 CPU-s → 1 for a 2-rank tiny verify).
        importlib.import_module("torch._dynamo")
    ctx = mp.get_context("fork" if fork else "spawn")
    results = ctx.Queue()
    port = ctx.RawValue("i", 0)  # rank 0's store port, once bound (`_rendezvous`)
    lastops = tempfile.mkdtemp(prefix="shardwise-lastop-")
    procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, fn, args, results, backend, lastops,
                                               run_dir, save_signal, os.getpid(), group), daemon=False)
             for r in range(world)]
    stop_forwarding = _start(procs, save_signal)
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + (wall_timeout_s or float("inf"))
    failed_at, detected_at = None, None
    try:
        while len(out) + len(errors) < world:
            now = time.monotonic()
            if failed_at is not None and now > failed_at + grace_s:
                break
            if stop_when is not None and save_signal and stop_when():
                stop_when = None
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.Signals[save_signal])
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out
                        and r not in errors]
                if dead and results.empty() and failed_at is None:
                    failed_at, detected_at = now, time.time()
                if dead and results.empty() and len(out) + len(errors) + len(dead) == world:
                    break  # every rank has reported or died: nothing left to wait for
                if now > deadline and failed_at is None:
                    raise RankError(f"ranks {sorted(set(range(world)) - set(out))} did not finish within "
                                    f"{wall_timeout_s:.0f} s")
                continue
            if ok:
                out[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                failed_at = failed_at or time.monotonic()
                detected_at = detected_at or time.time()
        # Ranks that refused in one line (a ConfigError or subclass — SaveFailed, an unreadable shard: no traceback)
        # while the others wait for them or lost them in a collective: the first such line, exit 2, as on one rank.
        refused = sorted(r for r, m in errors.items() if "\n" not in m)
        if refused and not out and all(r in refused or procs[r].exitcode is None
                                       or errors.get(r, "").startswith("CollectiveError: ") for r in range(world)):
            from ..config import ConfigError

            raise ConfigError(errors[refused[0]].split(": ", 1)[1])
        if errors or len(out) < world:
            error = RankError(_failure_report(procs, out, errors, lastops))
            error.failure = _failure_event(procs, out, errors, lastops, group, detected_at or time.time())
            raise error
        for p in procs:
            p.join(timeout=30)
    finally:
        stop_forwarding()
        for p in procs:  # SIGKILL: SIGTERM may be a rank's stop request now, which a stuck rank would not act on
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(lastops, ignore_errors=True)
    return [out[r] for r in range(world)]


def _start(procs, save_signal: str | None):
    """Start the ranks; with `save_signal`, forward it to each from then on. Returns what ends the forwarding."""
    if not save_signal or threading.current_thread() is not threading.main_thread():
        for p in procs:
            p.start()
        return lambda: None
    signum = signal.Signals[save_signal]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signum})  # held until the ranks have their handlers (`_worker`)
    try:
        for p in procs:
            p.start()

        def forward(sig, frame):
            for p in procs:
                if p.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, sig)

        previous = signal.signal(signum, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})  # one that came meanwhile is forwarded now
    return lambda: signal.signal(signum, signal.SIG_DFL if previous is None else previous)


def _failure_report(procs, out, errors, lastops: str | None = None) -> str:
    records = {r: rec for r in range(len(procs)) if lastops and (rec := LastOp.read(lastops, r)) is not None}

    def last(r: int) -> str:
        if r not in records:
            return ""
        n, op, axis = records[r]
        return f" (last collective call #{n}: {op} on axis '{axis}')"

    dead = [r for r, p in enumerate(procs) if r not in out and r not in errors and p.exitcode not in (None, 0)]
    hung = [r for r, p in enumerate(procs) if r not in out and r not in errors and p.exitcode is None]
    lines = []
    for r in dead:
        lines.append(f"rank {r} died with exit code {procs[r].exitcode}{last(r)}")
    for r in hung:
        lines.append(f"rank {r} hung: alive but reported nothing while its peers failed{last(r)}")
    same: dict[str, list[int]] = {}  # a decision every rank made together (a refused resume) is said once
    for r, msg in sorted(errors.items()):
        same.setdefault(msg.splitlines()[0], []).append(r)
    for first, ranks in same.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"{who} failed: {first}")
    first_tb = next(iter(sorted(errors.items())), (None, ""))[1]
    traced = "\n" in first_tb  # a ConfigError comes without a traceback (`_worker`)
    return ("; ".join(lines) + _last_ops_report(records)
            + ("\n" + first_tb if traced and not dead and not hung else ""))
