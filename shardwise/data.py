"""Byte-level tokenizer and a deterministic loader over one token stream.

The default corpus is CPython's own documentation (`pydoc_data.topics`, ~465 KB, in every Python
install), so training needs no download. Sample i of step k is a window of seq_len+1 tokens at a
position drawn from a permutation seeded by (seed, epoch): every layout sees the same global batch
for the same step, dp ranks take disjoint slices of it, TP/CP ranks of one dp rank the same slice.
"""
from __future__ import annotations

import os

import torch

from .config import ConfigError

EOS = 256
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def default_corpus() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[k] + "\0" for k in sorted(topics))


def load_tokens(path: str | None) -> torch.Tensor:
    """Token ids of the corpus: documents separated by EOS. Missing or empty files are config errors."""
    if path is None:
        docs = default_corpus().split("\0")
    else:
        if not os.path.isfile(path):
            raise ConfigError(f"--data {path!r}: no such file")
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


class Loader:
    """Deterministic windows: `global_batch(step)` → (inputs, targets) of shape [G, seq_len]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int):
        if tokens.numel() < seq_len + 2:
            raise ConfigError(f"corpus has {tokens.numel()} tokens, fewer than --seq-len {seq_len} + 2")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.n_windows = (tokens.numel() - 1) // seq_len
        self._perm_epoch, self._perm = -1, None

    def _starts(self, step: int) -> torch.Tensor:
        idx = torch.arange(step * self.global_batch, (step + 1) * self.global_batch)
        out = torch.empty_like(idx)
        for epoch in idx.div(self.n_windows, rounding_mode="floor").unique().tolist():
            if epoch != self._perm_epoch:
                gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perm, self._perm_epoch = torch.randperm(self.n_windows, generator=gen), epoch
            sel = idx.div(self.n_windows, rounding_mode="floor") == epoch
            out[sel] = self._perm[idx[sel] % self.n_windows] * self.seq_len
        return out

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._starts(step)
        win = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
        return win[:, :-1], win[:, 1:]
