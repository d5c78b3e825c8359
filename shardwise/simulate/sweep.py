"""A sweep of `shardwise simulate` over small layouts, in this one process: the planner's live peak, static
and saved-activation bytes and comm bytes against the trace of real steps (issue 20: peak within 3%, static
1%, activations 2%, comm bytes equal) for every pairing of ZeRO stage, hybrid sharding, tp/SP, pipeline
schedule, cp implementation, ep, recompute and dtype that the trainer accepts.

`python -m shardwise.simulate.sweep [NAME ...]` prints one line per layout (all layouts, or those named);
`tests/test_peak_sweep.py` asserts every bound for every layout.
"""
from __future__ import annotations

import sys
import time

S32 = ["--seq-len", "32"]
S64 = ["--seq-len", "64"]
BF = ["--dtype", "bf16"]

LAYOUTS: dict[str, list[str]] = {
    # data parallel, every ZeRO stage, fp32 and bf16
    "dp2-z0": S64 + ["--dp", "2", "--micro-batch", "2", "--microbatches", "2"],
    "dp2-z1-bf16": S64 + BF + ["--dp", "2", "--zero", "1", "--microbatches", "2"],
    "dp4-z2": S32 + ["--dp", "4", "--zero", "2", "--micro-batch", "2", "--microbatches", "2"],
    "dp4-z2-bf16-sel": S64 + BF + ["--dp", "4", "--zero", "2", "--recompute", "selective", "--microbatches", "2"],
    "dp4-z3": S32 + ["--dp", "4", "--zero", "3", "--micro-batch", "2", "--microbatches", "2"],
    "dp4-z3-bf16-full": S64 + BF + ["--dp", "4", "--zero", "3", "--recompute", "full", "--microbatches", "2"],
    # hybrid sharding
    "dp4-hs2-z2": S32 + ["--dp", "4", "--dp-shard", "2", "--zero", "2", "--micro-batch", "2", "--microbatches", "2"],
    "dp4-hs2-z3-bf16": S64 + BF + ["--dp", "4", "--dp-shard", "2", "--zero", "3", "--microbatches", "2"],
    "dp4-hs1-z3-full": S32 + ["--dp", "4", "--dp-shard", "1", "--zero", "3", "--recompute", "full",
                              "--micro-batch", "2", "--microbatches", "2"],
    # tensor parallel with and without SP
    "tp2": S64 + ["--tp", "2", "--micro-batch", "2", "--microbatches", "2"],
    "tp2-sp-bf16-sel": S64 + BF + ["--tp", "2", "--sequence-parallel", "--recompute", "selective",
                                   "--microbatches", "2"],
    "dp2-tp2-sp-z2": S32 + ["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero", "2", "--micro-batch", "2",
                            "--microbatches", "2"],
    "dp2-tp2-z3-bf16-full": S64 + BF + ["--dp", "2", "--tp", "2", "--zero", "3", "--recompute", "full",
                                        "--microbatches", "2"],
    "dp4-hs2-tp2-sp-z3-bf16": S32 + BF + ["--dp", "4", "--dp-shard", "2", "--tp", "2", "--sequence-parallel",
                                          "--zero", "3", "--micro-batch", "2", "--microbatches", "2"],
    # pipeline schedules
    "pp2-1f1b-z1": S64 + ["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batch", "2", "--microbatches", "4"],
    "pp2-1f1b-bf16-full": S64 + BF + ["--pp", "2", "--recompute", "full", "--microbatches", "4"],
    "pp2-int-z2": S32 + ["--dp", "2", "--pp", "2", "--schedule", "interleaved", "--vp", "2", "--zero", "2",
                         "--micro-batch", "2", "--microbatches", "4"],
    "pp2-int-z3-bf16-sel": S64 + BF + ["--dp", "2", "--pp", "2", "--schedule", "interleaved", "--vp", "2",
                                       "--zero", "3", "--recompute", "selective", "--microbatches", "4"],
    "pp2-zb-tp2-sp": S64 + ["--pp", "2", "--schedule", "zb", "--tp", "2", "--sequence-parallel",
                            "--micro-batch", "2", "--microbatches", "2"],
    "pp2-zb-z3-bf16": S32 + BF + ["--dp", "2", "--pp", "2", "--schedule", "zb", "--zero", "3",
                                  "--micro-batch", "2", "--microbatches", "4"],
    "pp2-dualpipev-z1-bf16": S64 + BF + ["--dp", "2", "--pp", "2", "--schedule", "dualpipev", "--zero", "1",
                                         "--microbatches", "4"],
    "pp2-dualpipev-hs1-z2": S32 + ["--dp", "2", "--dp-shard", "1", "--pp", "2", "--schedule", "dualpipev",
                                   "--zero", "2", "--micro-batch", "2", "--microbatches", "4"],
    "pp2-gpipe-sel": S64 + ["--pp", "2", "--schedule", "gpipe", "--recompute", "selective", "--microbatches", "2"],
    # the lead's layout, and with hybrid sharding and full recompute
    "dp4-tp2-sp-pp2-z3": S32 + ["--dp", "4", "--zero", "3", "--tp", "2", "--sequence-parallel", "--pp", "2",
                                "--micro-batch", "2", "--global-batch", "16"],
    "dp4-hs2-tp2-sp-pp2-z3": S32 + ["--dp", "4", "--dp-shard", "2", "--zero", "3", "--tp", "2",
                                    "--sequence-parallel", "--pp", "2", "--micro-batch", "2", "--global-batch", "16"],
    "dp4-tp2-sp-pp2-z3-full": S32 + ["--dp", "4", "--zero", "3", "--tp", "2", "--sequence-parallel", "--pp", "2",
                                     "--recompute", "full", "--micro-batch", "2", "--global-batch", "16"],
    # context parallel
    "cp2-ring-dp2-z2": S64 + ["--cp", "2", "--dp", "2", "--zero", "2", "--micro-batch", "2", "--microbatches", "2"],
    "cp2-ulysses-bf16-sel": S64 + BF + ["--cp", "2", "--cp-impl", "ulysses", "--recompute", "selective",
                                        "--micro-batch", "2", "--microbatches", "2"],
    "cp2-ring-tp2-sp-z3-bf16-full": S64 + BF + ["--cp", "2", "--dp", "2", "--tp", "2", "--sequence-parallel",
                                                "--zero", "3", "--recompute", "full", "--microbatches", "2"],
    "cp2-ulysses-hs1-z3": S64 + ["--cp", "2", "--cp-impl", "ulysses", "--dp", "2", "--dp-shard", "1",
                                 "--zero", "3", "--micro-batch", "2", "--microbatches", "2"],
    "cp2-ring-pp2-zb-bf16": S64 + BF + ["--cp", "2", "--pp", "2", "--schedule", "zb", "--microbatches", "2"],
    # mixture of experts
    "moe-ep2": S64 + ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--micro-batch", "2", "--microbatches", "2"],
    "moe-ep2-tp2-sp-z1-bf16-full": S32 + BF + ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--tp", "2",
                                               "--sequence-parallel", "--zero", "1", "--recompute", "full",
                                               "--micro-batch", "2", "--microbatches", "2"],
    "moe-ep2-z3-bf16-sel": S64 + BF + ["--model", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "3",
                                       "--recompute", "selective", "--microbatches", "2"],
    "moe-ep2-pp2-z2": S32 + ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--pp", "2", "--zero", "2",
                             "--micro-batch", "2", "--microbatches", "4"],
    "moe-ep2-cp2-hs1-z3-full": S32 + ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--cp", "2",
                                      "--dp-shard", "1", "--zero", "3", "--recompute", "full",
                                      "--micro-batch", "2", "--microbatches", "2"],
}
"""Name -> `shardwise simulate` flags. Every layout's world is at most 16."""

FIGURES = ("peak_bytes", "static_bytes", "activation_bytes")


def simulate(flags: list[str], ranks: str = "stages") -> dict:
    """`shardwise simulate FLAGS --ranks RANKS` in this process: its report (`simulate.cli.run`)."""
    from ..cli import build_parser, config_from_args
    from .cli import check_simulable, choose_ranks, run

    args = build_parser().parse_args(["simulate", *flags, "--ranks", ranks])
    cfg = config_from_args(args, None)
    check_simulable(cfg)
    p = cfg.parallel
    return run(cfg, choose_ranks(args.ranks, p.world_size, p.pp, p.cp, p.tp), cfg.steps)


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
        report = simulate(LAYOUTS[name])
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
