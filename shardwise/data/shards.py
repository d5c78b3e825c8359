"""Prepared token directories: the writer prepare-data uses and the memory-mapped reader train uses.

A prepared directory holds `tokens-NNNNN.bin` (raw uint16 ids when the vocabulary fits, else
uint32), `mask-NNNNN.bin` beside each for SFT data (uint8, 1 = a completion token the loss counts),
`documents.npy` (int64 start offset of every document in the concatenated stream) and
`manifest.json`. The manifest is written last, and the whole directory is built under a temporary
name and renamed into place, so a directory with a manifest is complete: a crash leaves only the
temporary directory.

Reading maps a shard with numpy.memmap only for the duration of one batch read and copies out the
windows asked for, so the pages a rank touched over a run never accumulate in its RSS; peak RSS per
rank does not grow with the dataset. Checksums are streamed (1 MiB at a time).
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from ..config import ConfigError
from .checksum import sha256_file

FORMAT = "shardwise-tokens/1"
MANIFEST = "manifest.json"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class ShardWriter:
    """Appends token (and loss-mask) arrays to fixed-size shards, hashing as it writes."""

    def __init__(self, folder: str, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens, self.masked = folder, np.dtype(dtype), shard_tokens, False
        self.shards: list[dict] = []
        self.doc_starts: list[np.ndarray] = []
        self.tokens = 0
        self._files = None

    def _open(self) -> None:
        i = len(self.shards)
        self.shards.append({"file": f"tokens-{i:05d}.bin", "tokens": 0})
        self._files = [self._new_file(f"tokens-{i:05d}.bin")]
        if self.masked:
            self._files.append(self._new_file(f"mask-{i:05d}.bin"))

    def _new_file(self, name: str):
        return name, open(os.path.join(self.folder, name), "wb"), hashlib.sha256()

    def _close(self) -> None:
        shard = self.shards[-1]
        for (name, f, h), key in zip(self._files, ("", "mask_")):
            f.close()
            shard[f"{key}file"], shard[f"{key}sha256"] = name, h.hexdigest()
        self._files = None

    def _enable_masks(self) -> None:
        """The first SFT record arrived: every token written so far (plain documents) is counted (mask 1)."""
        self.masked = True
        chunk = np.ones(1 << 20, np.uint8)
        for i, shard in enumerate(self.shards):
            entry = self._new_file(f"mask-{i:05d}.bin")
            for lo in range(0, shard["tokens"], len(chunk)):
                part = chunk[:min(len(chunk), shard["tokens"] - lo)].data
                entry[1].write(part)
                entry[2].update(part)
            if self._files is not None and i == len(self.shards) - 1:
                self._files.append(entry)
            else:
                entry[1].close()
                shard["mask_file"], shard["mask_sha256"] = entry[0], entry[2].hexdigest()

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray, mask: np.ndarray | None) -> None:
        """Append documents given as concatenated tokens (and masks, None = all counted) with their lengths."""
        if mask is not None and not self.masked:
            self._enable_masks()
        if mask is None and self.masked:
            mask = np.ones(len(tokens), np.uint8)
        self.doc_starts.append(self.tokens + np.concatenate(([0], np.cumsum(doc_lengths[:-1]))).astype(np.int64))
        tokens = tokens.astype(self.dtype, copy=False)
        pos = 0
        while pos < len(tokens):
            if self._files is None:
                self._open()
            shard = self.shards[-1]
            take = min(len(tokens) - pos, self.shard_tokens - shard["tokens"])
            parts = [tokens[pos:pos + take]] + ([mask[pos:pos + take]] if self.masked else [])
            for (_, f, h), part in zip(self._files, parts):
                buf = np.ascontiguousarray(part).data
                f.write(buf)
                h.update(buf)
            shard["tokens"] += take
            pos += take
            if shard["tokens"] == self.shard_tokens:
                self._close()
        self.tokens += len(tokens)

    def finish(self, manifest: dict) -> dict:
        """Close the last shard, write the document index, then the manifest (atomically, last)."""
        if self._files is not None:
            self._close()
        starts = np.concatenate(self.doc_starts) if self.doc_starts else np.zeros(0, np.int64)
        np.save(os.path.join(self.folder, "documents.npy"), starts)
        manifest = dict(manifest, format=FORMAT, dtype=self.dtype.name, documents=int(len(starts)),
                        tokens=int(self.tokens), loss_mask=self.masked, shards=self.shards,
                        document_index={"file": "documents.npy",
                                        "sha256": sha256_file(os.path.join(self.folder, "documents.npy"))})
        tmp = os.path.join(self.folder, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, os.path.join(self.folder, MANIFEST))
        return manifest


class ShardUnreadable(ConfigError):
    """A shard checked at the start that a rank can no longer read mid-run (deleted, truncated, unreadable): one
    line naming the file instead of each rank's traceback (`--debug` keeps the original error)."""

    every_rank_alike = False  # only the ranks that read the file know: each says it (under torchrun)


