"""`--fp8 blockwise` / `mxfp8` on MoE models where a routed expert's token tiles span ranks: under SP each TP rank
routes its own sequence shard, under cp its own part of each sequence, and at ep < dp an expert's tokens sit on dp/ep
ranks. The weight-gradient GEMM's 128- (32-) token tiles of an expert's rows are then taken at the rows' single-device
positions (`expert_parallel.positions`, tag `fp8_positions`), their per-(tile, column) amaxes in a buffer of the
routing's Σ_e ⌈t_e/tile⌉ rows (at most `rules.fp8.token_tile_bound`) max-reduced over edp (and tp under SP), tag
`fp8_tiles` (`fp8.scaling.TokenTiles`).

Checked, fast: the rule (a capacity factor and the shared experts' runs still refused, the rest accepted), the bound
against every routing of a small case, and `quantize_all`'s global tiles on one process against the single device's
cast of each expert's rows in position order (rows shuffled, experts of uneven sizes).

Slow, one 2-rank spawn (fresh seeds): `verify` passes blockwise and mxfp8 on tiny-moe at tp2 with SP, dp2×ep1, cp2
and cp2×ep2, and on the DeepSeek-shaped MLA+MTP MoE at dp2×ep1 (both) and tp2+SP (mxfp8), every cast replayed; it
fails, at the replay's scale-group check on an expert's token tiles, each of tp2+SP blockwise, dp2 mxfp8 and cp2
mxfp8 with the tile all-reduce dropped (each rank's own tile amaxes), and tensorwise at tp2+SP with per-rank amaxes.
One 4-rank spawn: verify passes dp4×ep2 blockwise, dp2×cp2×ep2 mxfp8 and dp2×tp2+SP×ep2 blockwise; one step's
ledger equals the plan per rank (the `fp8_positions` all-gathers; the `edp`/`tp` `fp8_tiles` all-reduces, routing-
sized, in count, within the bound and within 2× of the plan's balanced estimate) at
dp2×tp2+SP blockwise, dp4×ep2 mxfp8 (also under full recompute), dp2×cp2 mxfp8, dp2×pp2 zero-bubble mxfp8 (tiny-moe)
and dp4×ep2 blockwise (DeepSeek-shaped). The planner finds a DeepSeek-V3 layout on 2,048 GPUs under blockwise, and
`simulate` (fake tensors) runs tp2+SP blockwise with memory and traffic as planned.
"""
import dataclasses
import itertools
import math

import pytest
import torch

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.config import training
from shardwise.rules.fp8 import token_tile_bound

from _dist import fresh_seed, run_ranks
from test_mtp import DEEPSEEK_MTP
from test_planner_fp8 import assert_ops_as_planned, one_step

PASS = {  # name: (degrees, recipe, TrainConfig extras)
    "tp2_sp_blockwise": (dict(tp=2, sequence_parallel=True), "blockwise", dict(seq_len=256, micro_batch=1)),
    "dp2_ep1_blockwise": (dict(dp=2), "blockwise", {}),
    "dp2_ep1_mxfp8": (dict(dp=2), "mxfp8", {}),
    "cp2_mxfp8": (dict(cp=2), "mxfp8", dict(seq_len=128)),
    "cp2_blockwise": (dict(cp=2), "blockwise", dict(seq_len=512, micro_batch=1)),
    "deepseek_dp2_blockwise": (dict(dp=2), "blockwise", dict(model=DEEPSEEK_MTP, global_batch=8)),
    "deepseek_dp2_mxfp8": (dict(dp=2), "mxfp8", dict(model=DEEPSEEK_MTP, seq_len=32, global_batch=4)),
    # MLA+MTP under tp2+SP: dimensions whose TP halves keep whole 32-blocks
    "deepseek_tp2_sp_mxfp8": (dict(tp=2, sequence_parallel=True), "mxfp8", dict(
        model=dataclasses.replace(DEEPSEEK_MTP, qk_rope_dim=16, v_head_dim=16, ffn_dim=128))),
    "cp2_ep2_mxfp8": (dict(cp=2, ep=2), "mxfp8", dict(seq_len=128)),  # edp 1: no all-reduce, rows out of order
    "tp2_blockwise": (dict(tp=2), "blockwise", {}),  # no split: each rank's tiles are the single device's
    "dp2_ep2_blockwise": (dict(dp=2, ep=2), "blockwise", {}),
}
SABOTAGED = ("tp2_sp_blockwise", "dp2_ep1_mxfp8", "cp2_mxfp8")
"""Layouts verified again with each rank's own tile amaxes (the all-reduce over edp and tp dropped)."""
PER_SHARD = ("tensorwise", dict(tp=2, sequence_parallel=True))
"""The routed experts' scales over their rows, split over tp under SP, taken on each rank's own rows (their layout
emptied of axes): verify must fail it at the replay's scale-group check on an expert's operand."""


