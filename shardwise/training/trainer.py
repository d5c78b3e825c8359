"""One rank's training step: the `Trainer` shared by `shardwise train`, `verify`, `simulate` and the evaluator.

The loss of a step is the mean over every non-ignored token of the *global* batch: each rank sums
its token losses and divides by the global count (known on every rank, since every rank sees the
global batch's targets), so gradients sum across dp×cp and microbatching changes nothing.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist

from .. import comm, host
from .batches import BatchSlicer
from ..comm import Ledger
from ..config import ParallelConfig, TrainConfig
from ..config.schedule import lr_at_plan, lr_plan
from ..data import IGNORE_INDEX, Loader, open_data
from ..expert_parallel import metrics as moe_metrics
from ..expert_parallel.metrics import MoEMetrics
from ..expert_parallel.routing_stats import moe_blocks, slot_count
from ..mesh import Mesh
from ..optim import optimizers
from ..parallelize import parallelize
from ..pipeline.tied_embedding import emb_stages
from .step_timer import StepTimer


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR of 0-based `step` under the run's schedule (shardwise.config.schedule): warm-up, then cosine, linear,
    WSD or constant, reaching --min-lr on the schedule's last step."""
    return lr_at_plan(step, lr_plan(cfg))


class Trainer:
    def __init__(self, cfg: TrainConfig, mesh: Mesh, tokens: torch.Tensor | None = None, io=None,
                 microbatches: int | None = None):
        """`io`: where the loader and each batch's host-side preparation run (`io.host()`, a context) and how
        a host batch reaches the device (`io.to_device(t)`); None: as they are, and a copy to the mesh's
        device. A world whose rank computes on something else (shardwise simulate) passes its own.
        `microbatches`: run only that many of each step's microbatches — the schedule and the reducer's
        rounds for that count, on the whole step's batch (shardwise simulate runs a shortened step); None: all."""
        self.cfg, self.mesh, self.io = cfg, mesh, io
        self.model_cfg = cfg.model_config()
        p = cfg.parallel
        self.schedule = None
        self.microbatches_run = microbatches or cfg.grad_accum
        if p.pp > 1:
            from ..rules.schedules import build_schedule

            self.schedule = build_schedule(p.schedule, p.pp, self.microbatches_run, p.vp)
        self.act_dtype = torch.bfloat16 if cfg.residual_dtype() == "bf16" else torch.float32
        self.global_batch = cfg.global_batch or cfg.micro_batch * p.dp
        rounds = microbatches or self.global_batch // mesh.dims.dp // cfg.micro_batch  # the microbatches run
        # every axis, in one order (parallelize.py): TP, EP, CP, PP, init, compile, recompute, the starting
        # weights, then DP/ZeRO — the reducer (gradient reduction, ZeRO-3 gathers) with the optimizer
        self.model, self.reducer = parallelize(self.model_cfg, mesh, cfg.seed, p, schedule=self.schedule,
                                               act_dtype=self.act_dtype, load=self._load if cfg.init_from_hf else None,
                                               train=cfg, rounds=rounds)
        self.model.train()
        with self._host():  # a pure function of the step: the checkpoint's step is the data position
            self.loader = Loader(open_data(cfg.data, debug=cfg.debug) if tokens is None else tokens, cfg.seq_len, self.global_batch,
                                 cfg.seed)
        self.eos_id = self.loader.eos_id if cfg.eos_id is None else cfg.eos_id  # the data's EOS (bytes: 256)
        self.moe = moe_blocks(self.model, self.model_cfg.n_layers)  # each labelled with its layer id (routing record)
        for m in self.moe:  # every global microbatch's aux loss weighs tokens(microbatch) / tokens(step)
            m.aux_scale = 1.0 / cfg.grad_accum
        self.batches = BatchSlicer(cfg, mesh, self.global_batch, self.model_cfg.vocab_size, self.eos_id)
        self.timer = StepTimer(mesh.device)
        self.step = 0
        self.bad_steps = 0
        self.step_hooks: list[Callable[[Trainer, int], None]] = []  # called before each step (shardwise.training.faults)
        self.poison = False  # this step's loss and gradients become NaN (fault injection)
        self.executor = None
        if self.schedule is not None:
            from ..pipeline.runtime import PipelineExecutor

            s_local = cfg.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
            self.executor = PipelineExecutor(self.model.chunks, self.schedule, mesh,
                                             (cfg.micro_batch, s_local, self.model_cfg.dim), self.act_dtype,
                                             lambda logits, y: self.model.loss_fn(logits, y, IGNORE_INDEX, cfg.label_smoothing),
                                             self.model.grad_store, self._autocast, p.pp_scatter_gather)

    def _load(self, model) -> None:
        """--init-from-hf: the checkpoint's weights over the seeded ones (before DP: ZeRO's flat buffers start
        from the parameters' values)."""
        from ..hf.weights import load_hf_into

        load_hf_into(model, self.cfg.init_from_hf, self.mesh, self.cfg.mtp_init)

    def _host(self):
        """The host side of the loop: the loader and each batch's preparation."""
        return contextlib.nullcontext() if self.io is None else self.io.host()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """The one point where batch data leaves the host."""
        return to_device(t, self.mesh.device) if self.io is None else self.io.to_device(t)

    def _autocast(self):
        if self.cfg.dtype == "bf16":
            return torch.autocast(self.mesh.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, step: int) -> float:
        """Run every microbatch of this rank's share of the step's global batch; returns the global loss."""
        return host.read(self._forward_backward(step), "loss")[0]

    def _forward_backward(self, step: int) -> torch.Tensor:
        """`forward_backward`, leaving the global loss on the device: [loss], or [loss, MTP part] when the
        model has MTP modules. Nothing waits for it."""
        dp = self.mesh["dp_cp"]
        n_tokens = self.loader.count_targets(step)  # every rank knows the global count: no collective
        xs, ys, side = self.microbatches(self.loader, step, mtp=True)
        if self.poison:  # fault injection: NaN gradients enter this rank's reductions
            self.reducer.poison()
        if self.executor is not None:
            loss_sum = self.executor.run(xs, ys, n_tokens, side)
        else:
            loss_sum = torch.zeros(1, device=self.mesh.device)
            for mb, (xm, ym) in enumerate(zip(xs[:self.microbatches_run], ys)):
                with self._autocast():
                    logits = self.model(xm, **(side[mb] if side else {}))
                loss = self.model.loss_fn(logits, ym, IGNORE_INDEX, self.cfg.label_smoothing).sum() / n_tokens
                loss.backward()
                loss_sum += loss.detach()
        parts = [loss_sum]
        if self.model_cfg.mtp_layers:  # the MTP modules' loss (last stage), reported with the main loss
            mtp = torch.zeros_like(loss_sum)
            if self.model.mtp_loss is not None:
                loss_sum += self.model.mtp_loss
                mtp += self.model.mtp_loss
            self.model.mtp_loss = None
            parts.append(mtp)
        for t in parts:  # the loss's reduction alone, as without MTP: the part is reduced on its own
            if self.poison:  # fault injection: this rank's loss and gradients become NaN
                t.fill_(float("nan"))
            comm.all_reduce(t, dp, tag="metrics")
            comm.all_reduce(t, self.mesh["pp"], tag="metrics")  # only the last stage holds a loss
        return torch.cat(parts) if len(parts) > 1 else loss_sum

    def microbatches(self, loader: Loader, step: int, mtp: bool = False) -> tuple[list, list, list[dict] | None]:
        """This rank's share of `loader`'s global batch `step`: inputs and targets per microbatch on the
        device (its dp rows, its cp cut) and the per-microbatch side inputs (training and evaluation; `mtp`:
        with the MTP modules' inputs when the model has them)."""
        with self._host():
            x, y, side = self.batches.host_batch(loader, step, mtp and bool(self.model_cfg.mtp_layers))
            xs, ys = x.split(self.cfg.micro_batch), y.split(self.cfg.micro_batch)
        xs, ys = [self._to_device(t) for t in xs], [self._to_device(t) for t in ys]
        side = side and [{k: self._to_device(v) for k, v in s.items()} for s in side]
        return xs, ys, side

    def finish_gradients(self) -> float:
        return self.reducer.reduce_and_clip(self.cfg.grad_clip)

    def _finish_gradients(self) -> torch.Tensor:
        """`finish_gradients` with the clipping queued on the device; the norm stays there ([1])."""
        return self.reducer.reduce_and_clip_queued(self.cfg.grad_clip)

    def optimizer_step(self, step: int) -> float:
        lr = lr_at(step, self.cfg)
        for opt in optimizers(self.reducer):
            for g in opt.param_groups:
                g["lr"] = lr
        self.reducer.step()
        return lr

    def train_step(self, step: int) -> dict:
        """One optimizer step. Non-finite loss or gradient norm (global, so every rank agrees) skips it.

        One host read per step (`shardwise.host`): loss, grad norm and the MoE metrics come back together,
        once the clipped gradients — the optimizer's inputs — are queued; the step time is read a step
        late (`StepTimer`), so the host never waits for the optimizer before queuing the next step.
        """
        self.timer.start()
        host.reset()
        self.poison = False
        for hook in self.step_hooks:
            hook(self, step)
        loss_parts = self._forward_backward(step)
        queued = [loss_parts[:1], self._finish_gradients(), loss_parts[1:]]
        moe = self.moe_step(read=False) if self.model_cfg.moe_experts else None  # every stage joins the pp reduce
        values = host.read(torch.cat(queued + ([moe] if moe is not None else [])), "loss+norm")
        loss, norm = values[0], values[1]
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        lr = self._skip(step, loss, norm) if skipped else self.optimizer_step(step)
        self.mesh.ledger.end_step(step + 1)
        rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
               "tokens": self.global_batch * self.cfg.seq_len, "host_syncs": host.count()}
        self.timer.stop(rec)  # sets rec["step_time_s"] now (host clock) or at the next step (device events)
        if skipped:
            rec["skipped"] = True
        n_parts = len(loss_parts) - 1
        if n_parts:  # MTP: the main loss and the MTP modules' part of `loss`
            rec["loss_main"], rec["loss_mtp"] = loss - values[2], values[2]
        if moe is not None:
            rec.update(MoEMetrics.from_values(values[2 + n_parts:], self.model_cfg.moe_experts, self.mesh["ep"].size).record())
        return rec

    def _skip(self, step: int, loss: float, norm: float) -> float:
        """A non-finite step: its gradients are dropped; too many of them (or --bad-step abort) end the run."""
        self.bad_steps += 1
        self.reducer.zero_grad()
        if self.cfg.bad_step == "abort" or self.bad_steps > self.cfg.max_bad_steps:
            raise FloatingPointError(
                f"step {step + 1}: non-finite loss ({loss}) or grad norm ({norm}); "
                + ("aborting (--bad-step abort)" if self.cfg.bad_step == "abort" else
                   f"{self.bad_steps} bad steps exceed --max-bad-steps {self.cfg.max_bad_steps}"))
        return lr_at(step, self.cfg)

    def moe_step(self, read: bool = True):
        """The loss-free bias update and this step's global routing metrics (`expert_parallel.metrics`).
        Collective over the token axes and pp. `read=False` leaves the metrics on the device as one vector."""
        axes = (self.mesh["dp_cp"], self.mesh["tp"]) if self.cfg.parallel.sequence_parallel else (self.mesh["dp_cp"],)
        n_exp = self.model_cfg.moe_experts
        vec = moe_metrics.gather(self.moe, n_exp, axes, self.mesh["pp"], self.mesh.device, slot_count(self.model_cfg))
        return MoEMetrics.from_values(host.read(vec, "moe metrics"), n_exp, self.mesh["ep"].size) if read else vec


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch onto the device. CUDA: through pinned memory (the caching host allocator reuses its
    blocks, and records the copy so a block is not reused before the DMA is done), without blocking."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def make_mesh(cfg: TrainConfig, device: torch.device) -> Mesh:
    p = cfg.parallel
    if not dist.is_initialized():
        return Mesh.single(device)
    dims = ParallelConfig.build(dist.get_world_size(), p.dp, p.pp, p.cp, p.tp, p.ep, p.dp_shard)
    m = cfg.model_config()
    tied = emb_stages(p) if m.tie_embeddings or m.mtp_layers else None  # MTP reads the embedding on the last stage
    return Mesh.build(dims, device, Ledger(), cfg.timeout_s, emb_stages=tied)
