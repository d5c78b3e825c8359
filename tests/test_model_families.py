"""Qwen3 (per-head q/k norms, explicit head_dim), Qwen3-MoE- and DeepSeek-shaped models on every axis: `verify`
proves each layout equal to the single-device model (loss, every reduced gradient, parameters after AdamW); preset
and planner sizes against the published ones; config refusals. The HF-oracle side (logits, one step's loss and
gradients against transformers) is in test_hf.py."""
import dataclasses

import pytest

from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, get_model_config

from _dist import fresh_seed, run_ranks, verify_all

# head_dim 24: n_heads·head_dim = 96 != dim 64, so a dim // n_heads anywhere breaks shapes; tied like Qwen3-0.6B.
QWEN3 = ModelConfig(name="qwen3-tiny", vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=24,
                    ffn_dim=96, max_seq_len=64, norm_eps=1e-6, qk_norm=True, tie_embeddings=True)


# Qwen3-MoE-shaped: layer 1 dense, top-2 of 4 renormalised, Hugging Face's aux loss pooled over layers 0, 2, 3.
QWEN3_MOE = dataclasses.replace(QWEN3, name="qwen3-moe-tiny", tie_embeddings=False, moe_experts=4, moe_topk=2,
                                moe_ffn_dim=32, moe_dense_layers=(1,), moe_softmax_before_topk=False,
                                moe_aux_loss_coef=0.1, moe_aux_loss_scope="model")
# Under PP the pool would span stages: the per-layer aux loss instead.
QWEN3_MOE_LAYER = dataclasses.replace(QWEN3_MOE, moe_aux_loss_scope="layer")


# DeepSeek-V3-shaped: MLA with a query latent (q/k head 16 + 8 rotary, v head 12), layer 0 dense, 8 experts in 4
# groups (top-2 groups), sigmoid top-2 renormalised × 2.5, one shared expert, loss-free bias updates on.
DEEPSEEK = ModelConfig(name="deepseek-tiny", vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=4,
                       head_dim=16, ffn_dim=96, max_seq_len=64, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=24,
                       qk_rope_dim=8, v_head_dim=12, moe_experts=8, moe_topk=2, moe_ffn_dim=32, moe_shared_experts=1,
                       moe_dense_layers=(0,), moe_score="sigmoid", moe_n_group=4, moe_topk_group=2,
                       moe_routed_scaling=2.5, moe_bias_update_rate=0.01)
DEEPSEEK_NOQ = dataclasses.replace(DEEPSEEK, name="deepseek-noq", q_lora_rank=0, moe_norm_topk=False)


def _cfg(seed, model, global_batch=4, **parallel):
    return TrainConfig(model=model, parallel=ParallelConfig(**parallel), steps=2, seq_len=32, micro_batch=2,
                       global_batch=global_batch, seed=seed, progress=False)


def _check(cfgs, world, seed):
    for cfg, result in zip(cfgs, run_ranks(world, verify_all, cfgs, timeout_s=300)[0]):
        assert result["passed"] and result["first_step_grad_rel_diff"] < 1e-5, (seed, cfg.parallel, result)


def test_qwen3_two_rank_layouts():
    """TP+SP (q/k norm grads partial per rank), every PP schedule, CP ring and Ulysses."""
    seed = fresh_seed()
    cfgs = [_cfg(seed, QWEN3, tp=2, sequence_parallel=True), _cfg(seed, QWEN3, tp=2),
            _cfg(seed, QWEN3, global_batch=8, pp=2, schedule="1f1b"),
            _cfg(seed, QWEN3, global_batch=8, pp=2, schedule="interleaved", vp=2),
            _cfg(seed, QWEN3, global_batch=8, pp=2, schedule="zb"),
            _cfg(seed, QWEN3, global_batch=8, pp=2, schedule="dualpipev"),
            _cfg(seed, QWEN3, cp=2), _cfg(seed, QWEN3, cp=2, cp_impl="ulysses"),
            _cfg(seed, QWEN3_MOE, dp=2, ep=2), _cfg(seed, QWEN3_MOE, global_batch=8, dp=2, ep=2),
            _cfg(seed, QWEN3_MOE, cp=2, ep=2), _cfg(seed, QWEN3_MOE, tp=2, sequence_parallel=True),
            _cfg(seed, QWEN3_MOE_LAYER, global_batch=8, pp=2, schedule="1f1b"),
            # seeds that once failed: step 1's allowed sign flips moved wo 1.3e-3 of its norm (the value bound now
            # adds the update bounds passed); one embedding element's step-2 update off by lr/21 (floor lr/16); an
            # embedding element first touched at step 2 with a ~1e-8 gradient, its AdamW first step 0.5·lr off
            # (verify's FirstTouch allowance: 7.97 of the floor before, 0.28 with it)
            _cfg(889595099, QWEN3, tp=2, sequence_parallel=True),
            _cfg(2758942747, QWEN3_MOE, tp=2, sequence_parallel=True), _cfg(2358380713, QWEN3_MOE, dp=2, ep=2)]
    _check(cfgs, 2, seed)