def _cfg(degrees: dict, seed: int, fp8: str = "blockwise", world: int = 2, **extra) -> TrainConfig:
    kw = dict(model="tiny-moe", steps=2, seq_len=64, micro_batch=2, model_overrides={"n_layers": 2}) | extra
    return TrainConfig(parallel=ParallelConfig(**degrees), seed=seed, progress=False, fp8=fp8,
                       warmup_steps=20, lr_decay_steps=200, **kw).resolved(world)


@pytest.mark.parametrize("fp8,degrees,extra,message", [
    ("blockwise", dict(tp=2, sequence_parallel=True), dict(moe_capacity_factor=1.5), "drop --moe-capacity-factor"),
    ("mxfp8", dict(dp=2), dict(moe_capacity_factor=2.0), "drop --moe-capacity-factor"),
    ("blockwise", dict(tp=2, sequence_parallel=True), dict(seq_len=64), "whose 32-token runs of a sequence"),
    ("mxfp8", dict(cp=2), dict(seq_len=32), "whose 8-token runs"),  # one tile a sequence: not a cp cut
    ("blockwise", dict(dp=2, ep=2), dict(seq_len=32, micro_batch=1), "micro_batch × seq_len a multiple of 128"),
])
def test_what_still_cannot_work_is_refused(fp8, degrees, extra, message):
    model = {k: extra.pop(k) for k in list(extra) if k.startswith("moe_")}
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny-moe", parallel=ParallelConfig(**degrees), fp8=fp8, model_overrides=model,
                    **extra).resolved()
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["tp2_sp_blockwise", "dp2_ep1_mxfp8", "cp2_mxfp8", "cp2_blockwise",
                                  "deepseek_dp2_blockwise"])
def test_split_token_tiles_are_accepted(name):
    degrees, fp8, extra = PASS[name]
    _cfg(degrees, 1, fp8, **extra)


def test_the_tile_bound_holds_for_every_routing():
    """token_tile_bound ≥ Σ_e ⌈t_e/tile⌉ over every dropless top-k routing of a few tokens to a few experts, and
    some routing reaches it."""
    for tokens, k, n_experts, local, tile in [(5, 2, 4, 2, 2), (6, 2, 3, 3, 4), (4, 1, 3, 2, 3), (5, 3, 4, 4, 2)]:
        best = 0
        for choice in itertools.product(itertools.combinations(range(n_experts), k), repeat=tokens):
            t = [sum(e in c for c in choice) for e in range(local)]
            best = max(best, sum(math.ceil(x / tile) for x in t))
        assert best == token_tile_bound(tokens, k, local, tile), (tokens, k, n_experts, local, tile, best)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_global_tiles_equal_the_single_devices_cast(recipe):
    """One process: each local expert's rows shuffled (positions say where they belong) cast with `TokenTiles`
    give, row for row, the scales and codes of the single device's cast of the rows in position order."""
    from shardwise.fp8.recipes import recipe as get_recipe
    from shardwise.fp8.scaling import Layout, TokenTiles, quantize_all

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    r = get_recipe(recipe)
    tile = r.g_wgrad.block[0]
    totals = torch.tensor([3 * tile + 5, 0, tile, 2 * tile - 1])
    perms = [torch.randperm(int(n), generator=gen) for n in totals]
    full = [torch.randn(int(n), 24, generator=gen) * torch.rand(int(n), 1, generator=gen) * 10 for n in totals]
    tt = TokenTiles(torch.cat(perms), [int(n) for n in totals], totals, int(totals.max()), 3, ())
    for cast in (r.g_wgrad, r.x_wgrad):
        items = [(x[p].unsqueeze(0), cast, Layout(tiles=(tt, j, "g"))) for j, (x, p) in enumerate(zip(full, perms))]
        ours = quantize_all(items)
        ref = quantize_all([(x.unsqueeze(0), cast, Layout()) for x in full])
        for j, (q, qr, p) in enumerate(zip(ours, ref, perms)):
            where = f"{recipe} expert {j} (seed {seed})"
            torch.testing.assert_close(q.scale_full()[0], qr.scale_full()[0][p], rtol=0, atol=0, msg=where)
            assert torch.equal(q.data[0].float(), qr.data[0][p].float()), where


