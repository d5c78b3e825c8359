"""The one executor that runs any valid schedule's action list on this pipeline rank.

Communication is point-to-point on the pp axis, non-blocking, and follows the p2p program that
`p2p_program.build_programs` derives from the schedule (checked against NCCL's rules by
`p2p_check`, so it cannot deadlock on a backend that runs a pair's p2p in posting order):
* before each action the rank posts one batch — the previous action's send fused with every
  receive the agreed order allows now, for all peers (receives are posted as early as that order allows) —
  and waits only for the batch that holds the next action's input; each batch is one unit, as
  NCCL returns one work handle per batch;
* both sides of a pair post their messages in one agreed order, so a message can never be matched
  to the wrong buffer — the silent-corruption mode of batched p2p in interleaved schedules;
* a stage output's storage is released once its send completed (Megatron's
  deallocate_output_tensor); backward then runs the autograd engine on the output's graph alone.
Each action's start and end are recorded for the timeline (`timing.ActionClock`: CUDA events on
the GPU); the number of microbatch-chunks whose activations are held (F done, B not yet) is
tracked for the memory report.

Everything that depends only on the schedule (the program, each action's stage, messages and peers)
is derived once, at construction (`_Action`); a step walks that plan. Where the backend returns one
handle per op (gloo), the next action waits only for its own receive, not for the sends beside it in
the batch; one handle for the batch (NCCL, strict mode) is waited whole.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import comm
from ..tensor_parallel.grad_store import WeightGradStore
from ..rules.p2p_program import build_program, messages
from ..rules.schedules import Schedule
from .timing import ActionClock

_ENGINE = torch.autograd.Variable._execution_engine


class _Batch:
    """One posted p2p batch: its work handles (one on NCCL, one per op on gloo) and outputs to free."""

    def __init__(self, works: list, frees: list):
        self.works, self.frees, self.done = works, frees, False
        self.waited: set[int] = set()  # handles already waited on one by one (a gloo recv must not be waited twice)

    def completed(self) -> bool:
        return self.done or comm.completed(self.works)


class _Action(NamedTuple):
    """One action of this rank with everything the schedule fixes about it, derived once per program."""

    kind: str
    microbatch: int
    chunk: int
    last: bool                 # the model's last stage: F computes the loss, B starts from it
    input_key: tuple | None    # key of the input handed over by this rank's other chunk (None: received or data)
    first: bool                # the model's first stage: F reads the microbatch's tokens
    starts_backward: bool      # B with no incoming gradient (the loss's own)
    out_key: tuple | None      # key of the output this action produces for another stage
    out_local: bool            # that stage is on this rank (handed over, never sent or freed)
    label: dict                # the timeline's label of the action


class PipelineExecutor:
    def __init__(self, chunks, schedule: Schedule, mesh, act_shape, act_dtype, loss_fn,
                 store: WeightGradStore | None = None, autocast=None, scatter_gather: bool = False):
        self.chunks, self.schedule, self.mesh = chunks, schedule, mesh
        self.pp = mesh["pp"]
        self.rank = self.pp.rank
        self.act_shape, self.act_dtype, self.loss_fn = tuple(act_shape), act_dtype, loss_fn
        self.layout = schedule.layout
        self.program = build_program(schedule, self.rank)
        self.plan = self._plan(schedule)
        self.wait_names = [None if b.wait is None else
                           f"recv of {b.wait[0]} for microbatch {b.wait[1]}, stage {b.wait[2]}" for b in self.program]
        self.store = store if schedule.split_bw else None
        if schedule.split_bw and store is None:
            raise ValueError(f"schedule {schedule.name} splits B and W: pass the model's WeightGradStore")
        self.autocast = autocast
        # Megatron's scatter-gather: without SP every TP rank holds the same activation, so each sends
        # only its 1/tp and the receivers all-gather it over TP (p2p bytes / tp, plus one all-gather).
        self.tp = mesh["tp"]
        self.scatter = scatter_gather and self.tp.active
        numel = 1
        for d in self.act_shape:
            numel *= d
        if self.scatter and numel % self.tp.size:
            raise ValueError(f"scatter-gather needs the activation size {numel} divisible by tp={self.tp.size}")
        self.wire_shape = (numel // self.tp.size,) if self.scatter else self.act_shape
        # Gloo accepts a smaller message into a larger buffer silently: agree on the shape up front,
        # and check every outgoing tensor against it.
        agreed = comm.all_gather_object((self.act_shape, str(act_dtype)), self.pp)
        if any(a != agreed[0] for a in agreed):
            raise RuntimeError(f"pipeline ranks disagree on the activation shape/dtype: {agreed}")
        self.clock = ActionClock(mesh.device)
        self.peak_inflight = 0

    def _plan(self, schedule: Schedule) -> list[_Action]:
        """This rank's actions with their stages and messages resolved: once per program, not per step."""
        r, last = self.rank, schedule.num_stages - 1
        ins, outs = messages(schedule)
        plan = []
        for a, src, dst in zip(schedule.actions[r], ins[r], outs[r]):
            stage = self.layout.stage_of(r, a.chunk)
            plan.append(_Action(a.kind, a.microbatch, a.chunk, stage == last,
                                src[1] if src is not None and src[0] == r else None,
                                stage == 0, src is None and a.kind == "B",
                                dst[1] if dst is not None else None, dst is not None and dst[0] == r,
                                {"kind": a.kind, "microbatch": a.microbatch, "chunk": a.chunk}))
        return plan

    # ------------------------------------------------------------ messages
    def _begin(self):
        self.inbox: dict[tuple, tuple[torch.Tensor, _Batch, int | None]] = {}
        self.outbox: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.local: dict[tuple, torch.Tensor] = {}
        self.batches: list[_Batch] = []

    def _boundary(self, i: int) -> torch.Tensor | None:
        """Post boundary i's batches; return the next action's input once its receive completed."""
        bnd = self.program[i]
        for ops in bnd.batches:
            items, frees, recvs = [], [], []
            for op in ops:
                if op.kind == "send":
                    payload, free = self.outbox.pop(op.key)
                    items.append(("send", payload, self.pp, op.peer))
                    frees.append(free)
                else:
                    buf = torch.empty(self.wire_shape, dtype=self.act_dtype, device=self.mesh.device)
                    recvs.append((op.key, buf, len(items)))
                    items.append(("recv", buf, self.pp, op.peer))
            works = comm.p2p(items)
            batch = _Batch(works, frees)
            self.batches.append(batch)
            per_op = len(works) == len(items) > 1  # one handle per op: a receive can be waited alone
            for key, buf, k in recvs:
                self.inbox[key] = (buf, batch, k if per_op else None)
        if bnd.wait is None:
            return None
        buf, batch, k = self.inbox.pop(bnd.wait)
        what = self.wait_names[i]
        if k is None:
            self._wait(batch, what)
        elif not batch.done and k not in batch.waited:
            comm.wait(batch.works[k], self.pp, what)
            batch.waited.add(k)
            batch.done = len(batch.waited) == len(batch.works)
        if self.scatter:  # every TP rank reaches this receive at the same point of the same action list
            buf = comm.all_gather(buf, self.tp).view(self.act_shape)
        return buf

    def _wait(self, batch: _Batch, what: str) -> None:
        if not batch.done:
            comm.wait_all([w for k, w in enumerate(batch.works) if k not in batch.waited], self.pp, what)
            batch.done = True

    def _send(self, key: tuple, local: bool, t: torch.Tensor, free_after: torch.Tensor | None = None) -> None:
        """Queue an output for the next boundary's batch (or hand it over to this rank's other chunk)."""
        if local:
            self.local[key] = t
            return
        if t.shape != self.act_shape:
            raise RuntimeError(f"pp rank {self.rank}: sending {key} of shape {tuple(t.shape)}, "
                               f"expected {self.act_shape}")
        payload = t.reshape(-1).chunk(self.tp.size)[self.tp.rank].contiguous() if self.scatter else t.contiguous()
        self.outbox[key] = (payload, free_after)

    def _reap(self, wait: bool = False) -> None:
        """Free the outputs of sends that completed (all of them, waiting, at the end of the step). Every batch is
        polled and a completed one dropped: its handles hold their buffers (received activations, sent payloads),
        which the planner's peak counts as gone once used, so a batch kept to the step's end would raise the peak
        (pp8 full recompute: 6 %)."""
        if not self.batches:
            return
        still = []
        for batch in self.batches:
            if wait:
                self._wait(batch, "p2p batch at the end of the step")
            if batch.completed():
                batch.done = True
                for out in batch.frees:
                    if out is not None:
                        out.data = torch.empty(0, dtype=out.dtype, device=out.device)  # keep the graph, drop the data
            else:
                still.append(batch)
        self.batches = still

    # ------------------------------------------------------------ the loop
    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], n_tokens: int,
            side: list[dict] | None = None) -> torch.Tensor:
        """Run this rank's actions for one step; returns the sum of its last-stage losses (0 elsewhere).

        `side[mb]`: keyword inputs every chunk of microbatch mb gets (document ids, positions), on
        every stage — each rank has the global batch, so nothing travels for them.
        """
        self._begin()
        clock = self.clock
        clock.begin_step()
        state: dict[tuple[int, int], tuple] = {}
        loss_sum = torch.zeros(1, device=self.mesh.device)
        inflight = 0
        for i, a in enumerate(self.plan):
            received = self._boundary(i)
            chunk, mb = self.chunks[a.chunk], a.microbatch
            # Timing starts once the input has arrived: waiting on a peer is bubble, not work.
            if a.kind == "F":
                if a.first:
                    x = inputs[mb]
                else:
                    x = (self.local.pop(a.input_key) if a.input_key is not None else received).requires_grad_()
                t0 = clock.start()
                with self.autocast():
                    out = chunk(x, **(side[mb] if side else {}))
                if a.last:
                    out = self.loss_fn(out, targets[mb]).sum() / n_tokens
                    loss_sum += out.detach()
                state[(mb, a.chunk)] = (x, out)
                if a.out_key is not None:
                    self._send(a.out_key, a.out_local, out.detach(), free_after=None if a.out_local else out)
                inflight += 1
                if inflight > self.peak_inflight:
                    self.peak_inflight = inflight
            elif a.kind == "B":
                x, out = state.pop((mb, a.chunk))
                if a.starts_backward:
                    grad = torch.ones_like(out)
                else:
                    grad = self.local.pop(a.input_key) if a.input_key is not None else received
                t0 = clock.start()
                if self.store is not None:
                    self.store.capturing, self.store.key = True, (mb, a.chunk)
                try:
                    _ENGINE.run_backward((out,), (grad,), False, False, (), True, True)
                finally:
                    if self.store is not None:
                        self.store.capturing = False
                if a.out_key is not None:
                    self._send(a.out_key, a.out_local, x.grad)
                inflight -= 1
            else:
                t0 = clock.start()
                self.store.run((mb, a.chunk))
            clock.stop(a.label, t0)
            self._reap()
        self._boundary(len(self.plan))
        self._reap(wait=True)
        if state or self.inbox or self.outbox or (self.store is not None and len(self.store)):
            raise RuntimeError(f"pp rank {self.rank}: schedule {self.schedule.name} left work undone")
        return loss_sum
