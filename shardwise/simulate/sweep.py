"""A sweep of `shardwise simulate` over small layouts, in this one process: the planner's live peak, static
and saved-activation bytes and comm bytes against the trace of real steps (the planner's bounds: peak
within 3%, static 1%, activations 2%, comm bytes equal) for every pairing of ZeRO stage, hybrid sharding,
tp/SP, pipeline schedule, cp implementation, ep, recompute (--recompute-layers too) and dtype that the trainer
accepts.

`python -m shardwise.simulate.sweep [NAME ...]` prints one line per layout (all layouts, or those named);
`tests/test_peak_sweep.py` asserts every bound for every layout.
"""
from __future__ import annotations

import copy
import sys
import time

from ..config import ParallelConfig, TrainConfig


def _run(seq_len: int, dtype: str = "fp32", model: str = "tiny", micro_batch: int = 4, microbatches: int | None = None,
         global_batch: int | None = None, **parallel) -> TrainConfig:
    """A `shardwise simulate` run (2 steps): `parallel` are ParallelConfig fields; `microbatches` M sets the global
    batch to M × micro-batch × dp, as the flag does."""
    p = ParallelConfig(**parallel)
    if microbatches is not None:
        global_batch = microbatches * micro_batch * p.dp
    return TrainConfig(model=model, parallel=p, steps=2, seq_len=seq_len, micro_batch=micro_batch,
                       global_batch=global_batch, dtype=dtype)


