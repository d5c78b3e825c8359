"""Tokenizers for prepare-data: shardwise's byte tokenizer, or any Hugging Face fast tokenizer.

A Hugging Face tokenizer is read with the `tokenizers` library (the `tokenizer.json` every fast HF
tokenizer ships), so no `transformers` is needed. Documents are encoded without the tokenizer's own
special tokens; prepare-data appends one end-of-document id per document instead, so document
boundaries are the EOS ids (what document masking reads) whatever the model family.

Two tokenizers are the same when they turn text into the same ids: `fingerprint` hashes a canonical form of
what decides that (the model's vocabulary, merges and options, the normalizer, the pre-tokenizer and the added
tokens), not the file's bytes, so one BPE saved raw by `tokenizers` and through transformers' `save_pretrained`
is one tokenizer. The post-processor and decoder are left out: shardwise encodes without special tokens, and
decoding does not change what an id means. The byte tokenizer's fingerprint is that of its tokenizer.json
equivalent (what hf-export writes), so a model exported from a byte-level run takes byte-level data.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np

from ..config import ConfigError
from .checksum import sha256_file

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

    @property
    def fingerprint(self) -> str:
        return byte_fingerprint()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json (alone, or inside a Hugging Face model directory)."""

    kind = "tokenizers"

    def __init__(self, source: str, json_path: str, no_eos: bool, flag: str = "--tokenizer"):
        import tokenizers

        self.source, self.json_path = source, json_path
        try:
            self.tok = tokenizers.Tokenizer.from_file(json_path)
        except Exception as e:  # the Rust side raises plain Exceptions for unparsable files
            raise ConfigError(f"{flag} {source!r}: {json_path} is not a readable tokenizer.json "
                              f"({str(e).splitlines()[0][:120]})") from None
        self.sha256 = sha256_file(json_path)
        self.fingerprint = _fingerprint_of(self.tok)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = None if no_eos else self._find_eos(source, flag)

    def _find_eos(self, source: str, flag: str) -> int:
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
        raise ConfigError(f"{flag} {source!r} names no eos token (no tokenizer_config.json eos_token, no "
                          f"special {' / '.join(_EOS_NAMES)}); pass --no-eos to pack documents without one")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]


BYTE_EOS_TOKEN = "<|endoftext|>"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer_json():
    """The byte tokenizer as a `tokenizers.Tokenizer`: a byte-level BPE without merges whose ids 0–255 are the
    UTF-8 bytes, and <|endoftext|> (256) the end of a document."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True)])
    return tok


@functools.cache
def byte_fingerprint() -> str:
    return _fingerprint_of(byte_tokenizer_json())


def _strip_offsets(node):
    """Drop what only moves character offsets (`trim_offsets`): it never changes an id."""
    if isinstance(node, dict):
        return {k: _strip_offsets(v) for k, v in node.items() if k != "trim_offsets"}
    if isinstance(node, list):
        return [_strip_offsets(v) for v in node]
    return node


def canonical_form(tok) -> dict:
    """What decides a `tokenizers.Tokenizer`'s ids, in one form whatever wrote the file: the library's own
    serialisation (defaults filled in), merges as [left, right] pairs (older files write "left right"), added
    tokens in id order, offsets-only options dropped."""
    d = json.loads(tok.to_str())
    model = dict(d["model"])
    if isinstance(model.get("merges"), list):
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    added = sorted(d.get("added_tokens") or [], key=lambda t: t["id"])
    return _strip_offsets({"model": model, "normalizer": d.get("normalizer"), "pre_tokenizer": d.get("pre_tokenizer"),
                           "added_tokens": added})


def _fingerprint_of(tok) -> str:
    text = json.dumps(canonical_form(tok), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(json_path: str) -> str:
    """The fingerprint of a tokenizer.json (OSError / ConfigError when it cannot be read)."""
    return HFTokenizer(json_path, json_path, no_eos=True).fingerprint


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def load_tokenizer(spec: str, no_eos: bool = False, flag: str = "--tokenizer"):
    """`byte`, a tokenizer.json file, or a directory holding one (a Hugging Face model directory); `flag` is the
    option errors name."""
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec):
        path = os.path.join(spec, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{flag} {spec!r}: the directory has no tokenizer.json (a Hugging Face fast "
                              "tokenizer); valid: byte, a tokenizer.json, or a model directory holding one")
        return HFTokenizer(spec, path, no_eos, flag)
    if os.path.isfile(spec):
        return HFTokenizer(spec, spec, no_eos, flag)
    raise ConfigError(f"{flag} {spec!r} is unknown; valid: byte, a tokenizer.json file, or a Hugging Face "
                      "model directory holding tokenizer.json")
