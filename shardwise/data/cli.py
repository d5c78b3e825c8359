"""`shardwise prepare-data INPUT... --tokenizer T --out DIR`."""
from __future__ import annotations

import argparse
import sys

from ..config import ConfigError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("prepare-data", help="tokenize text / JSON lines / Parquet into token shards for train",
                              description="Tokenize documents into token shards, a document index and a manifest "
                                          "(written last, atomically) that `train --data DIR` reads.")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help=".txt (one document each), .jsonl / .jsonl.gz, .parquet files, directories or globs")
    p.add_argument("--tokenizer", default="byte",
                   help="byte (default), a tokenizer.json, or a Hugging Face model directory holding one")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument("--text-key", default="text",
                   help="JSON key / Parquet column of the text (records with prompt + completion are SFT)")
    p.add_argument("--format", default="text", metavar="{text,chat}",
                   help="text (default): a text key, or prompt + completion records (SFT); chat: records with a "
                        "'messages' list of {role, content}, rendered by the tokenizer's chat template, the loss on the "
                        "assistant's tokens only")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (1: in this process)")
    p.add_argument("--no-eos", action="store_true", help="do not append the end-of-document id to each document")
    p.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard file")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, else a line every 30 s)")
    p.add_argument("--glob", action="append", default=None, metavar="PATTERN",
                   help="read every file whose name matches PATTERN (e.g. '*.py', repeatable) as plain text, one "
                        "document per file; in directories only matching files are taken")
    p.add_argument("--debug", action="store_true",
                   help="show the full traceback of a filesystem failure (full disk, read-only) instead of its one line")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from .prepare import prepare_data

    try:
        m = prepare_data(args.inputs, args.tokenizer, args.out, args.text_key, args.workers, args.no_eos,
                         args.shard_tokens, progress=not args.no_progress, globs=args.glob, fmt=args.format,
                         debug=args.debug)
    except ConfigError as e:
        print(f"shardwise prepare-data: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {m['documents']} documents, {m['tokens']} tokens ({m['dtype']}, vocab "
          f"{m['vocab_size']}, {len(m['shards'])} shard(s){', loss masks' if m['loss_mask'] else ''})")
    return 0