LAYOUTS: dict[str, TrainConfig] = {
    "dp2-z0": _run(64, micro_batch=2, microbatches=2, dp=2),
    "dp2-z1-bf16": _run(64, dtype="bf16", microbatches=2, dp=2, zero=1),
    "dp4-z2": _run(32, micro_batch=2, microbatches=2, dp=4, zero=2),
    "dp4-z2-bf16-sel": _run(64, dtype="bf16", microbatches=2, dp=4, zero=2, recompute="selective"),
    "dp4-z3": _run(32, micro_batch=2, microbatches=2, dp=4, zero=3),
    "dp4-z3-bf16-full": _run(64, dtype="bf16", microbatches=2, dp=4, zero=3, recompute="full"),
    "dp4-hs2-z2": _run(32, micro_batch=2, microbatches=2, dp=4, dp_shard=2, zero=2),
    "dp4-hs2-z3-bf16": _run(64, dtype="bf16", microbatches=2, dp=4, dp_shard=2, zero=3),
    "dp4-hs1-z3-full": _run(32, micro_batch=2, microbatches=2, dp=4, dp_shard=1, zero=3, recompute="full"),
    "tp2": _run(64, micro_batch=2, microbatches=2, tp=2),
    "tp2-sp-bf16-sel": _run(64, dtype="bf16", microbatches=2, tp=2, recompute="selective", sequence_parallel=True),
    "dp2-tp2-sp-z2": _run(32, micro_batch=2, microbatches=2, dp=2, tp=2, zero=2, sequence_parallel=True),
    "dp2-tp2-z3-bf16-full": _run(64, dtype="bf16", microbatches=2, dp=2, tp=2, zero=3, recompute="full"),
    "dp4-hs2-tp2-sp-z3-bf16": _run(32, dtype="bf16", micro_batch=2, microbatches=2, dp=4, tp=2, dp_shard=2, zero=3,
                                   sequence_parallel=True),
    "pp2-1f1b-z1": _run(64, micro_batch=2, microbatches=4, dp=2, pp=2, zero=1),
    "pp2-1f1b-bf16-full": _run(64, dtype="bf16", microbatches=4, pp=2, recompute="full"),
    "pp2-int-z2": _run(32, micro_batch=2, microbatches=4, dp=2, pp=2, zero=2, schedule="interleaved", vp=2),
    "pp2-int-z3-bf16-sel": _run(64, dtype="bf16", microbatches=4, dp=2, pp=2, zero=3, schedule="interleaved", vp=2,
                                recompute="selective"),
    "pp2-zb-tp2-sp": _run(64, micro_batch=2, microbatches=2, tp=2, pp=2, schedule="zb", sequence_parallel=True),
    "pp2-zb-z3-bf16": _run(32, dtype="bf16", micro_batch=2, microbatches=4, dp=2, pp=2, zero=3, schedule="zb"),
    "pp2-dualpipev-z1-bf16": _run(64, dtype="bf16", microbatches=4, dp=2, pp=2, zero=1, schedule="dualpipev"),
    "pp2-dualpipev-hs1-z2": _run(32, micro_batch=2, microbatches=4, dp=2, pp=2, dp_shard=1, zero=2,
                                 schedule="dualpipev"),
    "pp2-gpipe-sel": _run(64, microbatches=2, pp=2, schedule="gpipe", recompute="selective"),
    "dp4-tp2-sp-pp2-z3": _run(32, micro_batch=2, global_batch=16, dp=4, tp=2, pp=2, zero=3, sequence_parallel=True),
    "dp4-hs2-tp2-sp-pp2-z3": _run(32, micro_batch=2, global_batch=16, dp=4, tp=2, pp=2, dp_shard=2, zero=3,
                                  sequence_parallel=True),
    "dp4-tp2-sp-pp2-z3-full": _run(32, micro_batch=2, global_batch=16, dp=4, tp=2, pp=2, zero=3, recompute="full",
                                   sequence_parallel=True),
    "cp2-ring-dp2-z2": _run(64, micro_batch=2, microbatches=2, dp=2, cp=2, zero=2),
    "cp2-ulysses-bf16-sel": _run(64, dtype="bf16", micro_batch=2, microbatches=2, cp=2, recompute="selective",
                                 cp_impl="ulysses"),
    "cp2-ring-tp2-sp-z3-bf16-full": _run(64, dtype="bf16", microbatches=2, dp=2, tp=2, cp=2, zero=3,
                                         recompute="full", sequence_parallel=True),
    "cp2-ulysses-hs1-z3": _run(64, micro_batch=2, microbatches=2, dp=2, cp=2, dp_shard=1, zero=3,
                               cp_impl="ulysses"),
    "cp2-ring-pp2-zb-bf16": _run(64, dtype="bf16", microbatches=2, pp=2, cp=2, schedule="zb"),
    "moe-ep2": _run(64, model="tiny-moe", micro_batch=2, microbatches=2, dp=2, ep=2),
    "moe-ep2-tp2-sp-z1-bf16-full": _run(32, dtype="bf16", model="tiny-moe", micro_batch=2, microbatches=2, dp=2,
                                        tp=2, ep=2, zero=1, recompute="full", sequence_parallel=True),
    "moe-ep2-z3-bf16-sel": _run(64, dtype="bf16", model="tiny-moe", microbatches=2, dp=4, ep=2, zero=3,
                                recompute="selective"),
    "moe-ep2-pp2-z2": _run(32, model="tiny-moe", micro_batch=2, microbatches=4, dp=2, pp=2, ep=2, zero=2),
    "moe-ep2-cp2-hs1-z3-full": _run(32, model="tiny-moe", micro_batch=2, microbatches=2, dp=2, cp=2, ep=2,
                                    dp_shard=1, zero=3, recompute="full"),
    # --recompute-layers: the first N layers of each chunk recomputed, the rest saved as without recompute
    "pp2-1f1b-bf16-full-rl1": _run(64, dtype="bf16", microbatches=4, pp=2, recompute="full", recompute_layers=1),
    "pp2-int-z3-bf16-full-rl1": _run(64, dtype="bf16", microbatches=4, dp=2, pp=2, zero=3, schedule="interleaved",
                                     vp=2, recompute="full", recompute_layers=1),
    "moe-ep2-tp2-sp-z1-bf16-full-rl1": _run(32, dtype="bf16", model="tiny-moe", micro_batch=2, microbatches=2, dp=2,
                                            tp=2, ep=2, zero=1, recompute="full", sequence_parallel=True,
                                            recompute_layers=1),
    "cp2-ring-sel-rl2-z3": _run(64, micro_batch=2, microbatches=2, dp=2, cp=2, zero=3, recompute="selective",
                                recompute_layers=2),
    # full-size MoE plans: `plan`'s top rows, each with fewer microbatches per step (the same per-microbatch
    # tensors and comm; fewer in flight) and only the distinct stages of RANKS
    "deepseek-v3-2048-1f1b-m4": _run(4096, dtype="bf16", model="deepseek-v3", micro_batch=1, microbatches=4, dp=8,
                                     pp=32, cp=8, ep=8, zero=1, recompute="full",
                                     pp_layers=[2] * 29 + [1] * 3),
    "qwen3-235b-512-1f1b-m2": _run(4096, dtype="bf16", model="qwen3-235b-a22b", micro_batch=1, microbatches=2, dp=32,
                                   tp=2, pp=2, cp=4, ep=128, zero=1, recompute="selective", sequence_parallel=True),
    # bf16 full recompute on a pipeline: each received chunk input saved by its first layer's checkpoint, the rebuilt
    # layer's weight casts through its MLP's backward (tiny pp8 1F1B; and the 70B interleaved last stage, where the
    # LM head's copy is gone by a layer's backward: 0.958 of planned while the planner kept it)
    "pp8-1f1b-bf16-full": _run(64, dtype="bf16", micro_batch=2, microbatches=16, pp=8, recompute="full"),
    "llama3-70b-int-z3-full-s8192": _run(8192, dtype="bf16", model="llama3-70b", micro_batch=1, microbatches=4, dp=16,
                                         tp=8, pp=4, cp=2, zero=3, recompute="full", schedule="interleaved", vp=2,
                                         sequence_parallel=True),
    # full-size 2026 families (shortened steps): Gated DeltaNet's state-map gathers beside a gated-attention ring;
    # gpt-oss's sinks, biases and a contiguous cp 4 ring that stops after two steps in its sliding layers
    "qwen3-next-80b-cp2-tp2-sp-pp4-ep2-z1-bf16": _run(1024, dtype="bf16", model="qwen3-next-80b-a3b", micro_batch=1,
                                                      microbatches=2, cp=2, tp=2, pp=4, ep=2, zero=1,
                                                      sequence_parallel=True),
    "gpt-oss-20b-cp4c-tp2-sp-pp2-ep4-z1-bf16": _run(2048, dtype="bf16", model="gpt-oss-20b", micro_batch=1,
                                                    microbatches=4, cp=4, cp_order="contiguous", tp=2, pp=2, ep=4,
                                                    zero=1, sequence_parallel=True),
    # gpt-oss-120b: the 1F1B row of `plan --model gpt-oss-120b --gpus 64 --global-batch 256` (within 0.01 s of the
    # interleaved rows) run at its full 64 microbatches, which simulate shortens to 3: 128 experts
    # over ep 32, a balanced cp 8 ring whose sliding layers (and their selective recompute) run steps 0, 1 and 7 only
    "gpt-oss-120b-64-cp8-pp2-ep32-z1-bf16-sel": _run(4096, dtype="bf16", model="gpt-oss-120b", micro_batch=1,
                                                     global_batch=256, dp=4, pp=2, cp=8, ep=32, zero=1,
                                                     recompute="selective"),
    # Qwen3.5's MoE hybrid: dp beside cp, 64 of 256 experts per rank, the fp32 chunk rule under bf16 autocast
    "qwen3.5-35b-a3b-dp2-cp2-tp2-sp-pp2-ep4-z1-bf16": _run(512, dtype="bf16", model="qwen3.5-35b-a3b", micro_batch=1,
                                                           microbatches=2, dp=2, cp=2, tp=2, pp=2, ep=4, zero=1,
                                                           sequence_parallel=True),
}
"""Name -> the run `shardwise simulate` checks. Every layout's world is at most 16, but the full-size ones."""

