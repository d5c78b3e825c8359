"""The rules a layout must obey, each stated once: `TrainConfig.validate` refuses a run by them and the planner
discards a layout by them, so a layout the planner ranks is one the trainer accepts.

Each rule is one function of plain numbers returning its one-line message (None: the rule holds). The two sides
word a message for their own readers — the trainer names flags (`--ep 2`), the planner a layout's keys (`ep=2`) —
so a rule whose wording differs takes that wording as an argument; the arithmetic is here alone.
"""
from __future__ import annotations

REST = -1
"""--dp's value for "the rest of the world size"."""
CP_IMPLS = ("ring", "ulysses")
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8")
DSA_STAGES = ("none", "dense-warmup", "sparse")
"""--dsa-stage: the DeepSeek Sparse Attention indexer's training objective (docs/sparse-attention.md)."""
FP8_TOKEN_TILE = {"blockwise": 128, "mxfp8": 32}
"""Rows of the weight-gradient GEMM's token tiles per FP8 recipe (tensorwise and rowwise scale over all tokens)."""


def fp8_cp_problem(recipe: str, seq_len: int, cp: int, balanced: bool) -> str | None:
    """A recipe's token tiles must not cut across CP ranks: each rank's parts of a sequence hold whole tiles, or one
    tile spans the whole sequence."""
    tile = FP8_TOKEN_TILE.get(recipe)
    part = seq_len // (cp * (2 if balanced else 1))
    if tile is None or cp == 1 or tile >= seq_len or part % tile == 0:
        return None
    return f"cuts its {tile}-token tiles across cp ranks ({part} tokens per part)"


def fp8_expert_tiles_split(recipe: str, sp_tp: int, cp: int, dp: int, ep: int) -> bool:
    """Whether a recipe's token tiles of a routed expert's rows (the weight gradient's 128×1 / 32×1 blocks) span
    ranks or another order: each TP rank routes its own sequence shard (SP), each cp rank its own part of every
    sequence, and at ep < dp an expert's tokens sit on dp/ep ranks. There the experts take each row's single-device
    position (`expert_parallel.positions`) and max-reduce a fixed-size buffer of per-tile amaxes over the ranks
    holding the expert's rows (`fp8.scaling.TokenTiles`)."""
    return recipe in FP8_TOKEN_TILE and (sp_tp > 1 or cp > 1 or ep < dp)


def fp8_moe_problem(recipe: str, sp_tp: int, cp: int, dp: int, ep: int, micro_batch: int, seq_len: int,
                    shared: bool, capacity: bool = False, balanced: bool = True) -> str | None:
    """A recipe's token tiles of the MoE's rows (an expert's rows, the shared experts' flattened tokens) must be the
    single device's. A routed expert's rows split over ranks (SP's tp, cp, ep < dp: `fp8_expert_tiles_split`) are
    tiled by their single-device positions, which need dropless routing (`capacity`: a capacity factor drops by
    each rank's own counts). The shared experts tile each rank's flattened rows as they lie: each run of consecutive
    tokens a rank holds (micro_batch × seq_len under dp alone; a sequence's SP chunk or cp part, two per sequence
    under cp's `balanced` order) must be whole tiles."""
    tile = FP8_TOKEN_TILE.get(recipe)
    if tile is None:
        return None
    if capacity and fp8_expert_tiles_split(recipe, sp_tp, cp, dp, ep):
        return (f"tiles each routed expert's rows in {tile}-token blocks by their single-device positions, which "
                f"need dropless routing; drop --moe-capacity-factor")
    split = sp_tp * cp * (2 if balanced and cp > 1 else 1)
    run = seq_len // split if split > 1 else micro_batch * seq_len
    if not shared or (split == 1 and dp == 1) or run % tile == 0:
        return None
    if split > 1:
        where = (f"--tp {sp_tp} --sequence-parallel --cp {cp}, whose {run}-token runs of a sequence per rank (the "
                 f"shared experts' rows)")
        fix = f"a sequence shard of a multiple of {tile} tokens"
    else:
        where = f"--dp {dp} with {run} tokens per microbatch (the shared experts' tiles span dp ranks)"
        fix = f"micro_batch × seq_len a multiple of {tile}"
    return (f"tiles the MoE's rows in {tile}-token blocks in one device's token order, which no rank holds under "
            f"{where}; use --fp8 tensorwise or rowwise, or {fix}")


