"""Which attention kernel runs each attention call of the cp paths, and the raw calls into it.

Ring attention needs a kernel that returns the log-sum-exp (to merge blocks) and whose backward
takes the *global* out and LSE, so it calls torch's fused ops directly:
  * CPU: `aten._scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), GQA native, LSE [b, h, s_q];
  * CUDA bf16/fp16 on sm80–sm90: `aten._scaled_dot_product_flash_attention` (+ `_backward`), LSE fp32,
    no GQA (K/V heads are expanded locally, after communication), no explicit mask;
  * CUDA otherwise (fp32, masks, sm50–sm121): `aten._scaled_dot_product_efficient_attention` (+ `_backward`),
    whose LSE is padded to a multiple of 32 query rows; we slice it on the way out and pad it back in.
Anything else falls back to fp32 math (materialises [b, h, s_q, s_k] scores), with one warning.

Called directly, these ops skip what the public SDPA entry does for its callers: flash needs every
head dim equal, a multiple of 8 and ≤ 256 (the public entry pads to 8; the raw op raises), the
memory-efficient kernel needs head dims aligned to its GEMM (8 elements in half precision on sm80+),
and CPU flash needs q, k and v of one head dim. `choose_kernel` is the pure decision — a function of
(device type, compute capability, dtype, q/k head dim, v head dim, mask kind) — and says which head
dims the kernel sees: zero columns are appended to q/k (scores unchanged, the scale is explicit) and
to v (extra output columns, sliced off), so e.g. the `tiny` model's head dim 12 runs flash at 16 and
MLA's 192/128 runs CPU flash with v padded to 192. Ulysses calls the public SDPA, which pads nothing
but flash's head dim, so its choice (`entry="sdpa"`) never relies on padding, and the chosen backend is
enabled first (math stays enabled as the safety net).

Document masking gives some block pairs an arbitrary boolean mask. The CPU flash kernel and CUDA's
memory-efficient kernel take an additive bias (0 / −inf); CUDA's flash kernel takes none, so a masked
pair runs on the memory-efficient kernel (bf16 too). A query row that sees no key of its block must
come back as out 0, LSE −inf so the LSE merge ignores it; the CPU flash kernel returns LSE 0 there,
so every masked result is normalised here. `USED` records, per call site, what ran (summary.json's
"attention_kernel"), and under "mla_padding" what MLA padded before calling it.
"""
from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

KERNELS = ("flash_cpu", "flash_cuda", "efficient_cuda", "math")
MASKS = ("none", "causal", "document")
USED: dict[str, set[str]] = {}  # call site ("ring_attention", "ulysses") -> kernels that ran there
_HALF = (torch.float16, torch.bfloat16)
_warned: set[str] = set()


