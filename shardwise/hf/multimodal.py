"""A multimodal checkpoint's language model read as a text-only checkpoint (the published Qwen3.5 ones).

`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` store the language model under
`model.language_model.*` (its `lm_head.weight` at the top), beside the vision tower `model.visual.*` and, in the
released checkpoints, the MTP drafter `mtp.*`. `text_view` names every tensor as the text-only class
(`Qwen3_5ForCausalLM`) would, so the rest of `hf.py` reads it like any causal LM; the vision tower and MTP are set
aside and counted (shardwise models neither). A tensor that is none of these is refused rather than guessed at: a
language-model tensor must never be dropped silently. Names only, torch-free, but for the export's copy of the vision
tower (`into_multimodal`).
"""
from __future__ import annotations

LANGUAGE_MODEL = "model.language_model."
TEXT = "model."
# Parts of a multimodal checkpoint shardwise does not train, by name prefix.
NOT_TRAINED = {"model.visual.": "vision tower", "mtp.": "MTP drafter"}


def is_multimodal(names) -> bool:
    """Whether a checkpoint's tensor names are a multimodal model's (its language model nested)."""
    return any(n.startswith(LANGUAGE_MODEL) for n in names)


def text_view(names, where: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({text-only name: stored name} for the language model, {part: its stored names} for what is set aside).

    ValueError naming the tensor for one that belongs to no known part."""
    view, aside = {}, {part: [] for part in NOT_TRAINED.values()}
    for n in names:
        if n.startswith(LANGUAGE_MODEL):
            view[TEXT + n[len(LANGUAGE_MODEL):]] = n
        elif n == "lm_head.weight":
            view[n] = n
        else:
            part = next((p for prefix, p in NOT_TRAINED.items() if n.startswith(prefix)), None)
            if part is None:
                parts = " nor the ".join(f"{p} ({x}*)" for x, p in NOT_TRAINED.items())
                raise ValueError(f"{where}: tensor {n!r} is neither the language model's ({LANGUAGE_MODEL}*, "
                                 f"lm_head.weight) nor the {parts}; refusing to guess what it is")
            aside[part].append(n)
    return view, {p: ns for p, ns in aside.items() if ns}


def stored_name(name: str, view: dict[str, str] | None) -> str:
    """The name a text-only tensor name has in the files (also one they lack, for the error that names it)."""
    if view is None:
        return name
    if name in view:
        return view[name]
    return LANGUAGE_MODEL + name[len(TEXT):] if name.startswith(TEXT) else name


def aside_line(aside: dict[str, list[str]]) -> str:
    """'the vision tower (model.visual.*, 333 tensors) and the MTP drafter (mtp.*, 15 tensors)'."""
    prefix = {p: x for x, p in NOT_TRAINED.items()}
    return " and ".join(f"the {p} ({prefix[p]}*, {len(ns)} tensors)" for p, ns in aside.items()) or "nothing"


# ---------------------------------------------------------------- export
def multimodal_config(source: str, cfg) -> dict:
    """config.json of the multimodal checkpoint `source` for a fine-tune of its language model `cfg`: the source's
    own (vision tower, token ids), its weights now fp32; ConfigError when `cfg` is not that language model."""
    import dataclasses

    from ..config import ConfigError
    from .config import MULTIMODAL, TRAINING_ONLY, config_from_hf, read_hf_config

    config = read_hf_config(source)
    if config.get("model_type") not in MULTIMODAL:
        raise ConfigError(f"export: {source} is not a multimodal Qwen3.5 checkpoint (model_type="
                          f"{config.get('model_type')!r}; valid: {', '.join(MULTIMODAL)})")
    theirs = config_from_hf(source)
    same = dataclasses.replace(theirs, **{k: getattr(cfg, k) for k in TRAINING_ONLY})
    if same != cfg:
        differ = [f.name for f in dataclasses.fields(cfg) if getattr(same, f.name) != getattr(cfg, f.name)]
        raise ConfigError(f"export: the model differs from {source}'s language model in {', '.join(differ)}; "
                          "it cannot be written into that checkpoint")
    config = dict(config, text_config=dict(config["text_config"]), dtype="float32")  # export writes fp32
    for c in (config, config["text_config"]):
        c.update({k: "float32" for k in ("dtype", "torch_dtype") if k in c})
    return config


def into_multimodal(tensors: dict, files) -> dict:
    """The text-only export's tensors (Qwen3_5ForCausalLM names) under the multimodal names, with the vision tower
    of the source checkpoint (`files`, an `hf.WeightFiles`) copied in, fp32 like the rest. Its MTP drafter is left
    out: it was not trained with the model."""
    import torch

    out = {}
    for n, t in tensors.items():
        out[LANGUAGE_MODEL + n[len(TEXT):] if n.startswith(TEXT) else n] = t
    for stored in files.aside.get(NOT_TRAINED["model.visual."], []):
        out[stored] = files.read_stored(stored).to(torch.float32).contiguous()
    return out
