"""One file's sha256, streamed: what manifests record for shards, tokenizers and checkpoint files."""
from __future__ import annotations

import hashlib


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
