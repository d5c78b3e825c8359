"""The tokenizer half of `hf-export`: which tokenizer a run trained with, its files in the exported folder, and
bos/eos/pad ids in config.json and generation_config.json that agree with the data's end-of-document id.

A run records its tokenizer in every checkpoint (`tokenizer_record`, in the checkpoint's extra_state): the
`--data` directory's tokenizer when it was prepared with a tokenizer.json, else the `--init-from-hf`
folder's, else shardwise's byte tokenizer — which is written as an equivalent byte-level tokenizer.json
(ids 0–255 are the UTF-8 bytes, 256 the end of a document), so `AutoTokenizer` reads every export.
"""
from __future__ import annotations

import json
import os
import shutil

from ..config import ConfigError

_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_record(data: str | None, init_from_hf: str | None, eos_id: int | None = None) -> dict:
    """{"source": a tokenizer.json path or "byte", "eos_id": the data's end-of-document id or None}."""
    from ..data import open_data
    from ..data.tokenizer import EOS

    sources, _ = open_data(data)
    first = sources[0]
    manifest = getattr(first, "manifest", None)
    data_eos = first.eos_id if manifest is not None else EOS
    eos = data_eos if eos_id is None else eos_id
    if manifest is not None and manifest.get("tokenizer_kind") == "tokenizers":
        return {"source": _json_path(manifest["tokenizer"]), "eos_id": eos}
    if init_from_hf and os.path.isfile(os.path.join(init_from_hf, "tokenizer.json")):
        # byte-level data on an HF model: the model's own tokenizer, with its own end-of-text id
        return {"source": os.path.abspath(os.path.join(init_from_hf, "tokenizer.json")), "eos_id": None}
    return {"source": "byte", "eos_id": eos}


def _json_path(spec: str) -> str:
    return os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec


def record_from_run_dir(ckpt_root: str) -> dict | None:
    """For checkpoints written before the record existed: the run directory's config.json beside them."""
    path = os.path.join(os.path.dirname(os.path.abspath(ckpt_root.rstrip("/"))), "config.json")
    try:
        with open(path) as f:
            train = json.load(f)["train"]
    except (OSError, ValueError, KeyError):
        return None
    try:
        return tokenizer_record(train.get("data"), train.get("init_from_hf"), train.get("eos_id"))
    except (ConfigError, OSError):
        return None


def _run_source(ckpt_root: str) -> str | None:
    """The --init-from-hf directory of the run whose checkpoints are under `ckpt_root` (its run directory's
    config.json: the recorded absolute path, else the flag as given), or None."""
    path = os.path.join(os.path.dirname(os.path.abspath(ckpt_root.rstrip("/"))), "config.json")
    try:
        with open(path) as f:
            run = json.load(f)
        return (run.get("init_from_hf") or {}).get("path") or run["train"].get("init_from_hf")
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def _source_type(ckpt_root: str) -> tuple[str, str | None]:
    """(the run's --init-from-hf directory, '' for none; its model_type, None when there is none or it is gone)."""
    from .config import read_hf_config

    source = _run_source(ckpt_root)
    if not source:
        return "", None
    try:
        return source, read_hf_config(source).get("model_type", "")
    except ConfigError:
        return source, None


def text_source(ckpt_root: str) -> tuple[str | None, str]:
    """(the Hugging Face text checkpoint the run started from, whose config.json the export keeps, or None; what the
    export writes of it, in words, '' for none or a multimodal one — `multimodal_source` says those)."""
    from .config import MULTIMODAL

    source, mt = _source_type(ckpt_root)
    if mt is None:
        return None, source and f"config.json from the model alone: the run's --init-from-hf {source} is gone"
    if mt in MULTIMODAL:
        return None, ""
    return source, f"{source}'s config.json, only the fields the run changed rewritten"


