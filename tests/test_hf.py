"""Hugging Face interop: HF checkpoints load into every layout with transformers' logits; one training
step's loss and every parameter gradient equal transformers' loss.backward() (Llama tp2×pp2, Qwen2 with
q/k/v biases dp2×tp2×SP, Mixtral dp2×ep2×tp2, Qwen3 dp2×tp2×SP and tp4, Qwen3-MoE with HF's pooled aux loss
dp2×ep2×tp2×SP, DeepSeek-V3 dp2×ep2×tp2; measured: loss within 1e-7, gradients within 3e-7 absolute); export
round-trips. Qwen3, Qwen3-MoE, DeepSeek-V3 and DeepSeek-V2 are described in docs/models.md.

Tiny random models are built with transformers itself (weights drawn with initializer_range 0.2,
so attention is far from uniform and a wrong q/k permutation is visible: it changes logits by ~5,
against ~1e-6 when right). Multi-rank runs: tp=2 × pp=2 × SP (CLI, with every safetensors read
recorded), tp=2, tp=2 × cp=2 × SP, dualpipev pp=2, Mixtral dp=2 × ep=2 (reads recorded) and
tp=2 × SP, Qwen2 tp=2, tied Qwen2 tp=2 × pp=2 (the head's stage reads embed_tokens).

Fine-tuning (`train --init-from-hf`): tp=2 × pp=2 with a tied model at lr 0 exports the original
tensors; a 5-step dp=2 × tp=2 ZeRO-1 fine-tune starts at transformers' loss and, exported, gives
transformers shardwise's loss on a held batch; contradicting flags, tokenizers and data exit 2.
"""
import argparse
import dataclasses
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from shardwise.hf import weights as hf  # noqa: E402
from shardwise.hf.config import config_from_hf  # noqa: E402
from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from shardwise.training.assemble import assemble, resolve_model  # noqa: E402
from shardwise.commands.hf import add_parser, compare, hf_logits, run_export  # noqa: E402
from _dist import global_grads, grad_slices  # noqa: E402

SHAPE = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
DEEPSEEK = SHAPE | dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                       n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                       kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
# YaRN as DeepSeek-V3 configures it, scaled down: the 32-token tests run past original_max_position_embeddings 16;
# mscale_all_dim != mscale makes both the cos/sin attention_factor and MLA's softmax mscale² differ from 1.
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}


