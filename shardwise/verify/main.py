"""`shardwise verify`: run a layout and the single-device model side by side and compare.

Every rank also builds the single-device model (same seed, same global batch) in-process, with a
disabled ledger. After each step's gradient finalisation it compares the gradient values it holds
with the matching slice of the reference gradients, and after the optimizer step its parameter
shards and their updates (after − before the step) with the reference's. Per-parameter squared norms
of (difference, reference) are summed over all ranks — replicas inflate both equally, so ratios are
exact — and the maximum norm-wise relative difference is reported. Updates, not values, are what
catch a parameter the layout never trains: a frozen parameter's update differs by exactly 1.0, while
its value after a few warm-up steps differs by ~1e-3. `coverage` proves every reference element was
compared at least once. MoE layouts go through routing replay (routing_replay.py); bf16 runs are held to a
multiple of the bf16 noise the single-device model shows against fp32 (`NoiseBudget`), and an fp32 first-step
gradient over its flat bound to a multiple of the fp32 noise measured against the reference run in float64
(`first_grad_samples`). docs/verify.md.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import comm
from ..comm import Ledger
from ..config import ConfigError, ParallelConfig, TrainConfig
from ..training.assemble import assembled
from ..mesh import Mesh
from ..pipeline.tied_embedding import tied_name
from .routing_replay import RoutingReplay, routers
from ..tensor_parallel.layers import get_spec
from ..optim import optimizers
from ..training.trainer import Trainer, lr_at, make_mesh

# fp32 bounds. first_grad: gradients of step 1, computed from bit-identical weights — pure layout arithmetic.
# grad / param: every step; later steps start from weights that AdamW's g/sqrt(v) has already pulled
# apart wherever a gradient is near zero, so they get a drift bound (a real layout bug is O(1)).
# first_update / update: ||dp - dp_ref|| / ||dp_ref|| of step 1 and of the later steps. Step 1's AdamW
# update is lr·sign(g), so rounding that flips the sign of a near-zero gradient moves it most: fp32 usually
# <3.6e-4, but seed 1061424824 at tp4+SP scores 2.9e-3 on step 1 from first-step gradients within 8e-7 — sign
# flips of near-zero gradients; later <1.5e-4.
# MoE: a token whose top-k is a near-tie can flip experts once AdamW has pulled the weights apart; routing
# replay (routing_replay.py) forces the layout's choices on the reference, so later steps compare strictly.
# Later updates also get an absolute floor of update_floor·lr per parameter (norm): where a step's gradient nearly
# cancels the AdamW momentum (m ≈ 0 with v > 0), a 1e-7 gradient difference moves that one element's update by
# a visible fraction of lr — DeepSeek-tiny dp4×ep4 ZeRO-1 seed 1629419864, with identical routing, has one
# embedding element whose step-2 update differs by lr/190, 1.3e-3 of the embedding's update norm, and
# qwen3-moe-tiny tp2+SP seed 2758942747 one by lr/21 (1.2e-3 of a 39·lr update norm: 0.86 of a lr/64 floor).
# The floor is lr/16, a sixteenth of one element's step, against an update norm of ~lr·√numel.
# Parameter values: 1e-3 of the value's norm plus every update bound so far (first_update·||u_1|| + Σ later
# (update·||u_t|| + update_floor·lr_t)) — an update that passed its bound moved the value by at most that; with
# lr 3e-3 on a 0.02-std weight, step 1's allowed sign flips alone (qwen3-tiny tp2+SP seed 889595099: wo's
# step-1 update 3.3e-3 off, within 5e-2) are 1.3e-3 of the value's norm.
# The update bound applies to what the gradient difference does not explain (`AdamResponse`: the reference's AdamW
# step given the layout's gradient instead of its own): an element first touched at a later step takes AdamW's first
# step there, rounding-sensitive near ε (qwen3-moe-tiny dp2×ep2 seed 2358380713: one element's step-2 update 0.5·lr
# off), and a drifted later gradient moves the update with it (tiny dp2×cp2 seed 2215398245).
# A parameter that is not updated scores 1.0 and one TP half of it 0.71 at every step, a quarter 0.5:
# the later-step bounds are far below all three (a 24-element norm weight's update is ~5·lr).
TOLERANCE = {"fp32": dict(loss=1e-5, first_grad=1e-5, grad=1e-3, param=1e-3, first_update=5e-2, update=1e-3,
                          update_floor=2**-4)}

# bf16 bounds (`NoiseBudget`): a multiple of the bf16 noise the single-device model itself shows against fp32,
# per parameter, plus an absolute floor: relative for the loss and gradients; for parameters and updates
# counted in flipped signs — bf16 flips the step-1 update lr·sign(g) of near-zero gradients at random, each
# flip moving a parameter by 2·lr, and a 96-element norm weight may flip one element in one run and none in
# the other — so floor·lr in norm per update, floor·Σlr per parameter value.
BF16_MULTIPLE = 4.0
BF16_FLOOR = dict(loss=2e-3, grad=2e-2, param=4.0, update=4.0)

# fp32 first-step gradients over the flat bound: the layout and the fp32 reference are two fp32 roundings of the
# same exact gradient, which the reference run in float64 stands in for. noise = the largest distance to it of five
# fp32 roundings (the reference and FP32_SAMPLES runs with weights moved one ulp): one alone ranged 1.8e-6 to
# 1.1e-4 on one seed (the hybrid's layer-1 A_log). |L − R| ≤ |L − E| + |R − E|, so a correct layout fails only
# when its own rounding error exceeds (FP64_MULTIPLE − 1)· the largest of five others; the multiple is bf16's
# (equal roundings stand √2 apart, the rest is margin). A parameter whose gradient cancels (the hybrid's A_log /
# dt_bias at initialisation) gets the room its conditioning costs fp32; every other parameter stays at the flat bound.
FP64_MULTIPLE = 4.0
FP32_SAMPLES = 4


def check_verifiable(cfg: TrainConfig) -> None:
    m, p = cfg.model_config(), cfg.parallel
    if m.attn_dropout > 0 and p.tp > 1:
        raise ConfigError("verify needs --attn-dropout 0 when tp > 1: attention dropout masks differ per TP rank "
                          "by design, so no single-device run can match")
    if m.dropout > 0 and p.dp > 1:
        raise ConfigError("verify needs --dropout 0 when dp > 1: each dp rank draws its own residual-dropout masks")
    if m.moe_capacity_factor is not None and (p.dp * p.cp > 1 or p.sequence_parallel):
        raise ConfigError("verify needs dropless MoE (no --moe-capacity-factor) when tokens are split over dp×cp "
                          "or SP: expert capacity is per rank's tokens, so drops depend on the layout")


def _reference(cfg: TrainConfig, device, tokens=None) -> Trainer:
    """The single-device run. Its microbatch i is every dp rank's microbatch i together, so losses
    defined per global microbatch (the MoE aux loss) see the same tokens."""
    dp = cfg.parallel.dp
    ref_cfg = dataclasses.replace(cfg, parallel=ParallelConfig(), global_batch=cfg.global_batch or
                                  cfg.micro_batch * dp, micro_batch=cfg.micro_batch * dp)
    ref = Trainer(ref_cfg, Mesh.single(device, Ledger(enabled=False)), tokens)
    ref.batches.reorder_rows = lambda t: dp_grouped_rows(t, dp, cfg.micro_batch)
    return ref


def dp_grouped_rows(t: torch.Tensor, dp: int, micro_batch: int) -> torch.Tensor:
    """The reference's batch rows regrouped so that its microbatch i holds every dp rank's microbatch i:
    rows [rank 0's microbatches | rank 1's | ...] become [every rank's microbatch 0 | microbatch 1 | ...]."""
    if dp == 1:
        return t
    return t.reshape(dp, -1, micro_batch, t.shape[-1]).transpose(0, 1).reshape(t.shape)


def _views(trainer, views):
    """(name, spec, values, lo, hi within the flattened local parameter) of a reducer's views."""
    local = dict(trainer.model.named_parameters())
    for name, vals, lo, hi in views:  # a pipeline copy of the embedding (MTP's) compares with the embedding
        yield tied_name(name, local[name]), get_spec(local[name]), vals, lo, hi


def _grad_views(trainer):
    """The reduced gradient values this rank holds."""
    return _views(trainer, trainer.reducer.grad_views())


def _param_views(trainer):
    """The parameter values this rank holds: whole parameters, or ZeRO-3 shards."""
    return _views(trainer, trainer.reducer.param_views())


def _against(views, ref: dict[str, torch.Tensor]):
    """(name, mine, matching slice of the reference) for each view."""
    return [(n, mine, spec.local_slice(ref[n]).reshape(-1)[lo:hi]) for n, spec, mine, lo, hi in views]


def _per_param_rel(pairs, names, world) -> torch.Tensor:
    """[parameters]: ||x - ref|| / ||ref|| per parameter, with the squared norms summed over all ranks."""
    index = {n: i for i, n in enumerate(names)}
    acc = torch.zeros(len(names), 2, dtype=torch.float64, device=world.device)  # NCCL: on the mesh device
    for name, mine, ref in pairs:
        acc[index[name], 0] += (mine.double() - ref.double()).pow(2).sum()
        acc[index[name], 1] += ref.double().pow(2).sum()
    comm.all_reduce(acc, world, tag="verify")
    return acc[:, 0].sqrt() / acc[:, 1].sqrt().clamp_min(1e-30)


def _global_index(spec, ref: torch.Tensor, lo: int, hi: int, device) -> torch.Tensor:
    """1 + the global element index of each value a view holds (0: padding), through the same `local_slice` that cuts
    the reference: an index tensor cut like the values."""
    idx = spec.local_slice(torch.arange(1, ref.numel() + 1, device=device).view(ref.shape))
    return idx.reshape(-1)[lo:hi]


def _coverage(view_lists, ref_params: dict[str, torch.Tensor], world) -> float:
    """Fraction of reference elements every comparison in `view_lists` reached, min over the comparisons.

    Each rank marks the global elements its views cover (`_global_index`; padding maps to no element); a max over
    ranks counts a replicated element once, and an element no rank compared stays 0.
    """
    canon = {}  # tied weights: the reference's output.weight IS tok_embeddings.weight; count its elements once
    for n in sorted(ref_params):
        canon.setdefault(id(ref_params[n]), n)
    offset, total = {}, 0
    for n in sorted(set(canon.values())):
        offset[n], total = total, total + ref_params[n].numel()
    offset = {n: offset[canon[id(p)]] for n, p in ref_params.items()}
    marks = torch.zeros(len(view_lists), total, device=world.device)
    for row, views in enumerate(view_lists):
        for n, spec, _, lo, hi in views:
            idx = _global_index(spec, ref_params[n], lo, hi, world.device)
            marks[row, offset[n] + idx[idx > 0] - 1] = 1.0
    comm.all_reduce(marks, world, op="max", tag="verify")
    return int((marks > 0).sum(1).min()) / total  # an integer count: exact past float32's 2**24


def _later_update_ratio(rel: torch.Tensor, ref_updates: dict, names, lr: float, response: torch.Tensor) -> float:
    """max over parameters of what the gradient difference does not explain, (rel − response), over update +
    update_floor·lr / ||ref update||: ≤ 1 passes (||u − u_ref|| ≤ response + bound, by the triangle inequality)."""
    tol = TOLERANCE["fp32"]
    norms = torch.stack([ref_updates[n].double().norm() for n in names]).to(rel.device)
    unexplained = (rel - response.to(rel.device)).clamp_min(0.0)
    return float((unexplained / (tol["update"] + tol["update_floor"] * lr / norms.clamp_min(1e-30))).max())


class AdamResponse:
    """What the reference's AdamW step does with the layout's gradient instead of its own: per element,
    F(g) = lr·m̂/(√v̂ + ε) from the reference's moments before the step, and `allowance` gives, per parameter and
    relative to the reference update's norm, ||F(g_layout) − F(g_ref)||. The gradient difference is checked on its
    own; this is the update difference it explains, computed rather than guessed: a first-touched element's first
    AdamW step (zero moments: a rounding-sensitive sign near ε), or the response to a later gradient's drift."""

    def __init__(self, ref: Trainer, ref_params: dict[str, torch.Tensor]):
        self.adam = {}  # id(param) -> (optimizer, beta1, beta2, eps)
        for opt in optimizers(ref.reducer):
            if isinstance(opt, torch.optim.AdamW):
                for group in opt.param_groups:
                    for p in group["params"]:
                        self.adam[id(p)] = (opt, *group["betas"], group["eps"])
        self.ref_params = ref_params
        self.pairs = []

    def collect(self, step: int, grad_views, lr: float) -> None:
        """Before the optimizer step: F(g_layout) − F(g_ref) over this rank's views, kept for `allowance`."""
        self.pairs = []
        for n, spec, mine, lo, hi in grad_views:
            p = self.ref_params[n]
            if id(p) not in self.adam:
                continue
            opt, beta1, beta2, eps = self.adam[id(p)]
            state = opt.state.get(p, {})

            def local(t):
                return spec.local_slice(t).reshape(-1)[lo:hi].double()
            m, v = ((local(state[k]) if k in state else torch.zeros_like(mine, dtype=torch.float64))
                    for k in ("exp_avg", "exp_avg_sq"))
            b1, b2 = 1 - beta1 ** (step + 1), (1 - beta2 ** (step + 1)) ** 0.5

            def update(g):
                g = g.double()
                return lr * ((beta1 * m + (1 - beta1) * g) / b1) / ((beta2 * v + (1 - beta2) * g * g).sqrt() / b2 + eps)
            self.pairs.append((n, spec, lo, hi, update(mine) - update(local(p.grad))))

    def allowance(self, ref_updates: dict, names, world) -> torch.Tensor:
        """[parameters]: ||allowed|| / ||reference update||, squared norms summed over ranks like `_per_param_rel`
        (a replicated view counts in both sums alike)."""
        index = {n: i for i, n in enumerate(names)}
        acc = torch.zeros(len(names), 2, dtype=torch.float64, device=world.device)
        for n, spec, lo, hi, allowed in self.pairs:
            acc[index[n], 0] += allowed.pow(2).sum()
            acc[index[n], 1] += spec.local_slice(ref_updates[n]).reshape(-1)[lo:hi].double().pow(2).sum()
        comm.all_reduce(acc, world, tag="verify")
        return torch.where(acc[:, 1] > 0, acc[:, 0].sqrt() / acc[:, 1].sqrt().clamp_min(1e-30), 0.0)


def _norms(values: dict, names) -> torch.Tensor:
    return torch.stack([values[n].double().norm() for n in names]).cpu()


class NoiseBudget:
    """bf16: the layout passes where its distance to the bf16 reference is within `BF16_MULTIPLE` times what bf16
    itself costs, measured on the single-device model (the bf16 reference against an fp32 one, same forced
    routing), plus an absolute floor for quantities whose bf16 noise is near zero by chance.

    Per parameter and step: rel(layout, ref16) ≤ BF16_MULTIPLE · rel(ref16, ref32) + floor, with rel the
    norm-wise relative difference and floor BF16_FLOOR[quantity] for gradients, BF16_FLOOR[quantity]·lr / ||ref16||
    for updates and values; for the loss, |Δ| ≤ BF16_MULTIPLE · |loss16 − loss32| + BF16_FLOOR["loss"] ·
    max(1, |loss16|). `ratios` holds the largest left/right side seen per quantity; the layout passes when all
    are ≤ 1. Two bf16 runs that round differently stand about √2 times as far apart as
    either stands from fp32, so the multiple leaves a ~3× margin; a parameter missing a quarter of its gradient
    scores 0.5 and an eighth 0.35 against a bf16 gradient floor of ~1e-2.
    """

    def __init__(self):
        self.ratios = {q: 0.0 for q in ("loss", "grad", "param", "update")}
        self.noise = {q: 0.0 for q in self.ratios}

    def add(self, quantity: str, layout_rel: torch.Tensor, ref16: dict, ref32: dict, names, lr: float = 0.0) -> None:
        """`lr`: for parameters and updates, the absolute floor's unit (the step's lr, or the sum so far)."""
        norms = torch.stack([ref16[n].double().norm() for n in names]).clamp_min(1e-30)
        floor = torch.stack([(ref16[n].double() - ref32[n].double()).norm() for n in names]) / norms
        extra = BF16_FLOOR[quantity] * (lr / norms if lr else 1.0)
        ratio = layout_rel / (BF16_MULTIPLE * floor + extra).to(layout_rel.device)
        floor = floor.to(layout_rel.device)
        self.ratios[quantity] = max(self.ratios[quantity], float(ratio.max()))
        self.noise[quantity] = max(self.noise[quantity], float(floor.max()))

    def add_loss(self, loss: float, loss16: float, loss32: float) -> None:
        budget = BF16_MULTIPLE * abs(loss16 - loss32) + BF16_FLOOR["loss"] * max(1.0, abs(loss16))
        self.ratios["loss"] = max(self.ratios["loss"], abs(loss - loss16) / budget)
        self.noise["loss"] = max(self.noise["loss"], abs(loss16 - loss32))

    @property
    def passed(self) -> bool:
        return all(r <= 1.0 for r in self.ratios.values())

    def result(self) -> dict:
        return {"multiple": BF16_MULTIPLE, "floors": BF16_FLOOR, "ratios": self.ratios, "noise": self.noise}


class Float64(TorchDispatchMode):
    """Everything run inside computes in float64: the default dtype, and every float32 an operation names (`.float()`,
    `.to(torch.float32)`, `dtype=torch.float32`) — the model's explicit fp32 casts (norms, rotary tables, the router,
    the loss, the linear layers' state, the attention kernels' backward) included, so no fp32 rounding is left. A
    dispatch mode, not a function mode: autograd runs custom backwards under dispatch modes, not function modes."""

    def __enter__(self):
        self.default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self.default)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def _first_step_grads(run: Trainer, replay: RoutingReplay | None, step: int = 0) -> dict[str, torch.Tensor]:
    """`run`'s gradients of `step` (after `finish_gradients`: clipped as the reference's), MoE layers taking the
    layout's choices of that step (`RoutingReplay.queue`, for one more reference)."""
    if replay is not None:
        replay.queue(routers(run.model))
    run.forward_backward(step)
    run.finish_gradients()
    grads = {n: p.grad.clone() for n, p in run.model.named_parameters(remove_duplicate=False)}
    run.reducer.zero_grad()
    return grads


