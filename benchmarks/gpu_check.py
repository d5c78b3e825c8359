"""Device check: multi-rank verify, CUDA kernel parity, single-GPU training throughput/MFU/memory.

Order matters: every multi-rank run starts before this process makes any CUDA call (forked ranks cannot
use a CUDA context inherited from their parent; `run_local` refuses to fork after one). GPUs are counted
through NVML (`torch.cuda.device_count`), which initialises nothing. With ≥ 2 GPUs the layouts (tp2, pp2 ×
every schedule, cp2 ring and Ulysses, ep2, ZeRO-3, tp2 under Muon with MuonClip) verify over NCCL, one spawned rank per GPU; with one GPU
the same layouts run as two forked gloo ranks sharing it with CUDA tensors (gloo moves CUDA tensors only
for some collectives: what fails is reported, not raised). Then, in this process: ring-attention kernel
parity against SDPA for head dims 12, 128 and MLA's 192/128 (q/k 192, v 128), fp32 and bf16, with and
without document masks, Muon's Newton–Schulz in bf16 (its CUDA default) against fp32, and training
throughput of `small` and a ~1B Llama (and `tiny` under Muon, bf16 Newton–Schulz on CUDA), and one FP8 step per
`--fp8` recipe against the same bf16 step (`fp8_steps`).

`--dry-run` runs the same code on CPU with tiny shapes and forked gloo ranks (CI runs it).
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

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


def ring_blocks_vs_sdpa(device, dtype, s: int, d: int, blocks: int = 2, documents: bool = False,
                        dv: int | None = None) -> dict:
    """Causal attention from `blocks` contiguous K/V blocks merged by LSE (and the block backward with the
    global out/LSE) against SDPA on the whole sequence, forward and backward.

    `documents`: packed documents of s/8 tokens, one starting mid-block, so some block pairs carry an explicit
    mask with fully masked rows (the memory-efficient kernel with a bias on CUDA) and some are skipped."""
    dv = d if dv is None else dv
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = ((8, d), (4, d), (4, dv), (8, dv))  # q, k, v, dout: [1, heads, s, head dim]
    q, k, v, dout = (torch.randn(1, h, s, e, generator=g).to(device, dtype) for h, e in shapes)
    n = s // blocks
    doc = (torch.arange(s, device=device) + s // 16).div(s // 8, rounding_mode="floor").view(1, s) if documents else None
    pos = torch.arange(s, device=device)

    def mask_of(i, j):  # None: no mask needed (or no documents); False: the pair is fully masked
        if doc is None:
            return None
        qs, ks = slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n)
        m = document_mask(doc[:, qs], doc[:, ks], pos[qs], pos[ks])
        return m if m.any() else False

    out = torch.zeros(dout.shape, dtype=torch.float32, device=device)
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


def muon_ns_bf16_vs_fp32(device) -> dict:
    """Muon's update of one [256, 704] matrix with Newton–Schulz in bf16 (the CUDA default) against fp32."""
    from shardwise.optim.muon import muon_update

    g = torch.randn(256, 704, generator=torch.Generator().manual_seed(0)).to(device)
    u16, u32 = muon_update(g, 5, torch.bfloat16), muon_update(g, 5, torch.float32)
    return {"rel_diff": _rel(u16, u32), "dtype": str(u16.dtype).split(".")[-1], "device": u16.device.type}


