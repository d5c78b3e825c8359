"""The one executor that runs any valid schedule's action list on this pipeline rank.

Communication is point-to-point on the pp axis, non-blocking and deadlock-free by construction:
* sends are posted (isend) as soon as an output or input-gradient exists and never waited on
  before later work;
* receives from a peer are posted in exactly the order that peer sends (the order is known on
  every rank, since every rank can read every rank's action list), so messages between a pair of
  ranks can never be matched to the wrong buffer — the silent-corruption mode of batched p2p in
  interleaved schedules — whatever the backend's matching rule (NCCL: order; gloo: tag + order);
* a stage output's storage is released once its send completed (Megatron's
  deallocate_output_tensor); backward then runs the autograd engine on the output's graph alone.
Each action's start and end are recorded for the timeline; the number of microbatch-chunks whose
activations are held (F done, B not yet) is tracked for the memory report.
"""
from __future__ import annotations

import time

import torch

from .. import comm
from .grad_store import WeightGradStore
from .schedules import Schedule

_ENGINE = torch.autograd.Variable._execution_engine
PREPOST = 2  # receives kept posted ahead of need


def message_in(schedule: Schedule, rank: int, a) -> tuple[int, tuple] | None:
    """(src rank, key) of the message action `a` on `rank` waits for: F's activation, B's gradient."""
    lay, stage = schedule.layout, schedule.layout.stage_of(rank, a.chunk)
    if a.kind == "F" and stage != 0:
        return lay.prev_rank(stage), ("act", a.microbatch, stage)
    if a.kind == "B" and stage != schedule.num_stages - 1:
        return lay.next_rank(stage), ("grad", a.microbatch, stage)
    return None


def message_out(schedule: Schedule, rank: int, a) -> tuple[int, tuple] | None:
    """(dst rank, key) of the message action `a` on `rank` produces: the mirror of `message_in`."""
    lay, stage = schedule.layout, schedule.layout.stage_of(rank, a.chunk)
    if a.kind == "F" and stage != schedule.num_stages - 1:
        return lay.next_rank(stage), ("act", a.microbatch, stage + 1)
    if a.kind == "B" and stage != 0:
        return lay.prev_rank(stage), ("grad", a.microbatch, stage - 1)
    return None


def _message_order(schedule: Schedule) -> dict[tuple[int, int], list[tuple]]:
    """For every (src, dst) pair of pp ranks: the messages src sends to dst, in src's program order."""
    order: dict[tuple[int, int], list[tuple]] = {}
    for src, actions in enumerate(schedule.actions):
        for a in actions:
            out = message_out(schedule, src, a)
            if out is not None:
                order.setdefault((src, out[0]), []).append(out[1])
    return order


