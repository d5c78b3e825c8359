"""The attention kernel choice as a table against torch 2.11–2.13's kernel constraints, and the padding it relies on.

Sources (pytorch/pytorch, aten/src/ATen/native/transformers/):
  [FA]  cuda/flash_attn/flash_api.cpp `mha_fwd`:
        TORCH_CHECK(is_sm90 || is_sm8x, "FlashAttention only supports Ampere GPUs or newer.");
        TORCH_CHECK(q_dtype == at::kHalf || q_dtype == at::kBFloat16, "FlashAttention only support fp16 and bf16 ...");
        TORCH_CHECK(head_size_og % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!");
        TORCH_CHECK(head_size_og <= 256, "FlashAttention forward only supports head dimension at most 256");
        CHECK_SHAPE(v, batch_size, seqlen_k, num_heads_k, head_size_og);   -- v has q's head dim
        (the padding is done by the public SDPA entry, attention.cpp `pad_last_dim<8>`; the raw op does none)
  [SDP] cuda/sdp_utils.cpp:
        check_head_dim_size_flash: "requires q,k,v to have the same last dimension and to be less than or
            equal to 256"; flash takes no attn_mask (check_for_attn_mask)
        check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: no flash training with
            head_dim in (192, 224] on sm86–sm89
        check_mem_efficient_hardware_support: check_sm_version<sm50, sm121>
        check_head_dim_size_mem_efficient: q and k last dims equal, q and v last dims divisible by
            minimum_gemm_alignment (sm80+: 8 in fp16/bf16, 4 in fp32; sm7x: 8 in half, 1 in fp32; older: 1)
        bf16 on the memory-efficient kernel needs sm80 (check_sm_version<sm80, ...> for kBFloat16)
  [CPU] sdp_utils_cpp.cpp / cpu/FlashAttentionKernel.cpp: "Q/K/V should have the same head size" (checked
        below against this torch build), no head-dim cap, fp32/fp64/bf16/fp16.
"""
import pytest
import torch
import torch.nn.functional as F

from shardwise.context_parallel import kernels
from shardwise.context_parallel.kernels import Choice, choose_kernel, efficient_alignment

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
SM75, SM80, SM86, SM90, SM100 = (7, 5), (8, 0), (8, 6), (9, 0), (10, 0)

TABLE = [
    # device, capability, dtype, qk dim, v dim, mask -> kernel, qk dim seen, v dim seen
    ("cpu", None, fp32, 12, 12, "causal", "flash_cpu", 12, 12),         # [CPU] no multiple-of-8 rule
    ("cpu", None, bf16, 128, 128, "document", "flash_cpu", 128, 128),   # [CPU] takes an additive mask
    ("cpu", None, fp32, 192, 128, "causal", "flash_cpu", 192, 192),     # [CPU] one head size: v padded
    ("cpu", None, torch.float8_e4m3fn, 64, 64, "causal", "math", 64, 64),
    ("cuda", SM80, bf16, 12, 12, "causal", "flash_cuda", 16, 16),       # [FA] % 8, padded here
    ("cuda", SM80, bf16, 80, 80, "causal", "flash_cuda", 80, 80),
    ("cuda", SM80, fp16, 96, 96, "none", "flash_cuda", 96, 96),
    ("cuda", SM80, bf16, 128, 128, "causal", "flash_cuda", 128, 128),
    ("cuda", SM80, bf16, 250, 250, "causal", "flash_cuda", 256, 256),   # [FA] padded 256 still fits
    ("cuda", SM80, bf16, 264, 264, "causal", "efficient_cuda", 264, 264),  # [FA] head dim > 256
    ("cuda", SM80, bf16, 192, 128, "causal", "efficient_cuda", 192, 128),  # [SDP] MLA: flash needs equal dims
    ("cuda", SM80, bf16, 128, 128, "document", "efficient_cuda", 128, 128),  # [SDP] flash takes no mask
    ("cuda", SM80, bf16, 12, 12, "document", "efficient_cuda", 16, 16),  # [SDP] alignment 8 in bf16
    ("cuda", SM80, fp32, 12, 12, "causal", "efficient_cuda", 12, 12),    # [FA] fp16/bf16 only; [SDP] align 4
    ("cuda", SM80, fp32, 14, 14, "causal", "efficient_cuda", 16, 16),    # [SDP] align 4 in fp32 on sm80
    ("cuda", SM86, bf16, 200, 200, "causal", "efficient_cuda", 200, 200),  # [SDP] sm86 flash bwd (192, 224]
    ("cuda", SM86, bf16, 192, 192, "causal", "flash_cuda", 192, 192),
    ("cuda", SM90, bf16, 12, 12, "causal", "flash_cuda", 16, 16),
    ("cuda", SM90, bf16, 128, 128, "causal", "flash_cuda", 128, 128),
    ("cuda", SM90, bf16, 192, 128, "causal", "efficient_cuda", 192, 128),
    ("cuda", SM90, fp32, 128, 128, "causal", "efficient_cuda", 128, 128),
    ("cuda", SM75, fp16, 128, 128, "causal", "efficient_cuda", 128, 128),  # [FA] Ampere or newer
    ("cuda", SM75, fp16, 12, 12, "causal", "efficient_cuda", 16, 16),     # [SDP] align 8 in half on sm7x
    ("cuda", SM75, fp32, 12, 12, "causal", "efficient_cuda", 12, 12),     # [SDP] no tensor cores: align 1
    ("cuda", SM75, bf16, 128, 128, "causal", "math", 128, 128),           # [SDP] bf16 efficient needs sm80
    ("cuda", SM100, bf16, 128, 128, "causal", "efficient_cuda", 128, 128),  # [FA] is_sm8x || is_sm90 only
    ("cuda", (3, 7), fp32, 64, 64, "causal", "math", 64, 64),             # [SDP] efficient from sm50
    ("mps", None, fp32, 64, 64, "causal", "math", 64, 64),
]