def first_grad_samples(cfg: TrainConfig, ref: Trainer, replay: RoutingReplay | None,
                       tokens=None) -> tuple[dict, list[dict]]:
    """The reference's first-step gradients from the same weights and tokens with every operation in float64
    (`Float64`), and FP32_SAMPLES more fp32 roundings of them: fp32 runs whose weights each moved one ulp up or down
    at random (an fp32 result is the exact one of inputs perturbed by about an ulp). Call it before the first
    optimizer step; single-device work on each rank, the same on every rank (seeded by cfg.seed), no collective."""
    device = ref.mesh.device
    weights = ref.model.state_dict()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with Float64():
            ref64 = _reference(cfg, device, tokens)
            ref64.model.load_state_dict(weights)
            exact = _first_step_grads(ref64, replay)
        del ref64
        run = _reference(cfg, device, tokens)
        gen = torch.Generator().manual_seed(cfg.seed)
        samples = []
        for _ in range(FP32_SAMPLES):
            with torch.no_grad():
                for n, p in run.model.named_parameters():
                    up = (torch.rand(p.shape, generator=gen) < 0.5).to(device)
                    p.copy_(torch.nextafter(weights[n], torch.where(up, torch.inf, -torch.inf)))
            samples.append(_first_step_grads(run, replay))
    return exact, samples


