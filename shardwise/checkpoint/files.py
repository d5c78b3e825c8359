"""A checkpoint directory's layout and naming (step-N, tmp-step-N, latest, manifest, meta, per-rank RNG
files), atomic small-file writes, and the integrity check against the manifest's sha256 sums."""
from __future__ import annotations

import base64
import json
import logging
import os
import re

import torch

from ..data.checksum import sha256_file

log = logging.getLogger("shardwise.checkpoint")

FORMAT_VERSION = 1
STATE_KEYS = ("exp_avg", "exp_avg_sq")
MUON_STATE_KEYS = ("momentum",)
"""Muon's state of a hidden matrix (shardwise.optim); AdamW's STATE_KEYS for every other parameter."""
MANIFEST, META, LATEST = "manifest.json", "meta.json", "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
SHARD_OWNER = re.compile(r"^__(\d+)_\d+\.distcp$")
RNG_AXES = ("dp", "pp", "cp", "tp", "ep")


def write_text(path: str, text: str) -> None:
    """Write then rename, so a reader never sees half a file."""
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def write_json(path: str, obj) -> None:
    write_text(path, json.dumps(obj, indent=1, default=str))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def to_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def from_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)



def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Published step directories under `root`, newest first (validity not checked)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := STEP_DIR.match(d))]
    return sorted(found, reverse=True)


def resume_order(root: str) -> list[tuple[int, str]]:
    """The checkpoints a resume tries, in order: the one `latest` names, then older ones (a fallback past a
    damaged one); steps newer than `latest` are not this run's published state and are left out."""
    found = list_checkpoints(root)
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        return found
    for i, (_, path) in enumerate(found):
        if os.path.basename(path) == name:
            return found[i:]
    return found


def checkpoint_problems(path: str, rank: int = 0, world: int = 1, checksum: bool = True) -> list[str]:
    """What is wrong with checkpoint `path`; this rank checks every `world`-th file of the manifest.
    `checksum=False`: presence and sizes only (a died-mid-write save is short or missing a file), which costs
    one stat per file instead of reading terabytes; the loading ranks checksum the files between them."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return [f"no {MANIFEST} (incomplete save)"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"unreadable {MANIFEST}: {e}"]
    if META not in files or ".metadata" not in files:
        return [f"{MANIFEST} lists no {META} or .metadata"]
    out = []
    for name in sorted(files)[rank::world]:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            out.append(f"{name} is missing")
        elif os.path.getsize(full) != files[name]["bytes"]:
            out.append(f"{name} has {os.path.getsize(full)} bytes, manifest says {files[name]['bytes']} (truncated?)")
        elif checksum and sha256_file(full) != files[name]["sha256"]:
            out.append(f"{name} fails its sha256 checksum")
    return out