@pytest.mark.parametrize("device, cap, dtype, d, dv, mask, kernel, qk_seen, v_seen", TABLE)
def test_kernel_table(device, cap, dtype, d, dv, mask, kernel, qk_seen, v_seen):
    c = choose_kernel(device, cap, dtype, d, dv, mask)
    assert (c.kernel, c.qk_dim, c.v_dim) == (kernel, qk_seen, v_seen), c.why
    if c.kernel == "flash_cuda":  # exactly what [FA] accepts
        assert c.qk_dim == c.v_dim and c.qk_dim % 8 == 0 and c.qk_dim <= 256 and dtype in (bf16, fp16)
        assert cap[0] in (8, 9) and mask != "document"
    if c.kernel == "efficient_cuda":  # exactly what [SDP] accepts
        a = efficient_alignment(cap, dtype)
        assert c.qk_dim % a == 0 and c.v_dim % a == 0 and (5, 0) <= cap <= (12, 1)
    assert c.qk_dim >= d and c.v_dim >= dv


def test_the_public_sdpa_entry_never_relies_on_our_padding():
    # Ulysses calls F.scaled_dot_product_attention: only flash's head dim is padded there (by torch).
    assert choose_kernel("cuda", SM80, bf16, 12, 12, "causal", entry="sdpa").kernel == "flash_cuda"
    assert choose_kernel("cuda", SM80, bf16, 12, 12, "document", entry="sdpa").kernel == "math"
    assert choose_kernel("cuda", SM80, fp32, 14, 14, "causal", entry="sdpa").kernel == "math"
    assert choose_kernel("cuda", SM90, bf16, 192, 128, "causal", entry="sdpa").kernel == "efficient_cuda"
    assert choose_kernel("cpu", None, fp32, 192, 128, "causal", entry="sdpa").kernel == "math"


@pytest.mark.parametrize("d, dv, dtype", [(12, 12, fp32), (24, 16, fp32), (16, 24, fp32), (128, 128, bf16),
                                          (12, 12, torch.float64)])
def test_cpu_rows_agree_with_torchs_own_dispatcher(d, dv, dtype):
    """On this build torch's SDPA chooser is callable: our "sdpa" entry on CPU must pick what it picks."""
    from torch.nn.attention import SDPBackend

    q, k, v = (torch.randn(1, 2, 8, e, dtype=dtype) for e in (d, d, dv))
    torch_pick = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True))
    ours = choose_kernel("cpu", None, dtype, d, dv, "causal", entry="sdpa").kernel
    assert (ours == "flash_cpu") == (torch_pick == SDPBackend.FLASH_ATTENTION), (ours, torch_pick)
    with pytest.raises(RuntimeError, match="same head size"):  # [CPU]: why the raw entry pads v
        if d == dv:
            raise RuntimeError("same head size (equal dims: nothing to show)")
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected 'auto' or 'math'"):
        choose_kernel("cpu", None, fp32, 64, backend="nope")
    with pytest.raises(ValueError, match="mask kind 'sliding'"):
        choose_kernel("cpu", None, fp32, 64, mask="sliding")
    assert choose_kernel("cpu", None, fp32, 64, backend="math").kernel == "math"