class Choice(NamedTuple):
    """A kernel and the head dims it is handed (≥ the model's: zero columns appended)."""

    kernel: str
    qk_dim: int
    v_dim: int
    why: str


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def efficient_alignment(capability: tuple[int, int], dtype: torch.dtype) -> int:
    """Head-dim alignment the memory-efficient kernel needs (sdp_utils.cpp `minimum_gemm_alignment`)."""
    major, half = capability[0], dtype in _HALF
    tensor_cores = major >= 8 or (major == 7 and half)
    mn = 4 if major >= 8 else 1
    return max(mn, 128 // (16 if half else 32)) if tensor_cores else mn


def choose_kernel(device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype, qk_head_dim: int,
                  v_head_dim: int | None = None, mask: str = "causal", backend: str = "auto",
                  entry: str = "raw") -> Choice:
    """Pure: the kernel for one attention call (see the module docstring) and the head dims it sees.

    capability: CUDA (major, minor), None elsewhere. mask: "none", "causal" (square blocks only) or
    "document" (an explicit boolean mask). entry "raw": we call the fused op and pad; "sdpa": the public
    SDPA runs it, so nothing may rely on our padding. backend "math" forces the fallback.
    """
    v_head_dim = qk_head_dim if v_head_dim is None else v_head_dim
    if backend not in ("auto", "math"):
        raise ValueError(f"attention backend {backend!r}: expected 'auto' or 'math'")
    if mask not in MASKS:
        raise ValueError(f"attention mask kind {mask!r}: expected one of {', '.join(MASKS)}")
    if entry not in ("raw", "sdpa"):
        raise ValueError(f"attention entry {entry!r}: expected 'raw' or 'sdpa'")
    if min(qk_head_dim, v_head_dim) <= 0:
        raise ValueError(f"head dims must be positive, got q/k {qk_head_dim}, v {v_head_dim}")
    d, dv = qk_head_dim, v_head_dim
    if backend == "math":
        return Choice("math", d, dv, "forced by the attention backend")
    if device_type == "cpu":
        if dtype not in (torch.float32, torch.float64, *_HALF):
            return Choice("math", d, dv, f"CPU flash takes no {dtype}")
        if d != dv and entry == "sdpa":
            return Choice("math", d, dv, "CPU flash needs one head dim for q, k, v; SDPA pads nothing")
        one = max(d, dv)
        return Choice("flash_cpu", one, one, "CPU flash" + (" (head dims padded to one)" if d != dv else ""))
    if device_type != "cuda" or capability is None:
        return Choice("math", d, dv, f"no fused LSE kernel for {device_type}")
    cap = tuple(capability)
    why_not = _flash_cuda_refusal(cap, dtype, d, dv, mask)
    if why_not is None:
        return Choice("flash_cuda", _up(d, 8), _up(d, 8), "CUDA flash" + (" (head dim padded to 8)" if d % 8 else ""))
    if not (5, 0) <= cap <= (12, 1):
        return Choice("math", d, dv, f"sm{cap[0]}{cap[1]} is outside the fused kernels' range; {why_not}")
    if dtype not in (torch.float32, *_HALF) or (dtype == torch.bfloat16 and cap < (8, 0)):
        return Choice("math", d, dv, f"the memory-efficient kernel takes no {dtype} on sm{cap[0]}{cap[1]}; {why_not}")
    a = efficient_alignment(cap, dtype)
    if entry == "sdpa" and (d % a or dv % a):
        return Choice("math", d, dv, f"head dims {d}/{dv} not multiples of {a}; SDPA pads nothing; {why_not}")
    return Choice("efficient_cuda", _up(d, a), _up(dv, a), f"memory-efficient ({why_not})")


def _flash_cuda_refusal(cap, dtype, d: int, dv: int, mask: str) -> str | None:
    """Why CUDA flash cannot run this call, or None (flash_api.cpp `mha_fwd` / sdp_utils.cpp checks)."""
    if dtype not in _HALF:
        return f"flash takes fp16/bf16, not {dtype}"
    if cap[0] not in (8, 9):
        return f"flash runs on sm80–sm90, not sm{cap[0]}{cap[1]}"
    if mask == "document":
        return "flash takes no explicit mask"
    if d != dv:
        return f"flash needs equal q/k and v head dims, got {d}/{dv}"
    if _up(d, 8) > 256:
        return f"flash caps the head dim at 256, got {d}"
    if cap in ((8, 6), (8, 7), (8, 9)) and 192 < _up(d, 8) <= 224:
        return f"flash's backward refuses head dims in (192, 224] on sm{cap[0]}{cap[1]}"
    return None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    """The device's compute capability; None off CUDA or with no CUDA runtime (fake CUDA tensors on a CPU build)."""
    if device.type != "cuda" or torch.cuda.device_count() == 0:
        return None
    return tuple(torch.cuda.get_device_capability(device))


def mask_kind(causal: bool, mask) -> str:
    return "document" if mask is not None else "causal" if causal else "none"


def pick(site: str, q: torch.Tensor, v: torch.Tensor, backend: str = "auto", mask: str = "causal",
         entry: str = "raw") -> Choice:
    """`choose_kernel` for these tensors; records the kernel under `site` and warns once on math."""
    choice = choose_kernel(q.device.type, _capability(q.device), q.dtype, q.shape[-1], v.shape[-1], mask,
                           backend, entry)
    if choice.kernel == "math" and backend == "auto" and site not in _warned:
        _warned.add(site)
        warnings.warn(f"{site}: no fused kernel for {q.device.type} {q.dtype} head dims {q.shape[-1]}/"
                      f"{v.shape[-1]} ({choice.why}); using math (materialises the scores)", stacklevel=3)
    USED.setdefault(site, set()).add(choice.kernel)
    return choice


def record_padding(site: str, what: str, head: int, to: int) -> None:
    """A caller zero-padded a head before `site` (MLA under cp: v to q/k's size or q/k to v's): summary.json's
    "attention_kernel" says so under "mla_padding", e.g. "ring_attention: v head 128 zero-padded to 192"."""
    USED.setdefault("mla_padding", set()).add(f"{site}: {what} head {head} zero-padded to {to}")


def used(clear: bool = False) -> dict[str, str]:
    """What ran per call site, for summary.json: {"ring_attention": "efficient_cuda,flash_cuda", ...}.

    `clear`: start afresh (a run's summary takes what ran since the previous one in this process)."""
    out = {site: ",".join(sorted(k)) for site, k in sorted(USED.items())}
    if clear:
        USED.clear()
    return out


def sdpa_backends(choice: Choice) -> list:
    """The public SDPA backends to enable for a choice: the chosen one first, math as the safety net."""
    from torch.nn.attention import SDPBackend

    first = {"flash_cpu": SDPBackend.FLASH_ATTENTION, "flash_cuda": SDPBackend.FLASH_ATTENTION,
             "efficient_cuda": SDPBackend.EFFICIENT_ATTENTION}.get(choice.kernel)
    return [SDPBackend.MATH] if first is None else [first, SDPBackend.MATH]


def _pad(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def _cut(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.shape[-1] == d else t[..., :d].contiguous()


def expand_heads(k: torch.Tensor, groups: int) -> torch.Tensor:
    """GQA: repeat each K/V head for the `groups` query heads that share it (dim 1 is heads)."""
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def fold_heads(dk: torch.Tensor, groups: int) -> torch.Tensor:
    """The adjoint of `expand_heads`: sum the gradients of a K/V head's `groups` copies."""
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


def fused_forward(choice: Choice, q, k, v, causal: bool, scale: float, mask: torch.Tensor | None = None):
    """(out, lse fp32 [b, hq, s_q]) from a fused kernel; `mask` boolean [b, 1, s_q, s_k] or None.

    q/k/v are zero-padded to the choice's head dims and the output sliced back to v's."""
    aten, dv = torch.ops.aten, v.shape[-1]
    q, k, v = _pad(q, choice.qk_dim), _pad(k, choice.qk_dim), _pad(v, choice.v_dim)
    bias = None if mask is None else additive_bias(mask, q.dtype, q.shape[1])
    if choice.kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                    scale=scale)
        out, lse = _cut(out, dv), lse.float()
        return (out, lse) if mask is None else masked_rows(mask, out, lse)
    g = q.shape[1] // k.shape[1]
    k, v = expand_heads(k, g), expand_heads(v, g)
    if choice.kernel == "flash_cuda":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return _cut(res[0], dv), res[1].float()
    res = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    out, lse = _cut(res[0], dv), res[1][..., :q.shape[2]].float()  # LSE rows are padded to a multiple of 32
    return (out, lse) if mask is None else masked_rows(mask, out, lse)


def fused_backward(choice: Choice, dout, q, k, v, out, lse, causal: bool, scale: float,
                   mask: torch.Tensor | None = None):
    """(dq, dk, dv) from a fused kernel, given the global out and LSE of these query rows.

    The global LSE is finite on every row (a token always sees itself), so masked rows need no care.
    Padding as in `fused_forward`: the padded columns of out and dout are zero, so the kernel's
    rowsum(dout · out) and every real gradient column are those of the unpadded problem.
    """
    aten, d, dv = torch.ops.aten, q.shape[-1], v.shape[-1]
    kd, vd = k.dtype, v.dtype
    q, k = _pad(q, choice.qk_dim), _pad(k, choice.qk_dim)
    v, out, dout = _pad(v, choice.v_dim), _pad(out, choice.v_dim), _pad(dout, choice.v_dim)
    bias = None if mask is None else additive_bias(mask, q.dtype, q.shape[1])
    if choice.kernel == "flash_cpu":
        dq, dk, dvv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
        return _cut(dq, d), _cut(dk, d), _cut(dvv, dv)
    g = q.shape[1] // k.shape[1]
    ke, ve = expand_heads(k, g), expand_heads(v, g)
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: philox state is unused
    if choice.kernel == "flash_cuda":
        dq, dk, dvv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, q.shape[2], ke.shape[2], 0.0, causal, no_rng, no_rng, scale=scale)
    else:
        pad = -q.shape[2] % 32
        lse_p = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
        dq, dk, dvv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, bias, out, lse_p.contiguous(), no_rng, no_rng, 0.0, [True, True, True, False],
            causal, scale=scale)
    return _cut(dq, d), _cut(fold_heads(dk, g), d).to(kd), _cut(fold_heads(dvv, g), dv).to(vd)
