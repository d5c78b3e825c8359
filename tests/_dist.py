"""Helpers for multi-rank tests: fork N gloo ranks, fresh seeds, mesh construction."""
from __future__ import annotations

import os

import torch

from shardwise.comm import Ledger
from shardwise.training.launch import run_local
from shardwise.config import ParallelConfig
from shardwise.mesh import Mesh
from shardwise.training.assemble import assemble


def fresh_seed() -> int:
    """A new seed per test run; tests pass it along so failures can name it. It is also printed, so pytest shows it
    under "Captured stdout" of any failing test that drew it, whatever the assertion's message; SHARDWISE_TEST_SEED
    replays one."""
    seed = int(os.environ.get("SHARDWISE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"fresh seed {seed} (replay: SHARDWISE_TEST_SEED={seed})", flush=True)
    return seed


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
    from shardwise.verify.main import verify_main

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
    from shardwise.training.trainer import Trainer

    cfg = assemble(TrainConfig(steps=1, seq_len=32, micro_batch=1, progress=False))
    Trainer(cfg, Mesh.single(torch.device("cpu"))).train_step(0)


class HFGrads:
    """A transformers model's gradients by name (the model, or its {name: gradient} already taken), read like a
    checkpoint (`hf.WeightFiles`' interface). `names`:
    {the name to read it by: the parameter's name} (a multimodal model's language model read by text-only names);
    every parameter under its own name when None."""

    def __init__(self, model, names: dict[str, str] | None = None):
        grads = model if isinstance(model, dict) else {n: p.grad for n, p in model.named_parameters()}
        self.t = grads if names is None else {n: grads[s] for n, s in names.items()}
        self.where = self.t

    def __contains__(self, n):
        return n in self.t

    def shape(self, n):
        return tuple(self.t[n].shape)

    def read(self, n, box):
        return self.t[n][box]


def hf_hybrid_grad(name, cfg, grads: HFGrads):
    """transformers' gradient of a Qwen3-Next / Qwen3.5 model's shardwise parameter `name`: mapped like its weight,
    but without the zero-centred norms' +1."""
    from shardwise.hf import qwen3_next as hf_qwen3_next

    special = hf_qwen3_next.source(name, cfg, grads, offset=0.0)
    if special is not None:
        return special[2](grads)
    return hf_grad(name, cfg, grads)


def hf_grad(name, cfg, grads: HFGrads):
    """transformers' gradient of shardwise parameter `name`, mapped as `hf.tensor_source` maps its weight."""
    from shardwise.hf import weights as hf

    src = hf.tensor_source(name, cfg, grads)
    return src.read(grads, tuple(slice(0, s) for s in src.shape))


def hf_hybrid_grad_bounds(model, ref_model, cfg, x, names: dict[str, str] | None = None) -> list[tuple]:
    """(name, rel, bound) for every shardwise parameter of a Qwen3-Next / Qwen3.5 model whose gradients (after its
    backward) are compared with transformers' `ref_model`'s (after its own, on tokens `x`): rel is norm-wise, as
    verify measures gradients; bound is fp32's floor, not ours — 3e-4 (at initializer_range 0.2 transformers' own
    fp32 gradients of the linear layers sit 5e-5–1.2e-4 from float64), or where a gradient's sums cancel (A_log,
    dt_bias, the decay's wa: 4 of 150 token draws went past 3e-4, up to 7e-4) 4x transformers' own distance to the
    same model run in float64 (verify's `Float64`, verify's multiple). A wrong mapping, norm offset or rotary
    permutation scores O(1). `names`: as `HFGrads`'."""
    import copy

    from shardwise.verify.fp64_budget import Float64

    grads = HFGrads(ref_model, names)
    rels = {n: float((p.grad - hf_hybrid_grad(n, cfg, grads)).norm() / hf_hybrid_grad(n, cfg, grads).norm())
            for n, p in model.named_parameters()}
    for n in rels:
        assert float(hf_hybrid_grad(n, cfg, grads).abs().max()) > 0, n
    if max(rels.values()) < 3e-4:  # the float64 run only where needed (MoE's grouped GEMM has no float64 kernel)
        return [(n, rel, 3e-4) for n, rel in rels.items()]
    exact = copy.deepcopy(ref_model).double()
    with Float64():
        logits = exact(input_ids=x[:, :-1]).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    grads64 = HFGrads(exact, names)
    out = []
    for n, rel in rels.items():
        ref, ref64 = hf_hybrid_grad(n, cfg, grads), hf_hybrid_grad(n, cfg, grads64)
        noise = float((ref.double() - ref64).norm() / ref64.norm())
        out.append((n, rel, max(3e-4, 4 * noise)))
    return out