def _save(factory, name, cls_name, save_kw=None, biases=False, norms=False, shape=SHAPE, **cfg_kw):
    torch.manual_seed(len(name))
    config = getattr(transformers, f"{cls_name}Config")(**(shape | cfg_kw))
    model = getattr(transformers, f"{cls_name}ForCausalLM")(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if biases and n.endswith("bias"):  # HF zero-initialises them; random ones make their permutation matter
                p.normal_(0.0, 0.5)
            if norms and n.endswith("norm.weight"):  # HF's are ones; random q/k norms make their permutation matter
                p.normal_(1.0, 0.5)
        for n, b in model.named_buffers():  # DeepSeek's selection bias: HF zeros; random ones change the routing
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    path = str(factory.mktemp(name))
    model.save_pretrained(path, safe_serialization=True, **(save_kw or {}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> HF directory. llama: GQA 4/2, untied, rope_theta 5e5; tied: one K/V head (shared by tp=2
    ranks), tied embeddings, sharded into several files with an index; mixtral: 4 experts, top-2."""
    f = tmp_path_factory
    out = {"llama": _save(f, "llama", "Llama", rope_theta=500000.0),
           "tied": _save(f, "tied", "Llama", dict(max_shard_size="20KB"), num_key_value_heads=1,
                         tie_word_embeddings=True, num_hidden_layers=2),
           "mixtral": _save(f, "mixtral", "Mixtral", num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
           # HF's pooled aux loss on (large coef: its gradient shows), over both layers and every token
           "mixtral_aux": _save(f, "mixtral_aux", "Mixtral", num_local_experts=4, num_experts_per_tok=2,
                                num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.5),
           "mistral_window": _save(f, "mistral", "Mistral", sliding_window=16, num_hidden_layers=2),
           "qwen2": _save(f, "qwen2", "Qwen2", biases=True, num_hidden_layers=2),
           "qwen2_tied": _save(f, "qwen2_tied", "Qwen2", biases=True, tie_word_embeddings=True, num_hidden_layers=2),
           "llama3": _save(f, "llama3", "Llama", rope_parameters=LLAMA3_ROPE, num_hidden_layers=2),
           # Qwen3: q/k norms, head_dim 12 (4 heads · 12 = 48 != hidden 32); tied: one K/V head shared over tp
           "qwen3": _save(f, "qwen3", "Qwen3", norms=True, head_dim=12, num_hidden_layers=2),
           "qwen3_tied": _save(f, "qwen3_tied", "Qwen3", norms=True, head_dim=12, num_key_value_heads=1,
                               tie_word_embeddings=True, num_hidden_layers=2),
           # Qwen3-MoE: layer 1 dense (mlp_only_layers), experts renormalised, HF's pooled aux loss on (large coef);
           # step2: MoE only where (i + 1) % 2 == 0, top-k probabilities unnormalised
           "qwen3_moe": _save(f, "qwen3_moe", "Qwen3Moe", norms=True, head_dim=12, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                              norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.5),
           "qwen3_moe_step2": _save(f, "qwen3_moe_step2", "Qwen3Moe", norms=True, head_dim=12, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2),
           # DeepSeek-V3: MLA (q/k head 12 + 8 rotary, v head 10), layer 0 dense, 8 experts in 4 groups (top-2
           # groups, top-2 experts, biased selection), one shared expert, routed weights × 2.5; "ds_noq": no q latent
           "deepseek": _save(f, "deepseek", "DeepseekV3", norms=True, shape=DEEPSEEK),
           "deepseek_noq": _save(f, "deepseek_noq", "DeepseekV3", norms=True, shape=DEEPSEEK, q_lora_rank=None,
                                 norm_topk_prob=False, num_hidden_layers=2),
           # YaRN RoPE: DeepSeek-V3 (mscale² on the softmax scale) and Qwen3 (factor only: attention_factor 1 + 0.1 ln 4)
           "deepseek_yarn": _save(f, "deepseek_yarn", "DeepseekV3", norms=True, shape=DEEPSEEK, rope_parameters=YARN_ROPE,
                                  num_hidden_layers=2),
           "qwen3_yarn": _save(f, "qwen3_yarn", "Qwen3", norms=True, head_dim=12, num_hidden_layers=2,
                               rope_parameters={k: YARN_ROPE[k] for k in ("rope_type", "rope_theta", "factor",
                                                                          "original_max_position_embeddings")}),
           # DeepSeek-V2 (V2-Lite's class): softmax top-3 unnormalised, groups scored by their max, 2 shared experts
           "deepseek_v2": _save(f, "deepseek_v2", "DeepseekV2", norms=True, shape=DEEPSEEK, q_lora_rank=None,
                                topk_method="group_limited_greedy", num_experts_per_tok=3, n_shared_experts=2,
                                routed_scaling_factor=1.5)}
    return out


@pytest.fixture
def reads(tmp_path, monkeypatch):
    """Record every safetensors read made inside a rank (rank, name, box, elements); returns a collector.

    Forked ranks inherit the patched `safetensors.safe_open`; each appends to its own file.
    """
    import torch.distributed as dist

    real, log = safetensors.safe_open, tmp_path / "reads"
    log.mkdir()

    def record(name, op, box, numel):
        if dist.is_initialized():
            with open(log / f"{os.getpid()}.jsonl", "a") as fh:
                fh.write(json.dumps({"rank": dist.get_rank(), "name": name, "op": op, "numel": numel,
                                     "box": [[b.start, b.stop] for b in box]}) + "\n")

    class Slice:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, box):
            t = self.inner[box]
            record(self.name, "get_slice", box if isinstance(box, tuple) else (box,), t.numel())
            return t

    class Handle:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name), name)

        def get_tensor(self, name):
            t = self.inner.get_tensor(name)
            record(name, "get_tensor", (), t.numel())
            return t

    monkeypatch.setattr(safetensors, "safe_open", Handle)
    return lambda: [json.loads(line) for p in log.glob("*.jsonl") for line in p.read_text().splitlines()]


def _full_numel(path):
    files = hf.WeightFiles(path)
    return {n: int(torch.Size(files.shape(n)).numel()) for n in files.where}


def _check_result(r):
    assert r["passed"] and r["max_abs_diff"] < 1e-4 * max(1.0, r["max_ref_abs"]), r


@pytest.mark.parametrize("name", ["llama", "tied", "mixtral", "qwen2", "llama3", "qwen3", "qwen3_moe",
                                  "qwen3_moe_step2", "deepseek", "deepseek_noq", "deepseek_v2", "deepseek_yarn",
                                  "qwen3_yarn"])
def test_single_device_matches_transformers(models, name):
    if name == "tied":
        assert os.path.isfile(os.path.join(models[name], hf.INDEX))
        assert len([f for f in os.listdir(models[name]) if f.endswith(".safetensors")]) > 1
    _check_result(compare(models[name], ParallelConfig(), seq_len=32, batch=2))


LAYOUTS = {
    "llama_tp2": ("llama", dict(tp=2)),
    "tied_tp2_cp2_sp": ("tied", dict(tp=2, cp=2, sequence_parallel=True)),
    "llama_dualpipev_pp2": ("llama", dict(pp=2, schedule="dualpipev")),
    "mixtral_tp2_sp": ("mixtral", dict(tp=2, sequence_parallel=True)),
    "mixtral_tp2_pp2": ("mixtral", dict(tp=2, pp=2)),
    "qwen2_tp2": ("qwen2", dict(tp=2)),
    "qwen2_tied_tp2_pp2": ("qwen2_tied", dict(tp=2, pp=2)),  # the LM head's stage reads embed_tokens
    "qwen3_tp2_sp": ("qwen3", dict(tp=2, sequence_parallel=True)),
    "qwen3_pp2": ("qwen3", dict(pp=2)),
    "qwen3_tied_tp2_cp2": ("qwen3_tied", dict(tp=2, cp=2)),  # one K/V head (and its k_norm) on both TP ranks
    "qwen3_moe_dp2_ep2_tp2_sp": ("qwen3_moe", dict(dp=2, ep=2, tp=2, sequence_parallel=True)),
    "qwen3_moe_step2_pp2_tp2": ("qwen3_moe_step2", dict(pp=2, tp=2)),
    "deepseek_tp2_sp": ("deepseek", dict(tp=2, sequence_parallel=True)),
    "deepseek_dp2_ep2_pp2": ("deepseek", dict(dp=2, ep=2, pp=2)),
    "deepseek_noq_tp2": ("deepseek_noq", dict(tp=2)),
    "deepseek_tp2_cp2_ulysses": ("deepseek", dict(tp=2, cp=2, cp_impl="ulysses")),
    "deepseek_noq_cp2": ("deepseek_noq", dict(cp=2)),
    "deepseek_v2_dp2_ep2_tp2_sp": ("deepseek_v2", dict(dp=2, ep=2, tp=2, sequence_parallel=True)),
    "deepseek_yarn_tp2_cp2": ("deepseek_yarn", dict(tp=2, cp=2)),  # YaRN tables at each chunk's global positions
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_transformers(models, layout):
    name, degrees = LAYOUTS[layout]
    _check_result(compare(models[name], ParallelConfig(**degrees), seq_len=32, batch=2))


def _cli(argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_tp2_pp2_reads_only_local_slices(models, reads, capsys):
    """hf-compare on tp=2 × pp=2: logits match, and each HF tensor is read by one pipeline stage only,
    split between its two TP ranks (norms whole on both), never with get_tensor."""
    assert _cli(["hf-compare", models["llama"], "--tp", "2", "--pp", "2", "--sequence-parallel",
                 "--seq-len", "16", "--batch", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["passed"] and result["layout"]["tp"] == 2 and result["layout"]["pp"] == 2, result
    records = reads()
    assert records and not [r for r in records if r["op"] != "get_slice"]
    full = _full_numel(models["llama"])
    assert {r["name"] for r in records} == set(full)
    for name, numel in full.items():
        got = [r for r in records if r["name"] == name]
        assert len({r["rank"] // 2 for r in got}) == 1, (name, got)  # rank = pp · tp + tp_rank
        layer = int(name.split(".")[2]) if ".layers." in name else None
        if layer is not None:
            assert got[0]["rank"] // 2 == layer // 2, (name, got)  # layers 0-1 on stage 0, 2-3 on stage 1
        assert len(got) == 2, (name, got)
        if name.endswith("norm.weight"):
            assert all(r["numel"] == numel for r in got)
        else:
            assert sum(r["numel"] for r in got) == numel and got[0]["box"] != got[1]["box"], (name, got)
    assert sum(r["numel"] * 4 for r in records) == sum(result["bytes_read_per_rank"])


def test_mixtral_dp2_ep2_reads_only_local_experts(models, reads):
    r = compare(models["mixtral"], ParallelConfig(dp=2, ep=2), seq_len=16, batch=2)
    _check_result(r)
    records = reads()
    assert not [x for x in records if x["op"] != "get_slice"]
    for name, numel in _full_numel(models["mixtral"]).items():
        got = sorted(x["rank"] for x in records if x["name"] == name)
        if ".experts." in name:  # expert e lives on ep rank e // 2 only
            assert got == [int(name.split(".experts.")[1].split(".")[0]) // 2], (name, got)
        else:  # everything else is replicated over dp
            assert got == [0, 1] and all(x["numel"] == numel for x in records if x["name"] == name), name


def test_fused_mixtral_experts_load(models, tmp_path):
    """transformers >= 5 keeps experts fused in memory (gate_up_proj [E, 2F, D], down_proj): a file
    saved from its state_dict loads too."""
    model = transformers.AutoModelForCausalLM.from_pretrained(models["mixtral"])
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not any(k.endswith("gate_up_proj") for k in state):
        pytest.skip("this transformers keeps Mixtral experts per expert")
    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(models["mixtral"], "config.json"), tmp_path)
    r = compare(str(tmp_path), ParallelConfig(), seq_len=16, batch=2)
    _check_result(r)
    assert torch.allclose(r["logits"], hf_logits(models["mixtral"], _tokens(16)), atol=1e-5)


def _tokens(seq_len, batch=2, seed=0):
    return torch.randint(0, SHAPE["vocab_size"], (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def _single_model(path):
    from shardwise.mesh import Mesh
    from shardwise.parallelize import build_model

    cfg = config_from_hf(path)
    model = build_model(cfg, Mesh.single(), seed=0)
    hf.load_hf_into(model, path)
    return cfg, model.eval()


@pytest.mark.parametrize("name,as_state", [("llama", False), ("tied", True), ("mixtral", True), ("qwen2", False),
                                           ("qwen3_tied", True), ("qwen3_moe", False), ("qwen3_moe_step2", True),
                                           ("deepseek", False), ("deepseek_noq", True), ("deepseek_v2", True),
                                           ("deepseek_yarn", False), ("qwen3_yarn", True)])
def test_export_round_trip(models, tmp_path, name, as_state):
    cfg, model = _single_model(models[name])
    out = hf.export_hf(model.state_dict() if as_state else model, cfg, str(tmp_path / "out"))
    tokens = _tokens(24)
    ref = hf_logits(models[name], tokens)
    assert torch.allclose(hf_logits(out, tokens), ref, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert torch.allclose(model(tokens), ref, atol=1e-4, rtol=0)
    back = config_from_hf(out)
    assert dataclasses.replace(back, name=cfg.name) == cfg


def test_hf_export_from_checkpoint(models, tmp_path):
    """A checkpoint of a model loaded from HF exports (hf-export) to the same HF logits."""
    from shardwise.checkpoint import save_checkpoint
    from shardwise.training.trainer import Trainer, make_mesh

    cfg = TrainConfig(model=config_from_hf(models["llama"]), steps=1, seq_len=16, micro_batch=2, progress=False)
    trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")), tokens=torch.randint(0, 101, (2048,)))
    hf.load_hf_into(trainer.model, models["llama"])
    save_checkpoint(str(tmp_path / "ckpt"), 0, trainer)
    out = str(tmp_path / "exported")
    assert run_export(argparse.Namespace(ckpt_dir=str(tmp_path / "ckpt"), out_dir=out)) == 0
    tokens = _tokens(16)
    assert torch.allclose(hf_logits(out, tokens), hf_logits(models["llama"], tokens), atol=1e-6, rtol=0)


def test_sliding_window_caps_sequence(models):
    with pytest.warns(UserWarning, match="sliding_window=16"):
        cfg = config_from_hf(models["mistral_window"])
    assert cfg.max_seq_len == 16
    with pytest.warns(UserWarning):
        _check_result(compare(models["mistral_window"], ParallelConfig(), seq_len=16, batch=2))
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="max_seq_len=16"):
        compare(models["mistral_window"], ParallelConfig(), seq_len=32)


def _write_config(tmp_path, **changes):
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(base | changes))
    return str(tmp_path)


@pytest.mark.parametrize("changes,message", [
    (dict(model_type="gpt2"), "model_type='gpt2' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope_scaling.rope_type='longrope'"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "lacks 'original_max_position_embeddings'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "rope_parameters.rope_type='dynamic'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "only \\*ForCausalLM"),
    (dict(hidden_size=None), "lacks 'hidden_size'"),
])
def test_unsupported_configs_are_refused(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf(_write_config(tmp_path, **changes))


def test_config_mapping_and_rope_scaling(tmp_path):
    cfg = config_from_hf(_write_config(tmp_path, rope_theta=5e5, tie_word_embeddings=True))
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.max_seq_len, cfg.rope_theta, cfg.norm_eps,
            cfg.tie_embeddings) == (32, 4, 2, 48, 64, 5e5, 1e-6, True)
    scaled = _write_config(tmp_path, rope_scaling=LLAMA3_ROPE)
    assert config_from_hf(scaled).rope_scaling == (8.0, 1.0, 4.0, 16)
    with pytest.raises(ConfigError, match="no config.json"):
        config_from_hf(str(tmp_path / "missing"))


def test_export_refuses_what_hf_cannot_express(tmp_path):
    moe = ModelConfig(moe_experts=4, moe_topk=2, moe_softmax_before_topk=False, moe_shared_experts=1)
    with pytest.raises(ConfigError, match="moe_shared_experts=1"):
        hf.export_hf({}, moe, str(tmp_path))
    with pytest.raises(ConfigError, match="moe_softmax_before_topk=True"):
        hf.export_hf({}, dataclasses.replace(moe, moe_shared_experts=0, moe_softmax_before_topk=True), str(tmp_path))


# ---------------------------------------------------------------- training oracle
TRAIN_LAYOUTS = {  # one 4-rank spawn runs them all: (model, degrees, global batch)
    "llama_tp2_pp2": ("llama", dict(tp=2, pp=2), 8),
    "qwen2_dp2_tp2_sp": ("qwen2", dict(dp=2, tp=2, sequence_parallel=True), 4),
    "mixtral_dp2_ep2_tp2": ("mixtral", dict(dp=2, ep=2, tp=2), 4),
    "mixtral_aux_dp2_ep2_tp2": ("mixtral_aux", dict(dp=2, ep=2, tp=2), 4),  # HF's pooled aux loss, coef 0.5
    "qwen3_dp2_tp2_sp": ("qwen3", dict(dp=2, tp=2, sequence_parallel=True), 4),
    "qwen3_tp4": ("qwen3", dict(tp=4), 4),  # no SP, yet q/k norm grads are partial; 2 K/V heads over 4 ranks
    # HF's pooled aux loss (coef 0.5) over layers 0, 2, 3 and both dp ranks' tokens: one global microbatch
    "qwen3_moe_dp2_ep2_tp2_sp": ("qwen3_moe", dict(dp=2, ep=2, tp=2, sequence_parallel=True), 4),
    # MLA heads over tp (replicated down-projections: partial grads), experts over ep
    "deepseek_dp2_ep2_tp2": ("deepseek", dict(dp=2, ep=2, tp=2), 4),
}
TRAIN_TOKENS = torch.randint(0, SHAPE["vocab_size"], (4096,), generator=torch.Generator().manual_seed(1))


def _train_config(path, degrees, global_batch):
    """One fp32 step, no clipping. Mixtral and Qwen3-MoE: HF's pooled aux loss where config.json asks for it
    (output_router_logits), none otherwise."""
    model = config_from_hf(path)
    if model.moe_aux_loss_scope != "model":
        model = dataclasses.replace(model, moe_aux_loss_coef=0.0)
    return TrainConfig(model=model, parallel=ParallelConfig(**degrees), steps=1, seq_len=16, micro_batch=2,
                       global_batch=global_batch, grad_clip=1e30, progress=False)


def _rank_grads(jobs):
    """Inside each rank: load the HF weights into the layout, one forward+backward, and the reduced
    gradient slices this rank holds as (global name, shard dim, start, rows, values)."""
    from shardwise.training.trainer import Trainer, make_mesh

    out = []
    for path, degrees, global_batch in jobs:
        cfg = _train_config(path, degrees, global_batch)
        cfg = cfg.resolved()
        trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")), tokens=TRAIN_TOKENS)
        hf.load_hf_into(trainer.model, path)
        loss = trainer.forward_backward(0)
        trainer.finish_gradients()
        aux = sum(float(m.step_aux) for m in trainer.moe)  # this rank's tokens' share of the pooled aux loss
        out.append((loss, grad_slices(trainer), aux))
    return out



def _hf_loss_and_grads(path, global_batch, out_dir):
    """transformers in training mode: mean token cross-entropy of the same global batch, its gradients
    written under HF names next to a copy of config.json, so shardwise's importer maps them."""
    from safetensors.torch import save_file

    from shardwise.data import Loader

    x, y = Loader(TRAIN_TOKENS, 16, global_batch, TrainConfig().seed).global_batch_at(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    out = model(x)
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    aux = 0.0
    if getattr(out, "aux_loss", None) is not None:  # output_router_logits: transformers adds coef · aux
        aux = float(out.aux_loss)
        (loss + model.config.router_aux_loss_coef * out.aux_loss).backward()
    else:
        loss.backward()
    os.makedirs(out_dir)
    save_file({n: p.grad.contiguous() for n, p in model.named_parameters()},
              os.path.join(out_dir, "model.safetensors"))
    shutil.copy(os.path.join(path, "config.json"), out_dir)
    return float(loss.detach()), aux


@pytest.fixture(scope="module")
def trained(models):
    from shardwise.training.launch import run_local

    jobs = [(models[m], degrees, gb) for m, degrees, gb in TRAIN_LAYOUTS.values()]
    return run_local(_rank_grads, 4, jobs, timeout_s=120)


@pytest.mark.parametrize("i,layout", list(enumerate(TRAIN_LAYOUTS)))
def test_training_step_matches_transformers(models, trained, tmp_path, i, layout):
    """Loss and every parameter gradient of one training step on a layout equal transformers'
    loss.backward(), its gradients read through the same HF → shardwise name and row mapping."""
    name, degrees, global_batch = TRAIN_LAYOUTS[layout]
    path = models[name]
    ref_loss, ref_aux = _hf_loss_and_grads(path, global_batch, str(tmp_path / "hf_grads"))
    losses = {round(r[i][0], 12) for r in trained}
    assert len(losses) == 1  # every rank reports the same global loss (the cross-entropy)
    assert abs(trained[0][i][0] - ref_loss) <= 1e-6 * abs(ref_loss), (trained[0][i][0], ref_loss)
    if layout.startswith(("qwen3_moe", "mixtral_aux")):  # HF's pooled aux loss: each rank holds its tokens' share
        assert ref_aux > 1.0
        copies = 1 if degrees.get("sequence_parallel") else degrees.get("tp", 1)  # without SP tp ranks share tokens
        ours = sum(r[i][2] for r in trained) / copies
        assert abs(ours - ref_aux) <= 1e-6 * ref_aux, ([r[i][2] for r in trained], ref_aux)
    cfg = config_from_hf(path)
    files = hf.WeightFiles(str(tmp_path / "hf_grads"))
    from shardwise.mesh import Mesh
    from shardwise.parallelize import build_model

    shapes = {n: p.shape for n, p in build_model(cfg, Mesh.single(), seed=0).named_parameters()}
    ours = global_grads([g for r in trained for g in r[i][1]], shapes)
    for n, g in ours.items():
        src = hf.tensor_source(n, cfg, files)
        ref = src.read(files, tuple(slice(0, s) for s in shapes[n]))
        assert float(ref.abs().max()) > 0, n  # every parameter gets a gradient in this step
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{layout} {n}: {m}")


# ---------------------------------------------------------------- fine-tuning: train --init-from-hf
HELD_STEP = 1000  # a global batch no training step of these tests reads


def _tokenizer(path, n_ids):
    """A WordLevel tokenizer.json with `n_ids` ids (the `tokenizers` library, as HF models ship)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({f"t{i}": i for i in range(n_ids)}, unk_token="t0")).save(os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def ft_models(tmp_path_factory):
    """Vocabulary 300, so the byte-level training data (ids < 257) fits; tokenizers of 280 ids."""
    f = tmp_path_factory
    return {"tied": _tokenizer(_save(f, "ft_tied", "Llama", dict(max_shard_size="40KB"), vocab_size=300,
                                     tie_word_embeddings=True), 280),
            "llama": _tokenizer(_save(f, "ft_llama", "Llama", vocab_size=300), 280)}


def test_init_from_hf_lr0_tied_tp2_pp2_export_reproduces_weights(ft_models, tmp_path, capsys):
    """`train --init-from-hf` on tp=2 × pp=2 with a tied model (the head's stage reads embed_tokens), one
    step at lr 0, then `hf-export`: every original safetensors tensor comes back (1e-6), nothing extra,
    and the run directory records the tokenizer."""
    from safetensors.torch import load_file

    from shardwise.cli import main

    path, run = ft_models["tied"], str(tmp_path / "run")
    text = tmp_path / "bytes.txt"  # byte-level data fits the 300-id vocabulary
    text.write_text("shardwise fine-tunes a Hugging Face model on a few bytes of text. " * 20)
    assert main(["train", "--init-from-hf", path, "--tp", "2", "--pp", "2", "--lr", "0", "--steps", "1",
                 "--seq-len", "16", "--micro-batch", "1", "--microbatches", "2", "--save-every", "1", "--out", run,
                 "--no-report", "--no-progress", "--data", str(text)]) == 0
    with open(os.path.join(run, "config.json")) as f:
        rec = json.load(f)["init_from_hf"]
    assert rec["tokenizer"]["vocab_size"] == 280 and len(rec["weight_files"]) > 1, rec
    out = str(tmp_path / "exported")
    assert run_export(argparse.Namespace(ckpt_dir=os.path.join(run, "checkpoints"), out_dir=out)) == 0
    files = hf.WeightFiles(path)
    original = {n: files.read(n, tuple(slice(0, s) for s in files.shape(n))) for n in files.where}
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(original) and "lm_head.weight" not in exported
    for n, t in original.items():
        torch.testing.assert_close(exported[n], t, atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(hf_logits(out, tokens), hf_logits(path, tokens), atol=1e-6, rtol=0)


def _finetune(path, ckpt):
    """Inside each rank: 5 steps of a real fine-tune on dp=2 × tp=2 with ZeRO-1, a checkpoint, and the
    loss (no update) on a held batch."""
    from shardwise.checkpoint import save_checkpoint
    from shardwise.training.trainer import Trainer, make_mesh

    cfg = TrainConfig(model=None, init_from_hf=path, parallel=ParallelConfig(dp=2, tp=2, zero=1), steps=5,
                      seq_len=16, micro_batch=2, global_batch=8, lr=3e-3, warmup_steps=1, progress=False)
    cfg = assemble(cfg)  # a new, resolved config
    trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
    losses = [trainer.train_step(s)["loss"] for s in range(cfg.steps)]
    save_checkpoint(ckpt, cfg.steps, trainer)
    return losses, trainer.forward_backward(HELD_STEP)


def test_finetune_dp2_tp2_zero1_exported_loss_matches_transformers(ft_models, tmp_path):
    from shardwise.data import Loader, load_tokens
    from shardwise.training.launch import run_local

    path, ckpt = ft_models["llama"], str(tmp_path / "ckpt")
    results = run_local(_finetune, 4, path, ckpt, timeout_s=120)
    losses, held = results[0]
    assert all(r[1] == held for r in results)
    out = str(tmp_path / "exported")
    assert run_export(argparse.Namespace(ckpt_dir=ckpt, out_dir=out)) == 0
    loader = Loader(load_tokens(None), 16, 8, TrainConfig().seed)

    def hf_loss(d, step):
        x, y = loader.global_batch_at(step)
        logits = hf_logits(d, x)
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))

    assert abs(hf_loss(path, 0) - losses[0]) <= 1e-5, (hf_loss(path, 0), losses)  # started from the HF weights
    assert abs(hf_loss(out, HELD_STEP) - held) <= 1e-5, (hf_loss(out, HELD_STEP), held, losses)
    assert abs(hf_loss(path, HELD_STEP) - held) > 1e-2, "the fine-tune changed the model"


@pytest.mark.parametrize("extra,message", [
    (["--model", "small"], "--model small contradicts --init-from-hf"),
    (["--tie-embeddings"], "--tie-embeddings True contradicts"),
    (["--moe-experts", "4"], "--moe-experts 4 contradicts"),
    (["--seq-len", "128"], "--seq-len 128 exceeds max_seq_len=64"),
])
def test_init_from_hf_contradicting_flags_exit_2(ft_models, capsys, extra, message):
    from shardwise.cli import main

    assert main(["train", "--init-from-hf", ft_models["llama"], "--seq-len", "16", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_init_from_hf_tokenizer_and_data_vocab_checked(ft_models, models, tmp_path, capsys):
    """Exit 2 before any rank starts: a tokenizer with more ids than the model's vocabulary; byte data
    (ids up to 256) for a model of 101 ids; a shape override (e.g. n_layers) that differs."""
    from shardwise.cli import main

    big = str(tmp_path / "big")
    shutil.copytree(ft_models["llama"], big)
    _tokenizer(big, 400)
    text = tmp_path / "bytes.txt"
    text.write_text("byte-level text " * 40)
    for path, message in ((big, "the tokenizer has 400 ids, more than the model's vocab_size=300"),
                          (models["llama"], "token ids up to 256 exceed the vocab_size=101"),
                          (big, f"needs --data tokenized with its tokenizer (the built-in corpus is byte-level): "
                                f"shardwise prepare-data FILES --tokenizer {big} --out DIR")):
        data = ["--data", str(text)] if "needs --data" not in message else []
        assert main(["train", "--init-from-hf", path, "--seq-len", "16", *data]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    cfg = TrainConfig(model=None, init_from_hf=ft_models["llama"], model_overrides={"n_layers": 3})
    with pytest.raises(ConfigError, match="--n-layers 3 contradicts .* n_layers=4"):
        resolve_model(cfg)
    # data tokenized by another tokenizer.json: its 250 ids fit the vocabulary and would mean other tokens
    from shardwise.data.prepare import prepare_data

    other = _tokenizer(str(tmp_path), 250)
    (tmp_path / "docs.jsonl").write_text('{"text": "t1"}\n' * 40)  # a WordLevel word per document
    prepare_data([str(tmp_path / "docs.jsonl")], os.path.join(other, "tokenizer.json"), str(tmp_path / "data"),
                 no_eos=True, progress=False)
    assert main(["train", "--init-from-hf", ft_models["llama"], "--data", str(tmp_path / "data"), "--seq-len", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--data was prepared with another tokenizer ({os.path.join(other, 'tokenizer.json')}), not --init-from-hf's " \
        in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------- hf-export: a complete folder
def _bpe_dir(folder):
    """A byte-level BPE with an <|endoftext|> special token, saved as a model folder's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models as tmodels, pre_tokenizers, trainers

    tok = Tokenizer(tmodels.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = "the quick brown fox jumps over a lazy dog while wizards pack boxes".split()
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def _export_loads_and_generates(out, eos, text):
    """transformers reads the folder: the tokenizer round-trips `text`, the ids agree, and generate runs."""
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    cfg, gen = (json.load(open(os.path.join(out, n))) for n in ("config.json", "generation_config.json"))
    assert cfg["eos_token_id"] == gen["eos_token_id"] == tok.eos_token_id == eos, (cfg, gen, tok.eos_token_id)
    assert cfg["pad_token_id"] == gen["pad_token_id"] == eos and cfg["bos_token_id"] == eos
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == text
    new = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert new.shape == (1, ids.shape[1] + 4)
    return ids[0].tolist()


def test_hf_export_writes_tokenizer_ids_and_refuses_a_used_folder(tmp_path, capsys):
    """The quickstart's run (byte data, no checkpoint flag) exports a folder transformers loads with a
    byte-level tokenizer equal to shardwise's (eos 256); a BPE-prepared run exports its tokenizer with the
    data's end-of-document id; a non-empty folder is refused without --overwrite."""
    from shardwise.cli import main
    from shardwise.data.prepare import prepare_data

    one = ["train", "--dp", "1", "--tp", "1", "--steps", "1", "--seq-len", "16", "--micro-batch", "1",
           "--no-progress", "--no-report"]
    run = tmp_path / "byte_run"
    assert main([*one, "--out", str(run)]) == 0  # checkpoints by default: export works right after
    out = str(tmp_path / "byte_export")
    assert main(["hf-export", str(run / "checkpoints"), out]) == 0
    text = "héllo, wörld\n"
    assert _export_loads_and_generates(out, 256, text) == list(text.encode())

    capsys.readouterr()
    assert main(["hf-export", str(run / "checkpoints"), out]) == 2  # never over an existing model
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0] and "--overwrite" in err[0], err
    (tmp_path / "byte_export" / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    assert main(["hf-export", str(run / "checkpoints"), out, "--overwrite"]) == 0
    assert not os.path.exists(os.path.join(out, "model-00001-of-00002.safetensors"))

    bpe = _bpe_dir(str(tmp_path / "bpe"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"the quick fox {i} jumps"}) + "\n"
                                                 for i in range(60)))
    m = prepare_data([str(tmp_path / "docs.jsonl")], bpe, str(tmp_path / "data"), progress=False)
    run = tmp_path / "bpe_run"
    assert main([*one, "--data", str(tmp_path / "data"), "--out", str(run)]) == 0
    out = str(tmp_path / "bpe_export")
    assert main(["hf-export", str(run / "checkpoints"), out]) == 0
    assert open(os.path.join(out, "tokenizer.json")).read() == open(os.path.join(bpe, "tokenizer.json")).read()
    from tokenizers import Tokenizer

    text = "the quick brown fox"
    want = Tokenizer.from_file(os.path.join(bpe, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert _export_loads_and_generates(out, m["eos_id"], text) == want and m["eos_id"] != 256


def test_deepseek_init_from_hf_tp2_ep2_lr0_exports_the_checkpoint(tmp_path):
    """`train --init-from-hf` of a DeepSeek-V3 checkpoint on dp2×ep2×tp2 at lr 0, then `hf-export`: every tensor
    comes back, e_score_correction_bias included (a buffer shardwise checkpoints), and transformers' logits match."""
    from safetensors.torch import load_file

    from shardwise.cli import main

    path = _tokenizer(_save(tmp_path_factory_shim(tmp_path), "ft_deepseek", "DeepseekV3", norms=True,
                            shape=DEEPSEEK | dict(vocab_size=300)), 280)
    run = str(tmp_path / "run")
    text = tmp_path / "bytes.txt"  # byte-level data fits the 300-id vocabulary
    text.write_text("shardwise fine-tunes a DeepSeek model on a few bytes of text. " * 20)
    assert main(["train", "--init-from-hf", path, "--dp", "2", "--ep", "2", "--tp", "2", "--lr", "0", "--steps", "1",
                 "--seq-len", "16", "--micro-batch", "1", "--save-every", "1", "--out", run, "--no-report",
                 "--no-progress", "--data", str(text)]) == 0
    out = str(tmp_path / "exported")
    assert run_export(argparse.Namespace(ckpt_dir=os.path.join(run, "checkpoints"), out_dir=out)) == 0
    files = hf.WeightFiles(path)
    original = {n: files.read(n, tuple(slice(0, s) for s in files.shape(n))) for n in files.where}
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert any(n.endswith("e_score_correction_bias") for n in exported)
    for n, t in original.items():
        torch.testing.assert_close(exported[n], t, atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(hf_logits(out, tokens), hf_logits(path, tokens), atol=1e-5, rtol=0)


class tmp_path_factory_shim:
    """`_save` takes a pytest tmp_path_factory; one directory under tmp_path serves here."""

    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        d = self.root / name
        d.mkdir()
        return d


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_equal_transformers(tmp_path, truncate):
    """DeepSeek-V3's real YaRN (rotary dim 64, factor 40 over 4096, beta 32/1) and a variant with truncate off
    and mscale != mscale_all_dim: shardwise's cos/sin tables at positions up to 163839 are transformers'
    (`_compute_yarn_parameters`'s inv_freq, cos/sin times its attention_factor) — the ramp's fractional bounds
    only matter at this scale."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardwise.models.rope import rope_tables
    from test_model_families import DS_V3_REAL

    rope = DS_V3_REAL["rope_scaling"] | ({} if truncate else {"truncate": False, "mscale": 0.9})
    (tmp_path / "config.json").write_text(json.dumps(DS_V3_REAL | {"rope_scaling": rope}))
    cfg = config_from_hf(str(tmp_path))
    ref_cfg = transformers.AutoConfig.from_pretrained(str(tmp_path))
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](ref_cfg, torch.device("cpu"))
    assert cfg.rope_yarn[4] == attention and (attention == 1.0) == truncate
    pos = torch.tensor([0, 1, 4095, 4096, 50000, 163839])
    cos, sin = rope_tables(cfg.rope_dim, 0, cfg.rope_theta, "cpu", positions=pos, yarn=cfg.rope_yarn)
    ang = pos[:, None].float() * inv.float()[None, :]  # transformers: inv_freq @ positions in fp32
    assert torch.equal(cos, ang.cos() * attention) and torch.equal(sin, ang.sin() * attention)
