"""Data: tokenizers, prepare-data (token shards + manifest), and the deterministic loader.

The package imports no torch until the loader is asked for, so config validation (and the
planner through it) can read a prepared directory's manifest without torch.
"""
from .tokenizer import EOS, VOCAB_SIZE, decode, encode

_LOADER = ("Loader", "load_tokens", "default_corpus", "open_data", "TensorSource", "IGNORE_INDEX")


def __getattr__(name):
    if name in _LOADER:
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EOS", "VOCAB_SIZE", "decode", "encode", *_LOADER]