def test_deepseek_layouts():
    """MLA heads over TP (with and without SP: the replicated down-projections' grads are partial either way),
    PP schedules, EP with group-limited sigmoid routing and loss-free bias updates, ZeRO-3, CP ring and Ulysses
    with v's head size below and above q/k's, 4-rank compositions."""
    seed = fresh_seed()
    two = [_cfg(seed, DEEPSEEK, tp=2), _cfg(seed, DEEPSEEK, tp=2, sequence_parallel=True),
           _cfg(seed, DEEPSEEK_NOQ, tp=2), _cfg(seed, DEEPSEEK, global_batch=8, pp=2, schedule="interleaved", vp=2),
           _cfg(seed, DEEPSEEK, global_batch=8, pp=2, schedule="dualpipev"), _cfg(seed, DEEPSEEK, dp=2, ep=2),
           _cfg(seed, DEEPSEEK, global_batch=8, dp=2, ep=2, zero=3),
           # CP: ring and Ulysses move one K/V shape, so MLA pads v (12) to q/k's 24, or q/k to a wider v (32)
           _cfg(seed, DEEPSEEK, cp=2), _cfg(seed, DEEPSEEK, cp=2, cp_impl="ulysses"),
           _cfg(seed, dataclasses.replace(DEEPSEEK, v_head_dim=32), cp=2),
           # selective recompute replays MLA's core (SDPA, and the padded ring under cp); full: whole blocks
           _cfg(seed, DEEPSEEK, tp=2, sequence_parallel=True, recompute="selective"),
           _cfg(seed, DEEPSEEK, cp=2, recompute="selective"), _cfg(seed, QWEN3_MOE, dp=2, ep=2, recompute="full")]
    _check(two, 2, seed)
    four = [_cfg(seed, DEEPSEEK, global_batch=8, dp=2, ep=2, tp=2, sequence_parallel=True),
            _cfg(seed, DEEPSEEK, global_batch=8, pp=2, tp=2, schedule="zb"),
            _cfg(seed, DEEPSEEK_NOQ, global_batch=8, dp=4, ep=4, zero=1)]
    _check(four, 4, seed)


def test_qwen3_four_rank_compositions():
    """tp=4 (2 K/V heads: each k_norm sees a head shared by two ranks), dp×tp×SP with ZeRO-3, pp×tp."""
    seed = fresh_seed()
    cfgs = [_cfg(seed, QWEN3, tp=4), _cfg(seed, QWEN3, global_batch=8, dp=2, tp=2, sequence_parallel=True, zero=3),
            _cfg(seed, QWEN3, global_batch=8, pp=2, tp=2, sequence_parallel=True),
            _cfg(seed, QWEN3_MOE, global_batch=8, dp=2, ep=2, tp=2, sequence_parallel=True),
            _cfg(seed, QWEN3_MOE, global_batch=8, dp=4, ep=4, zero=3),
            _cfg(seed, QWEN3_MOE_LAYER, global_batch=8, dp=2, ep=2, pp=2, schedule="zb")]
    _check(cfgs, 4, seed)


def test_pooled_aux_loss_refuses_pipeline():
    cfg = _cfg(0, QWEN3_MOE, global_batch=8, pp=2)
    with pytest.raises(ConfigError, match="--pp 2 with model 'qwen3-moe-tiny'.s aux loss pooled over all layers"):
        cfg.resolve_world(2)


def test_head_dim_is_derived_unless_given():
    assert get_model_config("tiny").head_dim == 12 and get_model_config("tiny", dim=128).head_dim == 16
    assert get_model_config("qwen3-8b", n_heads=16).head_dim == 128  # explicit: kept
    assert dataclasses.replace(QWEN3, head_dim=0).head_dim == 16
    with pytest.raises(ConfigError, match="dim=65 is not divisible by n_heads=4"):
        get_model_config("tiny", dim=65, n_heads=4, n_kv_heads=2)
    get_model_config("qwen3-0.6b").validate()


@pytest.mark.parametrize("name,total,active", [("qwen3-0.6b", 0.596, 0.596), ("qwen3-8b", 8.19, 8.19),
                                               ("qwen3-32b", 32.76, 32.76), ("qwen3-30b-a3b", 30.53, 3.35),
                                               ("qwen3-235b-a22b", 235.09, 22.19), ("mixtral-8x7b", 46.70, 12.88),
                                               ("deepseek-v3", 671.03, 37.55), ("deepseek-v2-lite", 15.71, 2.66)])
def test_preset_sizes(name, total, active):
    """Parameter counts, total and per token, are the published sizes (Qwen3: 0.6B, 8.2B, 32.8B, 30.5B / 3.3B
    active, 235B / 22B; Mixtral-8x7B: 46.7B / 12.9B; DeepSeek-V3 671B / 37B; V2-Lite 15.7B, whose published 2.4B
    active leaves out the 0.21B embedding)."""
    cfg = get_model_config(name)
    assert abs(cfg.num_params() / 1e9 - total) < 0.01 and abs(cfg.num_active_params() / 1e9 - active) < 0.01