def train_once(model, device, steps: int, seq_len: int, micro_batch: int, dtype: str, compile_: bool,
               optimizer: str = "adamw") -> dict:
    from shardwise.training.loop import train_main

    cfg = TrainConfig(model=model, parallel=ParallelConfig(compile=compile_), steps=steps, seq_len=seq_len,
                      micro_batch=micro_batch, dtype=dtype, out=tempfile.mkdtemp(prefix="gpu_check-"), progress=False,
                      report=False, optimizer=optimizer)
    cfg = cfg.resolved()
    planned = planner_memory(cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    s = train_main(cfg, device)
    m = cfg.model_config()
    # matmul weights per layer: q, o, k, v (GQA) and SwiGLU's three; plus the LM head
    n_params = m.n_layers * (2 * m.dim * m.dim + 2 * m.dim * m.dim * m.n_kv_heads // m.n_heads + 3 * m.dim * m.ffn_dim)
    flops_per_token = 6 * (n_params + m.dim * m.vocab_size) + 6 * m.n_layers * m.dim * seq_len  # causal attention
    tflops = s["tokens_per_s"] * flops_per_token / 1e12
    out = {"model": m.name, "dtype": dtype, "optimizer": optimizer, "tokens_per_s": s["tokens_per_s"], "model_tflops": tflops,
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


def fp8_steps(device) -> list[dict]:
    """One training step of a 2-layer tiny model per --fp8 recipe (bf16 autocast), from the same weights and tokens
    as a bf16 step without FP8: each recipe's loss must be finite and within FP8's rounding of bf16's; `scaled_mm`
    says whether the tensorwise/rowwise GEMMs took torch._scaled_mm here (CPU, CUDA sm89+) or were emulated."""
    from shardwise.fp8.linear import use_scaled_mm
    from shardwise.fp8.recipes import RECIPES
    from shardwise.mesh import Mesh
    from shardwise.training.assemble import assemble
    from shardwise.training.trainer import Trainer

    out = []
    for fp8 in (None, *RECIPES):
        cfg = TrainConfig(model="tiny", model_overrides={"n_layers": 2}, steps=1, seq_len=128, micro_batch=2,
                          dtype="bf16", fp8=fp8, progress=False, report=False)
        t0 = time.perf_counter()
        loss = Trainer(assemble(cfg), Mesh.single(device)).train_step(0)["loss"]
        out.append({"fp8": fp8, "loss": loss, "seconds": round(time.perf_counter() - t0, 2)})
    for r in out[1:]:
        r["rel_to_bf16"] = abs(r["loss"] / out[0]["loss"] - 1)
        r["passed"] = bool(torch.isfinite(torch.tensor(r["loss"])) and r["rel_to_bf16"] < 2e-2)
        r["scaled_mm"] = use_scaled_mm(device) and r["fp8"] in ("tensorwise", "rowwise")
    return out


def planner_memory(cfg: TrainConfig) -> dict:
    """The planner's per-GPU peak for exactly this run (static state + saved activations of one step)."""
    from shardwise.planner.estimate import memory_by_stage
    from shardwise.planner.layout import from_train_config

    (stage,) = memory_by_stage(*from_train_config(cfg))
    return {"planner_peak_gib": stage["total"] / 2**30, "planner_activation_gib": stage["activation"] / 2**30}


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "dualpipev")


def layouts() -> list[tuple[str, str, dict]]:
    """(name, model, parallel) of every two-rank layout the check verifies."""
    out = [("tp2", "tiny", {"tp": 2})]
    out += [(f"pp2-{s}", "tiny", {"pp": 2, "schedule": s, "vp": 2 if s == "interleaved" else 1}) for s in PP_SCHEDULES]
    out += [("cp2-ring", "tiny", {"cp": 2}), ("cp2-ulysses", "tiny", {"cp": 2, "cp_impl": "ulysses"}),
            ("ep2", "tiny-moe", {"dp": 2, "ep": 2}), ("zero3", "tiny", {"dp": 2, "zero": 3}),
            ("tp2-muon-clip", "tiny", {"tp": 2})]
    return out


RUN_OPTIONS = {"tp2-muon-clip": {"optimizer": "muon", "muon_qk_clip": 0.12, "muon_ns_fp32": True}}
"""Run flags beyond the layout. Muon's verify keeps Newton–Schulz in fp32 (bf16 rounding of two differently
reduced inputs is not verify's fp32 bound); its bf16 path is `muon_ns_bf16_vs_fp32` and the Muon training run."""


def verify_layouts(mode: str, seq_len: int = 64) -> list[dict]:
    """Verify every layout on two ranks. mode "nccl": spawned ranks, one GPU each; "gloo-cuda": forked gloo
    ranks sharing cuda:0 (what gloo cannot do with CUDA tensors is reported, not raised); "gloo": forked
    CPU ranks (the dry run; failures raise)."""
    from shardwise.training.launch import RankError, run_local
    from shardwise.verify.main import verify_main

    res = []
    for name, model, par in layouts():
        pp = par.get("pp", 1)
        cfg = TrainConfig(model=model, parallel=ParallelConfig(**par), steps=2, seq_len=seq_len, micro_batch=2,
                          progress=False, global_batch=8 if pp > 1 else None, **RUN_OPTIONS.get(name, {}))
        cfg = cfg.resolved()
        world = cfg.parallel.world_size
        args = (cfg, torch.device("cuda", 0)) if mode == "gloo-cuda" else (cfg,)
        t0 = time.perf_counter()
        try:
            r = run_local(verify_main, world, *args, timeout_s=120, backend="nccl" if mode == "nccl" else "gloo")[0]
        except RankError as e:
            if mode == "gloo":
                raise
            res.append({"layout": name, "mode": mode, "passed": False, "error": str(e)[:300]})
            continue
        res.append({"layout": name, "mode": mode, "passed": r["passed"], "max_grad_rel_diff": r["max_grad_rel_diff"],
                    "seconds": round(time.perf_counter() - t0, 2)})
    return res


def kernel_parity(device, dtypes, s: int, dims) -> list[dict]:
    """Ring blocks vs SDPA per (dtype, q/k head dim, v head dim, document mask), with the kernel each chose."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    out = []
    for dt in dtypes:
        for d, dv in dims:
            for documents in (False, True):
                choice = kernels.choose_kernel(device.type, cap, dt, d, dv, "document" if documents else "causal")
                err = ring_blocks_vs_sdpa(device, dt, s, d, 4 if documents else 2, documents, dv)
                out.append({"dtype": str(dt).split(".")[-1], "qk_dim": d, "v_dim": dv, "document_mask": documents,
                            "kernel": choice.kernel, "padded_to": [choice.qk_dim, choice.v_dim]} | err)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", "--smoke", action="store_true",
                    help="CPU, tiny shapes, forked gloo ranks (what CI runs)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    gpus = 0 if args.dry_run else torch.cuda.device_count()  # NVML: no CUDA context yet
    if not args.dry_run and gpus == 0:
        print("gpu_check: no CUDA device; use --dry-run on CPU", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)  # tiny shapes: a second thread only contends with the forked ranks
    t0 = time.perf_counter()
    res: dict = {"dry_run": args.dry_run, "gpus": gpus, "seconds": {}}
    # 1. every multi-rank run, before this process touches CUDA
    res["verify"] = verify_layouts("gloo" if args.dry_run else "nccl" if gpus >= 2 else "gloo-cuda",
                                   32 if args.dry_run else 64)
    res["seconds"]["verify"] = round(time.perf_counter() - t0, 1)
    # 2. this process: CUDA from here on
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    res["device"] = "cpu" if args.dry_run else torch.cuda.get_device_name(device)
    t1 = time.perf_counter()
    kernels.USED.clear()
    if args.dry_run:
        res["kernel_parity"] = kernel_parity(device, [torch.float32], 64, [(12, 12), (16, 16), (24, 16)])
    else:
        res["kernel_parity"] = kernel_parity(device, [torch.bfloat16, torch.float32], 2048,
                                             [(12, 12), (128, 128), (192, 128)])
    res["attention_kernels"] = kernels.used()
    res["vocab_ce_rel_diff"] = vocab_ce_vs_torch(device)
    res["muon_ns_bf16_vs_fp32"] = muon_ns_bf16_vs_fp32(device)
    res["seconds"]["kernel_parity"] = round(time.perf_counter() - t1, 1)
    t2 = time.perf_counter()
    steps = 2 if args.dry_run else args.steps
    # tiny fp32 then bf16 (residual stream and payloads bf16): the same seed and data, so their first
    # losses differ only by bf16 rounding — the bf16-vs-fp32 model parity check, on either device.
    runs = [("tiny", 64, 2, "fp32", False, "adamw"), ("tiny", 64, 2, "bf16", False, "adamw"),
            ("tiny", 64, 2, "bf16", False, "muon")]
    if not args.dry_run:
        runs += [("small", 1024, 8, "bf16", True, "adamw"), (LLAMA_1B, 2048, 4, "bf16", True, "adamw")]
    res["train"] = [train_once(m, device, steps, sl, mb, dt, compile_=c, optimizer=o) for m, sl, mb, dt, c, o in runs]
    res["bf16_vs_fp32_first_loss_diff"] = abs(res["train"][1]["first_loss"] - res["train"][0]["first_loss"])
    res["fp8"] = fp8_steps(device)
    res["seconds"]["train"] = round(time.perf_counter() - t2, 1)
    res["seconds"]["total"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
