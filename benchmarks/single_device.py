"""Single-device forward+backward: shardwise's `tiny`/`small` against transformers' LlamaForCausalLM, and CPU-sized
Qwen3-MoE and DeepSeek-V3 shapes against transformers' own Qwen3MoeForCausalLM and DeepseekV3ForCausalLM.

One microbatch per step: logits → mean cross-entropy over precomputed targets → backward, in
fp32 on CPU in a single process. Both models get the same weights (shardwise's seeded init, copied
into the HF model), the same tokens and the same targets, and both compute the loss from their
logits in the script (shardwise: `model.loss_fn(logits, targets).mean()`, its vocab-parallel CE at
tp=1; transformers: `F.cross_entropy(logits, targets)`), so HF's internal label shift is not used.

The HF model has the identical shape: vocab_size, hidden_size=dim, intermediate_size=ffn_dim,
num_hidden_layers, num_attention_heads, num_key_value_heads, rope_theta, rms_norm_eps,
tie_word_embeddings=False, attn_implementation="sdpa", fp32.

RoPE layouts differ: shardwise rotates Meta's interleaved pairs (2i, 2i+1), HF's rotate_half pairs
(i, i + hd/2). The q/k rows are therefore permuted per head when copying: HF row j·hd/2 + i is Meta
row 2i + j, i.e. `w.view(heads, hd//2, 2, dim).transpose(1, 2).reshape(heads*hd, dim)`. The script
checks logits, loss and every parameter gradient (gradients mapped back through the same
permutation) before timing.

Timing: per model, after warm-up, each repetition runs both implementations once, alternating who
goes first. Grad zeroing (set_to_none) is outside the timed region. Reported: medians and the
paired ratio (median over repetitions of shardwise/transformers), which is robust to the
background load of a shared machine.

    python benchmarks/single_device.py --threads 1
    python benchmarks/single_device.py              # torch's default thread count
    python benchmarks/single_device.py --profile    # + a torch.profiler table per implementation

The MoE families (`--models ...,qwen3-moe,deepseek-v3`) start from transformers: a random model of the
family's class (sdpa, fp32) is saved with `save_pretrained`, and shardwise reads it as `--init-from-hf` does
(`config_from_hf` + `load_hf_into`), so both hold the same weights by construction; their logits and loss are
compared before timing (their gradients are compared by tests/test_hf.py). Neither computes an auxiliary
loss (transformers' `output_router_logits=False`, shardwise's coefficient 0), so both do the same work.

Last stdout line: one JSON object (medians_s, ratios, ratio_of_medians, max_abs_diff, threads, config).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shardwise.config import get_model_config  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.parallelize import build_model  # noqa: E402


# ---------------------------------------------------------------- models
def hf_model(cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
              num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
              max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=False,
              attention_dropout=0.0, use_cache=False, hidden_act="silu", attention_bias=False, mlp_bias=False)
    try:  # transformers >= 5: RoPE settings live in rope_parameters
        hcfg = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, **kw)
    except TypeError:
        hcfg = LlamaConfig(rope_theta=cfg.rope_theta, **kw)
    hcfg._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(hcfg).to(torch.float32)
    model.config._attn_implementation = "sdpa"
    assert model.config._attn_implementation == "sdpa"
    return model


def meta_to_hf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Interleaved-pair (Meta) q/k rows → rotate_half (HF) rows, per head."""
    out_f, dim = w.shape
    hd = out_f // heads
    return w.view(heads, hd // 2, 2, dim).transpose(1, 2).reshape(out_f, dim)


def hf_to_meta_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    out_f, dim = w.shape
    hd = out_f // heads
    return w.view(heads, 2, hd // 2, dim).transpose(1, 2).reshape(out_f, dim)


def name_map(cfg) -> dict[str, tuple[str, int | None]]:
    """shardwise parameter name → (HF parameter name, heads to permute rows over or None)."""
    m = {"tok_embeddings.weight": ("model.embed_tokens.weight", None), "norm.weight": ("model.norm.weight", None),
         "output.weight": ("lm_head.weight", None)}
    for i in range(cfg.n_layers):
        s, h = f"layers.{i}.", f"model.layers.{i}."
        m |= {s + "attention.wq.weight": (h + "self_attn.q_proj.weight", cfg.n_heads),
              s + "attention.wk.weight": (h + "self_attn.k_proj.weight", cfg.n_kv_heads),
              s + "attention.wv.weight": (h + "self_attn.v_proj.weight", None),
              s + "attention.wo.weight": (h + "self_attn.o_proj.weight", None),
              s + "attention_norm.weight": (h + "input_layernorm.weight", None),
              s + "ffn_norm.weight": (h + "post_attention_layernorm.weight", None),
              s + "feed_forward.w1.weight": (h + "mlp.gate_proj.weight", None),
              s + "feed_forward.w3.weight": (h + "mlp.up_proj.weight", None),
              s + "feed_forward.w2.weight": (h + "mlp.down_proj.weight", None)}
    return m


def copy_weights(sw, hf, cfg) -> dict:
    mapping = name_map(cfg)
    sw_params, hf_params = dict(sw.named_parameters()), dict(hf.named_parameters())
    if set(mapping) != set(sw_params) or {v[0] for v in mapping.values()} != set(hf_params):
        raise RuntimeError(f"parameter names do not line up: shardwise-only {set(sw_params) - set(mapping)}, "
                           f"HF-only {set(hf_params) - {v[0] for v in mapping.values()}}")
    with torch.no_grad():
        for name, (hname, heads) in mapping.items():
            w = sw_params[name].detach()
            hf_params[hname].copy_(meta_to_hf_rows(w, heads) if heads else w)
    return mapping


# ---------------------------------------------------------------- MoE families, from transformers' classes
FAMILIES = {
    # Qwen3-MoE: q/k norms, head_dim 32, 16 experts top-4 renormalised, no shared expert, every layer MoE
    "qwen3-moe": ("Qwen3Moe", dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16,
                                    num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True,
                                    output_router_logits=False, max_position_embeddings=1024)),
    # DeepSeek-V3: MLA (q latent 96, kv latent 64, nope 32 + rope 16, v 32), layer 0 dense, 16 experts in 4
    # groups (top-2 groups, top-4 experts), one shared expert, routed weights x 2.5
    "deepseek-v3": ("DeepseekV3", dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                                        moe_intermediate_size=128, num_hidden_layers=4, first_k_dense_replace=1,
                                        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96,
                                        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                        max_position_embeddings=1024)),
    # gpt-oss: sinks, 128-token windows on even layers, q/k/v/o biases, 16 experts top-4 with biases and the
    # clamped SwiGLU, YaRN; transformers runs it with eager attention (GptOss has no SDPA path: sinks)
    "gpt-oss": ("GptOss", dict(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_local_experts=16,
                               num_experts_per_tok=4, sliding_window=128, max_position_embeddings=1024,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 128})),
    # Qwen3-Next: layers 0-2 Gated DeltaNet (4 key / 8 value heads of 64), layer 3 gated attention (8/2 heads of 64,
    # a quarter rotary), 16 experts top-4 plus a gated shared expert, every layer MoE
    "qwen3-next": ("Qwen3Next", dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                                      linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4,
                                      moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                      norm_topk_prob=True, output_router_logits=False, max_position_embeddings=1024)),
    # Qwen3.5-MoE (its text model): Qwen3-Next's shapes under Qwen3.5's classes (interleaved M-RoPE over text
    # positions, the top-k always renormalised)
    "qwen3.5-moe": ("Qwen3_5Moe", dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                                        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                                        shared_expert_intermediate_size=128, output_router_logits=False,
                                        max_position_embeddings=1024)),
}


