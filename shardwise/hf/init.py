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
from ..data.tokenizer import ByteTokenizer, load_tokenizer
from .weights import WeightFiles, tensor_source
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


def check_init_from_hf(path: str, cfg: ModelConfig, data_vocab: int, data_tokenizer_sha256: str | None = None, *,
                       data_tokenizer: dict | None = None, allow_tokenizer_mismatch: bool = False,
                       mtp_init: str = "checkpoint") -> dict:
    """Before any rank starts: the weights match config.json (shapes from the safetensors headers only),
    the tokenizer's ids and the training data's ids (`data_vocab` = largest id + 1) fit the model's
    vocabulary, and data prepared with a tokenizer.json used the checkpoint's (ids of another tokenizer
    fit the vocabulary and silently mean other tokens; byte-level data is allowed) unless
    `allow_tokenizer_mismatch`. `data_tokenizer` is the data manifest's {"tokenizer", "vocab_size"} (names it
    in the error). The MTP modules' tensors must be in the checkpoint unless `mtp_init` is "fresh" (then
    none is read). ConfigError otherwise; returns `init_record(path)`."""
    from ..parallelize import plain_model

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
    data_name = (data_tokenizer or {}).get("tokenizer") or "another tokenizer"
    if tok is not None and data_tokenizer_sha256 not in (None, ByteTokenizer.sha256, tok["sha256"]) \
            and not allow_tokenizer_mismatch:
        raise ConfigError(f"--data was prepared with a tokenizer whose sha256 is {data_tokenizer_sha256[:12]}… "
                          f"({data_name}), not --init-from-hf's {tok['file']} ({tok['sha256'][:12]}…): its ids mean "
                          f"other tokens to the model; prepare it with --tokenizer {path}, or pass "
                          "--allow-tokenizer-mismatch")
    data_ids = (data_tokenizer or {}).get("vocab_size")
    if tok is None and data_tokenizer_sha256 not in (None, ByteTokenizer.sha256) and data_ids is not None \
            and int(data_ids) != cfg.vocab_size and not allow_tokenizer_mismatch:
        raise ConfigError(f"--data was prepared with {data_name} ({data_ids} ids), but --init-from-hf {path} has no "
                          f"tokenizer.json and a vocabulary of {cfg.vocab_size}: another tokenizer's ids mean other "
                          f"tokens to the model; prepare the data with the model's tokenizer, or pass "
                          "--allow-tokenizer-mismatch")
    if data_vocab > cfg.vocab_size:
        raise ConfigError(f"--data: token ids up to {data_vocab - 1} exceed the vocab_size={cfg.vocab_size} of "
                          f"--init-from-hf {path}; tokenize the data with the model's tokenizer")
    return record