RANKS: dict[str, str] = {
    # the embedding and dense layers, a dense + MoE stage, the largest (two MoE layers), the head with the MTP module
    "deepseek-v3-2048-1f1b-m4": "0,8,16,248",
    "qwen3-235b-512-1f1b-m2": "0",  # the first of two stages of 47 MoE layers (the larger activations)
    "llama3-70b-int-z3-full-s8192": "48",  # the last stage (the head's)
    "pp8-1f1b-bf16-full": "1,6",  # tiny, but 8 stages: the two terms' drift is widest between the first and last
}
"""Layouts that run only some stages: the ranks `simulate` runs (every other layout runs the first rank of each
stage)."""


def ranks_of(name: str) -> str:
    """--ranks of the sweep layout `name`."""
    return RANKS.get(name, "stages")

FIGURES = ("peak_bytes", "static_bytes", "activation_bytes")


def simulate(layout: TrainConfig, ranks: str = "stages") -> dict:
    """`shardwise simulate` of `layout` (a copy: assembling fills it in) with --ranks RANKS in this process:
    its report (`simulate.cli.run`). A layout of `RANKS` passes its own ranks (`ranks_of`)."""
    from ..training.assemble import assemble
    from .cli import check_simulable, choose_ranks, run

    cfg = assemble(copy.deepcopy(layout))
    check_simulable(cfg)
    p = cfg.parallel
    return run(cfg, choose_ranks(ranks, p.world_size, p.pp, p.cp, p.tp), cfg.steps)


def ratios(report: dict) -> list[dict]:
    """Per simulated rank: measured/planned of each figure, whether comm bytes are equal, the peak's phase."""
    out = []
    for r in report["ranks"]:
        row = {k: r[k]["measured"] / r[k]["planned"] if r[k]["planned"] else float("nan") for k in FIGURES}
        row["comm_equal"] = all(v["measured"] == v["planned"] for v in r["comm_bytes"].values())
        row.update(stage=r["stage"], passed=r["passed"], phase=r["peak_phase"], top=r["top_live"])
        out.append(row)
    return out


def main(argv: list[str]) -> int:
    names = argv or list(LAYOUTS)
    failed = 0
    for name in names:
        t0 = time.perf_counter()
        report = simulate(LAYOUTS[name], ranks_of(name))
        cells = []
        for r in ratios(report):
            cells.append(f"s{r['stage']} peak {r['peak_bytes']:.3f} static {r['static_bytes']:.3f} "
                         f"act {r['activation_bytes']:.3f} comm {'=' if r['comm_equal'] else 'DIFF'}"
                         + ("" if r["passed"] else f" FAIL [{r['phase']}: "
                            + "; ".join(f"{t['group']} {t['bytes']}" for t in r["top"]) + "]"))
        failed += not report["passed"]
        print(f"{name:32} {time.perf_counter() - t0:5.1f}s  " + " | ".join(cells), flush=True)
    print(f"{len(names) - failed}/{len(names)} layouts within bounds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