def family_models(name: str, seed: int, folder: str):
    """(shardwise model, transformers model, shardwise config) holding the same weights: transformers' random
    init, saved and read back by shardwise's --init-from-hf path."""
    import dataclasses

    import transformers

    from shardwise.hf.weights import load_hf_into
    from shardwise.hf.config import config_from_hf

    cls, kw = FAMILIES[name]
    torch.manual_seed(seed)
    model_cls = getattr(transformers, f"{cls}ForCausalLM")
    hcfg = model_cls.config_class(**kw)  # Qwen3.5's is its text config (Qwen3_5MoeTextConfig)
    attn = "eager" if cls == "GptOss" else "sdpa"
    hcfg._attn_implementation = attn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = model_cls(hcfg).to(torch.float32)
    with torch.no_grad():
        for n, b in hf.named_buffers():  # DeepSeek's selection bias: random, so group-limited routing matters
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
        for n, p in hf.named_parameters():  # gpt-oss's biases and sinks: random, so their paths do work
            if n.endswith("bias") or n.endswith("sinks"):
                p.normal_(0.0, 0.1)
    hf.config._attn_implementation = attn
    hf.save_pretrained(folder, safe_serialization=True)
    cfg = dataclasses.replace(config_from_hf(folder), moe_aux_loss_coef=0.0)
    sw = build_model(cfg, Mesh.single(), seed=seed)
    load_hf_into(sw, folder)
    return sw, hf, cfg