class PreparedData:
    """A prepared directory opened for reading: the manifest checked, shards sized, nothing loaded."""

    def __init__(self, folder: str, debug: bool = False):
        self.folder, self.debug = folder, debug
        path = os.path.join(folder, MANIFEST)
        if not os.path.isfile(path):
            raise ConfigError(f"--data {folder!r} has no {MANIFEST}: not a complete prepared directory "
                              "(shardwise prepare-data writes the manifest last)")
        try:
            with open(path) as f:
                m = json.load(f)
            assert m.get("format") == FORMAT and isinstance(m["shards"], list)
            self.dtype = np.dtype(m["dtype"])
            self.vocab_size, self.eos_id, self.masked = int(m["vocab_size"]), m.get("eos_id"), bool(m["loss_mask"])
            self.n_tokens, self.tokenizer_sha256 = int(m["tokens"]), m["tokenizer_sha256"]
        except (ValueError, KeyError, TypeError, AssertionError):
            raise ConfigError(f"--data {folder!r}: {MANIFEST} is not a complete {FORMAT} manifest; "
                              "prepare the directory again with shardwise prepare-data") from None
        self.manifest = m
        self.shards = m["shards"]
        sizes = np.array([s["tokens"] for s in self.shards], dtype=np.int64)
        if int(sizes.sum()) != self.n_tokens:
            raise ConfigError(f"--data {folder!r}: the manifest's shards hold {int(sizes.sum())} tokens, not "
                              f"{self.n_tokens}; prepare the directory again")
        self.offsets = np.concatenate(([0], np.cumsum(sizes)))
        for s in self.shards:
            for key, width in (("file", self.dtype.itemsize), ("mask_file", 1)):
                if key == "mask_file" and not self.masked:
                    continue
                p = os.path.join(folder, s[key])
                if not os.path.isfile(p) or os.path.getsize(p) != s["tokens"] * width:
                    raise ConfigError(f"--data {folder!r}: shard {s[key]} is missing or not {s['tokens'] * width} "
                                      "bytes as the manifest says; prepare the directory again")

    @property
    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.manifest)

    def verify_checksums(self) -> None:
        """Stream every shard's sha256 against the manifest (constant memory)."""
        files = [(s["file"], s["sha256"]) for s in self.shards]
        files += [(s["mask_file"], s["mask_sha256"]) for s in self.shards if self.masked]
        files.append((self.manifest["document_index"]["file"], self.manifest["document_index"]["sha256"]))
        for name, want in files:
            path = os.path.join(self.folder, name)
            try:
                got = sha256_file(path)
            except OSError as e:
                raise ConfigError(f"--data {self.folder!r}: cannot read {name} ({e.strerror})") from None
            if got != want:
                raise ConfigError(f"--data {self.folder!r}: {name} has sha256 {got[:12]}…, the manifest says "
                                  f"{want[:12]}… (altered or truncated); prepare the directory again")

    def read(self, starts: list[int], length: int, mask: bool = False) -> np.ndarray:
        """[len(starts), length] int64 tokens (or uint8 masks) of the windows at these stream offsets.
        Each shard is mapped for this call only: its pages leave the process with the mapping."""
        out = np.empty((len(starts), length), dtype=np.uint8 if mask else np.int64)
        maps: dict[int, np.memmap] = {}
        for row, start in enumerate(starts):
            pos, end = int(start), int(start) + length
            while pos < end:
                i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
                if i not in maps:
                    maps[i] = self._map(self.shards[i], mask)
                take = min(end, int(self.offsets[i + 1])) - pos
                lo = pos - int(self.offsets[i])
                out[row, pos - start:pos - start + take] = maps[i][lo:lo + take]
                pos += take
        del maps
        return out

    def _map(self, shard: dict, mask: bool) -> np.memmap:
        name = shard["mask_file" if mask else "file"]
        try:
            return np.memmap(os.path.join(self.folder, name), dtype=np.uint8 if mask else self.dtype, mode="r",
                             shape=(shard["tokens"],))
        except (OSError, ValueError) as e:  # ValueError: numpy's word for a file shorter than the manifest says
            if self.debug:
                raise
            why = e.strerror if isinstance(e, OSError) and e.strerror else "shorter than the manifest says"
            raise ShardUnreadable(f"--data {self.folder}: shard {name} can no longer be read ({why}); it was "
                                  "intact when the run started: restore it (or prepare the directory again) and run "
                                  "again (--resume continues from the last checkpoint)") from e


