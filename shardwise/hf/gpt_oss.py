"""gpt-oss's expert and router tensors in Hugging Face's layout, in (bf16/fp32 or MXFP4) and out.

transformers' GptOssExperts keeps, per layer, `gate_up_proj` [E, h, 2·ffn] with the gate and up columns
interleaved (gate at even columns, up at odd), `gate_up_proj_bias` [E, 2·ffn] likewise, `down_proj` [E, ffn, h]
and `down_proj_bias` [E, h]: inputs times weights (x @ W), the transpose of shardwise's w1, w3 [E, ffn, h] and
w2 [E, h, ffn]. The released checkpoints store the two matrices as MXFP4 `*_blocks` / `*_scales` of the
[E, out, in] orientation (`gate_up_proj_blocks` [E, 2·ffn, h/32, 16], rows interleaved the same way), which are
dequantised to the training dtype on import (`hf_mxfp4.py`). The router is `mlp.router.weight` / `.bias`.
Only the experts of a rank's EP slice are read.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from ..config import ModelConfig
from .mxfp4 import BLOCK, dequantize

EXPERT = re.compile(r"layers\.(\d+)\.feed_forward\.(router\.(?:weight|bias)|experts\.(?:w1|w2|w3|b1|b2|b3))")
# shardwise expert tensor → (HF tensor, which interleaved half: 0 gate, 1 up, None all)
_PARTS = {"experts.w1": ("gate_up_proj", 0), "experts.w3": ("gate_up_proj", 1), "experts.w2": ("down_proj", None),
          "experts.b1": ("gate_up_proj_bias", 0), "experts.b3": ("gate_up_proj_bias", 1),
          "experts.b2": ("down_proj_bias", None)}


@dataclasses.dataclass
class ExpertSource:
    """One shardwise global expert tensor read from a gpt-oss checkpoint (plain or MXFP4): `read` returns the box."""

    names: list[str]
    shape: tuple[int, ...]
    half: int | None
    mxfp4: bool
    kind: str = "gpt_oss"

    def read(self, files, box: tuple[slice, ...]) -> torch.Tensor:
        experts = box[0]
        if self.mxfp4:  # [E_l, out, in] after dequantising, rows interleaved like the plain tensor's columns
            blocks, scales = self.names
            t = dequantize(files.read(blocks, (experts,)), files.read(scales, (experts,)))
            t = t if self.half is None else t[:, self.half::2]
        else:
            t = files.read(self.names[0], (experts,))
            if t.dim() == 3:  # plain matrices are x @ W: [E_l, in, out]
                t = (t if self.half is None else t[..., self.half::2]).transpose(1, 2)
            elif self.half is not None:  # a bias [E_l, 2·ffn]
                t = t[:, self.half::2]
        return t[(slice(None), *box[1:])].contiguous()


def expert_source(name: str, cfg: ModelConfig, files) -> ExpertSource | None:
    """How to read gpt-oss tensor `name` (router or expert) from `files`; None for any other tensor."""
    m = EXPERT.fullmatch(name)
    if m is None:
        return None
    base = f"model.layers.{m.group(1)}.mlp"
    part = m.group(2)
    if part.startswith("router"):
        hf = f"{base}.router.{part.split('.')[1]}"
        return ExpertSource([hf], files.shape(hf), None, False)
    hf, half = _PARTS[part]
    plain = f"{base}.experts.{hf}"
    if plain in files:
        shape = files.shape(plain)
        if len(shape) == 3:
            e, rows, cols = shape
            out = (e, cols // 2 if half is not None else cols, rows)
        else:
            out = (shape[0], shape[1] // 2 if half is not None else shape[1])
        return ExpertSource([plain], out, half, False)
    blocks, scales = f"{plain}_blocks", f"{plain}_scales"
    e, rows, groups, _ = files.shape(blocks)
    return ExpertSource([blocks, scales], (e, rows // 2 if half is not None else rows, groups * BLOCK), half, True)


def export_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GptOss's router and expert tensors (plain, unquantised) from shardwise's global ones."""
    out = {}
    for i in range(cfg.n_layers):
        p, base = f"layers.{i}.feed_forward", f"model.layers.{i}.mlp"
        w1, w3, w2 = (state[f"{p}.experts.{w}"] for w in ("w1", "w3", "w2"))
        b1, b3, b2 = (state[f"{p}.experts.{b}"] for b in ("b1", "b3", "b2"))
        out[f"{base}.router.weight"] = state[f"{p}.router.weight"]
        out[f"{base}.router.bias"] = state[f"{p}.router.bias"]
        out[f"{base}.experts.gate_up_proj"] = torch.stack((w1, w3), dim=2).flatten(1, 2).transpose(1, 2)
        out[f"{base}.experts.gate_up_proj_bias"] = torch.stack((b1, b3), dim=-1).flatten(1)
        out[f"{base}.experts.down_proj"] = w2.transpose(1, 2)
        out[f"{base}.experts.down_proj_bias"] = b2
    return out
