"""`shardwise generate SOURCE --prompt TEXT`: text from a shardwise checkpoint or a Hugging Face directory.

SOURCE is a run directory, a checkpoint root (its newest intact step) or one step-N directory — saved
under any layout: its global tensors are read whole into this one process, as hf-export does — or a
Hugging Face model directory (config.json + safetensors). The model is `build_model`'s single-device
model, and decoding runs its own forward with a KV cache (each attention's core sees the cached keys and
values): the prompt in one forward, then one token per step. Decoding stops
at the end-of-document id or after --max-new-tokens (or at the model's max_seq_len).

Tokenizer: `--tokenizer`, else for a checkpoint the one its run recorded (the data's tokenizer and
end-of-document id, as hf-export writes them; older checkpoints: the run's config.json beside
checkpoints/), for an HF directory its tokenizer.json. A byte-sized vocabulary (257) without any of these is
shardwise's byte tokenizer. `--temperature 0` is greedy (argmax): token for token what transformers'
greedy `generate` gives on the hf-export of the same checkpoint. `--json` prints
`{"text", "tokens", ...}` as the last line (text and tokens: the continuation; tokens include the EOS).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from ..config import ConfigError


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except for flags that are off or derived (None/False): their help says so."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text from a checkpoint or a Hugging Face directory",
                              description=__doc__.splitlines()[0],
                              formatter_class=_Help)
    p.add_argument("source", metavar="SOURCE", help="run directory, checkpoint root, step-N directory or HF directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.7, help="softmax temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling: smallest set of tokens with this mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--tokenizer", default=None, help="byte, a tokenizer.json or a directory holding one "
                   "(default: the checkpoint's data / the HF directory's)")
    p.add_argument("--device", default="auto", help="auto (the GPU when CUDA is present), cpu or cuda")
    p.add_argument("--json", action="store_true", help='print {"text", "tokens", ...} as the last line')
    p.set_defaults(func=run)
    return p


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be a positive integer")
    if not temperature >= 0:
        raise ConfigError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p {top_p} must be in (0, 1]")


# ---------------------------------------------------------------- sources
def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _is_hf_dir(path: str) -> bool:
    from glob import glob

    cfg = os.path.join(path, "config.json")
    return os.path.isfile(cfg) and "model_type" in _read_json(cfg) and bool(
        glob(os.path.join(path, "*.safetensors")) or os.path.isfile(os.path.join(path, "model.safetensors.index.json")))


def _checkpoint_root(path: str) -> str | None:
    """The checkpoint root or step directory `path` names (a run directory: its checkpoints/), or None."""
    from .. import checkpoint as ck

    run_cfg = os.path.join(path, "config.json")
    if os.path.isfile(run_cfg) and "train" in _read_json(run_cfg):
        path = _read_json(run_cfg)["train"].get("checkpoint_dir") or os.path.join(path, "checkpoints")
    if os.path.isfile(os.path.join(path, ck.MANIFEST)) or ck.list_checkpoints(path):
        return path
    return None


def load_source(source: str, device=None):
    """(single-device model in eval mode, tokenizer spec or None, end-of-document id or None (the tokenizer's),
    'checkpoint'|'hf', resolved path). A checkpoint's tokenizer is the one its run recorded (hf-export's record)."""
    import torch

    from ..mesh import Mesh
    from ..parallelize import build_model

    device = torch.device(device or "cpu")
    if not os.path.isdir(source):
        raise ConfigError(f"{source!r} is not a directory; give a run directory, a checkpoint or an HF model directory")
    root = _checkpoint_root(source)
    if root is not None:
        from .. import checkpoint as ck
        from ..config import ModelConfig
        from ..hf.export import record_from_run_dir

        path, skipped = ck.newest_intact(root)
        if path is None:
            why = "; ".join(f"{p}: {r}" for p, r in skipped) or "no step-N directories"
            raise ConfigError(f"{source!r}: no intact checkpoint ({why})")
        meta = _read_json(os.path.join(path, ck.META))
        saved = meta["model"]
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in known})
        model = build_model(cfg, Mesh.single(device), seed=0)
        # buffers (the sigmoid routers' selection bias) are saved under their own prefix
        _load_global(model, ck.load_global_tensors(path) | ck.load_global_tensors(path, prefix="buffer."))
        record = meta.get("extra_state", {}).get("tokenizer") or record_from_run_dir(os.path.dirname(path)) or {}
        return model.eval(), record.get("source"), record.get("eos_id"), "checkpoint", path
    if _is_hf_dir(source):
        from ..hf.weights import check_weight_files, load_hf_into, need_safetensors
        from ..hf.config import config_from_hf

        need_safetensors("generate")
        check_weight_files(source, "model directory")
        model = build_model(config_from_hf(source), Mesh.single(device), seed=0)
        load_hf_into(model, source)
        has_tok = os.path.isfile(os.path.join(source, "tokenizer.json"))
        return model.eval(), source if has_tok else None, None, "hf", source
    raise ConfigError(f"{source!r} is neither a shardwise checkpoint (run directory, checkpoint root, step-N) nor a "
                      "Hugging Face model directory (config.json + *.safetensors)")


def _load_global(model, state: dict) -> None:
    """Copy global tensors (shardwise names) into the single-device model: parameters and saved buffers."""
    import torch

    from ..tensor_parallel.layers import get_spec

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in state:
                raise ConfigError(f"the checkpoint has no tensor {name!r} for its own model config")
            spec = get_spec(p)
            dst = p if spec.dim is None else p.narrow(spec.dim, 0, spec.valid)
            dst.copy_(state[name])
        for name, b in model.named_buffers():
            if name in state:
                b.copy_(state[name])


# ---------------------------------------------------------------- tokenizer
class _Tok:
    """encode / decode / eos of the byte tokenizer or a tokenizer.json."""

    def __init__(self, spec: str | None, vocab_size: int, add_special: bool, eos_id: int | None = None):
        from ..data.tokenizer import VOCAB_SIZE, load_tokenizer

        if spec is None:
            if vocab_size != VOCAB_SIZE:
                raise ConfigError(f"no tokenizer found for a {vocab_size}-id vocabulary; pass --tokenizer "
                                  "(a tokenizer.json or a directory holding one)")
            spec = "byte"
        try:
            self.tok = load_tokenizer(spec)
        except ConfigError:
            self.tok = load_tokenizer(spec, no_eos=True)  # a tokenizer without an eos: stop at max_new_tokens
        self.byte, self.add_special = self.tok.kind == "byte", add_special
        self.eos_id = self.tok.eos_id if eos_id is None else eos_id  # the data's end of document, when recorded

    def encode(self, text: str) -> list[int]:
        if self.byte:
            return list(text.encode("utf-8"))
        return self.tok.tok.encode(text, add_special_tokens=self.add_special).ids

    def decode(self, ids: list[int]) -> str:
        if self.byte:
            from ..data.tokenizer import decode

            return decode(ids)
        return self.tok.tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- decoding
def _cached_core(core):
    """Stands in for one attention module's `core` (an AttentionCore) while decoding: prepends the cached keys
    and values. The prompt (nothing cached yet) runs the module's own causal core; each later single token
    attends to every cached key (a sliding layer's: its window's latest), so no mask is needed (SDPA at the core's
    scale: MLA's, else 1/sqrt(d); with gpt-oss's sinks an explicit softmax with the sink column)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class CachedCore(nn.Module):
        def __init__(self):
            super().__init__()
            self.own, self.k, self.v = [core], None, None  # a list: not registered as a child module

        def forward(self, q, k, v, doc_ids=None, sinks=None):
            if self.k is None:
                self.k, self.v = k, v
                return self.own[0](q, k, v, doc_ids, sinks)
            if q.shape[2] != 1:
                raise ValueError("the KV cache takes the prompt in one call and then one token per call")
            self.k, self.v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
            window = self.own[0].window  # gpt-oss's sliding layers: the newest token sees its `window` latest keys
            keys, values = (self.k, self.v) if not window else (self.k[:, :, -window:], self.v[:, :, -window:])
            if sinks is None:
                return F.scaled_dot_product_attention(q, keys, values, scale=self.own[0].scale,
                                                      enable_gqa=q.shape[1] != keys.shape[1])
            # gpt-oss's sinks: one more logit per head in the softmax, with no value (one query row: explicit)
            g = q.shape[1] // keys.shape[1]
            scale = self.own[0].scale or q.shape[-1] ** -0.5
            scores = q.float() @ keys.float().repeat_interleave(g, 1).transpose(-1, -2) * scale
            scores = torch.cat((scores, sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)), -1)
            probs = scores.softmax(-1)[..., :-1]
            return (probs @ values.float().repeat_interleave(g, 1)).to(q.dtype)

    return CachedCore()


