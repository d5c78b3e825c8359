"""Helpers for multi-rank tests: fork N gloo ranks, fresh seeds, mesh construction."""
from __future__ import annotations

import os

import torch

from shardwise.comm import Ledger
from shardwise.launch import run_local
from shardwise.config import ParallelConfig
from shardwise.mesh import Mesh
from shardwise.run import assemble


def fresh_seed() -> int:
    """A new seed per test run; tests pass it along so failures can name it."""
    return int.from_bytes(os.urandom(4), "little")


def run_ranks(world: int, fn, *args, timeout_s: float = 120.0):
    """Run fn(*args) on `world` forked gloo ranks; return the per-rank results."""
    return run_local(fn, world, *args, timeout_s=timeout_s, wall_timeout_s=600)


def run_ranks_to_a_crash(world: int, fn, *args, timeout_s: float = 120.0):
    """`run_ranks` for a run in which a rank is meant to die: the launcher's RankError (naming the dead rank) comes
    0.5 s after the death instead of after its 5 s wait for the survivors' own reports, which such a test does
    not read (a dead rank never reports, so that wait always runs out)."""
    return run_local(fn, world, *args, timeout_s=timeout_s, wall_timeout_s=600, grace_s=0.5)


def make_mesh(timeout_s: float = 120.0, **degrees) -> Mesh:
    """Inside a rank: the mesh for the given degrees (dp fills the rest)."""
    import torch.distributed as dist

    dims = ParallelConfig.build(dist.get_world_size(), **degrees)
    return Mesh.build(dims, torch.device("cpu"), Ledger(), timeout_s)


def verify_all(cfgs):
    """Inside ranks: run `verify_main` for each config in turn (one spawn checks many layouts)."""
    from shardwise.verify import verify_main

    out = []
    for cfg in cfgs:
        out.append(verify_main(assemble(cfg)))
    return out


def grad_slices(trainer) -> list[tuple]:
    """This rank's reduced gradients after `finish_gradients`, as (global name, shard dim, start, rows, values)
    for `global_grads`; values as numpy, pickled by value rather than as shared memory the exiting rank owns.
    Whole local gradients only (no ZeRO)."""
    from shardwise.tensor_parallel.layers import get_spec

    params = dict(trainer.model.named_parameters())
    out = []
    for name, vals, lo, hi in trainer.reducer.grad_views():
        spec = get_spec(params[name])
        assert (lo, hi) == (0, params[name].numel()), name  # no ZeRO: every rank holds whole local grads
        out.append((name, spec.dim, spec.start, spec.valid,
                    spec.valid_part(vals.reshape(params[name].shape)).numpy().copy()))
    return out


def global_grads(per_rank, shapes):
    """Assemble global gradients from every rank's (name, dim, start, rows, values) slices; replicas (a
    TP-replicated norm, a dp copy) must agree, and every element must be covered."""
    full = {n: torch.zeros(s) for n, s in shapes.items()}
    seen = {n: torch.zeros(s, dtype=torch.bool) for n, s in shapes.items()}
    for name, dim, start, rows, vals in per_rank:
        vals = torch.from_numpy(vals)
        dst = full[name] if dim is None else full[name].narrow(dim, start, rows)
        mask = seen[name] if dim is None else seen[name].narrow(dim, start, rows)
        if mask.any():
            torch.testing.assert_close(vals[mask], dst[mask], rtol=1e-6, atol=1e-9)
        dst.copy_(vals)
        mask.fill_(True)
    missing = [n for n, m in seen.items() if not m.all()]
    assert not missing, f"gradient elements no rank holds: {missing}"
    return full


def _cli_child(argv: list[str], err_fd: int) -> None:
    import sys

    from shardwise.cli import main

    os.dup2(err_fd, 2)
    os.close(err_fd)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # pytest's capture object would swallow the lines
    sys.exit(main(argv))


class ForkedCli:
    """`shardwise <argv>` run by the CLI's own `main` in a child forked from this process: no interpreter start
    and no imports per run, and its ranks fork from a warm parent. Its stderr (and its ranks') comes back
    through a pipe as `self.stderr`; stdout goes to /dev/null. Several can run at once."""

    def __init__(self, argv: list[str]):
        import multiprocessing

        read, write = os.pipe()
        self._proc = multiprocessing.get_context("fork").Process(target=_cli_child, args=(list(argv), write))
        self._proc.start()
        os.close(write)  # the child (and its ranks) hold the only write end: EOF when the last of them exits
        self.stderr = os.fdopen(read, "r")

    def wait(self, timeout: float) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            self._proc.kill()
            raise TimeoutError(f"the CLI run did not exit within {timeout} s")
        return self._proc.exitcode


def warm_parent() -> None:
    """One single-device training step in this process, so forked ranks inherit torch's lazy first-use setup
    instead of each paying it (measured ~10 CPU-s per 4-rank fork cold, ~3 warm)."""
    from shardwise.config import TrainConfig
    from shardwise.trainer import Trainer

    cfg = assemble(TrainConfig(steps=1, seq_len=32, micro_batch=1, progress=False))
    Trainer(cfg, Mesh.single(torch.device("cpu"))).train_step(0)