def multimodal_source(ckpt_root: str) -> tuple[str | None, str]:
    """(the Qwen3.5 multimodal checkpoint the run started from, or None; what the export writes of it, in words,
    '' for a run that started from no such checkpoint).

    Read from the run directory's config.json beside the checkpoints. Such a run is written back into that
    checkpoint's layout, its vision tower kept; when it is no longer there, the text model alone, saying so."""
    from .config import MULTIMODAL

    source, mt = _source_type(ckpt_root)
    if mt is None:
        return None, source and (f"the text model: the run's --init-from-hf {source} is gone, so its vision tower "
                                 "is not included")
    if mt not in MULTIMODAL:
        return None, ""
    return source, f"the trained language model in {source}'s multimodal layout, its vision tower copied"


def record_from_flag(spec: str) -> dict:
    """`hf-export --tokenizer SPEC`: byte, a tokenizer.json or a folder holding one; its own eos id."""
    from ..data.tokenizer import load_tokenizer

    tok = load_tokenizer(spec)
    return {"source": "byte" if tok.kind == "byte" else os.path.abspath(tok.json_path), "eos_id": tok.eos_id}


def _write_byte_tokenizer(out_dir: str) -> None:
    from ..data.tokenizer import byte_tokenizer_json

    byte_tokenizer_json().save(os.path.join(out_dir, "tokenizer.json"))


def _token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def write_tokenizer(out_dir: str, record: dict, max_len: int, vocab_size: int) -> dict:
    """tokenizer.json and tokenizer_config.json (+ special_tokens_map.json when the source has one) in `out_dir`;
    returns {"bos_token_id", "eos_token_id", "pad_token_id"} (None where there is none)."""
    from tokenizers import Tokenizer

    src = record["source"]
    config: dict = {}
    if src == "byte":
        _write_byte_tokenizer(out_dir)
    else:
        if not os.path.isfile(src):
            raise ConfigError(f"export: the run's tokenizer {src} no longer exists; pass --tokenizer DIR")
        shutil.copyfile(src, os.path.join(out_dir, "tokenizer.json"))
        folder = os.path.dirname(src)
        for name in _TOKENIZER_SIDE_FILES:
            if os.path.isfile(os.path.join(folder, name)):
                shutil.copyfile(os.path.join(folder, name), os.path.join(out_dir, name))
        try:
            with open(os.path.join(folder, "tokenizer_config.json")) as f:
                config = json.load(f)
        except (OSError, ValueError):
            config = {}
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ConfigError(f"export: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, more than "
                          f"the model's vocab_size={vocab_size}; pass --tokenizer with the run's tokenizer")

    def token_id(name):
        t = _token(config.get(name))
        return None if t is None else tok.token_to_id(t)

    eos = record.get("eos_id")
    if eos is None:
        eos = token_id("eos_token")
    if eos is None and src == "byte":
        eos = 256
    bos = token_id("bos_token")
    pad = token_id("pad_token")
    bos = eos if bos is None else bos  # no BOS: every document of the data follows an end-of-document id
    pad = eos if pad is None else pad
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config["model_max_length"] = max_len
    for name, i in (("eos_token", eos), ("bos_token", bos), ("pad_token", pad)):
        if i is not None:
            config[name] = tok.id_to_token(i)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def write_generation_config(out_dir: str, ids: dict) -> None:
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}, f, indent=1)


def prepare_out_dir(out_dir: str, overwrite: bool) -> None:
    """A non-empty folder (perhaps the source model's) is refused unless --overwrite, which removes the weights
    and tokenizer files an earlier model left there (sharded weights would otherwise shadow the new ones)."""
    if not os.path.isdir(out_dir) or not os.listdir(out_dir):
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise ConfigError(f"export: {out_dir} exists and is not a directory")
        return
    if not overwrite:
        raise ConfigError(f"export: {out_dir} is not empty; choose a new folder or pass --overwrite to replace "
                          "the model in it")
    for name in os.listdir(out_dir):
        if name.endswith((".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")) or \
                name in ("tokenizer.json", "generation_config.json", "tokenizer.model", *_TOKENIZER_SIDE_FILES):
            os.remove(os.path.join(out_dir, name))