def _first_grad_budget(cfg, rel: torch.Tensor, ref: Trainer, replay, tokens, names, grad_views,
                       world) -> tuple[float, dict]:
    """fp32 first-step gradients: (largest ratio to the bound, the report: the multiple, whether the float64
    reference ran, and each parameter over the flat bound with its distance, its fp32 noise, the layout's own distance
    to float64 and its bound). A parameter passes within max(flat bound, FP64_MULTIPLE · noise), noise the largest
    distance to the float64 gradient of the reference and its FP32_SAMPLES perturbed runs; all that runs only when some
    parameter is over the flat bound (`rel` is the same on every rank, so every rank decides alike)."""
    flat = TOLERANCE["fp32"]["first_grad"]
    rel = rel.cpu()
    report = {"multiple": FP64_MULTIPLE, "fp32_samples": FP32_SAMPLES, "fp64_run": False, "params": {}}
    model = cfg.model_config()
    if not bool((rel > flat).any()) or model.dropout > 0 or model.attn_dropout > 0:
        return float(rel.max()) / flat, report  # dropout: other runs draw other masks, so no budget
    g32 = {n: p.grad for n, p in ref.model.named_parameters(remove_duplicate=False)}
    exact, samples = first_grad_samples(cfg, ref, replay, tokens)
    noise = torch.stack([max((g[n].double() - exact[n]).norm() for g in [g32, *samples])
                         / g32[n].double().norm().clamp_min(1e-30) for n in names]).cpu()
    bound = (FP64_MULTIPLE * noise).clamp_min(flat)
    ratio = rel / bound
    to_exact = _per_param_rel(_against(grad_views, exact), names, world).cpu()  # collective: every rank is here
    over = {names[i]: {"rel": float(rel[i]), "fp32_noise": float(noise[i]), "layout_vs_fp64": float(to_exact[i]),
                       "bound": float(bound[i])}
            for i in (rel > flat).nonzero().flatten().tolist()}
    return float(ratio.max()), report | {"fp64_run": True, "params": over}


