"""FP8 replay for `shardwise verify --fp8`: the references cast what the layout cast, every difference explained.

An FP8 cast is a discontinuity. A value within fp32's reordering error of a rounding boundary (the midpoint of two
FP8 values) rounds one way in the layout and the other in the reference, and the flipped element moves by a whole
FP8 step (6 % in e4m3): one flip in a 30k-element operand of an early GEMM moves a layer's gradients by ~1e-2, and a
budget drawn from one perturbed twin cannot say whether a correct layout flips more than the twin did. So, as routing
replay does for top-k choices, the flips are explained instead of budgeted for:

1. During the layout's forward-backward every FP8 cast of an FP8 linear (and of each routed expert) whose tokens
   and features have known global positions is recorded: the high-precision tensor it cast and the scale of each element.
   Afterwards the parts are placed at their global positions (one max all-reduce over the world per step; replicas
   are equal) — the layout's logical operand x_l.
2. Scale group, exactly: each rank's scales must equal, element for element, the scales the single device takes
   of x_l (an amax is a max, exact in any order, so a correct scale group gives the same fp32 bits). A per-shard
   amax, or any other wrong scale block, fails here, and that operand is not replayed.
3. The references cast x_l with the single device's scales instead of their own x_r — the layout's operand, bit for
   bit. The first reference checks, per cast, that this replaces only what fp32 reordering explains: each scale
   block's amax of x_l within RHO of x_r's (so the scale moved by fp32 error), and wherever the FP8 codes of x_l
   and x_r cast with one scale differ (a flip), |x_l − x_r| within RHO of the block's amax — the flipped element sat
   within fp32 error of a rounding boundary. Anything else fails verify, naming the parameter, the operand and
   the step. The twin (`fp8_twin`) takes the same operands unchecked: its spread is then fp32's, not FP8's flips.

Routed experts (one grouped call, a weight per local expert) are keyed by logical expert: each received row's place
is its row within its expert in the single device's order (`expert_parallel.positions`, which the layout's MoE blocks
compute while the replay runs: an all-gather of counts and an all-to-all of positions, tagged `verify` — or already
in training, tagged `fp8_positions`, where blockwise / MX token tiles span ranks and the experts tile by them); a rank
records empty operands for the experts it does not hold, so every rank exchanges the same operands. The MoE's
flattened token rows (shared experts) sit at their tokens' single-device ids (`positions.token_ids`).

Pipeline stages hold different layers: each stage's ranks record their own layers' casts under their global names,
and the exchange runs over the union of every rank's keys (an all-gather of keys, global shapes and casts; the ranks
of one stage must agree). Backward keys g by its GEMM (dx's or dW's), so zero-bubble's deferred dW, cast at the
microbatch's W action, keys as the reference's: the k-th key of a name is the k-th microbatch in every schedule.
A g all-reduced over tp before its cast (`grad_sum`, MLA's down-projections) is a new tensor, matched by its shape.

What the replay cannot reach keeps its own rounding and the twin's budget: experts under a capacity factor (each rank
drops by its own counts), operands that came over the wire in FP8 and bf16 runs. `--tp-overlap` (its chunks' casts
are not recorded) is refused with `--fp8` (`main.check_verifiable`).
"""
from __future__ import annotations

import contextlib
import json
import math

import torch

from .. import comm
from ..context_parallel.sharding import shard_sequence
from ..expert_parallel.positions import TokenLayout, token_ids
from ..fp8 import linear as fp8_linear
from ..fp8.recipes import Cast
from ..fp8.scaling import Layout, Quantized, local_amax, quantize_all
from ..tensor_parallel.layers import get_spec

RHO = 2**10 * torch.finfo(torch.float32).eps
"""How far fp32 reordering may move a pre-quantisation value, relative to its scale block's amax: the layout's and
the reference's activations agree to ~1e2 ulp of the block's largest element (partial sums of a TP GEMM, a
reduction in another order); 2**10 ulp (1.2e-4) leaves room, as routing replay's fp32 near-tie does, and stays a
thousand times below an FP8 step (e4m3: 2**-3 relative; an e5m2 gradient 2**-2)."""
NOISE = 2**7 * torch.finfo(torch.float32).eps
"""The floor of that allowance, relative to the whole operand's amax: a block whose values cancel to ~0 (ring
attention's dq at a cp chunk's first tokens, seed 3097446964: blocks of amax 1e-12 in an operand of 1e-5) holds only
the reordering residue of summands at the operand's scale, a few ulp of it, which no relative bound on the block's own
amax explains, and which per-row or per-block scales blow up to whole FP8 steps (tensorwise's one scale does not)."""