class KVCache:
    """Decoding state of one sequence: `forward(tokens)` runs the model's own forward (embedding, every block
    with its norms, q/k norms or MLA, dense or MoE feed-forward, head) on the new tokens at their positions,
    with each attention's core swapped for a cached one (`_cached_core`) for the duration of the call."""

    def __init__(self, model):
        self.model, self.length = model, 0
        # attention layers get a cached core; a linear-attention (Gated DeltaNet) layer keeps its conv window and
        # recurrent state in a dict it advances itself (its `decode_state`)
        self.blocks = [b for b in model.layers.values() if hasattr(b.attention, "core")]
        self.cores = [_cached_core(block.attention.core) for block in self.blocks]
        self.linear = {id(b): {} for b in model.layers.values() if hasattr(b.attention, "decode_state")}

    def forward(self, tokens):
        """Logits [b, s, vocab] (fp32) of the new `tokens` [b, s]."""
        import torch

        s = tokens.shape[1]
        positions = torch.arange(self.length, self.length + s, device=tokens.device).expand(tokens.shape[0], s)
        blocks = self.blocks
        linear = [b for b in self.model.layers.values() if id(b) in self.linear]
        for block, core in zip(blocks, self.cores):
            block.attention.core = core
        for block in linear:
            block.attention.decode_state = self.linear[id(block)]
        try:
            logits = self.model(tokens, positions=positions)
        finally:
            for block, core in zip(blocks, self.cores):
                block.attention.core = core.own[0]
            for block in linear:
                block.attention.decode_state = None
        self.length += s
        return logits[..., :self.model.cfg.vocab_size].float()


