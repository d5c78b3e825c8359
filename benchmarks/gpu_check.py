"""One-GPU device check: CUDA kernel parity, single-rank training throughput/MFU/memory, multi-rank verify.

`--dry-run` runs the same code on CPU with tiny shapes (CI runs it). Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch
import torch.nn.functional as F

from shardwise.comm import Ledger
from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.context_parallel import kernels
from shardwise.context_parallel.ring_attention import _merge, block_backward, block_forward
from shardwise.mesh import Axis
from shardwise.models.documents import document_mask
from shardwise.planner.hardware import get_gpu
from shardwise.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

LLAMA_1B = ModelConfig(name="llama-1b", vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8,
                       ffn_dim=5632, max_seq_len=2048)


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def ring_blocks_vs_sdpa(device, dtype, s: int, d: int, blocks: int = 2, documents: bool = False) -> dict:
    """Causal attention from `blocks` contiguous K/V blocks merged by LSE (and the block backward with the
    global out/LSE) against SDPA on the whole sequence, forward and backward.

    `documents`: packed documents of s/8 tokens, one starting mid-block, so some block pairs carry an explicit
    mask with fully masked rows (the memory-efficient kernel with a bias on CUDA) and some are skipped."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, s, d, generator=g).to(device, dtype) for h in (8, 4, 4, 8))
    n = s // blocks
    doc = (torch.arange(s, device=device) + s // 16).div(s // 8, rounding_mode="floor").view(1, s) if documents else None
    pos = torch.arange(s, device=device)

    def mask_of(i, j):  # None: no mask needed (or no documents); False: the pair is fully masked
        if doc is None:
            return None
        qs, ks = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
        m = document_mask(doc[:, qs], doc[:, ks], pos[qs], pos[ks])
        return m if m.any() else False

    out = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=device)
    for i in range(blocks):
        for j in range(i + 1):
            m = mask_of(i, j)
            if m is False:
                continue
            o, lb = block_forward(q[:, :, i * n:(i + 1) * n], k[:, :, j * n:(j + 1) * n], v[:, :, j * n:(j + 1) * n],
                                  i == j and m is None, d ** -0.5, mask=m)
            _merge(out, lse, slice(i * n, (i + 1) * n), o, lb)
    out = out.to(dtype)
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
        torch.zeros_like(v, dtype=torch.float32)
    for i in range(blocks):
        qs = slice(i * n, (i + 1) * n)
        for j in range(i + 1):
            ks, m = slice(j * n, (j + 1) * n), mask_of(i, j)
            if m is False:
                continue
            a, b, c = block_backward(dout[:, :, qs].contiguous(), q[:, :, qs], k[:, :, ks], v[:, :, ks],
                                     out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), i == j and m is None,
                                     d ** -0.5, mask=m)
            dq[:, :, qs] += a
            dk[:, :, ks] += b
            dv[:, :, ks] += c
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    full = None if doc is None else document_mask(doc, doc)
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=full, is_causal=full is None, enable_gqa=True)
    ref.backward(dout)
    return {"out": _rel(out, ref), "dq": _rel(dq, qr.grad), "dk": _rel(dk, kr.grad), "dv": _rel(dv, vr.grad)}


def vocab_ce_vs_torch(device) -> float:
    logits = torch.randn(64, 1000, device=device)
    target = torch.randint(0, 1000, (64,), device=device)
    ours = vocab_parallel_cross_entropy(logits, target, Axis("tp", ledger=Ledger()))
    return _rel(ours, F.cross_entropy(logits, target, reduction="none"))