FP8_WIRE_WEIGHTS = ("tensorwise", "blockwise")
"""--fp8-all-gather under ZeRO-3: recipes casting W alike for the forward and the input gradient (one FP8 gather)."""
FP8_WIRE_ACTIVATIONS = ("tensorwise",)
"""--fp8-all-gather under SP: recipes casting x alike for the forward and the weight gradient (one FP8 gather)."""


def fp8_wire_problem(recipe: str, zero3: bool, sp: bool) -> str | None:
    """An FP8 all-gather is exact only where one FP8 copy feeds every GEMM reading the gathered tensor."""
    if zero3 and recipe not in FP8_WIRE_WEIGHTS:
        return ("casts W along its rows for the forward but along its columns for the input gradient, so one FP8 "
                "gather of the ZeRO-3 weights cannot feed both; use --fp8 tensorwise or blockwise")
    if sp and recipe not in FP8_WIRE_ACTIVATIONS:
        return ("tiles x along the features for the forward but along the tokens for the weight gradient, so one FP8 "
                "SP gather cannot feed both; use --fp8 tensorwise, or drop --sequence-parallel")
    return None


def rest_of_world(world: int, pp: int, cp: int, tp: int) -> int | None:
    """dp under `--dp -1`: the world size over pp×cp×tp (None when that product does not divide it)."""
    inner = pp * cp * tp
    return None if world % inner else world // inner


def tp_kv_problem(tp: int, n_kv_heads: int) -> str | None:
    """tp shards the K/V heads (n_kv_heads a multiple of tp) or replicates them (tp a multiple of n_kv_heads)."""
    if n_kv_heads >= tp and n_kv_heads % tp:
        return f"does not divide n_kv_heads={n_kv_heads}"
    if n_kv_heads < tp and tp % n_kv_heads:
        return f"> n_kv_heads={n_kv_heads} needs tp to be a multiple of n_kv_heads"
    return None


def ulysses_problem(n_heads: int, n_kv_heads: int, tp: int, cp: int, tp_name: str = "TP") -> str | None:
    """Ulysses' all-to-all trades sequence for heads over cp: each TP rank's query heads split evenly over cp, and
    its K/V heads divide cp (whole heads per rank) or are divided by it (each repeated cp/kv times)."""
    q_local, kv_local = n_heads // tp, max(1, n_kv_heads // tp)
    if q_local % cp or (kv_local % cp and cp % kv_local):
        return (f"ulysses needs the {q_local} query heads per {tp_name} rank divisible by cp={cp} and the "
                f"{kv_local} K/V heads per {tp_name} rank to divide or be divided by it")
    return None


def ep_dpcp_problem(dp: int, cp: int, ep: int) -> bool:
    """Expert parallelism is drawn from the dp×cp ranks: ep must divide dp×cp."""
    return bool((dp * cp) % ep)


def sp_tokens_problem(seq_len: int, cp: int, tp: int) -> bool:
    """Sequence parallelism splits each cp rank's tokens over tp."""
    return bool((seq_len // cp) % tp)


def dp_shard_problem(dp: int, dp_shard: int | None) -> bool:
    """Hybrid sharding's shard groups tile dp: dp_shard divides dp."""
    return dp_shard is not None and (not isinstance(dp_shard, int) or dp_shard < 1 or dp % dp_shard != 0)


def hsdp_zero_problem(hsdp: bool, zero: int) -> bool:
    """Hybrid sharding shards gradients (ZeRO 2) or parameters (ZeRO 3): under ZeRO 0/1 it shards nothing."""
    return hsdp and zero < 2


def heads_tp_problem(n_heads: int, tp: int) -> bool:
    """tp splits the query heads whole: tp divides n_heads."""
    return bool(n_heads % tp)


def layers_pp_problem(n_layers: int, chunks: int, uneven: bool = False) -> bool:
    """Every pipeline chunk (pp×vp of them) holds at least one layer, and as many as the others unless uneven."""
    return n_layers < chunks or bool(n_layers % chunks and not uneven)


def cp_seq_problem(seq_len: int, cp: int) -> bool:
    """Context parallelism splits each sequence evenly over cp."""
    return bool(seq_len % cp)