@pytest.mark.parametrize("name,total,active", [("qwen3-8b", 8.2, 8.2), ("qwen3-30b-a3b", 30.5, 3.3),
                                               ("qwen3-235b-a22b", 235, 22), ("deepseek-v3", 671, 37)])
def test_planner_published_sizes(name, total, active):
    """The planner's exact counts are the published sizes to within the figure's last digit (model cards round
    or cut: Qwen3-8B's 8.19B is "8.2B", Qwen3-30B-A3B's 3.353B active "3.3B", DeepSeek-V3's 37.55B "37B"); the
    trainer's presets count the same."""
    from shardwise.planner.models import PRESETS, active_params, total_params

    spec = PRESETS[name]
    unit = 0.1 if total < 100 else 1.0  # the published figure's last digit
    counts = [total_params(spec) / 1e9, active_params(spec) / 1e9]
    assert abs(counts[0] - total) < unit and abs(counts[1] - active) < unit, counts
    if not spec.untrainable:
        cfg = get_model_config(name)
        assert (cfg.num_params(), cfg.num_active_params()) == (total_params(spec), active_params(spec))


def test_explain_json_reports_active_parameters(capsys):
    import json

    from shardwise.cli import main

    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "16", "--explain", "dp=1,pp=2,cp=8,ep=8",
                 "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert (est["params_total"], est["params_active"]) == (30532122624, 3353032704)


DS_JSON = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 101,
           "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
           "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10,
           "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_interleave": True}


@pytest.mark.parametrize("changes,message", [
    (dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy' is not supported: valid: noaux_tc"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    (dict(rope_interleave=False), "rope_interleave=False is not supported"),
    (dict(rope_scaling={"type": "yarn", "factor": 40, "mscale_all_dim": 1.0}), "lacks 'original_max_position_emb"),
    (dict(rope_scaling={"type": "longrope", "factor": 40}), "rope_scaling.rope_type='longrope' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(model_type="deepseek_v2", topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported: valid: greedy"),
    (dict(model_type="deepseek_v2", topk_method="greedy", scoring_func="sigmoid"), "scoring_func=.sigmoid. is not supported"),
])
def test_deepseek_config_refusals(tmp_path, changes, message):
    import json

    from shardwise.hf.config import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(DS_JSON | changes))
    with pytest.raises(ConfigError, match=message):
        config_from_hf(str(tmp_path))


# deepseek-ai/DeepSeek-V3's config.json: its context, RoPE and attention fields as published.
DS_V3_REAL = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
              "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
              "num_attention_heads": 128, "num_key_value_heads": 128, "max_position_embeddings": 163840,
              "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
              "n_group": 8, "topk_group": 4, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
              "qk_nope_head_dim": 128, "v_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "rope_theta": 10000,
              "moe_layer_freq": 1, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
              "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                               "original_max_position_embeddings": 4096, "type": "yarn"}}


def test_deepseek_v3_real_config_yarn(tmp_path, capsys):
    """The published config.json is read with its YaRN RoPE (transformers' values: attention_factor 1, the softmax
    scale × (1 + 0.1 ln 40)²), equals the deepseek-v3 preset, and `plan --model-config` accepts it."""
    import json
    import math

    from shardwise.cli import main
    from shardwise.hf.config import config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(DS_V3_REAL))
    cfg = config_from_hf(str(tmp_path))
    assert cfg.rope_yarn == (40.0, 4096, 32.0, 1.0, 1.0, True) and cfg.max_seq_len == 163840
    assert cfg.mla_mscale == pytest.approx((1 + 0.1 * math.log(40)) ** 2, rel=1e-15)
    preset = get_model_config("deepseek-v3")
    same = ("rope_yarn", "mla_mscale", "max_seq_len", "rope_theta", "head_dim", "qk_rope_dim", "v_head_dim")
    assert all(getattr(cfg, f) == getattr(preset, f) for f in same) and cfg.num_params() == preset.num_params()
    assert main(["plan", "--model-config", str(tmp_path / "config.json"), "--gpus", "1024", "--seq-len", "32768",
                 "--global-batch", "1024", "--zero", "3", "--recompute", "full", "--top", "1"]) == 0
    assert "hf-deepseek_v3 (671.03B params)" in capsys.readouterr().out


@pytest.mark.parametrize("model_type,changes,message", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=True is not supported"),
    ("qwen3", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types=.* is not supported"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "rope_type='dynamic'"),
])
def test_qwen3_config_refusals(tmp_path, model_type, changes, message):
    import json

    from shardwise.hf.config import config_from_hf

    base = {"model_type": model_type, "vocab_size": 101, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
            "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(base | changes))
    with pytest.raises(ConfigError, match=message):
        config_from_hf(str(tmp_path))


def test_tp_not_dividing_heads_exits_2(capsys):
    from shardwise.cli import main

    assert main(["train", "--model", "qwen3-0.6b", "--tp", "3", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tp 3 does not divide n_heads=16" in err and len(err.splitlines()) == 1, err