# ---------------------------------------------------------------- steps
def sw_step(model, tokens, targets):
    loss = model.loss_fn(model(tokens), targets).mean()
    loss.backward()
    return loss


def hf_step(model, tokens, targets):
    logits = model(input_ids=tokens, use_cache=False).logits
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
    loss.backward()
    return loss


def check(sw, hf, cfg, mapping, tokens, targets) -> dict:
    """Max abs differences of logits (eval, no grad), loss and parameter gradients (one training step; not
    for the MoE families, whose gradients tests/test_hf.py compares)."""
    with torch.no_grad():
        logits_diff = (sw(tokens) - hf(input_ids=tokens, use_cache=False).logits).abs().max().item()
    for m in (sw, hf):
        m.zero_grad(set_to_none=True)
    loss_diff = (sw_step(sw, tokens, targets) - hf_step(hf, tokens, targets)).abs().item()
    if mapping is None:
        for m in (sw, hf):
            m.zero_grad(set_to_none=True)
        return {"logits": logits_diff, "loss": loss_diff, "grads": None}
    hf_params = dict(hf.named_parameters())
    grad_diff = 0.0
    for name, p in sw.named_parameters():
        hname, heads = mapping[name]
        g = hf_params[hname].grad
        g = hf_to_meta_rows(g, heads) if heads else g
        grad_diff = max(grad_diff, (p.grad - g).abs().max().item())
    for m in (sw, hf):
        m.zero_grad(set_to_none=True)
    return {"logits": logits_diff, "loss": loss_diff, "grads": grad_diff}


def timed(fn, model, tokens, targets) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    fn(model, tokens, targets)
    return time.perf_counter() - t0


def profile(name, fn, model, tokens, targets, steps: int = 3) -> None:
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            fn(model, tokens, targets)
    print(f"\n=== profile: {name} ({steps} steps) ===", file=sys.stderr)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