def train_once(model, device, steps: int, seq_len: int, micro_batch: int, dtype: str, compile_: bool) -> dict:
    from shardwise.train import train_main

    cfg = TrainConfig(model=model, parallel=ParallelConfig(compile=compile_), steps=steps, seq_len=seq_len,
                      micro_batch=micro_batch, dtype=dtype, out=tempfile.mkdtemp(prefix="gpu_check-"), progress=False)
    cfg.resolve_world()
    planned = planner_memory(cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    s = train_main(cfg, device)
    m = cfg.model_config()
    # matmul weights per layer: q, o, k, v (GQA) and SwiGLU's three; plus the LM head
    n_params = m.n_layers * (2 * m.dim * m.dim + 2 * m.dim * m.dim * m.n_kv_heads // m.n_heads + 3 * m.dim * m.ffn_dim)
    flops_per_token = 6 * (n_params + m.dim * m.vocab_size) + 6 * m.n_layers * m.dim * seq_len  # causal attention
    tflops = s["tokens_per_s"] * flops_per_token / 1e12
    out = {"model": m.name, "dtype": dtype, "tokens_per_s": s["tokens_per_s"], "model_tflops": tflops,
           "first_loss": s["first_loss"], "final_loss": s["final_loss"]} | planned
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        preset = next((p for key, p in (("h200", "h200"), ("h100", "h100-80gb"), ("a100", "a100-80gb")) if key in name),
                      None)
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_vs_planner"] = out["peak_memory_gib"] / planned["planner_peak_gib"]
        if preset:
            out["mfu"] = tflops * 1e12 / get_gpu(preset).peak_bf16_flops
    return out


def planner_memory(cfg: TrainConfig) -> dict:
    """The planner's per-GPU peak for exactly this run (static state + saved activations of one step)."""
    from shardwise.planner.estimate import memory_by_stage
    from shardwise.planner.layout import from_train_config

    (stage,) = memory_by_stage(*from_train_config(cfg))
    return {"planner_peak_gib": stage["total"] / 2**30, "planner_activation_gib": stage["activation"] / 2**30}


def verify_layouts(layouts: list[dict], device: str | None = None) -> list[dict]:
    """tp2/pp2/cp2 verify on forked gloo ranks: NCCL refuses two ranks on one GPU, and gloo's p2p and
    reduce-scatter take only CPU tensors, so on a one-GPU machine this checks the installed torch on its
    CPUs. `device="cuda"` puts every rank's tensors on the one GPU over gloo (only all-reduce layouts
    such as tp2 without SP can pass); a failure is reported, not raised."""
    from shardwise.config import ParallelConfig
    from shardwise.launch import RankError, run_local
    from shardwise.verify import verify_main

    res = []
    for lay in layouts:
        cfg = TrainConfig(parallel=ParallelConfig(**lay), steps=2, seq_len=64, micro_batch=2, progress=False,
                          global_batch=4 if "pp" in lay else None)
        cfg.resolve_world()
        world = cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.cp * cfg.parallel.tp
        try:
            r = run_local(verify_main, world, cfg, torch.device(device) if device else None, timeout_s=120)[0]
        except RankError as e:
            if device is None:
                raise
            res.append({"layout": lay, "device": device, "passed": False, "error": str(e)[:300]})
            continue
        res.append({"layout": lay, "passed": r["passed"], "max_grad_rel_diff": r["max_grad_rel_diff"]}
                   | ({"device": device} if device else {}))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (what CI runs)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --dry-run on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    res: dict = {"device": "cpu" if args.dry_run else torch.cuda.get_device_name(device), "dry_run": args.dry_run}
    res["verify"] = verify_layouts([{"tp": 2}, {"pp": 2}, {"cp": 2}])  # fork before any CUDA work
    # Two ranks sharing the GPU over gloo with CUDA tensors (the dry run takes the same path on the CPU).
    res["verify_shared_gpu_gloo"] = verify_layouts([{"tp": 2}], None if args.dry_run else "cuda:0")
    dtypes = [torch.float32] if args.dry_run else [torch.bfloat16, torch.float32]
    s, d = (64, 16) if args.dry_run else (4096, 128)
    res["ring_blocks_vs_sdpa"] = {str(dt).split(".")[-1]: ring_blocks_vs_sdpa(device, dt, s, d) for dt in dtypes}
    res["ring_blocks_vs_sdpa_document_mask"] = {str(dt).split(".")[-1]: ring_blocks_vs_sdpa(device, dt, s, d, 4, True)
                                                for dt in dtypes}
    res["attention_kernels"] = sorted(kernels.USED)
    res["vocab_ce_rel_diff"] = vocab_ce_vs_torch(device)
    steps = 3 if args.dry_run else args.steps
    # tiny fp32 then bf16 (residual stream and payloads bf16): the same seed and data, so their first
    # losses differ only by bf16 rounding — the bf16-vs-fp32 model parity check, on either device.
    runs = [("tiny", 64, 2, "fp32", False), ("tiny", 64, 2, "bf16", False)]
    if not args.dry_run:
        runs += [("small", 1024, 8, "bf16", True), (LLAMA_1B, 2048, 4, "bf16", True)]
    res["train"] = [train_once(m, device, steps, sl, mb, dt, compile_=c) for m, sl, mb, dt, c in runs]
    res["bf16_vs_fp32_first_loss_diff"] = abs(res["train"][1]["first_loss"] - res["train"][0]["first_loss"])
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
