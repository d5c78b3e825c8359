"""Peak RSS of a rank reading prepared token shards: a 1 GB token set against a 10 MB one.

Two prepared directories of random uint16 tokens (written with prepare-data's ShardWriter, so they
carry real shards, checksums, a document index and a manifest) and, for each, two fresh processes:

  * train — `shardwise train --data DIR --dp 1` (one rank, in the process): the launcher's streamed
    sha256 check of every shard, then --steps training steps;
  * sweep — the same checks, then a Loader reading one dp rank's rows (1/--dp of each global batch)
    for --sweep-steps steps, touching windows all over the set.

Reported: each process's peak RSS (ru_maxrss) and the 1 GB − 10 MB difference (target < 100 MB).

    python benchmarks/loader_rss.py
Last stdout line: one JSON object {"medians_s": ..., "ratios": ..., "rss_mb": ..., "config": ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from shardwise.data.shards import ShardWriter  # noqa: E402

SMOKE = {"big_mb": 2, "small_mb": 1, "steps": 1, "sweep_steps": 10, "seq_len": 32}

CHILD = r"""
import json, resource, sys, time
mode, data, out, steps, seq, dp = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
t0 = time.perf_counter()
if mode == "train":
    from shardwise.cli import main
    rc = main(["train", "--dp", "1", "--steps", str(steps), "--seq-len", str(seq), "--micro-batch", "8",
               "--data", data, "--out", out, "--no-progress", "--no-report"])
    assert rc == 0
else:
    from shardwise.data import Loader, open_data
    loader = Loader(open_data(data, verify=True), seq, 8 * dp, 0)
    for step in range(steps):
        loader.batch_at(step, 0, 8)
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "seconds": time.perf_counter() - t0}))
"""


def make_set(folder: str, n_tokens: int, vocab: int = 4096) -> None:
    os.makedirs(folder)
    w = ShardWriter(folder, "uint16", 1 << 27)
    rng = np.random.default_rng(0)
    chunk = 1 << 24
    for lo in range(0, n_tokens, chunk):
        toks = rng.integers(0, vocab, size=min(chunk, n_tokens - lo), dtype=np.uint16)
        w.add(toks, np.array([len(toks)]), None)
    w.finish({"tokenizer_kind": "synthetic", "tokenizer_sha256": "0" * 64, "vocab_size": vocab, "eos_id": None})


def measure(mode: str, data: str, out: str, steps: int, seq: int, dp: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", CHILD, mode, data, out, str(steps), str(seq), str(dp)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-mb", type=float, default=1024)
    ap.add_argument("--small-mb", type=float, default=10)
    ap.add_argument("--steps", type=int, default=5, help="training steps (train mode)")
    ap.add_argument("--sweep-steps", type=int, default=2000, help="loader steps (sweep mode)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dp", type=int, default=8, help="sweep: the rank reads 8 of 8·dp rows per step")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    work = tempfile.mkdtemp(prefix="sw-rss-")
    try:
        sizes = {"small": args.small_mb, "big": args.big_mb}
        results, build_s = {}, {}
        for name, mb in sizes.items():
            t0 = time.perf_counter()
            make_set(os.path.join(work, name), int(mb * 2**20) // 2)
            build_s[name] = time.perf_counter() - t0
        for mode, steps in (("train", args.steps), ("sweep", args.sweep_steps)):
            for name in sizes:
                r = measure(mode, os.path.join(work, name), os.path.join(work, f"run-{mode}-{name}"), steps,
                            args.seq_len, args.dp)
                results[f"{mode}_{name}"] = r
                print(f"{mode} {name}: peak RSS {r['maxrss_kb'] / 1024:.1f} MB in {r['seconds']:.1f}s", file=sys.stderr)
        rss = {k: v["maxrss_kb"] / 1024 for k, v in results.items()}
        print(json.dumps({
            "medians_s": {k: v["seconds"] for k, v in results.items()},
            "ratios": {f"{m}_rss_big_over_small": rss[f"{m}_big"] / rss[f"{m}_small"] for m in ("train", "sweep")},
            "rss_mb": rss,
            "rss_difference_mb": {m: rss[f"{m}_big"] - rss[f"{m}_small"] for m in ("train", "sweep")},
            "config": vars(args) | {"build_s": build_s, "tokens_touched_sweep": args.sweep_steps * 8 * (args.seq_len + 1),
                                    "loadavg_1m": os.getloadavg()[0]},
        }))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