def _layout_values(param_views, ref_params: dict[str, torch.Tensor], world) -> dict[str, torch.Tensor]:
    """The layout's parameters as whole tensors on every rank: each rank scatters the values it holds to their global
    elements (`_global_index`), summed over ranks and divided by how many hold each."""
    out = {}
    for n, ref in ref_params.items():
        out[n] = torch.zeros(2, ref.numel(), dtype=torch.float64, device=world.device)
    for n, spec, vals, lo, hi in param_views:
        idx = _global_index(spec, ref_params[n], lo, hi, world.device)
        keep = idx > 0
        out[n][0, idx[keep] - 1] += vals.reshape(-1)[keep].double()
        out[n][1, idx[keep] - 1] += 1.0
    for n in sorted(out):
        comm.all_reduce(out[n], world, tag="verify")
    return {n: (t[0] / t[1].clamp_min(1.0)).view(ref_params[n].shape).to(ref_params[n].dtype) for n, t in out.items()}


def _grads_at_layout_weights(cfg, step: int, param_views, ref_params, replay, tokens, world) -> dict:
    """The reference's gradients of `step` at the layout's own weights (every rank assembles them; single-device work
    after that): a later step compared there carries no drift from earlier steps, only this step's arithmetic."""
    values = _layout_values(param_views, ref_params, world)
    probe = _reference(cfg, world.device, tokens)
    with torch.no_grad():
        for n, p in probe.model.named_parameters(remove_duplicate=False):
            p.copy_(values[n])
    return _first_step_grads(probe, replay, step)


