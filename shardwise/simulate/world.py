"""One rank of a large world, run in this process on fake tensors.

torch's "fake" process group (every collective returns at once, nothing moves) gives the rank its real
mesh, and FakeTensorMode gives every tensor its real shape, dtype and storage without memory or compute.
The rank then runs shardwise's own Trainer — model build, ZeRO reducer, pipeline executor, comm layer and
ledger — for a few steps, while `LiveMemory` follows every storage and the saved-activation meter the
tensors autograd keeps. Host reads get stated stand-ins (`Answers`): zeros for loss, norm and token-id
range, the planner's balanced MoE routing — every expert receives n·k/E rows of every ep rank — and for
ring attention's document plan every block pair visible and masked (`DOCUMENT_PLAN`).

The fake world enters the production code only through what it is handed: the mesh's `FakeTransport`, the
Trainer's `FakeIO`, and `StandIns`, a TorchFunctionMode answering the few functions shardwise leaves
overridable (host reads, the grouped-GEMM check, the recompute routing check).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from torch.overrides import TorchFunctionMode

from .. import host
from ..training.activation_memory import SavedActivationMeter, static_storage_bytes
from ..comm import Transport
from ..config import ConfigError, ParallelConfig, TrainConfig
from ..expert_parallel.dispatch import check_same_routing
from ..expert_parallel.experts import grouped_mm_available
from ..mesh import Mesh
from ..optim import optimizers
from ..pipeline.tied_embedding import emb_stages
from ..rules.fp8 import planned_token_tiles
from ..rules.routing import send_counts
from ..rules.validation import FP8_TOKEN_TILE
from . import peer_copy
from .dispatch_key import fake_mode
from .live import LiveMemory
from .shorten import ScaledLedger, Shortening, shorten

ROUTING = "balanced MoE routing (the planner's assumption): each expert receives n·k/E rows from every ep rank"
SKEWED = ("skewed MoE routing (--moe-skew / --routing): the simulated rank is the busiest ep rank, receiving {s:.3g}x "
          "the mean rows (rules.routing)")
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
    """The stand-in each host read gets in a simulation (`StandIns`)."""

    def __init__(self, cfg: TrainConfig, skew: float = 1.0):
        model = cfg.model_config()
        self.experts, self.topk, self.ep = model.moe_experts, model.moe_topk, cfg.parallel.ep
        self.tokens = routed_tokens(cfg)
        self.rows = self.tokens * self.topk
        self.skew, self.capacity_factor = skew, model.moe_capacity_factor
        self.ep_rank = 0  # set once the mesh is built
        self.cfg = cfg

    def balanced(self) -> list[int]:
        """Rows per expert of one rank's n·k assignments, as even as integers allow: over the ep ranks first, then
        over each rank's experts (GLM-4.5's 160 experts on ep 32: every rank still receives the group's mean)."""
        e_l = self.experts // max(self.ep, 1)
        base, extra = divmod(self.rows, self.experts // e_l)
        out = []
        for r in range(self.experts // e_l):
            b, x = divmod(base + (r < extra), e_l)
            out += [b + (j < x) for j in range(e_l)]
        return out

    def routed(self) -> list[int]:
        """Rows per expert every source rank sends: balanced, or under a skew with this rank's experts the hot ones
        (the simulated rank is the busiest, as the plan is for it); with a capacity factor, what each expert keeps."""
        if (self.skew == 1.0 or self.ep < 2) and self.capacity_factor is None:
            return self.balanced()
        return send_counts(self.tokens, self.topk, self.experts, self.ep, self.skew, self.ep_rank, self.capacity_factor)

    def token_tiles(self) -> int:
        """Rows of a routed-expert group's FP8 tile buffer (`fp8.scaling.TokenTiles.count`), as the plan counts
        them (`rules.fp8.planned_token_tiles`) from the rows this rank's experts receive."""
        p, e_l = self.cfg.parallel, self.experts // max(self.ep, 1)
        received = sum(self.routed()[self.ep_rank * e_l:(self.ep_rank + 1) * e_l]) * self.ep
        sp = p.tp if p.sequence_parallel and p.tp > 1 else 1
        return planned_token_tiles(received, p.dp, p.cp, p.ep, sp, self.cfg.micro_batch, self.cfg.seq_len,
                                   self.topk, e_l, FP8_TOKEN_TILE[self.cfg.fp8])

    def __call__(self, what: str, t: torch.Tensor):
        if what == "moe split sizes":  # E send counts, then ep·E_l receive counts (source rank, local expert)
            per, e_l = self.routed(), self.experts // self.ep
            mine = per[self.ep_rank * e_l:(self.ep_rank + 1) * e_l]
            return per + mine * self.ep  # every source routes like this rank
        if what == "fp8 token tiles":  # the routed experts' tile buffer rows, as the plan counts them
            return self.token_tiles()
        if what == "cp document plan":  # [pairs, (visible, one document)]: the most work and memory
            return [[1, 0] for _ in range(t.shape[0])]
        return _zeros(list(t.shape))


def _zeros(shape: list[int]):
    return 0 if not shape else [_zeros(shape[1:]) for _ in range(shape[0])]


class StandIns(TorchFunctionMode):
    """What the fake world says where shardwise would look at data or at a kernel fake tensors lack: host
    reads answered by `answers(what, t)`, torch._grouped_mm only in bf16 (the fake kernel accepts nothing
    else), and no recompute routing check (fake counts hold no values). Every other call passes through.

    A mode is off while it handles a call, so a call that runs shardwise code inside it would escape the
    stand-ins: `Tensor.backward` (recomputation, gradient hooks) runs its engine with the mode back on —
    the engine keeps its caller's modes for every node. The pipeline calls the engine itself.

    `position()`: where a step without a pipeline is — 2i in microbatch i's forward, 2i + 1 in its backward
    (the trainer's F0 B0 F1 B1 …), counted from the outermost `Tensor.backward` calls."""

    def __init__(self, answers):
        super().__init__()
        self.answers = answers
        self.backwards = self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is host.values:
            return self.answers(args[1], args[0])
        if func is grouped_mm_available:
            return args[0].dtype == torch.bfloat16 and func(*args)
        if func is check_same_routing:
            return None
        if func is torch.Tensor.backward:
            self.depth += 1
            try:
                with self:
                    return _backward(*args, **(kwargs or {}))
            finally:
                self.depth -= 1
                self.backwards += self.depth == 0
        return func(*args, **(kwargs or {}))

    def position(self) -> int:
        return 2 * self.backwards + (self.depth > 0)

    def new_step(self) -> None:
        self.backwards = 0


def _backward(tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    """`Tensor.backward`'s own body (torch.autograd.backward's, for one tensor), minus its torch-function check."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grads = _make_grads((tensor,), _tensor_or_tensors_to_tuple(gradient, 1), is_grads_batched=False)
    _engine_run_backward((tensor,), grads, create_graph if retain_graph is None else retain_graph, create_graph,
                         inputs, allow_unreachable=True, accumulate_grad=True)


class FakeTransport(Transport):
    """The fake process group's world: it can host no second backend (the world group serves for checkpoint
    metadata), builds no DeviceMesh, takes every peer to hold what this rank holds in an object gather, and
    its p2p handles — done as soon as issued — report so (torch's FakeWork always answers False)."""

    def __init__(self, through_backend: bool = False):
        self.through_backend = through_backend

    def side_group(self, timeout):
        return dist.group.WORLD

    def device_mesh(self, groups, device_type, grid, names):
        return None

    def all_gather_object(self, out: list, obj, group) -> list:
        return [obj] * len(out)

    def batch_isend_irecv(self, ops: list) -> list:
        """One completed handle per op. The fake process group's send and recv move and allocate nothing (the
        ledger has recorded the batch already) but cost its dispatch, an eighth of a ring-attention rank's
        simulation time: called only `through_backend` (the plain path, `simulate_rank(fast=False)`)."""
        if self.through_backend:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return [ISSUED] * len(ops)


class Issued:
    """A fake p2p handle: done as soon as issued."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


ISSUED = Issued()


class FakeIO:
    """The Trainer's batches under FakeTensorMode: the loader and each batch's host-side preparation stay real,
    outside the mode, and a batch crosses in as a fake tensor."""

    def __init__(self, fake_mode):
        self.fake_mode = fake_mode

    def host(self):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        return unset_fake_temporarily()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return self.fake_mode.from_tensor(t)


def fake_mesh(cfg: TrainConfig, fast: bool = True) -> Mesh:
    """`trainer.make_mesh`'s mesh on the fake process group's transport (CPU kernels: see PLATFORM.md); `fast`:
    p2p batches skip the fake backend (`FakeTransport`)."""
    p, m = cfg.parallel, cfg.model_config()
    dims = ParallelConfig.build(dist.get_world_size(), p.dp, p.pp, p.cp, p.tp, p.ep, p.dp_shard)
    tied = emb_stages(p) if m.tie_embeddings or m.mtp_layers else None
    return Mesh.build(dims, torch.device("cpu"), ScaledLedger(), cfg.timeout_s, emb_stages=tied,
                      transport=FakeTransport(through_backend=not fast))


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


def simulate_rank(cfg: TrainConfig, rank: int, steps: int = 2, every_microbatch: bool = False,
                  fast: bool = True, moe_skew: float = 1.0) -> dict:
    """Run `steps` training steps of global rank `rank` on fake tensors; its measured memory and traffic.

    Each step runs only the microbatches the rank's schedule needs to show every moment of the full step
    (`shorten`: the warm-up, a steady period, the cool-down), on the full step's batch; the ledger counts the
    repeated period's ops as often as the full step runs them (`ScaledLedger`). `every_microbatch`: run the
    whole step.

    Static bytes are taken after the first optimizer step (as `shardwise train` does), plus the deferred
    TP-partial gradients the step held until its TP sum (`deferred_grad_bytes`), saved activations
    over the first step, the live peak over all steps (AdamW's moments exist from the first step's end),
    and the comm ledger of the last step. The model build's own peak (ZeRO-3 builds every unit's full flat
    buffer before sharding it) is reported apart, as `build_peak_bytes`.

    `fast` (the default) takes three shortcuts that change no figure: the dispatch cache's static-shape key
    and its one-pass cache hits (`StaticKeyMode`, where this torch has the hook), device queries answered by the live-memory trace, p2p batches that skip the fake
    backend. `fast=False` is the plain path, kept to show them equal (`tests/test_simulate_fast.py`).
    `moe_skew`: the router's split sizes make this rank the busiest ep rank at S× the mean (`Answers.routed`).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..training.trainer import Trainer

    world = world_size(cfg)
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside the world of {world} ranks")
    answers = Answers(cfg, moe_skew)
    stand = StandIns(answers)
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with fake_mode(fast) as fake, LiveMemory(answer_device=fast) as live, stand:
            mesh = fake_mesh(cfg, fast)
            answers.ep_rank = mesh["ep"].rank
            p = cfg.parallel
            cut = Shortening(cfg.grad_accum, cfg.grad_accum) if every_microbatch else \
                shorten(p.schedule, p.pp, p.vp, cfg.grad_accum, mesh["pp"].rank)
            trainer = Trainer(cfg, mesh, io=FakeIO(fake), microbatches=cut.run)
            mesh.ledger.shortening = cut
            mesh.ledger.position = stand.position if trainer.executor is None else \
                (lambda clock=trainer.executor.clock: len(clock.raw))
            _label_statics(trainer, live)
            if trainer.reducer.units is not None:  # ZeRO-3: unit buffers gathered and freed by resizing
                live.watch([b.flat for b in trainer.reducer.buckets])
                trainer.reducer.units.on_resize = live.resized
            build_peak = live.reset_peak()  # the planner's peak is the training step's
            static = activation = None
            for step in range(steps):
                meter = SavedActivationMeter(trainer.model.parameters()) if step == 0 else None
                stand.new_step()
                with meter or contextlib.nullcontext():
                    held = _step(trainer, live, step)
                if meter is not None:
                    activation = meter.peak
                if static is None:
                    static = static_storage_bytes(trainer) + held
                _label_statics(trainer, live)
            axes = mesh.ledger.steps[-1]["axes"]
            stage = mesh["pp"].rank
            copies = peer_copy.held(trainer)
            del trainer
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "stage": stage, "static_bytes": static, "activation_bytes": activation,
            "peak_bytes": live.peak, "peak_phase": live.peak_phase, "build_peak_bytes": build_peak, "top_live": live.top(5),
            "comm_bytes": comm_bytes(axes), "ledger": axes, "microbatches_run": cut.run,
            "microbatches_scaled": cut.scaled, "peer_copy_host_bytes": copies, "wall_s": time.perf_counter() - t0}
