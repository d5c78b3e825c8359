"""The degrees of every parallel axis and the per-axis options (`ParallelConfig`): the one type that holds
them. The runtime's mesh is built from it, the planner's `Layout` extends it, and every world-size product
is its `world_size`. The degrees alone are checked against a world size by `ParallelConfig.build`; the rest
is validated together with the model by `TrainConfig.validate`. Frozen (derive with `dataclasses.replace`), so a
layout is hashable and nothing changes it after resolution."""
from __future__ import annotations

from dataclasses import dataclass

from ..rules.validation import REST, dp_shard_problem, ep_dpcp_problem, rest_of_world
from .errors import ConfigError


AXES = ("dp", "pp", "cp", "tp", "ep")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of every parallel axis. Their product (ep excluded: it is drawn from dp×cp) is the world size."""

    dp: int = 1
    """Data-parallel degree; -1 means "whatever is left of the world size"."""
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert-parallel degree, drawn from the dp×cp ranks."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism in the TP regions (norms/residuals on s/tp shards)."""
    tp_overlap: bool = False
    """Under SP, each TP all-gather / reduce-scatter runs in tp chunks under the GEMM that reads / writes it."""
    fused_projections: bool = False
    """q/k/v and w1/w3 each run as one GEMM on the concatenated weights (parameters stay per projection)."""
    zero: int = 0
    """ZeRO stage over dp×cp: 0 (replicated), 1 (AdamW state sharded), 2 (+ gradients), 3 (+ parameters)."""
    dp_shard: int | None = None
    """Hybrid sharded DP: ZeRO 2/3 shard over this many consecutive dp ranks (× cp), replicate over dp/S; None = dp
    (no hybrid sharding; the one sentinel for it)."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved, zb or dualpipev."""
    vp: int = 1
    """Model chunks (virtual stages) per pipeline rank: >1 for interleaved; dualpipev uses 2."""
    pp_layers: tuple[int, ...] | None = None
    """Layers per stage (pp × vp counts), for uneven splits; default an even split. A list given is kept as a tuple."""
    pp_scatter_gather: bool = False
    """Under TP without SP, send 1/tp of each stage activation and all-gather it over TP on arrival."""
    cp_order: str = "balanced"
    """Context-parallel token order: 'balanced' (rank r holds chunks r and 2c-1-r) or 'contiguous'."""
    cp_impl: str = "ring"
    """Context-parallel attention: 'ring' (p2p K/V ring) or 'ulysses' (all-to-all to head shards)."""
    recompute: str = "none"
    """Activation recompute: 'none', 'selective' (the attention core) or 'full' (whole blocks)."""
    recompute_layers: int | None = None
    """Full recompute of the first N layers of every stage/chunk; None = all."""
    compile: bool = False
    """torch.compile each transformer block (collectives and their ledger stay eager, between graphs)."""

    def __post_init__(self):
        if isinstance(self.pp_layers, list):
            object.__setattr__(self, "pp_layers", tuple(self.pp_layers))

    @classmethod
    def build(cls, world_size: int, dp: int = -1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1,
              dp_shard: int | None = None) -> "ParallelConfig":
        """Degrees checked against a world size (dp=-1 takes the rest); dp_shard equal to dp means no hybrid
        sharding and is stored as None."""
        named = f"dp={dp}, pp={pp}, cp={cp}, tp={tp}, ep={ep}, world size={world_size}"
        for name, v in (("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)):
            if v < 1:
                raise ConfigError(f"{name} must be >= 1 ({named})")
        if dp == REST:
            dp = rest_of_world(world_size, pp, cp, tp)
            if dp is None:
                raise ConfigError(f"world size not divisible by pp×cp×tp={pp * cp * tp} ({named})")
        if dp < 1 or dp * pp * cp * tp != world_size:
            raise ConfigError(f"dp×pp×cp×tp = {dp * pp * cp * tp} must equal the world size ({named})")
        if ep_dpcp_problem(dp, cp, ep):
            raise ConfigError(f"ep={ep} must divide dp×cp={dp * cp} ({named})")
        if dp_shard_problem(dp, dp_shard):
            raise ConfigError(f"dp_shard={dp_shard} must divide dp={dp} ({named})")
        return cls(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, dp_shard=None if dp_shard == dp else dp_shard)

    @property
    def world_size(self) -> int:
        """Ranks the layout needs: dp × pp × cp × tp (ep is drawn from dp×cp, so it adds none)."""
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shard(self) -> int:
        """dp ranks per ZeRO shard group (dp itself unless hybrid sharding)."""
        return self.dp_shard if self.hsdp else self.dp

    @property
    def replicas(self) -> int:
        """Copies of each ZeRO shard across dp (1 unless hybrid sharding)."""
        return self.dp // self.shard

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the dp×cp ranks left once ep is carved out."""
        return self.dp * self.cp // self.ep

    def describe(self) -> str:
        return ", ".join(f"{a}={getattr(self, a)}" for a in AXES)

    @property
    def hsdp(self) -> bool:
        """Hybrid sharding is on: ZeRO shards over dp_shard < dp ranks and replicates over the rest."""
        return self.dp_shard is not None and self.dp_shard != self.dp

    def as_dict(self) -> dict:
        out = {a: getattr(self, a) for a in AXES} | {"sequence_parallel": self.sequence_parallel, "zero": self.zero}
        out |= {"tp_overlap": True} if self.tp_overlap else {}
        out |= {"fused_projections": True} if self.fused_projections else {}
        if self.recompute != "none":
            out |= {"recompute": self.recompute, "recompute_layers": self.recompute_layers}
        out |= {"dp_shard": self.dp_shard} if self.hsdp else {}
        if self.compile:
            out |= {"compile": True}
        if self.pp > 1:
            out |= {"schedule": self.schedule, "vp": self.vp, "pp_layers": _listed(self.pp_layers),
                    "pp_scatter_gather": self.pp_scatter_gather}
        return out


def _listed(counts: tuple[int, ...] | None) -> list[int] | None:
    """pp_layers as the run's JSON and layout strings have always shown it (a list)."""
    return None if counts is None else list(counts)
