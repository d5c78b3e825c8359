"""A parallel layout, the workload it runs, and the facts about it that need no cost model.

The mesh is shardwise's: ranks are `arange(world).view(dp, pp, cp, tp)`, so tp is innermost (one TP
group is consecutive ranks, hence inside a node), then cp, pp, and dp outermost. Expert parallelism is
carved out of the dp×cp ranks (cp fastest), and the remaining dp×cp/ep ranks form the expert-data-
parallel group. Stages hold contiguous layer chunks: chunk j of pp×vp sits on stage j mod pp
(interleaved), and DualPipeV's V puts chunks k and 2·pp−1−k on stage k.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from shardwise.config.parallel import ParallelConfig
from shardwise.rules.geometry import GRID, axis_lines
from shardwise.rules.partition import balanced_counts, recomputed_layers
from shardwise.rules.schedules import SCHEDULE_NAMES
from shardwise.rules.validation import (
    CP_IMPLS, RECOMPUTE, ZERO_STAGES, cp_seq_problem, dp_shard_problem, ep_dpcp_problem, fp8_cp_problem,
    fp8_moe_problem, heads_tp_problem, hsdp_zero_problem, layers_pp_problem, rest_of_world, sp_tokens_problem,
    tp_kv_problem, ulysses_problem,
)
from shardwise.planner.errors import PlanError
from shardwise.planner.models import ModelSpec

SCHEDULES = SCHEDULE_NAMES  # the runtime's schedule names, declared once in rules/schedules.py
DEFAULT_GLOBAL_BATCH = 1024
AXIS_NAMES = (*GRID, "dp_cp", "ep", "edp", "dp_shard", "dp_replicate")
"""The communication axes whose groups `group_spans` reports."""
PRECISIONS = {"bf16": 2, "fp32": 4}
"""Activation bytes per element; parameters, grads and Adam moments stay fp32 in both (shardwise's AMP)."""


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096
    global_batch: int = DEFAULT_GLOBAL_BATCH
    """Sequences per optimizer step."""
    precision: str = "bf16"
    fp32_residual: bool = False
    """shardwise's --fp32-residual: under bf16 the residual stream (and what it feeds: TP/SP region entries,
    the embedding's reduction, PP boundaries, MoE dispatch) stays fp32."""
    grad_reduce: str = "fp32"
    """Dtype of the dp×cp / edp gradient reduction (shardwise's --grad-reduce-dtype)."""
    optimizer: str = "adamw"
    """shardwise's --optimizer: muon adds its gathers and keeps one momentum buffer (planner/muon.py)."""
    muon_qk_clip: float = 0.0
    """shardwise's --muon-qk-clip τ (0: off): MuonClip completes each head's largest logit over dp×cp (and tp)."""
    moe_skew: float = 1.0
    """The busiest ep rank's received MoE rows over the mean (`moe_skew.py`; 1: balanced routing)."""
    moe_routing: tuple | None = None
    """A recorded run's tokens per expert per MoE layer (`moe_skew.read_routing`); replaces `moe_skew`."""
    expert_placement: str = "contiguous"
    """shardwise's --expert-placement: 'balanced' plans the busiest ep rank after the experts are placed for an even
    load (`moe_skew.skew`, `rules.placement`)."""
    fp8: str | None = None
    """shardwise's --fp8 RECIPE (None: off): the FP8 linears' GEMMs at the FP8 peak and their amax all-reduces
    (planner/fp8.py)."""
    fp8_all_gather: bool = False
    """shardwise's --fp8-all-gather: ZeRO-3 parameter and SP activation all-gathers in FP8 (`rules.wire`)."""

    @property
    def act_bytes(self) -> int:
        return PRECISIONS[self.precision]

    @property
    def resid_bytes(self) -> int:
        """Bytes per element of the residual stream and of the norm outputs it feeds."""
        return 4 if self.fp32_residual else self.act_bytes

    @property
    def grad_reduce_bytes(self) -> int:
        return PRECISIONS[self.grad_reduce]


@dataclass(frozen=True)
class Layout(ParallelConfig):
    """A `ParallelConfig` (the degrees, defaults and `world_size` shardwise runs with) plus how the planner
    splits each step's batch. A cache key: frozen and hashable with every field, derived with `dataclasses.replace`."""

    mb: int = 1
    """Sequences per microbatch."""
    m: int = 1
    """Microbatches per step per dp rank (gradient accumulation)."""

    @property
    def sp(self) -> bool:
        """Sequence parallelism (`sequence_parallel`), under the planner's short name."""
        return self.sequence_parallel

    @property
    def world(self) -> int:
        """GPUs the layout needs (`world_size`)."""
        return self.world_size

    def as_dict(self) -> dict:
        """The plan's JSON keys; dp_shard only under hybrid sharding (it changes nothing otherwise)."""
        return {k: getattr(self, k) for k in PLAN_KEYS if k != "dp_shard" or self.hsdp}

    def short(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        parts += [f"{k}{getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1]
        if self.cp > 1 and self.cp_impl != "ring":
            parts.append(self.cp_impl)
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.vp}" if self.vp > 1 and self.schedule == "interleaved" else ""))
        parts += [f"mb{self.mb}", f"m{self.m}"]
        if self.hsdp:
            parts.append(f"hs{self.dp_shard}")
        return " ".join(parts) + (" sp" if self.sp else "")

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        """The inverse of `as_dict` (a plan row's "layout" object)."""
        return cls(**{_FIELD_OF.get(k, k): v for k, v in d.items()})


PLAN_KEYS = ("dp", "tp", "pp", "cp", "ep", "vp", "schedule", "mb", "m", "zero", "recompute", "sp", "cp_impl",
             "dp_shard")
"""A layout's keys in `plan --json` rows and --explain text, in order."""
_FIELD_OF = {"sp": "sequence_parallel"}
_INT_KEYS = ("dp", "tp", "pp", "cp", "ep", "vp", "mb", "m", "zero", "dp_shard")
_ALIASES = {"v": "vp", "micro_batch": "mb", "microbatches": "m"}


def parse_layout(text: str, base: Layout, gpus: int, global_batch: int | None) -> Layout:
    """Parse 'dp=8,tp=8,pp=4[,cp=..,ep=..,vp=..,mb=..,m=..,schedule=..,zero=..,recompute=..,sp=..,cp_impl=..]'.

    dp left out fills the rest of the GPUs; m left out follows from the global batch.
    """
    given: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = item.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        val = val.strip()
        if not sep or not val:
            raise PlanError(f"--explain: {item!r} is not key=value")
        if key in _INT_KEYS:
            if not val.isdigit() or int(val) <= 0 and key != "zero":
                raise PlanError(f"--explain: {key}={val!r} must be a positive integer")
            given[key] = int(val)
        elif key in ("schedule", "recompute", "cp_impl"):
            given[key] = val  # checked by layout_problems
        elif key == "sp":
            if val.lower() not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                raise PlanError(f"--explain: sp={val!r} must be on/off")
            given[key] = val.lower() in ("1", "true", "on", "yes")
        else:
            raise PlanError(f"--explain: unknown key {key!r}; valid: {', '.join(_INT_KEYS)}, schedule, recompute, sp, "
                            "cp_impl")
    lay = replace(base, **{_FIELD_OF.get(k, k): v for k, v in given.items() if k != "m"})
    if "dp" not in given:
        dp = rest_of_world(gpus, lay.pp, lay.cp, lay.tp)
        if dp is None:
            raise PlanError(f"--explain: tp×pp×cp = {lay.tp * lay.pp * lay.cp} does not divide --gpus {gpus}")
        lay = replace(lay, dp=dp)
    if lay.schedule in ("dualpipev", "interleaved") and "vp" not in given:
        lay = replace(lay, vp=2)
    if "m" in given:
        m = given["m"]
        if global_batch is not None and m * lay.mb * lay.dp != global_batch:
            raise PlanError(f"--explain: m={m} × mb={lay.mb} × dp={lay.dp} != --global-batch {global_batch}")
    else:
        gb = DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch
        if gb % (lay.mb * lay.dp):
            raise PlanError(f"--global-batch {gb} is not divisible by mb={lay.mb} × dp={lay.dp}")
        m = gb // (lay.mb * lay.dp)
    if lay.tp == 1:
        lay = replace(lay, sequence_parallel=False)
    return replace(lay, m=m)


def layout_problems(spec: ModelSpec, lay: Layout, gpus: int, seq_len: int, uneven_pp: bool = False,
                    fp8: str | None = None) -> list[str]:
    """Every reason this layout cannot run (empty when it can): divisibility and schedule rules, and the FP8 recipe's
    token tiles (`fp8`: the run's --fp8) where `train` refuses them."""
    bad = []
    if lay.world_size != gpus:
        bad.append(f"dp×tp×pp×cp = {lay.world_size} != {gpus} GPUs")
    t = lay.tp
    if heads_tp_problem(spec.n_heads, t):
        bad.append(f"tp={t} does not divide n_heads={spec.n_heads}")
    kv = spec.attn_kv_heads
    if tp_kv_problem(t, kv):
        bad.append(f"tp={t} and n_kv_heads={kv}: one must divide the other")
    if spec.n_moe_layers < spec.n_layers and spec.ffn_dim % t:  # MoE blocks are not tp-sharded
        bad.append(f"tp={t} does not divide ffn_dim={spec.ffn_dim}")
    if spec.is_moe:
        if spec.moe_experts % lay.ep:
            bad.append(f"ep={lay.ep} does not divide moe_experts={spec.moe_experts}")
    if ep_dpcp_problem(lay.dp, lay.cp, lay.ep):
        bad.append(f"ep={lay.ep} does not divide dp×cp = {lay.dp * lay.cp}")
    if not spec.is_moe and lay.ep > 1:
        bad.append(f"ep={lay.ep} needs an MoE model")
    chunks = lay.pp * lay.vp
    if layers_pp_problem(spec.n_layers, chunks, uneven_pp):
        bad.append(f"pp×vp = {chunks} does not divide n_layers={spec.n_layers}")
    if cp_seq_problem(seq_len, lay.cp):
        bad.append(f"cp={lay.cp} does not divide seq_len={seq_len}")
    elif lay.sp and sp_tokens_problem(seq_len, lay.cp, t):
        bad.append(f"seq_len/cp = {seq_len // lay.cp} is not divisible by tp={t} (sequence parallelism)")
    if lay.cp_impl not in CP_IMPLS:
        bad.append(f"cp_impl {lay.cp_impl!r} unknown; valid: {', '.join(CP_IMPLS)}")
    elif lay.cp > 1 and lay.cp_impl == "ulysses":
        problem = ulysses_problem(spec.n_heads, spec.attn_kv_heads, t, lay.cp, tp_name="tp")
        bad += [problem] if problem else []
    if lay.schedule not in SCHEDULES:
        bad.append(f"schedule {lay.schedule!r} unknown; valid: {', '.join(SCHEDULES)}")
    elif lay.pp > 1 and lay.schedule == "interleaved" and (lay.vp < 2 or lay.m % lay.pp):
        bad.append(f"interleaved needs vp >= 2 and m % pp == 0 (vp={lay.vp}, m={lay.m}, pp={lay.pp})")
    elif lay.schedule == "dualpipev" and (lay.vp != 2 or lay.m < 2 * lay.pp):
        bad.append(f"dualpipev needs vp=2 and m >= 2·pp (vp={lay.vp}, m={lay.m}, pp={lay.pp})")
    elif lay.schedule not in ("interleaved", "dualpipev") and lay.vp != 1:
        bad.append(f"vp={lay.vp} needs schedule interleaved or dualpipev")
    if lay.recompute not in RECOMPUTE:
        bad.append(f"recompute {lay.recompute!r} unknown; valid: {', '.join(RECOMPUTE)}")
    if lay.zero not in ZERO_STAGES:
        bad.append(f"zero={lay.zero} unknown; valid: {', '.join(map(str, ZERO_STAGES))}")
    if lay.sp and t == 1:
        bad.append("sp needs tp > 1")
    if dp_shard_problem(lay.dp, lay.dp_shard):
        bad.append(f"dp_shard={lay.dp_shard} does not divide dp={lay.dp}")
    elif hsdp_zero_problem(lay.hsdp, lay.zero):
        bad.append(f"dp_shard={lay.dp_shard} shards nothing at zero={lay.zero} (needs zero 2 or 3)")
    if seq_len > spec.max_seq_len:
        bad.append(f"seq_len={seq_len} exceeds max_seq_len={spec.max_seq_len} of {spec.name}")
    if fp8:
        problem = fp8_cp_problem(fp8, seq_len, lay.cp, True) or (spec.moe_experts and fp8_moe_problem(
            fp8, t if lay.sp else 1, lay.cp, lay.dp, lay.ep, lay.mb, seq_len, bool(spec.moe_shared_experts),
            spec.moe_capacity_factor is not None))
        bad += [f"--fp8 {fp8} {problem}"] if problem else []
    return bad


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage (one pp rank, all its chunks) holds."""

    index: int
    n_dense: int
    n_moe: int
    embedding: bool
    head: bool
    kinds: tuple[bool, ...] = ()
    """MoE flag of each held layer in model order (shardwise's parameter order); () = dense first, then MoE."""
    recomputed: tuple[bool, ...] = ()
    """Under --recompute-layers N, whether each held layer (as `kinds`) is one the runtime recomputes: the first N
    of every chunk (`shardwise.recompute.apply_recompute`); () = every layer follows the layout's recompute."""
    linear: tuple[bool, ...] = ()
    """Whether each held layer (as `kinds`) is a Gated DeltaNet layer (planner/linear_attention.py); () = none."""

    @property
    def n_layers(self) -> int:
        return self.n_dense + self.n_moe

    def recompute_split(self, lay: "Layout") -> tuple[tuple[int, int], tuple[int, int]]:
        """((dense, MoE) layers run under `lay.recompute`, (dense, MoE) layers run without recompute)."""
        if not self.recomputed or lay.recompute == "none":
            return ((self.n_dense, self.n_moe), (0, 0)) if lay.recompute != "none" else ((0, 0), (self.n_dense, self.n_moe))
        kinds = self.kinds or (False,) * self.n_dense + (True,) * self.n_moe
        rec = [moe for moe, r in zip(kinds, self.recomputed) if r]
        plain = [moe for moe, r in zip(kinds, self.recomputed) if not r]
        return (rec.count(False), rec.count(True)), (plain.count(False), plain.count(True))


def chunk_owners(lay: Layout) -> list[int]:
    """Stage of each model chunk, in model order (pp×vp chunks; vp counts only when pp > 1)."""
    p, v = lay.pp, lay.vp if lay.pp > 1 else 1
    if lay.schedule == "dualpipev":
        return [2 * p - 1 - j if j >= p else j for j in range(p * v)]
    return [j % p for j in range(p * v)]


def chunk_layer_ids(spec: ModelSpec, lay: Layout) -> list[range]:
    """Global layer indices of every model chunk, in model order (`partition.balanced_counts`' split)."""
    out, start = [], 0
    for size in balanced_counts(spec.n_layers, len(chunk_owners(lay))):
        out.append(range(start, start + size))
        start += size
    return out


def stage_layer_ids(spec: ModelSpec, lay: Layout) -> list[list[int]]:
    """Global layer indices each stage holds, in model order (its chunks' contiguous runs)."""
    held: list[list[int]] = [[] for _ in range(lay.pp)]
    for owner, ids in zip(chunk_owners(lay), chunk_layer_ids(spec, lay)):
        held[owner] += ids
    return [sorted(ids) for ids in held]


def recomputed_layer_ids(spec: ModelSpec, lay: Layout) -> set[int]:
    """The layers the runtime recomputes: every layer, or under --recompute-layers N the first N of each chunk."""
    if lay.recompute == "none":
        return set()
    return set(recomputed_layers(chunk_layer_ids(spec, lay), lay.recompute_layers))


def stages(spec: ModelSpec, lay: Layout) -> list[Stage]:
    owner = chunk_owners(lay)
    chosen = recomputed_layer_ids(spec, lay) if lay.recompute_layers is not None else None
    out = []
    for k, ids in enumerate(stage_layer_ids(spec, lay)):
        kinds = tuple(spec.is_moe_layer(i) for i in ids)
        out.append(Stage(k, len(kinds) - sum(kinds), sum(kinds), embedding=owner[0] == k, head=owner[-1] == k,
                         kinds=kinds, recomputed=tuple(i in chosen for i in ids) if chosen is not None else (),
                         linear=tuple(spec.is_linear_layer(i) for i in ids) if spec.linear_layers else ()))
    return out


@lru_cache(maxsize=4096)
def _lines(dims: ParallelConfig) -> dict[str, list[list[int]]]:
    """`rules.geometry.axis_lines` of the degrees alone (many layouts share them; large worlds have many lines)."""
    return axis_lines(dims)


def _degrees(lay: Layout) -> ParallelConfig:
    return ParallelConfig(dp=lay.dp, pp=lay.pp, cp=lay.cp, tp=lay.tp, ep=lay.ep, dp_shard=lay.dp_shard)


def group_spans(lay: Layout, axis: str):
    """(lowest, highest) rank of every group of one communication axis (`rules.geometry.axis_lines`; none for an
    axis without groups). Ranks grow along each group, so the two ends decide whether it leaves a domain."""
    if axis not in AXIS_NAMES:
        raise ValueError(axis)
    return ((line[0], line[-1]) for line in _lines(_degrees(lay)).get(axis, ()))


def group_size(lay: Layout, axis: str) -> int:
    """Ranks in each group of `axis` (1 for an axis without groups: dp_shard and dp_replicate without hybrid sharding)."""
    if axis not in AXIS_NAMES:
        raise KeyError(axis)
    lines = _lines(_degrees(lay)).get(axis)
    return len(lines[0]) if lines else 1


def from_train_config(cfg) -> tuple[ModelSpec, Layout, Workload]:
    """The planner's (model, layout, workload) for a resolved shardwise `TrainConfig`.

    The layout carries every `ParallelConfig` field of the run (those the planner does not model too: `unmodeled`
    names them), normalised where a field does nothing: vp and schedule without pp, recompute_layers without
    recompute, SP and its overlap without tp, dp_shard equal to dp. m is the config's gradient-accumulation count.
    """
    p = cfg.parallel
    spec = ModelSpec.of(cfg.model_config())
    given = {f.name: getattr(p, f.name) for f in fields(ParallelConfig)}
    lay = Layout(**given | dict(
        vp=p.vp if p.pp > 1 else 1, schedule=p.schedule if p.pp > 1 else "1f1b",
        recompute_layers=p.recompute_layers if p.recompute != "none" else None,
        sequence_parallel=bool(p.sequence_parallel and p.tp > 1), dp_shard=p.dp_shard if p.hsdp else None,
        tp_overlap=bool(p.tp_overlap and p.sequence_parallel and p.tp > 1)), mb=cfg.micro_batch, m=cfg.grad_accum)
    gb = cfg.global_batch or cfg.micro_batch * p.dp
    return spec, lay, Workload(seq_len=cfg.seq_len, global_batch=gb, precision=cfg.dtype,
                               fp32_residual=cfg.fp32_residual, grad_reduce=cfg.grad_reduce_dtype,
                               optimizer=cfg.optimizer, muon_qk_clip=cfg.muon_qk_clip, fp8=cfg.fp8,
                               fp8_all_gather=cfg.fp8_all_gather)


def unmodeled(cfg) -> list[str]:
    """The train flags of a resolved `TrainConfig` that the planner does not model (empty: it models the run):
    `simulate` and `plan --trace` refuse them, since the plan they compare against would describe another run."""
    p, bad = cfg.parallel, []
    if p.pp_layers is not None and list(p.pp_layers) != balanced_counts(cfg.model_config().n_layers, p.pp * p.vp):
        bad.append(f"--pp-layers {','.join(map(str, p.pp_layers))}")
    if p.pp_scatter_gather:
        bad.append("--pp-scatter-gather")
    if p.fused_projections:
        bad.append("--fused-projections")
    if cfg.dsa_stage != "none":  # the indexer's KL: its FLOPs, saved inputs and tp/cp bytes
        bad.append(f"--dsa-stage {cfg.dsa_stage}")
    return bad
