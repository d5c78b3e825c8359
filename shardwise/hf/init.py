"""`train --init-from-hf DIR`: fine-tuning a Hugging Face checkpoint on any layout.

The model is the checkpoint's config.json (a preset or a contradicting shape flag is refused); before
any rank starts the weights' shapes (safetensors headers only), the tokenizer's vocabulary and the
training data's ids are checked against it; the Trainer then fills every rank's slices with
`hf.load_hf_into` before it builds the optimizer (so ZeRO's flat buffers start from them). What the
run started from, tokenizer included, is recorded in the run's config.json.

A multimodal checkpoint (Qwen3.5's `*ForConditionalGeneration`) is read as its language model
(`hf_multimodal.py`): every language-model tensor is trained, the vision tower and MTP drafter are named in one
line and left out.
"""
from __future__ import annotations

import os
import re

import torch

from ..config import ConfigError, ModelConfig
from ..data.tokenizer import load_tokenizer
from .weights import WeightFiles, check_weight_files, need_safetensors, tensor_source
from .multimodal import aside_line


def not_trained_line(path: str) -> str | None:
    """The one line `train` prints for a multimodal checkpoint: what of it is neither loaded nor trained."""
    files = WeightFiles(path)
    if files.view is None:
        return None
    return (f"--init-from-hf {path} is multimodal: its language model is trained; {aside_line(files.aside)} "
            "are neither loaded nor trained")


def init_record(path: str) -> dict:
    """What a fine-tune started from (config.json's `init_from_hf`): the directory, its weight files and its
    tokenizer (tokenizer.json through the `tokenizers` library: vocabulary size and sha256), if it has one."""
    try:
        files = WeightFiles(path)
    except (FileNotFoundError, ValueError) as e:  # no weights; a multimodal tensor of no known part
        raise ConfigError(f"--init-from-hf {e}") from None
    record = {"path": os.path.abspath(path), "weight_files": sorted({os.path.basename(f) for f in files.where.values()}),
              "tokenizer": None}
    if files.view is not None:  # a multimodal checkpoint: what of it is not trained
        record["not_trained"] = {part: len(names) for part, names in files.aside.items()}
    tok = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tok):
        try:
            t = load_tokenizer(tok, no_eos=True)
        except ConfigError as e:
            raise ConfigError(f"--init-from-hf {path}: {e}") from None
        record["tokenizer"] = {"file": tok, "vocab_size": t.vocab_size, "sha256": t.sha256}
    return record


_PREPARE = "shardwise prepare-data FILES --tokenizer {} --out DIR"


def check_data_tokenizer(path: str, manifest: dict, init_tokenizer: str | None = None) -> None:
    """Prepared data's ids mean the model's tokens only when its tokenizer does what the model's does
    (`tokenizer.fingerprint`: vocabulary, merges, normalizer, pre-tokenizer, added tokens; not the file's
    bytes). The model's tokenizer is `path`'s tokenizer.json, else the one `--init-tokenizer` names: a checkpoint
    without one cannot be checked, so the user says which. Byte-level data (prepare-data's default, what a user
    forgets to change) is refused like any other. ConfigError naming both tokenizers and the fix."""
    from ..data.shards import tokenizer_fingerprint

    own = os.path.join(path, "tokenizer.json")
    data_name = "prepare-data's default byte tokenizer" if manifest.get("tokenizer_kind") == "byte" \
        else f"another tokenizer ({manifest.get('tokenizer')})"
    fix = f"prepare it with `{_PREPARE.format(path)}`, or pass --allow-tokenizer-mismatch"
    if os.path.isfile(own):
        model_tok, model_name = own, f"--init-from-hf's {own}"
    elif init_tokenizer is None:
        raise ConfigError(f"--init-from-hf {path} has no tokenizer.json, so the tokenizer --data was prepared with "
                          f"({manifest.get('tokenizer')}) cannot be checked against the model's: name the model's "
                          "tokenizer with --init-tokenizer SPEC (byte, a tokenizer.json or a folder holding one), or "
                          "pass --allow-tokenizer-mismatch")
    else:
        model_tok, model_name = init_tokenizer, f"--init-tokenizer {init_tokenizer}"
        fix = f"prepare it with `{_PREPARE.format(init_tokenizer)}`, or pass --allow-tokenizer-mismatch"
    model = load_tokenizer(model_tok, no_eos=True, flag="--init-from-hf" if model_tok == own else "--init-tokenizer")
    if init_tokenizer is not None and model_tok == own:
        named = load_tokenizer(init_tokenizer, no_eos=True, flag="--init-tokenizer")
        if named.fingerprint != model.fingerprint:
            raise ConfigError(f"--init-tokenizer {init_tokenizer} is not --init-from-hf's own {own}; drop "
                              "--init-tokenizer (it names the tokenizer of a checkpoint that has none)")
    if tokenizer_fingerprint(manifest) != model.fingerprint:
        raise ConfigError(f"--data was prepared with {data_name}, not {model_name}: its ids mean other tokens to "
                          f"the model; {fix}")


