"""One rank's training step: the `Trainer` shared by `shardwise train`, `verify`, `simulate` and the evaluator.

The loss of a step is the mean over every non-ignored token of the *global* batch: each rank sums
its token losses and divides by the global count (known on every rank, since every rank sees the
global batch's targets), so gradients sum across dp×cp and microbatching changes nothing.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from . import comm, host
from .comm import Ledger
from .config import TrainConfig
from .config.schedule import lr_at_plan, lr_plan, parse_betas
from .context_parallel.sharding import shard_sequence
from .data import IGNORE_INDEX, Loader, open_data
from .data_parallel import GradReducer
from .expert_parallel.moe import MoE
from .mesh import Mesh, ParallelDims
from .models.documents import document_ids, document_positions
from .models.mtp import depth_counts, shift_inputs
from .parallelize import build_model
from .pipeline.tied_embedding import emb_stages
from .step_timer import StepTimer
from .tensor_parallel.layers import check_token_ids


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR of 0-based `step` under the run's schedule (shardwise.config.schedule): warm-up, then cosine, linear,
    WSD or constant, reaching --min-lr on the schedule's last step."""
    return lr_at_plan(step, lr_plan(cfg))


class Trainer:
    def __init__(self, cfg: TrainConfig, mesh: Mesh, tokens: torch.Tensor | None = None, io=None):
        """`io`: where the loader and each batch's host-side preparation run (`io.host()`, a context) and how
        a host batch reaches the device (`io.to_device(t)`); None: as they are, and a copy to the mesh's
        device. A world whose rank computes on something else (shardwise simulate) passes its own."""
        self.cfg, self.mesh, self.io = cfg, mesh, io
        self.model_cfg = cfg.model_config()
        p = cfg.parallel
        self.schedule = None
        if p.pp > 1:
            from .pipeline.schedules import build_schedule

            self.schedule = build_schedule(p.schedule, p.pp, cfg.grad_accum, p.vp)
        self.act_dtype = torch.bfloat16 if cfg.residual_dtype() == "bf16" else torch.float32
        self.model = build_model(self.model_cfg, mesh, cfg.seed, p.sequence_parallel, self.schedule, p.pp_layers,
                                 p.cp_order, p.cp_impl, self.act_dtype, p.recompute, p.recompute_layers,
                                 p.compile)
        if cfg.init_from_hf:  # before the reducer: ZeRO's flat buffers start from the parameters' values
            from .hf import load_hf_into

            load_hf_into(self.model, cfg.init_from_hf, mesh)
        self.model.train()
        self.global_batch = cfg.global_batch or cfg.micro_batch * p.dp
        rounds = self.global_batch // mesh.dims.dp // cfg.micro_batch  # the microbatches forward_backward runs
        self.reducer = GradReducer(self.model, mesh, p.zero, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   betas=parse_betas(cfg.adam_betas), eps=cfg.adam_eps,
                                   reduce_dtype=torch.bfloat16 if cfg.grad_reduce_dtype == "bf16" else None,
                                   rounds=rounds, overlap=cfg.overlap_grad_reduce)
        with self._host():  # a pure function of the step: the checkpoint's step is the data position
            self.loader = Loader(open_data(cfg.data) if tokens is None else tokens, cfg.seq_len, self.global_batch,
                                 cfg.seed)
        self.eos_id = self.loader.eos_id if cfg.eos_id is None else cfg.eos_id  # the data's EOS (bytes: 256)
        self.moe = [m for m in self.model.modules() if isinstance(m, MoE)]
        for m in self.moe:  # every global microbatch's aux loss weighs tokens(microbatch) / tokens(step)
            m.aux_scale = 1.0 / cfg.grad_accum
        self.group_dp = 1  # >1 only for verify's reference: microbatch i = every dp rank's microbatch i
        self.timer = StepTimer(mesh.device)
        self.step = 0
        self.bad_steps = 0
        self._poison = False
        self.executor = None
        if self.schedule is not None:
            from .pipeline.runtime import PipelineExecutor

            s_local = cfg.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
            self.executor = PipelineExecutor(self.model.chunks, self.schedule, mesh,
                                             (cfg.micro_batch, s_local, self.model_cfg.dim), self.act_dtype,
                                             lambda logits, y: self.model.loss_fn(logits, y, IGNORE_INDEX, cfg.label_smoothing),
                                             self.model.grad_store, self._autocast, p.pp_scatter_gather)

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
        """`forward_backward`, leaving the global loss on the device ([1]): nothing waits for it."""
        dp = self.mesh["dp_cp"]
        n_tokens = self.loader.count_targets(step)  # every rank knows the global count: no collective
        xs, ys, side = self.microbatches(self.loader, step, mtp=True)
        if self._poison:  # fault injection: NaN gradients enter this rank's reductions
            self.reducer.poison()
        if self.executor is not None:
            loss_sum = self.executor.run(xs, ys, n_tokens, side)
        else:
            loss_sum = torch.zeros(1, device=self.mesh.device)
            for mb, (xm, ym) in enumerate(zip(xs, ys)):
                with self._autocast():
                    logits = self.model(xm, **(side[mb] if side else {}))
                loss = self.model.loss_fn(logits, ym, IGNORE_INDEX, self.cfg.label_smoothing).sum() / n_tokens
                loss.backward()
                loss_sum += loss.detach()
        if self.model.mtp_loss is not None:  # the MTP modules' loss (last stage), reported with the main loss
            loss_sum += self.model.mtp_loss
            self.model.mtp_loss = None
        if self._poison:  # fault injection: this rank's loss and gradients become NaN
            loss_sum.fill_(float("nan"))
        comm.all_reduce(loss_sum, dp, tag="metrics")
        comm.all_reduce(loss_sum, self.mesh["pp"], tag="metrics")  # only the last stage holds a loss
        return loss_sum

    def microbatches(self, loader: Loader, step: int, mtp: bool = False) -> tuple[list, list, list[dict] | None]:
        """This rank's share of `loader`'s global batch `step`: inputs and targets per microbatch on the
        device (its dp rows, its cp cut) and the per-microbatch side inputs (training and evaluation; `mtp`:
        with the MTP modules' inputs when the model has them)."""
        with self._host():
            x, y, side = self._host_batch(loader, step, mtp and bool(self.model_cfg.mtp_layers))
            xs, ys = x.split(self.cfg.micro_batch), y.split(self.cfg.micro_batch)
        xs, ys = [self._to_device(t) for t in xs], [self._to_device(t) for t in ys]
        side = side and [{k: self._to_device(v) for k, v in s.items()} for s in side]
        return xs, ys, side

    def _host_batch(self, loader: Loader, step: int, mtp: bool = False):
        """This rank's inputs, targets and document side inputs of `loader`'s batch `step`, on the host."""
        per = self.global_batch // self.mesh.dims.dp
        dp_rank = self.mesh["dp"].rank
        x, y = loader.batch_at(step, dp_rank * per, (dp_rank + 1) * per)  # only this rank's windows
        check_token_ids(x, self.model_cfg.vocab_size)  # once per batch, on the host, before the copy to the device
        if self.group_dp > 1:
            g, mb = self.group_dp, self.cfg.micro_batch // self.group_dp
            x, y = (t.reshape(g, -1, mb, t.shape[-1]).transpose(0, 1).reshape(t.shape) for t in (x, y))
        side = self._document_inputs(x)  # from the global sequences, before any cp cut
        if mtp:
            side = mtp_side_inputs(x, y, side, loader, step, self.cfg, self.mesh["cp"])
        cp = self.mesh["cp"]
        if cp.active:  # targets were shifted over the whole sequence; both are cut the same way
            x = shard_sequence(x, cp.rank, cp.size, self.cfg.parallel.cp_order)
            y = shard_sequence(y, cp.rank, cp.size, self.cfg.parallel.cp_order)
        return x, y, side

    def _document_inputs(self, x: torch.Tensor) -> list[dict] | None:
        """Per microbatch, the model's side inputs for --attention-mask document / --reset-positions:
        document ids and positions of the *global* (uncut) sequences; every cp rank takes its share."""
        if self.cfg.attention_mask == "causal" and not self.cfg.reset_positions:
            return None
        doc = document_ids(x, self.eos_id)
        side = [{} for _ in range(-(-x.shape[0] // self.cfg.micro_batch))]
        if self.cfg.attention_mask == "document":
            for s, d in zip(side, doc.split(self.cfg.micro_batch)):
                s["doc_ids"] = d
        if self.cfg.reset_positions:
            for s, pos in zip(side, document_positions(doc).split(self.cfg.micro_batch)):
                s["positions"] = pos
        return side

    def finish_gradients(self) -> float:
        return self.reducer.reduce_and_clip(self.cfg.grad_clip)

    def _finish_gradients(self) -> torch.Tensor:
        """`finish_gradients` with the clipping queued on the device; the norm stays there ([1])."""
        return self.reducer.reduce_and_clip_queued(self.cfg.grad_clip)

    def optimizer_step(self, step: int) -> float:
        lr = lr_at(step, self.cfg)
        for g in self.reducer.optimizer.param_groups:
            g["lr"] = lr
        self.reducer.step()
        return lr

    def _inject_fault(self, step: int) -> None:
        fault = self.cfg.fault()
        if fault is None or fault[0] != self.mesh.rank or fault[1] != step + 1:
            return
        kind = fault[2]
        if kind == "crash":
            print(f"shardwise: fault injection: rank {self.mesh.rank} crashes at step {step + 1}", file=sys.stderr,
                  flush=True)
            os._exit(13)
        if kind == "hang":
            print(f"shardwise: fault injection: rank {self.mesh.rank} hangs at step {step + 1}", file=sys.stderr,
                  flush=True)
            while True:
                time.sleep(3600)
        self._poison = True

    def train_step(self, step: int) -> dict:
        """One optimizer step. Non-finite loss or gradient norm (global, so every rank agrees) skips it.

        One host read per step (`shardwise.host`): loss, grad norm and the MoE metrics come back together,
        once the clipped gradients — the optimizer's inputs — are queued; the step time is read a step
        late (`StepTimer`), so the host never waits for the optimizer before queuing the next step.
        """
        self.timer.start()
        host.reset()
        self._poison = False
        self._inject_fault(step)
        queued = [self._forward_backward(step), self._finish_gradients()]
        moe = self.moe_step(read=False) if self.model_cfg.moe_experts else None  # every stage joins the pp reduce
        values = host.read(torch.cat(queued + ([moe] if moe is not None else [])), "loss+norm")
        loss, norm = values[0], values[1]
        skipped = not (math.isfinite(loss) and math.isfinite(norm))
        if skipped:
            self.bad_steps += 1
            self.reducer.zero_grad()
            lr = lr_at(step, self.cfg)
            if self.cfg.bad_step == "abort" or self.bad_steps > self.cfg.max_bad_steps:
                raise FloatingPointError(
                    f"step {step + 1}: non-finite loss ({loss}) or grad norm ({norm}); "
                    + ("aborting (--bad-step abort)" if self.cfg.bad_step == "abort" else
                       f"{self.bad_steps} bad steps exceed --max-bad-steps {self.cfg.max_bad_steps}"))
        else:
            lr = self.optimizer_step(step)
        self.mesh.ledger.end_step(step + 1)
        rec = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
               "tokens": self.global_batch * self.cfg.seq_len, "host_syncs": host.count()}
        self.timer.stop(rec)  # sets rec["step_time_s"] now (host clock) or at the next step (device events)
        if skipped:
            rec["skipped"] = True
        if moe is not None:
            rec.update(_moe_metrics(values[2:], self.model_cfg.moe_experts))
        return rec

    def moe_step(self, read: bool = True):
        """The loss-free bias update (the bias is no optimizer input: before or after `optimizer_step`
        alike) and this step's global routing metrics (all dp×cp ranks, all stages). Collective over the
        token axes and pp. `read=False` leaves the metrics on the device as one float64 vector."""
        p = self.cfg.parallel
        axes = (self.mesh["dp_cp"], self.mesh["tp"]) if p.sequence_parallel else (self.mesh["dp_cp"],)
        n_exp = self.model_cfg.moe_experts
        vec = torch.zeros(n_exp + 4, dtype=torch.float64, device=self.mesh.device)  # NCCL: on the device
        for m in self.moe:
            counts = m.update_bias(axes).double()  # all-reduced over the token axes; bias step
            vec[:n_exp] += counts
            vec[n_exp] += torch.where(counts.sum() > 0, counts.max() / counts.mean().clamp_min(1e-30), 0.0)
            vec[n_exp + 1] += 1
            vec[n_exp + 2] += m.step_dropped
            vec[n_exp + 3] += m.step_aux
            m.step_dropped, m.step_aux = 0, 0.0
        tail = vec[n_exp + 2:]  # dropped rows and aux parts are per rank: sum them over every token axis
        for ax in axes:
            comm.all_reduce(tail, ax, tag="metrics")
        comm.all_reduce(vec, self.mesh["pp"], tag="metrics")
        return _moe_metrics(host.read(vec, "moe metrics"), n_exp) if read else vec


def mtp_side_inputs(x, y, side, loader: Loader, step: int, cfg: TrainConfig, cp) -> list[dict]:
    """Per microbatch, the MTP inputs (models/mtp.py): ids and labels shifted over the whole window on the host,
    then cut for cp like the tokens; the per-depth loss scales λ / (D · n_k) from the global batch's counts."""
    depth = cfg.model_config().mtp_layers
    ids, labels = shift_inputs(x, y, depth)
    if cp.active:
        ids, labels = (shard_sequence(t, cp.rank, cp.size, cfg.parallel.cp_order, dim=2) for t in (ids, labels))
    masked = any(getattr(s, "masked", False) for s in loader.sources)
    counts = depth_counts(loader.global_batch_at(step)[1] if masked else None, loader.global_batch,
                          loader.seq_len, depth)
    scale = torch.tensor([cfg.mtp_loss_weight / (depth * n) if n else 0.0 for n in counts], device=x.device)
    side = side or [{} for _ in range(-(-x.shape[0] // cfg.micro_batch))]
    for mb, s in enumerate(side):
        rows = slice(mb * cfg.micro_batch, (mb + 1) * cfg.micro_batch)
        s.update(mtp_ids=ids[:, rows], mtp_labels=labels[:, rows], mtp_scale=scale)
    return side


def _moe_metrics(vec: list[float], n_exp: int) -> dict:
    return {"moe_tokens_per_expert": [int(c) for c in vec[:n_exp]],
            "moe_max_over_mean_load": vec[n_exp] / max(1.0, vec[n_exp + 1]),
            "moe_dropped": int(vec[n_exp + 2]), "moe_aux_loss": vec[n_exp + 3]}


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
    dims = ParallelDims.build(dist.get_world_size(), p.dp, p.pp, p.cp, p.tp, p.ep, p.dp_shard)
    m = cfg.model_config()
    tied = emb_stages(p) if m.tie_embeddings or m.mtp_layers else None  # MTP reads the embedding on the last stage
    return Mesh.build(dims, device, Ledger(), cfg.timeout_s, emb_stages=tied)
