"""Routing replay for `shardwise verify`: the reference routes every token where the layout did.

A top-k choice is a discontinuity: when a token's k-th and (k+1)-th selection scores nearly tie, rounding
that differs between the layout and the single-device model (reduction order, a sign flipped by AdamW in a
near-zero gradient) sends it to another expert, and every later comparison then measures the flip, not the
layout. So after the layout's forward of a step, every MoE layer's choices are gathered into the reference's
token order and forced on the reference (same gates: the reference's own scores at the forced experts). The
reference still computes its own choice: a token where the two differ must be a near-tie in the reference —
a gap below `NEAR_TIE[dtype]` — or verify fails, naming the token, the layer and both gaps. The loss-free
bias buffers must then agree exactly: they change only by counts of (forced, hence equal) choices.

Token order: the reference's microbatch i holds every dp rank's microbatch i (rank r's rows at r·mb), whole
sequences. A layout rank routes, per microbatch, its dp rows, its cp cut of the sequence and under SP its
tp chunk of that cut; pipeline stages route their own layers. Each rank writes its choices at their global
token positions and a max over all ranks fills the table (replicas write equal values).
"""
from __future__ import annotations

import torch

from .. import comm
from ..context_parallel.sharding import shard_sequence
from ..expert_parallel.router import Router, RoutingTape

# The largest selection-score gap a flip may have, by the run's dtype. The router computes in fp32 either
# way; what differs between the runs is its input. fp32: activations agree to ~1e2 ulp and weights drift by
# ~lr where AdamW flips the sign of a near-zero gradient, so scores (probabilities, sigmoids or logits, all
# O(1)) move by well under 2**10 ulp = 1.2e-4. bf16: the input is a bf16 activation rounded differently by
# each layout (relative 2**-8), moving an O(1) score by a few ulp of bf16: 4·2**-7 = 3.1e-2.
NEAR_TIE = {"fp32": 2**10 * torch.finfo(torch.float32).eps, "bf16": 4 * torch.finfo(torch.bfloat16).eps}


def routers(model) -> dict[str, Router]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Router)}


