"""`shardwise checkpoint`: inspect and convert resharding checkpoints without starting any rank.

`add_parser(subparsers)` registers the subcommand; `run(args)` executes it and returns the exit
status (0 ok, 2 bad input: a missing directory, no intact checkpoint, an existing OUT without --overwrite, or
safetensors not installed; one stderr line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("checkpoint", help="list or convert checkpoints written by `shardwise train`",
                              description="Work with checkpoint directories (root/step-N) in one process.")
    sub = p.add_subparsers(dest="checkpoint_command", required=True)
    c = sub.add_parser("convert", help="consolidate model weights into one file with global names")
    c.add_argument("ckpt_dir", metavar="CKPT_DIR",
                   help="a checkpoint root (its newest intact step is used) or one step-N directory")
    c.add_argument("--to-safetensors", metavar="OUT", required=True, help="output .safetensors file")
    c.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    ls = sub.add_parser("list", help="every step directory under a root, with its integrity")
    ls.add_argument("ckpt_dir", metavar="CKPT_DIR")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from .. import checkpoint as ck

    if args.checkpoint_command == "list":
        if not os.path.isdir(args.ckpt_dir):
            print(f"shardwise checkpoint list: error: {args.ckpt_dir} is not a directory (a checkpoint root, "
                  "e.g. <out>/checkpoints)", file=sys.stderr)
            return 2
        rows = []
        for step, path in ck.list_checkpoints(args.ckpt_dir):
            problems = ck.checkpoint_problems(path)
            rows.append({"step": step, "path": path, "ok": not problems, "problems": problems})
        print(json.dumps(rows, indent=1))
        return 0
    out = args.to_safetensors
    if os.path.exists(out) and not args.overwrite:
        print(f"shardwise checkpoint convert: error: {out} already exists; choose a new file or pass --overwrite "
              "to replace it", file=sys.stderr)
        return 2
    try:
        from safetensors.torch import save_file
    except ImportError:
        print("shardwise checkpoint convert: error: needs the safetensors package (pip install safetensors)",
              file=sys.stderr)
        return 2
    path, skipped = ck.newest_intact(args.ckpt_dir)
    if path is None:
        why = "; ".join(f"{p}: {r}" for p, r in skipped) or "no step-N directories"
        print(f"shardwise checkpoint convert: error: no intact checkpoint under {args.ckpt_dir} ({why})",
              file=sys.stderr)
        return 2
    with open(os.path.join(path, ck.META)) as f:
        step = json.load(f)["step"]
    weights = ck.load_global_tensors(path, "model.")
    save_file(weights, f"{out}.tmp", metadata={"format": "pt", "step": str(step), "source": os.path.abspath(path)})
    os.replace(f"{out}.tmp", out)  # never leave a half-written file under the requested name
    print(f"wrote {len(weights)} tensors (step {step}, global names and shapes) from {path} to {out}")
    return 0