class _Call:
    """The FP8 linear call in progress: its phase and the tensors each operand role can be cut from."""

    def __init__(self, phase: str, weights, xs, gs, rows=None, g_parts=("dgrad", "wgrad"), summed=False):
        self.phase, self.weights, self.xs, self.gs = phase, list(weights), list(xs), list(gs)
        self.summed = summed  # `grad_sum`: the backward casts a tp-summed copy of each g, not the g it received
        self.rows = rows  # routed experts: their rows' single-device positions (`positions.ExpertRows`)
        self.g_parts, self.seen = g_parts, {}  # which GEMMs' g this call casts, in order (zb: dgrad now, wgrad later)

    def occurrence(self, role: str, group: int = 1) -> tuple[str, int]:
        """(the role as keyed, the index of its linear among `group`) of the next operand of `role` in this call. A
        backward casts g once for dx and once for dW (in one call, or split by zero-bubble's deferred W), so g is
        keyed by its GEMM: the k-th key is then the k-th microbatch in every schedule."""
        i = self.seen.get(role, 0)
        self.seen[role] = i + 1
        if role == "g" and self.phase == "bwd":
            return f"g.{self.g_parts[min(i // group, len(self.g_parts) - 1)]}", i % group
        return role, i % group

    def role(self, t: torch.Tensor) -> str | None:
        return self.role_at(t)[0]

    def role_at(self, t: torch.Tensor) -> tuple[str | None, int]:
        """(the operand role `t` was cut from, the index of its linear in the group)."""
        for role, cands in (("w", self.weights), ("x", self.xs), ("g", self.gs)):
            for i, c in enumerate(cands):
                if c is not None and c.data_ptr() == t.data_ptr() and c.shape[-1] == t.shape[-1]:
                    return role, i
        if self.summed:  # not the weight or the saved x: the summed g, of its linear's shape
            for i, g in enumerate(self.gs):
                if g is not None and g.shape[-1] == t.shape[-1] and g.numel() == t.numel():
                    return "g", i
        return None, -1