def _verify_all(seed: int) -> dict:
    """Inside ranks: verify's verdict on every layout, then on the sabotaged ones."""
    from shardwise.verify.main import verify_main

    from shardwise.fp8 import experts as fp8_experts
    from shardwise.fp8 import scaling
    from shardwise.fp8.linear import LinearLayout

    torch.set_num_threads(1)
    out = {name: verify_main(_cfg(degrees, seed, fp8, **extra)) for name, (degrees, fp8, extra) in PASS.items()}
    init = scaling.TokenTiles.__init__

    def own_tiles(self, position, counts, totals, tokens, topk, axes):  # the tile all-reduce dropped
        init(self, position, counts, totals, tokens, topk, ())
    scaling.TokenTiles.__init__ = own_tiles
    try:
        for name in SABOTAGED:
            degrees, fp8, extra = PASS[name]
            out[f"{name}/own_tiles"] = verify_main(_cfg(degrees, seed, fp8, **extra))
    finally:
        scaling.TokenTiles.__init__ = init
    grouped = fp8_experts.fp8_linears  # the routed experts' scales taken on each rank's rows: the wrong group
    fp8_experts.fp8_linears = lambda cfg, *args: grouped(dataclasses.replace(cfg, layout=LinearLayout(seq_global=0)),
                                                         *args)
    return out | {"per_shard": verify_main(_cfg(PER_SHARD[1], seed, PER_SHARD[0]))}


def _expert_scale_group(v: dict) -> bool:
    """Whether verify failed `v` at the replay's scale-group check on a routed expert's operand."""
    why = (v.get("fp8_replay") or {}).get("unexplained") or {}
    return not v["passed"] and why.get("what") == "scale group" and ".experts.w" in why.get("where", "")


@pytest.mark.slow
def test_verify_split_token_tiles():
    seed = fresh_seed()
    out = run_ranks(2, _verify_all, seed, timeout_s=900)[0]
    wrong = [(name, out[name]["fp8_budget"]["ratios"], out[name].get("fp8_replay")) for name in PASS
             if not (out[name]["passed"] and out[name]["coverage"] == 1.0 and len(out[name]["losses"]) == 2
                     and out[name]["fp8_replay"]["own_casts"] == 0)]
    wrong += [(name, "not failed at an expert's tiles", out[name].get("fp8_replay"))
              for name in (*(f"{n}/own_tiles" for n in SABOTAGED), "per_shard") if not _expert_scale_group(out[name])]
    wrong += [(name, "not at the token tiles", out[name]["fp8_replay"]["unexplained"]["where"])
              for name in (f"{n}/own_tiles" for n in SABOTAGED) if "wgrad" not in out[name]["fp8_replay"]["unexplained"]
              .get("where", "")]
    assert not wrong, (seed, wrong)


LEDGER = {  # name: (degrees, recipe, TrainConfig extras) on 4 ranks
    "dp2_tp2_sp_blockwise": (dict(dp=2, tp=2, sequence_parallel=True), "blockwise",
                             dict(seq_len=256, micro_batch=1, global_batch=4)),
    "dp4_ep2_mxfp8": (dict(dp=4, ep=2), "mxfp8", dict(seq_len=32, global_batch=16)),
    "dp2_cp2_mxfp8": (dict(dp=2, cp=2), "mxfp8", dict(seq_len=128, global_batch=8)),
    "deepseek_dp4_ep2_blockwise": (dict(dp=4, ep=2), "blockwise", dict(model=DEEPSEEK_MTP, global_batch=16)),
    # full recompute: the positions again in each recomputed forward; zero-bubble: the tiles with the deferred dW
    "dp4_ep2_full_mxfp8": (dict(dp=4, ep=2, recompute="full"), "mxfp8", dict(seq_len=32, global_batch=16)),
    "dp2_pp2_zb_mxfp8": (dict(dp=2, pp=2, schedule="zb"), "mxfp8", dict(seq_len=32, global_batch=8)),
}


def _ledger_cfg(name: str, seed: int) -> TrainConfig:
    degrees, fp8, extra = LEDGER[name]
    return _cfg(degrees, seed, fp8, 4, **(dict(steps=1) | extra))


VERIFY4 = {  # name: (degrees, recipe, TrainConfig extras) verified on 4 ranks: ep < dp with ep > 1, with cp, with SP
    "dp4_ep2_blockwise": (dict(dp=4, ep=2), "blockwise", {}),
    "dp2_cp2_ep2_mxfp8": (dict(dp=2, cp=2, ep=2), "mxfp8", dict(seq_len=128)),
    "dp2_tp2_sp_ep2_blockwise": (dict(dp=2, tp=2, ep=2, sequence_parallel=True), "blockwise",
                                 dict(seq_len=256, micro_batch=1)),
}