def tokenizer_fingerprint(manifest: dict) -> str:
    """What a prepared directory's tokenizer does (`tokenizer.fingerprint`), from its manifest: recorded by
    prepare-data; for a directory prepared before it was, the recorded tokenizer.json's when that file is
    unchanged, else the file's sha256."""
    from .tokenizer import byte_fingerprint, fingerprint

    if manifest.get("tokenizer_fingerprint"):
        return manifest["tokenizer_fingerprint"]
    if manifest.get("tokenizer_kind") == "byte":
        return byte_fingerprint()
    path = str(manifest.get("tokenizer", ""))
    path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        if sha256_file(path) == manifest.get("tokenizer_sha256"):
            return fingerprint(path)
    except (OSError, ConfigError):
        pass
    return str(manifest.get("tokenizer_sha256"))


def data_sources(spec: str) -> list[tuple[str, float]]:
    """--data of prepared directories: `DIR`, or a blend `a:0.7,b:0.3` → [(dir, weight)]."""
    if os.path.isdir(spec):
        return [(spec, 1.0)]
    out = []
    for part in spec.split(","):
        path, sep, weight = part.rpartition(":")
        try:
            w = float(weight) if sep else None
        except ValueError:
            w = None
        if w is None or not w > 0 or w == float("inf"):
            if "," not in spec and not sep:
                raise ConfigError(f"--data {spec!r}: no such file or directory")
            raise ConfigError(f"--data {spec!r}: {part!r} must be DIR:WEIGHT with a positive weight, "
                              "e.g. --data web:0.7,code:0.3")
        if not os.path.isdir(path):
            raise ConfigError(f"--data {spec!r}: {path!r} is not a prepared directory (blends take "
                              "shardwise prepare-data output)")
        out.append((path, w))
    return out


def data_vocab(spec: str | None) -> tuple[int, str] | None:
    """(vocab size, description) of --data's tokenizer; None for text files and the embedded corpus (bytes)."""
    if spec is None or os.path.isfile(spec):
        return None
    sets = [PreparedData(path) for path, _ in data_sources(spec)]
    best = max(sets, key=lambda d: d.vocab_size)
    return best.vocab_size, f"{best.folder} ({best.manifest.get('tokenizer', '?')})"