def _pick(logits, temperature: float, top_p: float, gen) -> int:
    """Greedy at temperature 0, else a draw from the top-p nucleus of softmax(logits / T)."""
    import torch

    from .. import host

    if temperature == 0:
        return host.read(logits.argmax(), "generate token")
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    keep = sorted_p.cumsum(0) - sorted_p < top_p  # the smallest prefix whose mass reaches top_p
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)
    return host.read(order[choice], "generate token")[0]


def generate_ids(model, prompt: list[int], max_new_tokens: int, eos_id: int | None, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, scores: list | None = None) -> tuple[list[int], str]:
    """New token ids (ending with the EOS when it came) and why decoding stopped: eos, max_new_tokens, max_seq_len.
    `scores`, when given, receives each step's logits [vocab] (tests compare them with transformers')."""
    import torch

    if not prompt:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    limit = model.cfg.max_seq_len
    if len(prompt) >= limit:
        raise ConfigError(f"--prompt is {len(prompt)} tokens; the model's max_seq_len is {limit}")
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    cache = KVCache(model)
    out: list[int] = []
    x = torch.tensor([prompt], device=device)
    with torch.no_grad():
        while True:
            logits = cache.forward(x)[0, -1].cpu()
            if scores is not None:
                scores.append(logits)
            tok = _pick(logits, temperature, top_p, gen)
            out.append(tok)
            if tok == eos_id:
                return out, "eos"
            if len(out) == max_new_tokens:
                return out, "max_new_tokens"
            if len(prompt) + len(out) >= limit:
                return out, "max_seq_len"
            x = torch.tensor([[tok]], device=device)


def pick_device(spec: str):
    """--device auto|cpu|cuda → a torch.device (cuda:0 for auto when CUDA is present)."""
    import torch

    if spec not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device {spec!r} is unknown; valid: auto, cpu, cuda")
    if spec == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu")
    return torch.device("cuda", 0) if spec != "cpu" and torch.cuda.is_available() else torch.device("cpu")


def generate(source: str, prompt: str, max_new_tokens: int = 64, temperature: float = 0.7, top_p: float = 0.9,
             seed: int = 0, tokenizer: str | None = None, device: str = "cpu") -> dict:
    """Load SOURCE, continue `prompt`; {"text", "tokens", "prompt_tokens", "stopped", "source"}."""
    check_sampling(max_new_tokens, temperature, top_p)
    model, tok_spec, eos_id, kind, path = load_source(source, pick_device(device))
    tok = _Tok(tokenizer or tok_spec, model.cfg.vocab_size, add_special=kind == "hf", eos_id=None if tokenizer else eos_id)
    ids = tok.encode(prompt)
    new, stopped = generate_ids(model, ids, max_new_tokens, tok.eos_id, temperature, top_p, seed)
    text = tok.decode(new[:-1] if stopped == "eos" else new)
    return {"text": text, "tokens": new, "prompt_tokens": ids, "stopped": stopped, "source": path}


def run(args) -> int:
    try:
        out = generate(args.source, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                       args.tokenizer, args.device)
    except (ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"shardwise generate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"text": out["text"], "tokens": out["tokens"], "prompt_tokens": out["prompt_tokens"],
                          "stopped": out["stopped"], "source": out["source"]}))
    else:
        print(args.prompt + out["text"])
    return 0
