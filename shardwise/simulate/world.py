"""One rank of a large world, run in this process on fake tensors.

torch's "fake" process group (every collective returns at once, nothing moves) gives the rank its real
mesh, and FakeTensorMode gives every tensor its real shape, dtype and storage without memory or compute.
The rank then runs shardwise's own Trainer — model build, ZeRO reducer, pipeline executor, comm layer and
ledger — for a few steps, while `LiveMemory` follows every storage and the saved-activation meter the
tensors autograd keeps. Host reads get stated stand-ins (`Answers`): zeros for loss, norm and token-id
range, the planner's balanced MoE routing — every expert receives n·k/E rows of every ep rank — and for
ring attention's document plan every block pair visible and masked (`DOCUMENT_PLAN`).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from .. import host
from ..activation_memory import SavedActivationMeter
from ..config import ConfigError, TrainConfig
from ..optim import optimizers
from .live import LiveMemory

ROUTING = "balanced MoE routing (the planner's assumption): each expert receives n·k/E rows from every ep rank"
DOCUMENT_PLAN = ("document mask: every ring block pair computed with its mask (documents taken to cross every "
                 "block boundary: no pair skipped, none unmasked)")
IGNORED_TAGS = ("metrics", "grad_norm")  # bookkeeping all-reduces the planner leaves out


def world_size(cfg: TrainConfig) -> int:
    p = cfg.parallel
    return p.world_size


def routed_tokens(cfg: TrainConfig) -> int:
    """Tokens one rank routes per microbatch: mb·s/cp, and 1/tp of them under sequence parallelism."""
    p = cfg.parallel
    n = cfg.micro_batch * cfg.seq_len // p.cp
    return n // p.tp if p.sequence_parallel and p.tp > 1 else n


class Answers:
    """The stand-in each host read gets in a simulation (`host.answered_by`)."""

    def __init__(self, cfg: TrainConfig):
        model = cfg.model_config()
        self.experts, self.topk, self.ep = model.moe_experts, model.moe_topk, cfg.parallel.ep
        self.rows = routed_tokens(cfg) * self.topk
        self.ep_rank = 0  # set once the mesh is built

    def balanced(self) -> list[int]:
        """Rows per expert of one rank's n·k assignments, as even as integers allow."""
        base, extra = divmod(self.rows, self.experts)
        return [base + (j < extra) for j in range(self.experts)]

    def __call__(self, what: str, t: torch.Tensor):
        if what == "moe split sizes":  # E send counts, then ep·E_l receive counts (source rank, local expert)
            per, e_l = self.balanced(), self.experts // self.ep
            mine = per[self.ep_rank * e_l:(self.ep_rank + 1) * e_l]
            return per + mine * self.ep  # every source routes like this rank
        if what == "cp document plan":  # [pairs, (visible, one document)]: the most work and memory
            return [[1, 0] for _ in range(t.shape[0])]
        return _zeros(list(t.shape))


def _zeros(shape: list[int]):
    return 0 if not shape else [_zeros(shape[1:]) for _ in range(shape[0])]


def _step(trainer, live: LiveMemory, step: int) -> int:
    """`Trainer.train_step` piece by piece, so the live-memory trace knows the phase of the step; returns the
    bytes of the TP-partial gradients held from backward to the TP sum (`deferred_grad_bytes`)."""
    live.phase = "forward"
    trainer.forward_backward(step)
    held = deferred_grad_bytes(trainer)
    live.phase = "gradient reduction"
    trainer.finish_gradients()
    live.phase = "optimizer"
    trainer.optimizer_step(step)
    live.phase = "after the step"
    if trainer.model_cfg.moe_experts:
        trainer.moe_step()
    trainer.mesh.ledger.end_step(step + 1)
    return held


def deferred_grad_bytes(trainer) -> int:
    """ZeRO 2/3: the whole gradients of TP-partial (deferred) buckets, which a rank holds from backward until
    the TP sum and the reduce-scatter after it free them — static state in the planner's count (they
    live through every microbatch), though gone by the time the optimizer has stepped."""
    if trainer.reducer.zero < 2:
        return 0
    grads = {p.grad.untyped_storage()._cdata: p.grad.untyped_storage().nbytes() for b in trainer.reducer.buckets
             if b.deferred for _, p, _, _ in b.offsets if p.grad is not None}
    return sum(grads.values())


def _label_statics(trainer, live: LiveMemory) -> None:
    params = list(trainer.model.parameters())
    opts = optimizers(trainer.reducer)
    live.label(params + [p for o in opts for g in o.param_groups for p in g["params"]], "parameters")
    live.label([p.grad for p in params if p.grad is not None], "gradients")
    live.label([t for o in opts for st in o.state.values() for t in st.values() if torch.is_tensor(t)],
               "optimizer state")
    live.label([t for b in trainer.reducer.buckets for k, t in vars(b).items() if torch.is_tensor(t)],
               "ZeRO flat buffers")


def comm_bytes(axes: dict) -> dict[str, int]:
    """Payload bytes per axis of one step's ledger, the planner's bookkeeping-free view."""
    out = {}
    for axis, ops in axes.items():
        n = sum(v["bytes"] for op, v in ops.items() if op.partition(":")[2] not in IGNORED_TAGS)
        if any(op.partition(":")[2] not in IGNORED_TAGS for op in ops):
            out[axis] = n
    return out


def simulate_rank(cfg: TrainConfig, rank: int, steps: int = 2) -> dict:
    """Run `steps` training steps of global rank `rank` on fake tensors; its measured memory and traffic.

    Static bytes are taken after the first optimizer step (as `shardwise train` does), plus the deferred
    TP-partial gradients the step held until its TP sum (`deferred_grad_bytes`), saved activations
    over the first step, the live peak over all steps (AdamW's moments exist from the first step's end),
    and the comm ledger of the last step. The model build's own peak (ZeRO-3 builds every unit's full flat
    buffer before sharding it) is reported apart, as `build_peak_bytes`.
    """
    from torch._subclasses import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..train import static_storage_bytes
    from ..trainer import Trainer, make_mesh

    world = world_size(cfg)
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside the world of {world} ranks")
    answers = Answers(cfg)
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with FakeTensorMode() as fake, LiveMemory() as live, host.answered_by(answers):
            mesh = make_mesh(cfg, torch.device("cpu"))
            answers.ep_rank = mesh["ep"].rank
            trainer = Trainer(cfg, mesh, fake_mode=fake)
            _label_statics(trainer, live)
            if trainer.reducer.units is not None:  # ZeRO-3: unit buffers gathered and freed by resizing
                live.watch([b.flat for b in trainer.reducer.buckets])
                trainer.reducer.units.on_resize = live.resized
            build_peak = live.reset_peak()  # the planner's peak is the training step's
            static = activation = None
            for step in range(steps):
                meter = SavedActivationMeter(trainer.model.parameters()) if step == 0 else None
                with meter or contextlib.nullcontext():
                    held = _step(trainer, live, step)
                if meter is not None:
                    activation = meter.peak
                if static is None:
                    static = static_storage_bytes(trainer) + held
                _label_statics(trainer, live)
            axes = mesh.ledger.steps[-1]["axes"]
            stage = mesh["pp"].rank
            del trainer
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "stage": stage, "static_bytes": static, "activation_bytes": activation,
            "peak_bytes": live.peak, "peak_phase": live.peak_phase, "build_peak_bytes": build_peak, "top_live": live.top(5),
            "comm_bytes": comm_bytes(axes), "wall_s": time.perf_counter() - t0}