def _reference(q, k, v, dout, causal, mask=None):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask, is_causal=causal and mask is None, scale=0.3)
    out.backward(dout.double())
    return out, q.grad, k.grad, v.grad


@pytest.mark.parametrize("choice, d, dv, masked", [
    (Choice("flash_cpu", 16, 16, "tiny's head dim padded as for CUDA flash"), 12, 12, False),
    (Choice("flash_cpu", 16, 16, "padded, with a document mask"), 12, 12, True),
    (choose_kernel("cpu", None, fp32, 24, 16), 24, 16, False),  # MLA-style: v padded to 24
])
def test_padded_kernels_compute_the_unpadded_attention(choice, d, dv, masked):
    """The zero columns change nothing: forward and backward equal attention at the model's head dims."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 32, d), torch.randn(1, 2, 32, d), torch.randn(1, 2, 32, dv)
    dout = torch.randn(1, 4, 32, dv)
    mask = None
    if masked:
        doc = torch.arange(32).div(10, rounding_mode="floor")
        mask = (doc[:, None] == doc[None, :]) & torch.ones(32, 32, dtype=torch.bool).tril()
        mask = mask.view(1, 1, 32, 32)
    out, lse = kernels.fused_forward(choice, q, k, v, True, 0.3, mask)
    ref, dq_r, dk_r, dv_r = _reference(q, k, v, dout, True, mask)
    assert out.shape == (1, 4, 32, dv) and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dq, dk, dvv = kernels.fused_backward(choice, dout, q, k, v, out, lse, True, 0.3, mask)
    assert (dq.shape[-1], dk.shape[-1], dvv.shape[-1]) == (d, d, dv)
    for got, want in ((dq, dq_r), (dk, dk_r), (dvv, dv_r)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_call_sites_record_their_kernel_and_ulysses_pins_the_backend(monkeypatch):
    from shardwise.comm import Ledger
    from shardwise.context_parallel import ulysses
    from shardwise.context_parallel.ring_attention import block_forward
    from shardwise.mesh import Axis

    kernels.USED.clear()
    q, k, v = torch.randn(1, 4, 16, 12), torch.randn(1, 2, 16, 12), torch.randn(1, 2, 16, 12)
    block_forward(q, k, v, True, 0.3)
    assert block_forward(q, k, torch.randn(1, 2, 16, 8), False, 0.3, backend="math")[0].shape[-1] == 8
    enabled, real = [], F.scaled_dot_product_attention

    def sdpa(*args, **kw):
        b = torch.backends.cuda
        enabled.append((b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()))
        return real(*args, **kw)

    monkeypatch.setattr(ulysses.F, "scaled_dot_product_attention", sdpa)
    out = ulysses.ulysses_attention(q, k, v, Axis("cp", ledger=Ledger()))
    monkeypatch.undo()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert enabled == [(True, False, True)]  # flash first, math the safety net, nothing else
    assert kernels.used() == {"ring_attention": "flash_cpu,math", "ulysses": "flash_cpu"}


def _train_both(tmp):
    import dataclasses

    from shardwise.config import ParallelConfig, TrainConfig
    from shardwise.training.assemble import assemble
    from shardwise.training.loop import train_main

    out = []
    for impl in ("ring", "ulysses"):
        cfg = TrainConfig(parallel=ParallelConfig(cp=2, cp_impl=impl), steps=1, seq_len=32, micro_batch=2,
                          progress=False, report=False, out=f"{tmp}/{impl}")
        out.append(train_main(assemble(dataclasses.replace(cfg))).get("attention_kernel"))  # rank 0 writes it
    return out


def test_summary_records_the_kernel_per_call_site(tmp_path):
    from _dist import run_ranks

    kernels.USED.clear()  # forked ranks inherit this process's record
    ring, uly = run_ranks(2, _train_both, str(tmp_path))[0]
    assert ring == {"ring_attention": "flash_cpu"} and uly == {"ulysses": "flash_cpu"}