def verify_main(cfg: TrainConfig, device: torch.device | None = None, tokens: torch.Tensor | None = None) -> dict:
    """`tokens`: a token stream to train on instead of cfg.data (tests build documents of known lengths)."""
    cfg = assembled(cfg)
    device = device or torch.device("cpu")
    check_verifiable(cfg)
    mesh = make_mesh(cfg, device)
    trainer = Trainer(cfg, mesh, tokens)
    ref = _reference(cfg, device, tokens)
    bf16 = cfg.dtype == "bf16"
    fp32 = dataclasses.replace(cfg, dtype="fp32", grad_reduce_dtype="fp32")  # bf16's noise, measured in one place
    ref32 = _reference(fp32, device, tokens) if bf16 else None
    refs = [ref] + ([ref32] if bf16 else [])
    ref_params = dict(ref.model.named_parameters(remove_duplicate=False))  # tied: output.weight too (PP's copy)
    ref32_params = dict(ref32.model.named_parameters(remove_duplicate=False)) if bf16 else {}
    names = sorted(ref_params)
    world = mesh["world"]
    moe = bool(trainer.model_cfg.moe_experts)
    replay = RoutingReplay(trainer, refs, world, cfg.dtype) if moe else None
    budget = NoiseBudget() if bf16 else None
    loss_diff = grad_diff = param_diff = first_grad = first_update = later_update = later_ratio = param_ratio = 0.0
    first_grad_ratio, first_grad_budget, later_grad = 0.0, None, 0.0
    resynced = {}  # later-step gradients over the drift bound, judged at the layout's own weights
    dropout = cfg.model_config().dropout > 0 or cfg.model_config().attn_dropout > 0
    update_allowance = torch.zeros(len(names), dtype=torch.float64)  # per parameter: Σ of its update bounds so far
    adam_response = None if bf16 else AdamResponse(ref, ref_params)
    coverage = None
    lr_sum = 0.0
    losses = []
    for step in range(cfg.steps):
        loss = trainer.forward_backward(step)
        if replay is not None:
            replay.force(step)
        ref_losses = [r.forward_backward(step) for r in refs]
        if replay is not None:
            replay.check(step)
        trainer.finish_gradients()
        for r in refs:
            r.finish_gradients()
        loss_diff = max(loss_diff, abs(loss - ref_losses[0]))
        losses.append(loss)
        grad_views = list(_grad_views(trainer))
        ref_grads = {n: p.grad for n, p in ref_params.items()}
        step_grads = _per_param_rel(_against(grad_views, ref_grads), names, world)
        step_grad = float(step_grads.max())
        first_grad = step_grad if step == 0 else first_grad
        grad_diff = max(grad_diff, step_grad)
        if step and step_grad > TOLERANCE["fp32"]["grad"] and not bf16 and not dropout:
            # over the drift bound: judged again at the layout's own weights, where the drift is gone (not under
            # dropout: the extra run would draw other masks)
            at_layout = _grads_at_layout_weights(cfg, step, list(_param_views(trainer)), ref_params, replay, tokens,
                                                 world)
            resync = _per_param_rel(_against(grad_views, at_layout), names, world)
            over = (step_grads > TOLERANCE["fp32"]["grad"]).cpu()
            resynced.update({names[i]: {"step": step + 1, "rel": float(step_grads[i]), "at_layout_weights":
                                        float(resync[i])} for i in over.nonzero().flatten().tolist()})
            step_grad = float(torch.where(over.to(step_grads.device), resync, step_grads).max())
        later_grad = later_grad if step == 0 else max(later_grad, step_grad)  # step 1: first_grad_ratio
        if step == 0 and not bf16:
            first_grad_ratio, first_grad_budget = _first_grad_budget(cfg, step_grads, ref, replay, tokens, names,
                                                                  grad_views, world)
        if budget is not None:
            budget.add_loss(loss, *ref_losses)
            budget.add("grad", step_grads, ref_grads, {n: p.grad for n, p in ref32_params.items()}, names)
        if adam_response is not None:
            adam_response.collect(step, grad_views, lr_at(step, cfg))
        before = [v[2].clone() for v in _param_views(trainer)]
        ref_before = [{n: p.detach().clone() for n, p in params.items()} for params in (ref_params, ref32_params)]
        trainer.optimizer_step(step)
        for r in refs:
            r.optimizer_step(step)
        if moe:  # the loss-free bias moves the same way in both, or routing diverges
            trainer.moe_step()
            for r in refs:
                r.moe_step()
            replay.check_bias()
        param_views = list(_param_views(trainer))
        if coverage is None:
            coverage = _coverage([grad_views, param_views], ref_params, world)
        ref_values = {n: p.detach() for n, p in ref_params.items()}
        step_params = _per_param_rel(_against(param_views, ref_values), names, world)
        param_diff = max(param_diff, float(step_params.max()))
        updates = [(n, spec, p - b, lo, hi) for (n, spec, p, lo, hi), b in zip(param_views, before)]
        ref_updates = {n: p.detach() - ref_before[0][n] for n, p in ref_params.items()}
        step_updates = _per_param_rel(_against(updates, ref_updates), names, world)
        step_update = float(step_updates.max())
        first_update = step_update if step == 0 else first_update
        later_update = later_update if step == 0 else max(later_update, step_update)
        if not bf16:
            response = adam_response.allowance(ref_updates, names, world).cpu()
            if step:
                later_ratio = max(later_ratio, _later_update_ratio(step_updates, ref_updates, names,
                                                                   lr_at(step, cfg), response))
            tol = TOLERANCE["fp32"]
            u = _norms(ref_updates, names)
            update_allowance += (tol["first_update"] * u if step == 0
                                 else (tol["update"] + response) * u + tol["update_floor"] * lr_at(step, cfg))
            p = _norms(ref_values, names)
            param_ratio = max(param_ratio, float((step_params.cpu() * p / (tol["param"] * p + update_allowance)
                                                  .clamp_min(1e-30)).max()))
        if budget is not None:
            values32 = {n: p.detach() for n, p in ref32_params.items()}
            lr_sum += lr_at(step, cfg)
            budget.add("param", step_params, ref_values, values32, names, lr_sum)
            budget.add("update", step_updates, ref_updates,
                       {n: p - ref_before[1][n] for n, p in values32.items()}, names, lr_at(step, cfg))
        mesh.ledger.end_step(step + 1)
    if bf16:
        tol = {"multiple": BF16_MULTIPLE, **BF16_FLOOR}
        passed = budget.passed
    else:
        tol = TOLERANCE[cfg.dtype]
        passed = (loss_diff <= tol["loss"] * max(1.0, abs(losses[0])) and first_grad_ratio <= 1.0
                  and later_grad <= tol["grad"] and param_ratio <= 1.0 and first_update <= tol["first_update"]
                  and later_ratio <= 1.0)
    passed = passed and coverage == 1.0 and (replay is None or replay.passed)
    out = {"layout": cfg.parallel.as_dict(), "steps": cfg.steps, "max_loss_abs_diff": loss_diff,
           "max_grad_rel_diff": grad_diff, "max_param_rel_diff": param_diff,
           "max_update_rel_diff": max(first_update, later_update), "coverage": coverage, "passed": bool(passed),
           "first_step_grad_rel_diff": first_grad,
           "first_step_update_rel_diff": first_update, "later_update_rel_diff": later_update, "tolerances": tol,
           "losses": losses}
    if not bf16:
        out["later_update_ratio"] = later_ratio
        out["param_ratio"] = param_ratio
        out["first_grad_ratio"] = first_grad_ratio
        out["first_grad_budget"] = first_grad_budget
        out["later_grad_at_layout_weights"] = resynced
    if replay is not None:
        out["routing"] = replay.result()
    if budget is not None:
        out["bf16_budget"] = budget.result()
    return out