class Fp8Replay:
    """Records the layout's FP8 operands, gathers them, checks the scale group, and makes the references cast them."""

    def __init__(self, layout, refs: list, world):
        self.world, self.cfg = world, layout.cfg
        self.owner: dict[int, tuple[str, str]] = {}  # id(weight) -> (which run, its name)
        self.grouped: dict[int, tuple[str, str, tuple]] = {}  # id(stacked expert weight) -> (run, name, its experts)
        for kind, run in (("layout", layout), *((("check" if i == 0 else "follow"), r) for i, r in enumerate(refs))):
            for name, p in run.model.named_parameters(remove_duplicate=False):
                if p.dim() == 2:
                    self.owner[id(p)] = (kind, name)
            for mname, m in run.model.named_modules():
                if hasattr(m, "n_local") and hasattr(m, "rows"):  # GroupedExperts: slot j holds expert rows[j]
                    for w in ("w1", "w3", "w2"):
                        self.grouped[id(getattr(m, w))] = (kind, f"{mname}.{w}", tuple(m.rows), m.n_experts)
        cfg, mesh = layout.cfg, layout.mesh
        self.tokens = TokenLayout.of(mesh, cfg.seq_len, cfg.parallel.cp_order, cfg.parallel.sequence_parallel)
        self.micro_batch, self.dp = cfg.micro_batch, mesh.dims.dp
        self.stage = mesh["pp"].rank  # ranks of one pipeline stage record the same operands
        for m in layout.model.modules():  # the layout's MoE blocks place their experts' rows (dropless only)
            if hasattr(m, "token_layout") and m.token_layout is None and m.dispatcher.capacity_factor is None:
                m.token_layout, m.positions_tag = self.tokens, "verify"
        self.records: dict[tuple, tuple] = {}  # key -> (x [B,S,C] fp32, its scales, global index, global shape, cast)
        self.table: dict[tuple, tuple] = {}  # key -> (the single device's cast of x_l, x_l): what the references take
        self.counts: dict[tuple, int] = {}
        self.call: _Call | None = None
        self.step = 0
        self.flips: list[dict] = []
        self.replaced: list[dict] = []  # where the reference's own cast rounded otherwise than the layout's
        self.replayed = self.own = 0
        self.failure: dict | None = None

    # ------------------------------------------------------------------ hooks around fp8/linear.py
    @contextlib.contextmanager
    def active(self):
        """Patch the FP8 linear's forward, backward and cast for the duration (the layout's or a reference's run)."""
        fn = fp8_linear.Fp8Linears
        fwd, bwd, cast = fn.forward, fn.backward, fp8_linear.quantize_all
        me = self

        def forward(ctx, cfg, out_dtype, n, pre_x, store, *args):
            with me._in(_Call("fwd", args[n:2 * n], args[:n], (), cfg.rows)):
                return fwd(ctx, cfg, out_dtype, n, pre_x, store, *args)

        def backward(ctx, *gs):
            store, saved, summed = ctx.store, ctx.saved_tensors, ctx.cfg.grad_sum is not None
            if store is None or not store.capturing:
                with me._in(_Call("bwd", ctx.ws, saved, gs, ctx.cfg.rows, summed=summed)):
                    return bwd(ctx, *gs)
            defer = store.defer  # zero-bubble: dW's casts run later, at the microbatch's W action

            def deferring(params, compute):
                later = _Call("bwd", ctx.ws, saved, gs, ctx.cfg.rows, ("wgrad",), summed)

                def run():
                    with me._in(later):
                        return compute()
                defer(params, run)
            store.defer = deferring
            try:
                with me._in(_Call("bwd", ctx.ws, saved, gs, ctx.cfg.rows, ("dgrad",), summed)):
                    return bwd(ctx, *gs)
            finally:
                del store.defer

        def quantize_all(items):
            qs = cast(items)
            call = me.call
            if call is None:
                return qs
            if id(call.weights[0]._base) in me.grouped:  # routed experts: rows placed by their positions
                return me._grouped(call, items, qs)
            if len(call.weights) != 1:
                return qs
            return [me._cast(call, t, c, lay, q) for (t, c, lay), q in zip(items, qs)]

        fn.forward, fn.backward, fp8_linear.quantize_all = staticmethod(forward), staticmethod(backward), quantize_all
        try:
            yield
        finally:
            fn.forward, fn.backward, fp8_linear.quantize_all = staticmethod(fwd), staticmethod(bwd), cast

    @contextlib.contextmanager
    def _in(self, call: _Call):
        outer, self.call = self.call, call
        try:
            yield
        finally:
            self.call = outer

    def _cast(self, call: _Call, t, cast, lay, q: Quantized) -> Quantized:
        """The layout: record the operand. The first reference: check the layout's against its own, take it. The
        twin: take it."""
        owner = self.owner.get(id(call.weights[0]))
        role = call.role(t)
        if owner is None or role is None:
            return q
        kind, name = owner
        key = self._key(kind, name, call.phase, call.occurrence(role)[0], cast)
        if kind == "layout":
            placed = self._place(t, role, lay, call.weights[0])
            if placed is not None:
                self.records[key] = (t.detach().float().clone(), q.scale_full().detach().clone(), *placed, cast)
            return q
        return self._take(kind, key, t, q, cast)

    def _grouped(self, call: _Call, items: list, qs: list) -> list:
        """`_cast` for the routed experts' grouped call: each operand keyed by its logical expert; the layout's rows
        placed at their positions within the expert, an empty operand recorded for each expert it does not hold."""
        kind, name, experts, n_experts = self.grouped[id(call.weights[0]._base)]
        if kind == "layout" and call.rows is None:  # no positions (a capacity factor): the references keep their own
            return qs
        sizes = [x.shape[0] if x.dim() == 2 else x.shape[-2] for x in call.xs]
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        out, mirror = [], []
        for (t, cast, _), q in zip(items, qs):
            role, _ = call.role_at(t)
            if role is None:
                out.append(q)
                continue
            # a role's operands come in expert order (an empty expert's part may share its neighbour's address)
            label, j = call.occurrence(role, len(experts))
            key = self._key(kind, f"{name}[{experts[j]}]", call.phase, label, cast)
            if kind != "layout":
                out.append(self._take(kind, key, t, q, cast))
                continue
            C = t.shape[-1]
            if role == "w":
                shape = (1, *t.shape[-2:])
                idx = torch.arange(math.prod(shape), device=t.device).view(shape)
            else:
                total = int(call.rows.totals[experts[j]])
                pos = call.rows.position[starts[j]:starts[j] + sizes[j]].to(t.device)
                shape, idx = (1, total, C), (pos[:, None] * C + torch.arange(C, device=t.device)).unsqueeze(0)
            self.records[key] = (t.detach().float().clone(), q.scale_full().detach().clone(), idx, shape, cast)
            if j == 0:
                mirror.append((role, label, cast, t))
            out.append(q)
        for e in sorted(set(range(n_experts)) - set(experts)):  # every rank exchanges every expert's operands
            for role, label, cast, t in mirror:
                key = self._key(kind, f"{name}[{e}]", call.phase, label, cast)
                C = t.shape[-1]
                shape = (1, *t.shape[-2:]) if role == "w" else (1, int(call.rows.totals[e]), C)
                empty = t.new_zeros((1, 0, C), dtype=torch.float32)
                self.records[key] = (empty, empty.clone(), empty.long(), shape, cast)
        return out

    def _key(self, kind: str, name: str, phase: str, role: str, cast) -> tuple:
        """The operand's key: the k-th cast of this name, phase, role and cast in the step."""
        base = (kind, name, phase, role, _label(cast))
        k = self.counts.get(base, 0)
        self.counts[base] = k + 1
        return name, phase, role, _label(cast), k

    def _take(self, kind: str, key: tuple, t, q: Quantized, cast) -> Quantized:
        """A reference's cast: the layout's operand where the exchange queued it (checked on the first reference)."""
        if key not in self.table:
            self.own += kind == "check"
            return q
        ql, xl = self.table[key]
        if kind == "check":
            self.replayed += 1
            self._explain(key, t, q, ql, xl, cast)
        return ql

    # ------------------------------------------------------------------ the layout's operands at global positions
    def _place(self, t: torch.Tensor, role: str, lay: Layout, w: torch.Tensor):
        """(global flat index of each element of `t` [B, S, C], −1 for padding; the global shape) or None where the
        positions are unknown."""
        spec = get_spec(w)
        out_g, in_g = spec.global_shape if spec is not None else tuple(w.shape)
        full = torch.arange(out_g * in_g, device=t.device).view(out_g, in_g)
        widx = spec.local_slice(full + 1) - 1 if spec is not None else full  # −1: padding
        if role == "w":
            return (widx.unsqueeze(0), (1, out_g, in_g)) if widx.shape == t.shape[1:] else None
        flat = lay.seq_global == 0  # the MoE's flattened rows: placed by their tokens' ids
        if not flat and len([a for a in lay.seq if a is not None and a.active]) > 1:
            return None
        valid = widx >= 0
        if role == "x":
            row = widx[int(valid.any(1).nonzero()[0])]
            cols, c_g = torch.where(row >= 0, row % in_g, -1), in_g
        else:
            col = widx[:, int(valid.any(0).nonzero()[0])]
            cols, c_g = torch.where(col >= 0, col // in_g, -1), out_g
        B, S, C = t.shape
        if cols.numel() != C:
            return None
        if flat:
            ids = token_ids(self.tokens, self.micro_batch, t.device)
            if B != 1 or ids.numel() != S:
                return None
            idx = ids[:, None] * c_g + cols[None, :]
            s_g = self.micro_batch * self.dp * self.cfg.seq_len
            return torch.where(cols[None, :] >= 0, idx, -1).unsqueeze(0), (1, s_g, c_g)
        rows, b_g = torch.arange(B, device=t.device), B
        for a in lay.batch:
            if a is not None and a.active:
                rows, b_g = rows + a.rank * B, B * a.size
        pos, s_g = torch.arange(S, device=t.device), S
        for a in lay.seq:
            if a is not None and a.active:
                s_g = S * a.size
                pos = shard_sequence(torch.arange(s_g, device=t.device)[None], a.rank, a.size,
                                     self.cfg.parallel.cp_order)[0]
        idx = (rows[:, None, None] * s_g + pos[None, :, None]) * c_g + cols[None, None, :]
        return torch.where(cols[None, None, :] >= 0, idx, -1), (b_g, s_g, c_g)

    def exchange(self, step: int) -> None:
        """After the layout's forward-backward of `step` (a collective over the world): its operands at their global
        positions, each rank's scales checked against the single device's scales of them, queued for the
        references."""
        self.step = step
        shapes = self._union(step)
        keys = sorted(shapes)
        sizes = [math.prod(shapes[k][0]) for k in keys]  # global numel
        buf = torch.full((sum(sizes),), -torch.inf, device=self.world.device)
        off = 0
        for k, n in zip(keys, sizes):
            if k in self.records:  # a pipeline stage holds only its own layers' operands
                x, _, idx, _, _ = self.records[k]
                keep = idx >= 0
                buf[off + idx[keep]] = x[keep]
            off += n
        comm.all_reduce(buf, self.world, op="max", tag="verify")
        if bool((buf == -torch.inf).any()):
            raise RuntimeError(f"verify: the layout's FP8 operands left elements unrecorded at step {step + 1}")
        wrong = torch.zeros(len(keys), device=self.world.device)  # per operand: elements whose scale is not the group's
        casts, off = {}, 0
        for i, (k, n) in enumerate(zip(keys, sizes)):
            shape, cast = shapes[k]
            xl = buf[off:off + n].view(shape)
            off += n
            ql = self._quantize(xl, cast)
            if k in self.records:
                _, scale, idx, _, _ = self.records[k]
                keep = idx >= 0
                wrong[i] = (ql.scale_full().reshape(-1)[idx[keep]] != scale[keep]).sum()
            casts[k] = (ql, xl)
        comm.all_reduce(wrong, self.world, tag="verify")
        for i, k in enumerate(keys):  # a wrong scale group is not replayed: the references keep their own casts
            if not float(wrong[i]):
                self.table[k] = casts[k]
            elif self.failure is None:
                self.failure = {"step": step + 1, "what": "scale group", "where": _name(k),
                                "elements": int(wrong[i]), "operands": int((wrong > 0).sum()),
                                "why": "a rank's FP8 scale is not the single device's scale of the whole operand"}
        self.records.clear()

    def _union(self, step: int) -> dict:
        """key -> (global shape, cast) of every operand any rank recorded (a collective over the world: an all-gather
        of each rank's keys and shapes). Ranks of one pipeline stage must have recorded the same operands; under
        pp = 1 that is every rank."""
        mine = sorted((k, tuple(r[3]), _cast_fields(r[4])) for k, r in self.records.items())
        blob = torch.tensor(list(json.dumps([self.stage, mine]).encode()), dtype=torch.int32, device=self.world.device)
        n = comm.all_reduce(torch.tensor([blob.numel()], dtype=torch.int32, device=self.world.device), self.world,
                            op="max", tag="verify")
        padded = torch.full((int(n),), ord(" "), dtype=torch.int32, device=self.world.device)
        padded[:blob.numel()] = blob
        gathered = comm.all_gather(padded, self.world, tag="verify").view(-1, int(n))
        by_stage, shapes = {}, {}
        for row in gathered.tolist():
            stage, theirs = json.loads(bytes(row).decode())
            theirs = [(tuple(k), tuple(shape), tuple(map(_tuple, cast))) for k, shape, cast in theirs]
            if by_stage.setdefault(stage, theirs) != theirs:
                raise RuntimeError(f"verify: the ranks of pipeline stage {stage} cast different FP8 operands at step "
                                   f"{step + 1}")
            for k, shape, cast in theirs:
                if shapes.setdefault(k, (shape, cast)) != (shape, cast):
                    raise RuntimeError(f"verify: the ranks place FP8 operand {_name(k)} in different global shapes")
        return {k: (shape, _cast_of(cast)) for k, (shape, cast) in shapes.items()}

    @staticmethod
    def _quantize(x: torch.Tensor, cast) -> Quantized:
        """The single device's cast of `x` (no axis: nothing to reduce)."""
        return quantize_all([(x, cast, Layout())])[0]

    # ------------------------------------------------------------------ the check
    def _explain(self, key: tuple, xr: torch.Tensor, qr: Quantized, ql: Quantized, xl: torch.Tensor, cast) -> None:
        """`ql` (the cast of the layout's `xl`) replaces `qr` (the reference's own cast of `xr`) only where fp32
        reordering explains every difference (`explain`)."""
        n, distance, amax_ok = explain(xr, qr, xl, ql, cast)
        moved = rounded_apart(qr, ql)
        if moved:
            self.replaced.append({"step": self.step + 1, "operand": _name(key), "elements": moved})
        if n or not amax_ok:
            self.flips.append({"step": self.step + 1, "operand": _name(key), "flips": n, "max_distance": distance,
                               "amax_explained": amax_ok})
        if (distance > 1 or not amax_ok) and self.failure is None:
            self.failure = {"step": self.step + 1, "what": "unexplained FP8 difference", "where": _name(key),
                            "flips": n, "max_distance": distance, "amax_explained": amax_ok, "bound": RHO}

    def end_step(self) -> None:
        """After the references' forward-backward: this step's operands are spent."""
        self.table.clear()
        self.counts.clear()

    @property
    def passed(self) -> bool:
        return self.failure is None

    def result(self) -> dict:
        return {"replayed_casts": self.replayed, "own_casts": self.own,
                "flips": sum(f["flips"] for f in self.flips),
                "max_flip_distance": max((f["max_distance"] for f in self.flips), default=0.0),
                "rho": RHO, "per_operand": self.flips, "unexplained": self.failure,
                "reference_rounded_apart": sum(r["elements"] for r in self.replaced),
                "rounded_apart_per_operand": self.replaced}


def explain(xr: torch.Tensor, qr: Quantized, xl: torch.Tensor, ql: Quantized, cast) -> tuple[int, float, bool]:
    """How `ql`, the cast of `xl`, differs from `qr`, the cast of `xr` (both [B, S, C], same blocks): (the flips, the
    largest flip's distance in units of its bound, whether every scale block's amax agrees within RHO).

    The two differ in scale (explained when the blocks' amaxes agree within RHO: a power-of-two scale may then double,
    which moves no dequantised value) and in codes under one scale: a flip is an element whose code differs when x_r
    is cast with `ql`'s scale too. It is explained (distance ≤ 1) when |x_l − x_r| ≤ RHO · the block's amax: a rounding
    boundary lies between the two values, so each sat within fp32's reordering error of it — RHO of the block's amax,
    at least `NOISE` of the operand's."""
    br, bc = qr.blocks
    ar, al = local_amax(xr, cast, br, bc), local_amax(xl, cast, br, bc)
    floor = NOISE * float(torch.maximum(ar.max(), al.max())) if ar.numel() else 0.0  # `NOISE`
    amax_ok = bool(((al - ar).abs() <= (RHO * torch.maximum(al, ar)).clamp_min(floor)).all())
    scale = ql.scale_full()
    big = torch.finfo(cast.dtype).max
    codes = (xr.float() * scale).clamp(-big, big).to(cast.dtype)  # x_r cast as quantize_all casts, with ql's scale
    flipped = ql.data.float() != codes.float()
    amax = Quantized(ql.data, torch.maximum(al, ar), ql.blocks).scale_full()  # the block's amax, per element
    dist = (xl.float() - xr.float()).abs() / (RHO * amax).clamp_min(max(floor, 1e-30))
    dist = torch.where(flipped, dist, torch.zeros_like(dist))
    return int(flipped.sum()), float(dist.max()) if dist.numel() else 0.0, amax_ok


def rounded_apart(qr: Quantized, ql: Quantized) -> int:
    """How many elements the reference's own cast dequantises a whole FP8 step away from the layout's: what the
    replay replaced, the reference's side of each flip (a scale moved by fp32 error moves every value by ~1e-7
    relative; a flip by at least 2**-4 in e4m3, 2**-3 in e5m2)."""
    dr, dl = qr.data.float() / qr.scale_bcast(), ql.data.float() / ql.scale_bcast()
    return int(((dr - dl).abs() > 2**-8 * torch.maximum(dr.abs(), dl.abs())).sum())


def _label(cast) -> str:
    """A cast in a few words: its dtype and scale block."""
    kind = "e8m0 " if cast.e8m0 else "pow2 " if cast.pow2 else ""
    return f"{str(cast.dtype).removeprefix('torch.float8_')} {kind}block {cast.block}"


def _cast_fields(cast: Cast) -> tuple:
    """A cast as JSON carries it (another stage's operands are cast here too)."""
    return str(cast.dtype).removeprefix("torch."), tuple(cast.block), cast.pow2, cast.e8m0


def _cast_of(fields: tuple) -> Cast:
    dtype, block, pow2, e8m0 = fields
    return Cast(getattr(torch, dtype), tuple(block), pow2, e8m0)


def _tuple(v):
    return tuple(v) if isinstance(v, list) else v


def _name(key: tuple) -> str:
    name, phase, role, cast, k = key
    return f"{name} {phase} {role} ({cast}) #{k + 1}"