# ---------------------------------------------------------------- main
SMOKE = {"batch": 1, "seq_tiny": 16, "seq_small": 16, "reps": 1, "warmup": 0, "threads": 1}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small,qwen3-moe,deepseek-v3,gpt-oss,qwen3-next,qwen3.5-moe")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-tiny", type=int, default=128)
    ap.add_argument("--seq-small", type=int, default=256, help="small and the MoE families")
    ap.add_argument("--reps", type=int, default=0, help="timed repetitions per model (default: tiny 40, others 16)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="wall-time budget for all models; warm-up (after 1) and repetitions (after 3) stop "
                         "early once a model's share is spent, so an overloaded box still finishes")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 = torch's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per implementation")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, one repetition, every model: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load0 = round(os.getloadavg()[0], 2)
    torch.manual_seed(args.seed)
    print(f"torch {torch.__version__}, threads {threads} (interop {torch.get_num_interop_threads()}), "
          f"batch {args.batch}", file=sys.stderr)

    medians, ratios, ratio_of_medians, diffs, config = {}, {}, {}, {}, {}
    names = args.models.split(",")
    t_start = time.perf_counter()
    for i, name in enumerate(names):
        deadline = t_start + args.budget_s * (i + 1) / len(names)  # time a model leaves unused goes to the next
        seq = args.seq_tiny if name == "tiny" else args.seq_small
        reps = args.reps or (40 if name == "tiny" else 16)
        if name in FAMILIES:
            sw, hf, cfg = family_models(name, args.seed, tempfile.mkdtemp(prefix=f"sw-bench-{name}-"))
            mapping = None
        else:
            cfg = get_model_config(name)
            sw = build_model(cfg, Mesh.single(), seed=args.seed)
            hf = hf_model(cfg)
            mapping = copy_weights(sw, hf, cfg)
        gen = torch.Generator().manual_seed(args.seed + 1)
        data = torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), generator=gen)
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

        for m in (sw, hf):
            m.eval()  # dropout is 0 anyway; eval only for the logits comparison
        diffs[name] = check(sw, hf, cfg, mapping, tokens, targets)
        for m in (sw, hf):
            m.train()
        print(f"[{name}] dim {cfg.dim} layers {cfg.n_layers} heads {cfg.n_heads}/{cfg.n_kv_heads} ffn {cfg.ffn_dim} "
              f"experts {cfg.moe_experts} top-{cfg.moe_topk} "
              f"vocab {cfg.vocab_size}, batch {args.batch} seq {seq}; max abs diff {diffs[name]}", file=sys.stderr)

        impls = {"shardwise": (sw_step, sw), "transformers": (hf_step, hf)}
        for w in range(args.warmup):
            if w >= 1 and time.perf_counter() > deadline:
                break
            for fn, model in impls.values():
                timed(fn, model, tokens, targets)
        times = {k: [] for k in impls}
        order = list(impls)
        for r in range(reps):
            if r >= 3 and time.perf_counter() > deadline:
                print(f"[{name}] budget spent: stopping after {r} of {reps} repetitions", file=sys.stderr)
                reps = r
                break
            for k in (order if r % 2 == 0 else order[::-1]):
                fn, model = impls[k]
                times[k].append(timed(fn, model, tokens, targets))
        for k, ts in times.items():
            medians[f"{k}_{name}"] = statistics.median(ts)
        ratios[f"vs_transformers_{name}"] = statistics.median(a / b for a, b in zip(times["shardwise"],
                                                                                     times["transformers"]))
        ratio_of_medians[f"vs_transformers_{name}"] = medians[f"shardwise_{name}"] / medians[f"transformers_{name}"]
        config[name] = {"batch": args.batch, "seq": seq, "reps": reps, "warmup": args.warmup}
        print(f"[{name}] shardwise {medians[f'shardwise_{name}'] * 1e3:.1f} ms, transformers "
              f"{medians[f'transformers_{name}'] * 1e3:.1f} ms, paired ratio {ratios[f'vs_transformers_{name}']:.3f}",
              file=sys.stderr)
        if args.profile:
            for k, (fn, model) in impls.items():
                profile(f"{k} {name}", fn, model, tokens, targets)

    import transformers

    print(json.dumps({"medians_s": medians, "ratios": ratios, "ratio_of_medians": ratio_of_medians,
                      "max_abs_diff": diffs, "threads": threads, "config": config,
                      "wall_s": round(time.perf_counter() - t_start, 1),
                      "loadavg_1m": {"start": load0, "end": round(os.getloadavg()[0], 2)},
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))


if __name__ == "__main__":
    main()
