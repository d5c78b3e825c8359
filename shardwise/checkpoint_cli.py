"""`shardwise checkpoint`: inspect and convert resharding checkpoints without starting any rank.

`add_parser(subparsers)` registers the subcommand; `run(args)` executes it and returns the exit
status (0 ok, 2 bad input: no intact checkpoint, or safetensors not installed; one stderr line).
"""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("checkpoint", help="list or convert checkpoints written by `shardwise train`",
                              description="Work with checkpoint directories (root/step-N) in one process.")
    sub = p.add_subparsers(dest="checkpoint_command", required=True)
    c = sub.add_parser("convert", help="consolidate model weights into one file with global names")
    c.add_argument("ckpt_dir", metavar="CKPT_DIR", help="a checkpoint root (newest intact step is used) or a step-N dir")
    c.add_argument("--to-safetensors", metavar="OUT", required=True, help="output .safetensors file")
    ls = sub.add_parser("list", help="every step directory under a root, with its integrity")
    ls.add_argument("ckpt_dir", metavar="CKPT_DIR")
    p.set_defaults(func=run, run=run)
    return p


def run(args) -> int:
    from . import checkpoint as ck

    if args.checkpoint_command == "list":
        rows = []
        for step, path in ck.list_checkpoints(args.ckpt_dir):
            problems = ck.checkpoint_problems(path)
            rows.append({"step": step, "path": path, "ok": not problems, "problems": problems})
        print(json.dumps(rows, indent=1))
        return 0
    try:
        import safetensors  # noqa: F401
    except ImportError:
        print("shardwise checkpoint convert: error: needs the safetensors package (pip install safetensors)",
              file=sys.stderr)
        return 2
    try:
        path, n = ck.to_safetensors(args.ckpt_dir, args.to_safetensors)
    except (FileNotFoundError, KeyError, ValueError) as e:
        print(f"shardwise checkpoint convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} tensors from {path} to {args.to_safetensors}")
    return 0