def _four_ranks(seed: int) -> dict:
    """Inside 4 ranks: one step's ledger (with the rank's pp stage) of each LEDGER layout, verify on each VERIFY4."""
    from shardwise.verify.main import verify_main

    torch.set_num_threads(1)
    out = {}
    for name in LEDGER:
        _, mesh, axes = one_step(_ledger_cfg(name, seed))
        out[name] = mesh["pp"].rank, axes
    for name, (degrees, fp8, extra) in VERIFY4.items():
        out[name] = verify_main(_cfg(degrees, seed, fp8, 4, **extra))
    return out


@pytest.fixture(scope="module")
def four_ranks():
    seed = fresh_seed()
    with torch.device("meta"):  # torch's lazy imports once, before forking
        torch.nn.Embedding(2, 2)
    return seed, run_ranks(4, _four_ranks, seed, timeout_s=900)


@pytest.mark.slow
def test_verify_four_ranks(four_ranks):
    seed, runs = four_ranks
    out = runs[0]
    wrong = [(name, out[name]["fp8_budget"]["ratios"], out[name].get("fp8_replay")) for name in VERIFY4
             if not (out[name]["passed"] and out[name]["coverage"] == 1.0
                     and out[name]["fp8_replay"]["own_casts"] == 0)]
    assert not wrong, (seed, wrong)


@pytest.mark.slow
def test_ledger_equals_the_plan(four_ranks):
    """Every op of one step, per rank, as the planner counts it — the position all-gathers included (the routed
    all-to-alls, the position exchange's among them, follow the routing; so do the tile amax all-reduces' bytes)."""
    from shardwise.planner import Cluster, estimate, get_gpu
    from shardwise.planner.layout import from_train_config

    seed, runs = four_ranks
    for name in LEDGER:
        spec, lay, wl = from_train_config(_ledger_cfg(name, seed))
        stages = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)["stages"]
        tiles = "tp" if name.startswith("dp2_tp2") else "edp"
        seen = set()
        for rank, run in enumerate(runs):
            pp, measured = run[name]
            planned = stages[pp]["comm_ops_per_step"]
            where = f"{name} rank {rank} (seed {seed})"
            got = assert_ops_as_planned(measured, planned, where)
            seen |= {op for op in [("dp_cp", "all_gather:fp8_positions")] if op in got}
            m, p = (ops.get(tiles, {}).get("all_reduce:fp8_tiles") for ops in (measured, planned))
            if m or p:  # a stage without routed experts has neither
                assert m and p and m["count"] == p["count"] and p["bytes"] / 2 <= m["bytes"] <= 2 * p["bytes"], \
                    (where, m, p)
                seen.add("tiles")
        assert len(seen) == 2, f"{name}: the tile all-reduce or the position all-gather not measured: {seen}"


@pytest.mark.slow
def test_the_planner_finds_deepseek_v3_under_blockwise(capsys):
    """`shardwise plan --model deepseek-v3 --gpus 2048 --zero 3 --recompute full --fp8 blockwise` finds a layout
    whose experts' token tiles span ranks (cp > 1, SP, or ep < dp×cp; it found dp1024 cp2 ep256, refused before;
    without --zero 3 --recompute full no recipe fits 80 GB): DeepSeek-V3's own recipe on its layouts."""
    import re

    from shardwise.cli import main

    assert main(["plan", "--model", "deepseek-v3", "--gpus", "2048", "--zero", "3", "--recompute", "full", "--fp8",
                 "blockwise", "--top", "1"]) == 0
    best = re.search(r'--explain "([^"]+)"', capsys.readouterr().out)
    lay = dict(kv.split("=") for kv in best.group(1).split(","))
    dp, cp, ep = int(lay["dp"]), int(lay["cp"]), int(lay["ep"])
    assert cp > 1 or lay["sp"] == "true" or ep < dp * cp, lay


@pytest.mark.slow
def test_simulate_split_token_tiles(capsys):
    """`shardwise simulate` (fake tensors, one rank) runs the position exchange (static shapes: no boolean indexing)
    and its memory and traffic match the plan, at tiny-moe tp2+SP blockwise."""
    from test_simulate import _simulate, _within

    rc, report = _simulate(capsys, ["--model", "tiny-moe", "--tp", "2", "--sequence-parallel", "--fp8", "blockwise",
                                    "--seq-len", "256", "--micro-batch", "1"])
    assert rc == 0
    _within(report)