def check_init_from_hf(path: str, cfg: ModelConfig, data_vocab: int, data_tokenizer_sha256: str | None = None, *,
                       data_tokenizer: dict | None = None, allow_tokenizer_mismatch: bool = False,
                       mtp_init: str = "checkpoint", init_tokenizer: str | None = None) -> dict:
    """Before any rank starts: the weights match config.json (shapes from the safetensors headers only),
    the tokenizer's ids and the training data's ids (`data_vocab` = largest id + 1) fit the model's
    vocabulary, and prepared data (`data_tokenizer`: its manifest) was tokenized by the model's tokenizer
    (`check_data_tokenizer`) unless `allow_tokenizer_mismatch`. The MTP modules' tensors must be in the
    checkpoint unless `mtp_init` is "fresh" (then none is read). ConfigError otherwise; returns
    `init_record(path)`. (`data_tokenizer_sha256` is read from the manifest now; kept for callers.)"""
    from ..parallelize import plain_model

    need_safetensors(f"--init-from-hf {path}")
    check_weight_files(path, "--init-from-hf")
    record = init_record(path)
    files = WeightFiles(path)
    with torch.device("meta"):
        expected = dict(plain_model(cfg).named_parameters())
    read = set()
    for name, p in expected.items():
        if name.startswith("mtp.") and mtp_init == "fresh":
            continue
        try:
            src = tensor_source(name, cfg, files)
        except KeyError as e:
            if name.startswith("mtp."):
                missing = re.search(r"'([^']+)'", e.args[0])
                raise ConfigError(f"--init-from-hf {path} has no weights for the {cfg.mtp_layers} MTP module(s) of "
                                  f"--mtp-layers {cfg.mtp_layers} (no tensor {missing.group(0) if missing else repr(name)}"
                                  "; transformers' save_pretrained does not write them): pass --mtp-init fresh to "
                                  "initialise them as in training from scratch") from None
            raise ConfigError(f"--init-from-hf {e.args[0]}") from None
        if tuple(src.shape) != tuple(p.shape):
            raise ConfigError(f"--init-from-hf {path}: {src.names[0]} has shape {tuple(src.shape)}, but its "
                              f"config.json makes {name} {tuple(p.shape)}")
        read.update(src.names)
    if files.view is not None:  # every tensor of a multimodal checkpoint's language model is trained
        unread = sorted(files.view[n] for n in files.view if n not in read
                        and not (n == "lm_head.weight" and cfg.tie_embeddings))
        if unread:
            raise ConfigError(f"--init-from-hf {path}: the language model's {unread[0]!r} (and {len(unread) - 1} "
                              "more) would not be trained: its config.json describes another model than its weights")
    tok = record["tokenizer"]
    if tok is not None and tok["vocab_size"] > cfg.vocab_size:
        raise ConfigError(f"--init-from-hf {tok['file']}: the tokenizer has {tok['vocab_size']} ids, more than the "
                          f"model's vocab_size={cfg.vocab_size}")
    if data_tokenizer and not allow_tokenizer_mismatch:
        check_data_tokenizer(path, data_tokenizer, init_tokenizer)
    if data_vocab > cfg.vocab_size:
        raise ConfigError(f"--data: token ids up to {data_vocab - 1} exceed the vocab_size={cfg.vocab_size} of "
                          f"--init-from-hf {path}; tokenize the data with the model's tokenizer")
    return record
