"""Which fused attention kernel runs one ring-attention block pair, and the calls into it.

Ring attention needs a kernel that returns the log-sum-exp (to merge blocks) and whose backward
takes the *global* out and LSE. torch offers, per device and dtype:
  * CPU: `aten._scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), GQA native, LSE [b, h, s_q];
  * CUDA bf16/fp16: `aten._scaled_dot_product_flash_attention` (+ `_backward`), LSE [b, h, s_q] fp32,
    no GQA (K/V heads are expanded locally, after communication), head dim ≤ 256;
  * CUDA fp32 (and the rest): `aten._scaled_dot_product_efficient_attention` (+ `_backward`), whose LSE
    is padded to a multiple of 32 query rows ([b, h, ⌈s_q/32⌉·32]); we slice it on the way out and pad
    the global LSE on the way back in.
Anything else falls back to fp32 math (materialises [b, h, s_q, s_k] scores), with one warning.

Document masking (`--attention-mask document`) gives some block pairs an arbitrary boolean mask.
The CPU flash kernel and CUDA's memory-efficient kernel take an additive bias (0 / −inf); CUDA's
flash kernel takes none, so a masked pair runs on the memory-efficient kernel instead (bf16 too),
and unmasked pairs of the same call stay on flash. A query row that sees no key of its block
(its document starts later in the sequence) must come back as out 0, LSE −inf so the LSE merge
ignores it; the CPU flash kernel returns LSE 0 there, so every masked result is normalised here.
`choose_kernel` is the pure decision; `USED` records what ran, for summary.json's "attention_kernel".
"""
from __future__ import annotations

import warnings

import torch

KERNELS = ("flash_cpu", "flash_cuda", "efficient_cuda", "math")
USED: set[str] = set()
_OPS = {
    "flash_cpu": ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    "flash_cuda": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
    "efficient_cuda": ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
}
_warned = False


def available_kernels() -> set[str]:
    """The fused kernels this torch build exposes (CUDA ones only when a GPU is visible)."""
    have = {k for k, (f, b) in _OPS.items() if hasattr(torch.ops.aten, f) and hasattr(torch.ops.aten, b)}
    return have if torch.cuda.is_available() else have - {"flash_cuda", "efficient_cuda"}


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: int, available: set[str],
                  backend: str = "auto", masked: bool = False) -> str:
    """Pure: the kernel for one block pair (see the module docstring); backend "math" forces the fallback.

    `masked`: the pair has an explicit mask, which CUDA's flash kernel cannot take.
    """
    if backend not in ("auto", "math"):
        raise ValueError(f"attention backend {backend!r}: expected 'auto' or 'math'")
    if backend == "math":
        return "math"
    if device_type == "cpu" and "flash_cpu" in available:
        return "flash_cpu"
    if device_type == "cuda":
        if (dtype in (torch.bfloat16, torch.float16) and head_dim <= 256 and "flash_cuda" in available
                and not masked):
            return "flash_cuda"
        if "efficient_cuda" in available:
            return "efficient_cuda"
    return "math"


def pick(q: torch.Tensor, backend: str, masked: bool = False) -> str:
    global _warned
    kernel = choose_kernel(q.device.type, q.dtype, q.shape[-1], available_kernels(), backend, masked)
    if kernel == "math" and backend == "auto" and not _warned:
        _warned = True
        warnings.warn(f"ring attention: no fused LSE kernel for {q.device.type} {q.dtype}; using fp32 math "
                      "(materialises each block's scores)", stacklevel=3)
    USED.add(kernel)
    return kernel


def _expand(k: torch.Tensor, groups: int) -> torch.Tensor:
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _fold(dk: torch.Tensor, groups: int) -> torch.Tensor:
    return dk if groups == 1 else dk.unflatten(1, (-1, groups)).sum(2)


def additive_bias(mask: torch.Tensor, dtype: torch.dtype, heads: int) -> torch.Tensor:
    """Boolean mask [b, 1, s_q, s_k] (True = attend) → additive bias [b, heads, s_q, s_k] (0 / −inf).

    The rows are laid out padded to a multiple of 16 keys and the heads broadcast (stride 0), as
    SDPA's frontend does for the memory-efficient kernel, which requires an aligned bias.
    """
    b, _, s_q, s_k = mask.shape
    padded = torch.zeros(b, 1, s_q, s_k + (-s_k % 16), dtype=dtype, device=mask.device)[..., :s_k]
    return padded.masked_fill_(~mask, float("-inf")).expand(b, heads, s_q, s_k)


def masked_rows(mask: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """Rows of a masked block with no visible key: out 0, LSE −inf (whatever the kernel returned there)."""
    seen = mask.any(-1)  # [b, 1, s_q]
    return torch.where(seen.unsqueeze(-1), out, 0.0).to(out.dtype), torch.where(seen, lse, float("-inf"))


def fused_forward(kernel: str, q, k, v, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """(out, lse fp32 [b, hq, s_q]) from a fused kernel; `mask` boolean [b, 1, s_q, s_k] or None."""
    aten = torch.ops.aten
    bias = None if mask is None else additive_bias(mask, q.dtype, q.shape[1])
    if kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                    scale=scale)
        return (out, lse.float()) if mask is None else masked_rows(mask, out, lse.float())
    g = q.shape[1] // k.shape[1]
    k, v = _expand(k, g), _expand(v, g)
    if kernel == "flash_cuda":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].float()
    res = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    out, lse = res[0], res[1][..., :q.shape[2]].float()  # LSE rows are padded to a multiple of 32
    return (out, lse) if mask is None else masked_rows(mask, out, lse)


def fused_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """(dq, dk, dv) from a fused kernel, given the global out and LSE of these query rows.

    The global LSE is finite on every row (a token always sees itself), so masked rows need no care.
    """
    aten = torch.ops.aten
    bias = None if mask is None else additive_bias(mask, q.dtype, q.shape[1])
    if kernel == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         attn_mask=bias, scale=scale)
    g = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, g), _expand(v, g)
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: philox state is unused
    if kernel == "flash_cuda":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, q.shape[2], ke.shape[2], 0.0, causal, no_rng, no_rng, scale=scale)
    else:
        pad = -q.shape[2] % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, bias, out, lse_p.contiguous(), no_rng, no_rng, 0.0, [True, True, True, False],
            causal, scale=scale)
    return dq, _fold(dk, g).to(k.dtype), _fold(dv, g).to(v.dtype)
