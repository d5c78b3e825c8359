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
"""
from __future__ import annotations

import torch

from .. import comm
from ..tensor_parallel.grad_store import WeightGradStore
from ..rules.p2p_program import build_programs, message_in, message_out
from ..rules.schedules import Schedule
from .timing import ActionClock

_ENGINE = torch.autograd.Variable._execution_engine


class _Batch:
    """One posted p2p batch: its work handles (one on NCCL, one per op on gloo) and outputs to free."""

    def __init__(self, works: list, frees: list):
        self.works, self.frees, self.done = works, frees, False

    def completed(self) -> bool:
        return self.done or comm.completed(self.works)


class PipelineExecutor:
    def __init__(self, chunks, schedule: Schedule, mesh, act_shape, act_dtype, loss_fn,
                 store: WeightGradStore | None = None, autocast=None, scatter_gather: bool = False):
        self.chunks, self.schedule, self.mesh = chunks, schedule, mesh
        self.pp = mesh["pp"]
        self.rank = self.pp.rank
        self.act_shape, self.act_dtype, self.loss_fn = tuple(act_shape), act_dtype, loss_fn
        self.layout = schedule.layout
        self.program = build_programs(schedule)[self.rank]
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

    # ------------------------------------------------------------ messages
    def _begin(self):
        self.inbox: dict[tuple, tuple[torch.Tensor, _Batch]] = {}
        self.outbox: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.local: dict[tuple, torch.Tensor] = {}
        self.batches: list[_Batch] = []

    def _boundary(self, i: int) -> torch.Tensor | None:
        """Post boundary i's batches; return the next action's input once its batch completed."""
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
                    items.append(("recv", buf, self.pp, op.peer))
                    recvs.append((op.key, buf))
            batch = _Batch(comm.p2p(items), frees)
            self.batches.append(batch)
            for key, buf in recvs:
                self.inbox[key] = (buf, batch)
        if bnd.wait is None:
            return None
        buf, batch = self.inbox.pop(bnd.wait)
        self._wait(batch, f"recv of {bnd.wait[0]} for microbatch {bnd.wait[1]}, stage {bnd.wait[2]}")
        if self.scatter:  # every TP rank reaches this receive at the same point of the same action list
            buf = comm.all_gather(buf, self.tp).view(self.act_shape)
        return buf

    def _wait(self, batch: _Batch, what: str) -> None:
        if not batch.done:
            comm.wait_all(batch.works, self.pp, what)
            batch.done = True

    def _take(self, src_in: tuple[int, tuple], received: torch.Tensor | None) -> torch.Tensor:
        """The input of the current action: from this rank's other chunk, or the boundary's receive."""
        return self.local.pop(src_in[1]) if src_in[0] == self.rank else received

    def _send(self, dst: int, key: tuple, t: torch.Tensor, free_after: torch.Tensor | None = None) -> None:
        """Queue an output for the next boundary's batch to `dst` (or hand it over on this rank)."""
        if dst == self.rank:
            self.local[key] = t
            return
        if t.shape != self.act_shape:
            raise RuntimeError(f"pp rank {self.rank}: sending {key} of shape {tuple(t.shape)}, "
                               f"expected {self.act_shape}")
        payload = t.reshape(-1).chunk(self.tp.size)[self.tp.rank].contiguous() if self.scatter else t.contiguous()
        self.outbox[key] = (payload, free_after)

    def _reap(self, wait: bool = False) -> None:
        """Free the outputs of sends that completed (all of them, waiting, at the end of the step)."""
        still = []
        for batch in self.batches:
            if wait:
                self._wait(batch, "p2p batch at the end of the step")
            if batch.completed():
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
        self.clock.begin_step()
        last = self.schedule.num_stages - 1
        state: dict[tuple[int, int], tuple] = {}
        loss_sum = torch.zeros(1, device=self.mesh.device)
        inflight = 0
        for i, a in enumerate(self.schedule.actions[self.rank]):
            received = self._boundary(i)
            stage = self.layout.stage_of(self.rank, a.chunk)
            chunk, mb = self.chunks[a.chunk], a.microbatch
            src_in, dst_out = message_in(self.schedule, self.rank, a), message_out(self.schedule, self.rank, a)
            # Timing starts once the input has arrived: waiting on a peer is bubble, not work.
            if a.kind == "F":
                x = inputs[mb] if src_in is None else self._take(src_in, received).requires_grad_()
                t0 = self.clock.start()
                with self.autocast():
                    out = chunk(x, **(side[mb] if side else {}))
                if stage == last:
                    out = self.loss_fn(out, targets[mb]).sum() / n_tokens
                    loss_sum += out.detach()
                state[(mb, a.chunk)] = (x, out)
                if dst_out is not None:
                    self._send(*dst_out, out.detach(), free_after=out if dst_out[0] != self.rank else None)
                inflight += 1
                self.peak_inflight = max(self.peak_inflight, inflight)
            elif a.kind == "B":
                x, out = state.pop((mb, a.chunk))
                grad = torch.ones_like(out) if src_in is None else self._take(src_in, received)
                t0 = self.clock.start()
                if self.store is not None:
                    self.store.capturing, self.store.key = True, (mb, a.chunk)
                try:
                    _ENGINE.run_backward((out,), (grad,), False, False, (), True, True)
                finally:
                    if self.store is not None:
                        self.store.capturing = False
                if dst_out is not None:
                    self._send(*dst_out, x.grad)
                inflight -= 1
            else:
                t0 = self.clock.start()
                self.store.run((mb, a.chunk))
            self.clock.stop({"kind": a.kind, "microbatch": mb, "chunk": a.chunk}, t0)
            self._reap()
        self._boundary(len(self.schedule.actions[self.rank]))
        self._reap(wait=True)
        if state or self.inbox or self.outbox or (self.store is not None and len(self.store)):
            raise RuntimeError(f"pp rank {self.rank}: schedule {self.schedule.name} left work undone")
        return loss_sum
