"""Deterministic global batches over a token stream: in memory (a text file, the embedded corpus) or
memory-mapped prepared directories, alone or blended by weight.

The Loader is a pure function of the step: sample i of step k is global sample n = k·G + i; a blend
sends n to a source (and to a position inside that source) by a closed formula, and the source's
position picks a window through a keyed pseudo-random permutation of its windows, one per epoch.
Nothing about the data position is stateful, so a checkpoint's step *is* the data position:
`--resume` continues bitwise, and a resharded run (any layout, same --global-batch) sees the same
global batches. The permutation is evaluated pointwise (a Feistel network with cycle walking), so
no rank ever holds a table the size of the dataset; a rank reads only its own rows' windows.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..config import ConfigError
from .shards import PreparedData, data_sources
from .tokenizer import EOS, encode

IGNORE_INDEX = -100
_M64 = (1 << 64) - 1


def default_corpus() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[k] + "\0" for k in sorted(topics))


def load_tokens(path: str | None) -> torch.Tensor:
    """Byte ids of a text file (one document) or of the embedded corpus, documents separated by EOS."""
    if path is None:
        docs = default_corpus().split("\0")
    else:
        if not os.path.isfile(path):
            raise ConfigError(f"--data {path!r}: no such file")
        if path.endswith((".jsonl", ".jsonl.gz", ".parquet")):  # read raw, their bytes would train as text
            raise ConfigError(f"--data {path!r}: a file is read as plain UTF-8 text; run `shardwise prepare-data "
                              f"{path} --out DIR` and train with --data DIR")
        with open(path, "rb") as f:
            raw = f.read()
        if not raw.strip():
            raise ConfigError(f"--data {path!r} is empty; give a text file with at least one document")
        docs = [raw.decode("utf-8", errors="replace")]
    ids: list[int] = []
    for d in docs:
        if d:
            ids.extend(encode(d))
            ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


class TensorSource:
    """An in-memory token stream (text files, the embedded corpus, tests)."""

    masked, eos_id = False, EOS

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens.reshape(-1).cpu().numpy()
        self.n_tokens = len(self.tokens)

    def read(self, starts, length: int, mask: bool = False) -> np.ndarray:
        return np.stack([self.tokens[s:s + length] for s in starts]).astype(np.int64)


def open_data(spec: str | None, verify: bool = False, debug: bool = False) -> tuple[list, list[float]]:
    """--data → (sources, weights). `verify` streams every prepared shard's sha256 (the launcher does
    this once before ranks start; ranks only check the manifest and the shard sizes). `debug` (--debug): a shard
    unreadable mid-run keeps its original error."""
    if spec is None or os.path.isfile(spec):
        return [TensorSource(load_tokens(spec))], [1.0]
    sources, weights = [], []
    for path, w in data_sources(spec):
        src = PreparedData(path, debug)
        if verify:
            src.verify_checksums()
        sources.append(src)
        weights.append(w)
    if len({s.tokenizer_fingerprint for s in sources}) > 1:
        raise ConfigError(f"--data {spec!r} blends directories prepared with different tokenizers; "
                          "prepare them all with the same --tokenizer")
    if len({s.eos_id for s in sources}) > 1:  # one stream's documents would run into each other's
        ids = ", ".join(f"{s.folder}: {'none (--no-eos)' if s.eos_id is None else s.eos_id}" for s in sources)
        raise ConfigError(f"--data {spec!r} blends directories with different end-of-document ids ({ids}); "
                          "prepare them all with --no-eos or all without it")
    return sources, weights


def _splitmix(x):
    """splitmix64's finaliser: a well-mixed 64-bit hash (numpy uint64 arrays or Python ints)."""
    if isinstance(x, int):
        x = (x + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return x ^ (x >> 31)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(idx: np.ndarray, n: int, key: int) -> np.ndarray:
    """A keyed pseudo-random bijection of [0, n), applied to `idx`: a 4-round Feistel network on the
    smallest even-bit power of two ≥ n, with cycle walking back into [0, n)."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, low = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = [np.uint64(_splitmix(key * 4 + r)) for r in range(4)]
    out = idx.astype(np.uint64)
    todo = np.ones(len(out), dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> half, x & low
        for k in keys:
            left, right = right, left ^ (_splitmix(right ^ k) & low)
        out[todo] = (left << half) | right
        todo = out >= np.uint64(n)
    return out.astype(np.int64)


def blend_assign(idx: np.ndarray, weights: list[float], theta: float) -> tuple[np.ndarray, np.ndarray]:
    """Global sample indices → (source, index within that source). Level j takes a Sturmian share
    w_j / (w_j + … + w_last) of the stream left by earlier levels: of the first c samples of that
    stream, floor(c·w + θ) go to source j, so every source's share is exact to within one sample at
    every prefix, its indices count up 0, 1, 2, … in order, and both are closed formulas of idx."""
    src = np.full(len(idx), len(weights) - 1, dtype=np.int64)
    local = idx.astype(np.int64).copy()
    pending = np.ones(len(idx), dtype=bool)
    for j in range(len(weights) - 1):
        w = weights[j] / sum(weights[j:])
        c = local[pending]
        before = np.floor(c * w + theta).astype(np.int64)
        mine = np.floor((c + 1) * w + theta).astype(np.int64) > before
        rows = np.flatnonzero(pending)
        src[rows[mine]] = j
        local[rows] = np.where(mine, before, c - before)
        pending[rows[mine]] = False
    return src, local


class Loader:
    """`batch_at(step, lo, hi)` → rows lo:hi of the step's global batch (inputs, targets) [hi-lo, seq_len];
    targets are IGNORE_INDEX where a loss mask (SFT prompts) excludes them."""

    def __init__(self, data, seq_len: int, global_batch: int, seed: int):
        if isinstance(data, torch.Tensor):
            data = ([TensorSource(data)], [1.0])
        self.sources, weights = data
        total = sum(weights)
        self.weights = [w / total for w in weights]
        for s in self.sources:
            if s.n_tokens < seq_len + 2:
                where = f" ({s.folder})" if hasattr(s, "folder") else ""
                raise ConfigError(f"corpus{where} has {s.n_tokens} tokens, fewer than --seq-len {seq_len} + 2")
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.n_windows_per_source = [(s.n_tokens - 1) // seq_len for s in self.sources]
        self.eos_id = self.sources[0].eos_id  # document boundaries (None: prepared with --no-eos)
        self.theta = _splitmix(seed & _M64) / 2.0 ** 64

    def _rows(self, step: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window start) of rows lo:hi of the step's global batch."""
        idx = np.arange(step * self.global_batch + lo, step * self.global_batch + hi, dtype=np.int64)
        src, local = blend_assign(idx, self.weights, self.theta)
        starts = np.empty(len(idx), dtype=np.int64)
        for j, n in enumerate(self.n_windows_per_source):
            sel = src == j
            starts[sel] = self._windows(j, local[sel], n) * self.seq_len
        return src, starts

    def _windows(self, j: int, local: np.ndarray, n: int) -> np.ndarray:
        """Window index of source j's samples number `local` (of its n windows): a keyed permutation per epoch."""
        out = np.empty_like(local)
        for epoch in np.unique(local // n).tolist():
            e = local // n == epoch
            out[e] = permute(local[e] % n, n, (self.seed * 7919 + epoch) * 31 + j)
        return out

    def _starts(self, step: int) -> torch.Tensor:
        return torch.from_numpy(self._rows(step, 0, self.global_batch)[1])

    def batch_at(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reads only these rows' windows (seq_len + 1 tokens each)."""
        src, starts = self._rows(step, lo, hi)
        win = np.empty((hi - lo, self.seq_len + 1), dtype=np.int64)
        counted = np.ones((hi - lo, self.seq_len), dtype=bool)
        for j, s in enumerate(self.sources):
            sel = np.flatnonzero(src == j)
            if len(sel):
                win[sel] = s.read(starts[sel].tolist(), self.seq_len + 1)
                if s.masked:  # targets are tokens 1..S of the window: their mask decides
                    counted[sel] = s.read(starts[sel].tolist(), self.seq_len + 1, mask=True)[:, 1:].astype(bool)
        y = np.where(counted, win[:, 1:], IGNORE_INDEX)
        return torch.from_numpy(win[:, :-1].copy()), torch.from_numpy(y)

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch_at(step, 0, self.global_batch)

    def count_targets(self, step: int) -> int:
        """Non-ignored targets of the whole global batch (the loss denominator on every rank). Without
        loss masks it is G·S; with them each rank reads the 1-byte masks of every row of the step (not
        the tokens), so the denominator needs no collective."""
        if not any(s.masked for s in self.sources):
            return self.global_batch * self.seq_len
        src, starts = self._rows(step, 0, self.global_batch)
        n = 0
        for j, s in enumerate(self.sources):
            sel = np.flatnonzero(src == j)
            if not len(sel):
                continue
            if s.masked:
                n += int(s.read(starts[sel].tolist(), self.seq_len + 1, mask=True)[:, 1:].sum(dtype=np.int64))
            else:
                n += len(sel) * self.seq_len
        if n == 0:  # the loss would be 0/0: a NaN step blamed on the model
            raise ConfigError(f"step {step}: no target of the global batch's {self.global_batch} windows counts "
                              "toward the loss (every one is a masked prompt token); raise --global-batch or "
                              "--seq-len, or prepare the data without prompts this long")
        return n