class RoutingReplay:
    """Records the layout's routing, forces it on the reference(s) and checks every difference is a near-tie."""

    def __init__(self, trainer, refs: list, world, dtype: str):
        self.world, self.bound = world, NEAR_TIE[dtype]
        self.mine, self.refs = routers(trainer.model), [routers(r.model) for r in refs]
        self.names = sorted(self.refs[0])
        for table in [self.mine, *self.refs]:
            for r in table.values():
                r.tape = RoutingTape()
        cfg, mesh = trainer.cfg, trainer.mesh
        self.topk, self.seq = trainer.model_cfg.moe_topk, cfg.seq_len
        dp = mesh.dims.dp
        self.mb, self.ref_mb = cfg.micro_batch, cfg.micro_batch * dp
        self.rounds = trainer.global_batch // dp // cfg.micro_batch
        self.tokens = trainer.global_batch * cfg.seq_len
        self.ids = [self._local_ids(i, mesh, cfg) for i in range(self.rounds)]
        self.table = None
        self.flips: list[dict] = []
        self.failure: dict | None = None
        self.bias_exact = True

    def _local_ids(self, i: int, mesh, cfg) -> torch.Tensor:
        """Global token ids (reference order) of this rank's microbatch i, in the order its routers see them."""
        rows = mesh["dp"].rank * self.mb + torch.arange(self.mb)
        ids = i * self.ref_mb * self.seq + rows[:, None] * self.seq + torch.arange(self.seq)[None, :]
        cp, tp = mesh["cp"], mesh["tp"]
        ids = shard_sequence(ids, cp.rank, cp.size, cfg.parallel.cp_order)
        if cfg.parallel.sequence_parallel and tp.active:
            ids = ids.chunk(tp.size, dim=1)[tp.rank]
        return ids.reshape(-1).to(self.world.device)

    def force(self, step: int) -> None:
        """After the layout's forward-backward of `step`: gather its choices (collective over the world) and queue
        them on the references' routers."""
        k = self.topk
        table = torch.zeros(len(self.names), self.tokens, k + 1, dtype=torch.float64, device=self.world.device)
        for row, name in enumerate(self.names):
            tape = self.mine[name].tape if name in self.mine else None
            if tape is None:
                continue
            if len(tape.calls) != self.rounds:
                raise RuntimeError(f"verify: {name} routed {len(tape.calls)} microbatches at step {step + 1}, "
                                   f"expected {self.rounds}")
            for ids, (indices, margin) in zip(self.ids, tape.calls):
                table[row, ids, :k] = indices.double() + 1
                table[row, ids, k] = margin.double()
            tape.calls.clear()
        comm.all_reduce(table, self.world, op="max", tag="verify")
        if not bool((table[:, :, 0] > 0).all()):
            raise RuntimeError(f"verify: the layout's routing left tokens unrecorded at step {step + 1}")
        self.table = table
        for refs in self.refs:
            self.queue(refs)

    def queue(self, table: dict) -> None:
        """Queue the gathered choices of this step on the routers `table` (name -> router), a fresh tape where a
        router has none: every reference, and the extra single-device runs verify makes at the same step."""
        n, k = self.ref_mb * self.seq, self.topk
        for row, name in enumerate(self.names):
            if table[name].tape is None:
                table[name].tape = RoutingTape()
            table[name].tape.forced = [self.table[row, i * n:(i + 1) * n, :k].long() - 1 for i in range(self.rounds)]

    def check(self, step: int) -> None:
        """After the references' forward-backward: where the first reference chose otherwise, it was a near-tie."""
        k = self.topk
        for refs in self.refs[1:]:
            for r in refs.values():
                r.tape.calls.clear()
        for row, name in enumerate(self.names):
            tape = self.refs[0][name].tape
            own = torch.cat([c[0] for c in tape.calls]).sort(-1)[0]
            gap = torch.cat([c[1] for c in tape.calls]).double()
            tape.calls.clear()
            forced = self.table[row, :, :k].long().sub(1).sort(-1)[0]
            flipped = (own != forced).any(-1).nonzero().flatten()
            if not len(flipped):
                continue
            gaps = gap[flipped]
            self.flips.append({"step": step + 1, "layer": name, "tokens": len(flipped),
                               "max_gap": float(gaps.max())})
            worst = int(gaps.argmax())
            if float(gaps[worst]) > self.bound and self.failure is None:
                token = int(flipped[worst])
                self.failure = {"step": step + 1, "layer": name, **self._where(token),
                                "reference_gap": float(gaps[worst]),
                                "layout_gap": float(self.table[row, token, k]), "bound": self.bound}

    def _where(self, token: int) -> dict:
        """A reference token id as the global batch row and position the loader gave it."""
        n = self.ref_mb * self.seq
        i, rest = divmod(token, n)
        row, pos = divmod(rest, self.seq)
        r, j = divmod(row, self.mb)
        return {"batch_row": r * self.rounds * self.mb + i * self.mb + j, "position": pos}

    def check_bias(self) -> None:
        """After the loss-free bias step: the layout's bias buffers equal the reference's bit for bit."""
        bad = torch.zeros(1, device=self.world.device)
        for name, r in self.mine.items():
            bad += float(not torch.equal(r.expert_bias, self.refs[0][name].expert_bias))
        comm.all_reduce(bad, self.world, tag="verify")
        self.bias_exact = self.bias_exact and not float(bad)

    @property
    def passed(self) -> bool:
        return self.failure is None and self.bias_exact

    def result(self) -> dict:
        return {"flipped_tokens": sum(f["tokens"] for f in self.flips),
                "first_flip_step": self.flips[0]["step"] if self.flips else None,
                "max_flip_gap": max((f["max_gap"] for f in self.flips), default=0.0),
                "near_tie_bound": self.bound, "flips": self.flips, "bias_exact": self.bias_exact,
                "not_near_tie": self.failure}
