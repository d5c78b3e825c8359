"""Tokenizers for prepare-data: shardwise's byte tokenizer, or any Hugging Face fast tokenizer.

A Hugging Face tokenizer is read with the `tokenizers` library (the `tokenizer.json` every fast HF
tokenizer ships), so no `transformers` is needed. Documents are encoded without the tokenizer's own
special tokens; prepare-data appends one end-of-document id per document instead, so document
boundaries are the EOS ids (what document masking reads) whatever the model family.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from ..config import ConfigError
from .shards import sha256_file

EOS = 256
VOCAB_SIZE = 257
# Names of end-of-text tokens, tried (in order) when no tokenizer_config.json names one.
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes (ids 0–255) plus the end-of-document id 256: shardwise's default."""

    kind, source, vocab_size, eos_id = "byte", "byte", VOCAB_SIZE, EOS
    sha256 = hashlib.sha256(b"shardwise byte tokenizer: utf-8 bytes 0-255, eos 256").hexdigest()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json (alone, or inside a Hugging Face model directory)."""

    kind = "tokenizers"

    def __init__(self, source: str, json_path: str, no_eos: bool):
        import tokenizers

        self.source, self.json_path = source, json_path
        try:
            self.tok = tokenizers.Tokenizer.from_file(json_path)
        except Exception as e:  # the Rust side raises plain Exceptions for unparsable files
            raise ConfigError(f"--tokenizer {source!r}: {json_path} is not a readable tokenizer.json "
                              f"({str(e).splitlines()[0][:120]})") from None
        self.sha256 = sha256_file(json_path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = None if no_eos else self._find_eos(source)

    def _find_eos(self, source: str) -> int:
        """The eos token named by tokenizer_config.json / special_tokens_map.json / config.json beside
        the tokenizer.json, else a special token with a conventional end-of-text name."""
        folder = os.path.dirname(os.path.abspath(self.json_path))
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            tok = _read_json(os.path.join(folder, name)).get("eos_token")
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str) and self.tok.token_to_id(tok) is not None:
                return self.tok.token_to_id(tok)
        eos = _read_json(os.path.join(folder, "config.json")).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and 0 <= eos < self.vocab_size:
            return eos
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        for name in _EOS_NAMES:
            if name in special:
                return self.tok.token_to_id(name)
        raise ConfigError(f"--tokenizer {source!r} names no eos token (no tokenizer_config.json eos_token, no "
                          f"special {' / '.join(_EOS_NAMES)}); pass --no-eos to pack documents without one")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def load_tokenizer(spec: str, no_eos: bool = False):
    """`byte`, a tokenizer.json file, or a directory holding one (a Hugging Face model directory)."""
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec):
        path = os.path.join(spec, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--tokenizer {spec!r}: the directory has no tokenizer.json (a Hugging Face fast "
                              "tokenizer); valid: byte, a tokenizer.json, or a model directory holding one")
        return HFTokenizer(spec, path, no_eos)
    if os.path.isfile(spec):
        return HFTokenizer(spec, spec, no_eos)
    raise ConfigError(f"--tokenizer {spec!r} is unknown; valid: byte, a tokenizer.json file, or a Hugging Face "
                      "model directory holding tokenizer.json")
