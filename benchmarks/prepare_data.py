"""`shardwise prepare-data` against a plain `tokenizers` loop over the same input.

Input: a JSON-lines corpus built from CPython's embedded documentation (`pydoc_data.topics`, one
topic per document), repeated to --mb megabytes of text. Tokenizer: a byte-level BPE trained here on
the corpus (--vocab ids), or --tokenizer PATH (a tokenizer.json or HF model directory).

  * peer — read the file line by line, `json.loads`, and `Tokenizer.encode_batch` every batch of
    documents (the same batches prepare-data makes), keeping each document's `.ids`: the least any
    tool must do to get token ids out of this input;
  * shardwise — `prepare_data(...)` in-process with --workers 1 (reading, tokenizing, writing uint16
    shards with their sha256, the document index and the manifest), and with --workers 2.

Repetitions rotate the order; each figure is a median over repetitions: `medians_s` of wall time,
`cpu_medians_s` of CPU time (this process's threads plus reaped worker processes), which a busy
shared machine disturbs less; `paired_*` are medians of the per-repetition ratios (a repetition's
runs see the same background load). Target: ratio ≤ 1.1.

    python benchmarks/prepare_data.py --mb 20 --reps 5
Last stdout line: one JSON object {"medians_s": ..., "ratios": ..., "config": ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shardwise.data.loader import default_corpus  # noqa: E402
from shardwise.data.prepare import BATCH_CHARS, prepare_data  # noqa: E402


def build_corpus(folder: str, mb: float) -> tuple[str, list[str]]:
    docs = [d for d in default_corpus().split("\0") if d]
    path = os.path.join(folder, "corpus.jsonl")
    written = 0
    with open(path, "w") as f:
        while written < mb * 2**20:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
                written += len(d)
    return path, docs


def train_bpe(folder: str, docs: list[str], vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = os.path.join(folder, "tok")
    os.makedirs(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    return out


def peer(path: str, tok_dir: str) -> int:
    """The plain loop: json.loads and encode_batch over the same batches; returns the token count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json") if os.path.isdir(tok_dir) else tok_dir)
    n, batch, chars = 0, [], 0
    with open(path) as f:
        for line in f:
            text = json.loads(line)["text"]
            batch.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS:
                n += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
                batch, chars = [], 0
    if batch:
        n += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
    return n


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


SMOKE = {"mb": 0.05, "reps": 1, "vocab": 512}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20.0, help="megabytes of text")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json or HF model dir (default: train a BPE)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    work = tempfile.mkdtemp(prefix="sw-prep-")
    try:
        path, docs = build_corpus(work, args.mb)
        tok = args.tokenizer or train_bpe(work, docs, args.vocab)
        runs = {
            "tokenizers_encode_batch": lambda: peer(path, tok),
            "shardwise": lambda: prepare_data([path], tok, os.path.join(work, "out"), progress=False)["tokens"],
            "shardwise_workers2": lambda: prepare_data([path], tok, os.path.join(work, "out"), workers=2,
                                                       progress=False)["tokens"],
        }
        times = {k: [] for k in runs}
        cpu = {k: [] for k in runs}
        tokens = {}
        names = list(runs)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)
                c0, t0 = _cpu(), time.perf_counter()
                tokens[name] = runs[name]()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(_cpu() - c0)
            print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), file=sys.stderr)
        med = {k: statistics.median(v) for k, v in times.items()}
        cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
        ours = ("shardwise", "shardwise_workers2")
        print(json.dumps({
            "medians_s": med, "cpu_medians_s": cpu_med,
            "ratios": {k: med[k] / med["tokenizers_encode_batch"] for k in ours},
            "cpu_ratios": {k: cpu_med[k] / cpu_med["tokenizers_encode_batch"] for k in ours},
            "paired_ratios": {k: statistics.median(a / b for a, b in zip(times[k], times["tokenizers_encode_batch"]))
                              for k in ours},
            "paired_cpu_ratios": {k: statistics.median(a / b for a, b in zip(cpu[k], cpu["tokenizers_encode_batch"]))
                                  for k in ours},
            "config": {"mb": args.mb, "reps": args.reps, "tokenizer": args.tokenizer or f"bpe-{args.vocab}",
                       "tokens_peer": tokens["tokenizers_encode_batch"], "tokens_shardwise": tokens["shardwise"],
                       "documents_eos": tokens["shardwise"] - tokens["tokenizers_encode_batch"],
                       "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
        }))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