class PipelineExecutor:
    def __init__(self, chunks, schedule: Schedule, mesh, act_shape, act_dtype, loss_fn,
                 store: WeightGradStore | None = None, autocast=None, scatter_gather: bool = False):
        self.chunks, self.schedule, self.mesh = chunks, schedule, mesh
        self.pp = mesh["pp"]
        self.rank = self.pp.rank
        self.act_shape, self.act_dtype, self.loss_fn = tuple(act_shape), act_dtype, loss_fn
        self.layout = schedule.layout
        self.order = _message_order(schedule)
        self.position = {pair: {k: i for i, k in enumerate(seq)} for pair, seq in self.order.items()}
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
        self.events: list[dict] = []
        self.peak_inflight = 0

    # ------------------------------------------------------------ messages
    def _begin(self):
        self.posted: dict[tuple, tuple[torch.Tensor, object]] = {}
        self.next_recv = {src: 0 for (src, dst) in self.order if dst == self.rank}
        self.local: dict[tuple, torch.Tensor] = {}
        self.sends: list[tuple[object, torch.Tensor | None]] = []
        self.needed = self._needed_inputs()
        self.next_needed = 0
        self._prepost()

    def _needed_inputs(self) -> list[tuple[int, tuple]]:
        """(src rank, message) of every cross-rank input this rank's actions take, in action order."""
        ins = (message_in(self.schedule, self.rank, a) for a in self.schedule.actions[self.rank])
        return [m for m in ins if m is not None and m[0] != self.rank]

    def _prepost(self) -> None:
        """Keep the next PREPOST inputs' receives posted: gloo sends a payload only once the receive is
        posted, so a receive posted late costs a round trip through a sender that is busy computing."""
        for src, key in self.needed[self.next_needed:self.next_needed + PREPOST]:
            self._post_up_to(src, key)

    def _post_up_to(self, src: int, key: tuple) -> None:
        """Post receives for everything `src` sends us up to and including `key`, in src's send order."""
        seq, upto = self.order[(src, self.rank)], self.position[(src, self.rank)][key]
        new = []
        while self.next_recv[src] <= upto:
            k = seq[self.next_recv[src]]
            self.next_recv[src] += 1
            new.append((k, torch.empty(self.wire_shape, dtype=self.act_dtype, device=self.mesh.device)))
        if new:
            works = comm.p2p([("recv", buf, self.pp, src) for _, buf in new])
            for (k, buf), work in zip(new, works):
                self.posted[k] = (buf, work)

    def _receive(self, src: int, key: tuple) -> torch.Tensor:
        if src == self.rank:  # neighbouring stages on the same rank (the V turn-around)
            return self.local.pop(key)
        self._post_up_to(src, key)
        buf, work = self.posted.pop(key)
        self.next_needed += 1
        self._prepost()
        comm.wait(work, self.pp, f"recv of {key[0]} for microbatch {key[1]}, stage {key[2]} from pp rank {src}")
        if self.scatter:  # every TP rank reaches this receive at the same point of the same action list
            buf = comm.all_gather(buf, self.tp).view(self.act_shape)
        return buf

    def _send(self, dst: int, key: tuple, t: torch.Tensor, free_after: torch.Tensor | None = None) -> None:
        if dst == self.rank:
            self.local[key] = t
            return
        if t.shape != self.act_shape:
            raise RuntimeError(f"pp rank {self.rank}: sending {key} of shape {tuple(t.shape)}, "
                               f"expected {self.act_shape}")
        payload = t.reshape(-1).chunk(self.tp.size)[self.tp.rank].contiguous() if self.scatter else t.contiguous()
        (work,) = comm.p2p([("send", payload, self.pp, dst)])
        self.sends.append((work, free_after))
        self._reap_sends()

    def _reap_sends(self, wait: bool = False) -> None:
        still = []
        for work, out in self.sends:
            if wait:
                comm.wait(work, self.pp, "send")
            if wait or work.is_completed():
                if out is not None:
                    out.data = torch.empty(0, dtype=out.dtype, device=out.device)  # keep the graph, drop the data
            else:
                still.append((work, out))
        self.sends = still

    # ------------------------------------------------------------ the loop
    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], n_tokens: int) -> torch.Tensor:
        """Run this rank's actions for one step; returns the sum of its last-stage losses (0 elsewhere)."""
        self._begin()
        self.events = []
        last = self.schedule.num_stages - 1
        state: dict[tuple[int, int], tuple] = {}
        loss_sum = torch.zeros(1, device=self.mesh.device)
        inflight = 0
        for a in self.schedule.actions[self.rank]:
            stage = self.layout.stage_of(self.rank, a.chunk)
            chunk, mb = self.chunks[a.chunk], a.microbatch
            src_in, dst_out = message_in(self.schedule, self.rank, a), message_out(self.schedule, self.rank, a)
            # Timing starts once the input has arrived: waiting on a peer is bubble, not work.
            if a.kind == "F":
                x = inputs[mb] if src_in is None else self._receive(*src_in).requires_grad_()
                t0 = time.time()
                with self.autocast():
                    out = chunk(x)
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
                grad = torch.ones_like(out) if src_in is None else self._receive(*src_in)
                t0 = time.time()
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
                t0 = time.time()
                self.store.run((mb, a.chunk))
            self.events.append({"kind": a.kind, "microbatch": mb, "chunk": a.chunk, "start": t0, "end": time.time()})
            self._reap_sends()
        self._reap_sends(wait=True)
        if state or self.posted or (self.store is not None and len(self.store)):
            raise RuntimeError(f"pp rank {self.rank}: schedule {self.schedule.name} left work undone")
        return loss_sum
