"""Single-device forward+backward of the 2026 families against transformers' own classes: GLM-4.5
(Glm4MoeForCausalLM), MiniMax-M2 (MiniMaxM2ForCausalLM), DeepSeek-V3.2 with DeepSeek Sparse Attention
(DeepseekV32ForCausalLM) and Kimi-Linear (KimiLinearForCausalLM), CPU-sized.

Each family starts from transformers: a random model of its class (fp32, sdpa where the class has it) is saved with
`save_pretrained` and shardwise reads it as `--init-from-hf` does, so both hold the same weights; their logits and
loss are compared before timing (the gradients are the tests' business: tests/test_glm_minimax.py,
test_sparse_attention.py, test_kimi_linear.py). Neither computes an auxiliary loss. One step: logits → mean
cross-entropy over precomputed targets → backward; repetitions alternate who goes first, and the paired ratio
(median of shardwise/transformers per repetition) is robust to a shared machine's load
(`benchmarks/single_device.py`'s method and step functions).

    python benchmarks/family_speed.py --threads 1
    python benchmarks/family_speed.py --smoke      # tiny sizes, one repetition: the test of the script

Last stdout line: one JSON object (medians_s, ratios, ratio_of_medians, max_abs_diff, threads, config).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from single_device import hf_step, sw_step, timed  # noqa: E402

_MOE = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=1024)
FAMILIES = {
    # GLM-4.5: GQA 8/2 heads of 32, half-rotary, q/k norms, q/k/v biases, layer 0 dense, 16 experts in 4 groups
    # (top-2 groups, top-4 experts), one shared expert, routed weights x 2.5
    "glm-4.5": ("Glm4Moe", _MOE | dict(num_key_value_heads=2, head_dim=32, intermediate_size=512,
                                        moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
                                        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                        use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                         "partial_rotary_factor": 0.5})),
    # MiniMax-M2: GQA 8/2 heads of 32, a quarter rotary, width q/k norms, 16 experts top-4 sigmoid with a bias
    "minimax-m2": ("MiniMaxM2", _MOE | dict(num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                             num_local_experts=16, num_experts_per_tok=4, rotary_dim=8,
                                             bos_token_id=None, eos_token_id=None, output_router_logits=False)),
    # DeepSeek-V3.2: DeepSeek-V3's MLA and MoE with the lightning indexer (16 heads of 32) keeping 64 of the 256 keys
    "deepseek-v3.2": ("DeepseekV32", _MOE | dict(num_key_value_heads=8, intermediate_size=512,
                                                  moe_intermediate_size=128, first_k_dense_replace=1, q_lora_rank=96,
                                                  kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                                  v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                                  topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                                  norm_topk_prob=True, index_topk=64, index_n_heads=16,
                                                  index_head_dim=32)),
    # Kimi-Linear: 3 Kimi Delta Attention layers (8 heads of 32) and one MLA, 16 experts top-4 in 4 groups
    "kimi-linear": ("KimiLinear", _MOE | dict(num_key_value_heads=8, intermediate_size=512, moe_intermediate_size=128,
                                               kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                               v_head_dim=32, num_local_experts=16, num_experts_per_tok=4, n_group=4,
                                               topk_group=2, linear_head_dim=32, linear_num_heads=8,
                                               pad_token_id=None, bos_token_id=1, eos_token_id=2,
                                               layer_types=["linear_attention"] * 3 + ["full_attention"])),
}
SMOKE = {"batch": 1, "seq": 32, "reps": 1, "warmup": 0, "threads": 1}


def family_models(name: str, seed: int, folder: str):
    """(shardwise model, transformers model, shardwise config) with transformers' random weights."""
    import transformers

    from shardwise.hf.config import config_from_hf
    from shardwise.hf.weights import load_hf_into
    from shardwise.mesh import Mesh
    from shardwise.parallelize import build_model

    cls, kw = FAMILIES[name]
    torch.manual_seed(seed)
    model_cls = getattr(transformers, f"{cls}ForCausalLM")
    hcfg = model_cls.config_class(**kw)
    hcfg._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = model_cls(hcfg).to(torch.float32)
    with torch.no_grad():
        for n, b in hf.named_buffers():  # selection biases: random, so group-limited routing matters
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    hf.save_pretrained(folder, safe_serialization=True)
    cfg = dataclasses.replace(config_from_hf(folder), moe_aux_loss_coef=0.0)
    sw = build_model(cfg, Mesh.single(), seed=seed)
    load_hf_into(sw, folder)
    return sw, hf, cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(FAMILIES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="wall-time budget; repetitions (after 3) stop early once a model's share is spent")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 = torch's default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition, every model")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load0 = round(os.getloadavg()[0], 2)
    medians, ratios, ratio_of_medians, diffs, config = {}, {}, {}, {}, {}
    names = args.models.split(",")
    t_start = time.perf_counter()
    for i, name in enumerate(names):
        deadline = t_start + args.budget_s * (i + 1) / len(names)
        sw, hf, cfg = family_models(name, args.seed, tempfile.mkdtemp(prefix=f"sw-family-{name}-"))
        data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
        tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        with torch.no_grad():
            sw.eval(), hf.eval()
            diffs[name] = (sw(tokens) - hf(input_ids=tokens, use_cache=False).logits).abs().max().item()
        sw.train(), hf.train()
        impls = {"shardwise": (sw_step, sw), "transformers": (hf_step, hf)}
        for _ in range(args.warmup):
            for fn, model in impls.values():
                timed(fn, model, tokens, targets)
        times = {k: [] for k in impls}
        for r in range(args.reps):
            if r >= 3 and time.perf_counter() > deadline:
                break
            for k in (list(impls) if r % 2 == 0 else list(impls)[::-1]):
                fn, model = impls[k]
                times[k].append(timed(fn, model, tokens, targets))
        for k, ts in times.items():
            medians[f"{k}_{name}"] = statistics.median(ts)
        ratios[name] = statistics.median(a / b for a, b in zip(times["shardwise"], times["transformers"]))
        ratio_of_medians[name] = medians[f"shardwise_{name}"] / medians[f"transformers_{name}"]
        config[name] = {"batch": args.batch, "seq": args.seq, "reps": len(times["shardwise"])}
        print(f"[{name}] logits max abs diff {diffs[name]:.2e}; shardwise {medians[f'shardwise_{name}'] * 1e3:.1f} ms, "
              f"transformers {medians[f'transformers_{name}'] * 1e3:.1f} ms, paired ratio {ratios[name]:.3f}",
              file=sys.stderr)
    import transformers

    print(json.dumps({"medians_s": medians, "ratios": ratios, "ratio_of_medians": ratio_of_medians,
                      "max_abs_diff": diffs, "threads": torch.get_num_threads(), "config": config,
                      "wall_s": round(time.perf_counter() - t_start, 1),
                      "loadavg_1m": {"start": load0, "end": round(os.getloadavg()[0], 2)},
                      "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))


if __name__ == "__main__":
    main()
