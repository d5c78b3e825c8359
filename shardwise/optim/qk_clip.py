"""MuonClip (`--muon-qk-clip τ`, Kimi K2): after each Muon step, every attention head whose largest logit of the
step exceeded τ has its query and key weights scaled down so that logit would have been τ.

Per head, η = τ / S_max when S_max > τ, else 1 (S_max: the head's largest q·k·scale of the step's training
forwards), and with α = 0.5 (K2's balance between the two sides):
* GQA (MHA is the case of one query head per K head): the query heads sharing a K head form a group whose S_max is
  the largest of theirs — a shared key cannot be scaled per query head — and all of the group's query rows scale by
  η^α, its key rows by η^(1−α) (Megatron-Core's rule; for MHA it is K2's per-head one). q/k biases (Qwen2's,
  gpt-oss's) scale with their rows: q = W_q x + b_q scales by η^α only when W_q and b_q both do (likewise k), so
  every logit of the group scales by exactly η.
* MLA: per head, the q_nope rows by η^α, the k_nope rows of wkv_b by η^(1−α), the q_rope rows by η; the rotary key
  shared by all heads (in wkv_a) and the v rows stay (K2's rule).

S_max comes from the attention cores (`models.attention.MaxLogits`, no second attention pass): each rank records its
heads' largest logit over the tokens and key blocks it attends, per layer — under a sliding window only the
window's pairs; gpt-oss's sink is a learned logit, no q·k, so it is not among them (Wq, Wk cannot scale it).
After the step one all-reduce MAX over dp×cp (the step's batch and sequence are split there) completes it, and
— when a GQA group spans TP ranks (fewer K heads than tp) — one all-gather over tp hands every rank the other
heads of its group. Both are tagged "qk_clip".
Each rank then scales what it holds: its TP rows of its layers (PP: its stage's), under ZeRO ≥ 1 its flat shard,
before ZeRO's all-gather of the parameters.
"""
from __future__ import annotations

import torch

from .. import comm
from ..models.attention import AttentionCore, MaxLogits
from ..tensor_parallel.layers import get_spec

TAG = "qk_clip"
ALPHA = 0.5
"""The query side's share of the scaling exponent (K2: q by η^α, k by η^(1−α))."""


class _Layer:
    """One attention layer: its local query heads, its groups (query heads per K head; 1 for MLA), whether a group
    spans TP ranks, and per held q/k tensor (param, group of each row, exponent of η for each row)."""

    def __init__(self, layer_id: int, attn):
        self.layer_id = layer_id
        if hasattr(attn, "wkv_b"):  # MLA
            nope, rope, vd = attn.nope, attn.rope, attn.v_dim
            wq = attn.wq_b if hasattr(attn, "wq_b") else attn.wq
            self.heads = wq.weight.shape[0] // (nope + rope)
            self.groups, self.spans_tp = 1, False
            heads = range(self.heads)
            dev = wq.weight.device
            self.targets = [(wq.weight, *_rows(heads, [(nope, ALPHA), (rope, 1.0)], dev)),
                            (attn.wkv_b.weight, *_rows(heads, [(nope, 1.0 - ALPHA), (vd, 0.0)], dev))]
            return
        hd = attn.head_dim
        sq, sk = get_spec(attn.wq.weight), get_spec(attn.wk.weight)
        self.heads = attn.wq.weight.shape[0] // hd
        self.groups = (sq.global_shape[0] // hd) // (sk.global_shape[0] // hd)
        self.spans_tp = self.heads < self.groups
        # group index of each local head: among every query head of the layer when a group spans TP ranks (S_max
        # is then gathered over tp), else among this rank's (its K heads are exactly its groups)
        q0, k0 = (sq.start // hd, sk.start // hd) if self.spans_tp else (0, 0)
        dev = attn.wq.weight.device
        q_rows = _rows([(q0 + h) // self.groups for h in range(self.heads)], [(hd, ALPHA)], dev)
        k_rows = _rows(range(k0, k0 + attn.wk.weight.shape[0] // hd), [(hd, 1.0 - ALPHA)], dev)
        self.targets = [(attn.wq.weight, *q_rows), (attn.wk.weight, *k_rows)]
        for lin, rows in ((attn.wq, q_rows), (attn.wk, k_rows)):
            if lin.bias is not None:
                self.targets.append((lin.bias, *rows))

    def row_scales(self, per_head: torch.Tensor, tau: float):
        """(param, its rows' scale factors) per target, from the per-head S_max (this rank's heads, or under
        `spans_tp` every query head of the layer in TP order)."""
        m = per_head.view(-1, self.groups).amax(1)
        eta = torch.where(m > tau, tau / m, torch.ones_like(m))
        return [(p, eta[group].pow(exp)) for p, group, exp in self.targets]


def _rows(groups, parts: list[tuple[int, float]], device):
    """(group per row, exponent per row) for heads in `groups` order, each laid out as `parts` (rows, exponent);
    made once, on the weights' device, so a step's clip copies nothing from the host."""
    idx, exp = [], []
    for g in groups:
        for n, e in parts:
            idx += [g] * n
            exp += [e] * n
    return torch.tensor(idx, device=device), torch.tensor(exp, device=device)


class QKClip:
    """Installs a `MaxLogits` recorder in the model's attention cores and clips after each step (`apply`)."""

    def __init__(self, model, reducer, tau: float):
        self.tau, self.reducer = tau, reducer
        self.data, self.tp = reducer.mesh["dp_cp"], reducer.tp
        self.recorder = MaxLogits()
        self.layers = []
        for m in model.modules():
            core = getattr(m, "core", None)
            if isinstance(core, AttentionCore):
                core.ctx.max_logits = self.recorder
                self.layers.append(_Layer(core.layer_id, m))
        self.layers.sort(key=lambda l: l.layer_id)
        self.spans_tp = self.tp.active and any(l.spans_tp for l in self.layers)
        self.where = {id(p): (b, off) for b in reducer.buckets for _, p, off, _ in b.offsets} if reducer.zero else {}

    @torch.no_grad()
    def apply(self) -> None:
        """Complete each head's S_max of the step over the ranks that saw its tokens, then scale q/k rows."""
        if not self.layers:
            return
        got = self.recorder.take()
        dev = self.reducer.mesh.device
        flat = torch.cat([got.get(l.layer_id, torch.full((l.heads,), float("-inf"), device=dev)).to(dev)
                          for l in self.layers])
        comm.all_reduce(flat, self.data, op="max", tag=TAG)
        every = comm.all_gather(flat, self.tp, tag=TAG).view(self.tp.size, -1) if self.spans_tp else None
        at = 0
        for layer in self.layers:
            mine = flat[at:at + layer.heads]
            per_head = every[:, at:at + layer.heads].reshape(-1) if layer.spans_tp else mine
            at += layer.heads
            for p, rows in layer.row_scales(per_head, self.tau):
                self._scale(p, rows)

    def _scale(self, p: torch.Tensor, rows: torch.Tensor) -> None:
        """Multiply each row of `p` as this rank holds it: the parameter (ZeRO-0) or its part of the ZeRO shard."""
        if not self.reducer.zero:
            p.data.mul_(rows.view(-1, *[1] * (p.ndim - 1)))
            return
        b, off = self.where[id(p)]
        lo_s = b.axis.rank * b.per
        lo, hi = max(off, lo_s), min(off + p.numel(), lo_s + b.per)
        if lo < hi:
            per_elem = rows.repeat_interleave(p.numel() // rows.numel())[lo - off:hi - off]
            b.shard.data[lo - lo_s:hi - lo_s].mul_(per_elem)
