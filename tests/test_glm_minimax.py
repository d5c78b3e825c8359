"""GLM-4.5/4.6/4.7 (transformers' glm4_moe), MiniMax-M2 (minimax_m2) and Kimi K2 (a deepseek_v3 preset).

Fast (one process):
* small random Glm4MoeForCausalLM (q/k/v biases, per-head q/k norms, half-rotary heads, a dense layer then MoE
  layers with grouped sigmoid routing, the selection bias, scaling 2.5 and a shared expert) and MiniMaxM2ForCausalLM
  (q/k norms over all heads' width, partial rotary, sigmoid routing with the block's selection bias) saved with
  save_pretrained: logits, loss and every gradient equal transformers';
* export writes every tensor it read (the selection bias included) and transformers loads it with the same logits;
  GLM's MTP layer loads, trains and exports as layer n_layers;
* preset totals and active counts against the model cards; `plan --model-config` of both config.json files.

Slow: one 2-rank fork runs both families on tp2+SP, dp2×ep2, cp2 ring, cp2 Ulysses and pp2 against transformers'
loss and every gradient; one 4-rank fork runs `verify` on mixed layouts (GLM with its MTP module among them);
init-from-hf on dp2×ep2 → train → hf-export → hf-compare on tp2+SP → transformers generates the same greedy tokens
as shardwise; small layouts of both families and stage 1 of a full-size GLM-4.5 plan row through `simulate` within
the planner's bounds; `plan` of the full-size presets.
"""
import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from shardwise.config import MODEL_PRESETS, ConfigError, ParallelConfig, TrainConfig  # noqa: E402
from shardwise.hf import weights as hf  # noqa: E402
from shardwise.hf.config import config_from_hf, hf_config  # noqa: E402
from shardwise.parallelize import plain_model  # noqa: E402

from _dist import fresh_seed, global_grads, grad_slices, run_ranks, verify_all  # noqa: E402

BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=64, initializer_range=0.2)
FAMILIES = {  # name -> (model class, config class, config)
    # grouped routing (2 groups, the best 1 kept), scaling 2.5, the first layer dense, per-head q/k norms, biases
    "glm": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
            BASE | dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, use_qk_norm=True,
                        attention_bias=True, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # GLM-4.5-Air's kind: no q/k norms, no groups, scaling 1
    "glm_air": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                BASE | dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=False)),
    # the released config's legacy rotary_dim (a quarter of the head here)
    "minimax": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config",
                BASE | dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, rotary_dim=4,
                            bos_token_id=None, eos_token_id=None)),
}
SEQ = 16
TOL = dict(rtol=2e-5, atol=2e-5)


def _save(path, family, seed=0, **changes):
    """A random model of `family` saved with save_pretrained, with a WordLevel tokenizer: random biases, norms and
    selection biases (transformers' zeros and ones would hide a wrong permutation or name)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model_cls, cfg_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    kw = kw | changes
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or n.endswith("norm.weight"):
                p.normal_(1.0 if n.endswith("norm.weight") else 0.0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    Tokenizer(WordLevel({f"t{i}": i for i in range(min(kw["vocab_size"], 280))}, unk_token="t0")).save(
        os.path.join(path, "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {f: _save(str(tmp_path_factory.mktemp(f)), f) for f in FAMILIES}


def _hf_step(path, tokens, targets):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.train()
    logits = ref(tokens).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return ref, logits.detach(), loss.detach()


def _hf_grads(ref, cfg, tmp):
    """transformers' gradients under shardwise's names: saved by save_pretrained as if they were weights (its
    fused experts written per expert) and read back by the loader under test."""
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.grad)
    ref.save_pretrained(tmp)
    model = plain_model(cfg)
    hf.load_hf_into(model, tmp)
    return {n: p.detach() for n, p in model.named_parameters()}


def _tokens(seed):
    """Fixed batches for the MoE models (a fresh one may hold a top-k near-tie the two fp32 sums break apart)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, SEQ), generator=g), torch.randint(0, 64, (2, SEQ), generator=g)


# ---------------------------------------------------------------- one device against transformers
@pytest.mark.parametrize("family", list(FAMILIES))
def test_single_device_matches_transformers(saved, tmp_path, family):
    path = saved[family]
    cfg = config_from_hf(path)
    tokens, targets = _tokens(0)
    ref, ref_logits, ref_loss = _hf_step(path, tokens, targets)
    model = plain_model(cfg)
    hf.load_hf_into(model, path)
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    assert_close(logits, ref_logits, **TOL)
    assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    want = _hf_grads(ref, cfg, str(tmp_path / "grads"))
    for n, p in model.named_parameters():
        assert float(want[n].abs().max()) > 0, n
        assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{family} {n}: {m}")


def test_config_json_mapping(saved):
    glm, air, mm = (config_from_hf(saved[f]) for f in ("glm", "glm_air", "minimax"))
    assert glm.rope_dim == 8 and glm.attention_bias and glm.qk_norm and not glm.qk_norm_full
    assert glm.moe_dense_layers == (0,) and glm.moe_n_group == 2 and glm.moe_topk_group == 1
    assert glm.moe_routed_scaling == 2.5 and glm.moe_shared_experts == 1 and glm.moe_score == "sigmoid"
    assert glm.has_mtp_architecture and not air.qk_norm and air.moe_n_group == 1
    assert mm.rope_dim == 4 and mm.qk_norm_full and mm.moe_shared_experts == 0 and mm.moe_dense_layers == ()
    assert mm.moe_ffn_dim == 16 and not mm.has_mtp_architecture and not mm.attention_bias


def test_export_round_trip(saved, tmp_path):
    """Every tensor transformers saved (selection biases included) comes back bit for bit; the exported folder
    loads with the same logits and reads back as the same ModelConfig."""
    from safetensors.torch import load_file

    for family, path in saved.items():
        cfg = config_from_hf(path)
        model = plain_model(cfg)
        hf.load_hf_into(model, path)
        with torch.no_grad():  # the selection bias is a buffer: a non-zero one must be carried
            assert all(float(b.abs().max()) > 0 for n, b in model.named_buffers() if n.endswith("expert_bias"))
        out = str(tmp_path / family)
        hf.export_hf(model, cfg, out)
        assert config_from_hf(out) == cfg
        files = hf.WeightFiles(path)
        original = {n: files.read(n, tuple(slice(0, s) for s in files.shape(n))) for n in files.where}
        exported = load_file(os.path.join(out, "model.safetensors"))
        assert sorted(exported) == sorted(original), family
        for n, t in original.items():
            assert torch.equal(exported[n], t), (family, n)
        tokens, _ = _tokens(1)
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert_close(back(tokens).logits, ref(tokens).logits, rtol=0, atol=0)


def test_refusals(saved, tmp_path):
    cfg = config_from_hf(saved["minimax"])
    with pytest.raises(ConfigError, match="moe_shared_experts"):
        hf_config(dataclasses.replace(cfg, moe_shared_experts=1))
    with pytest.raises(ConfigError, match="qk_norm_full needs qk_norm"):
        dataclasses.replace(cfg, qk_norm=False).validate()
    hf_cfg = json.load(open(os.path.join(saved["minimax"], "config.json")))
    for key, value in (("output_router_logits", True), ("router_jitter_noise", 0.1)):
        shutil.rmtree(tmp_path / "bad", ignore_errors=True)
        os.makedirs(tmp_path / "bad")
        (tmp_path / "bad" / "config.json").write_text(json.dumps(hf_cfg | {key: value}))
        with pytest.raises(ConfigError, match=key):
            config_from_hf(str(tmp_path / "bad"))
    glm = config_from_hf(saved["glm"])
    with pytest.raises(ConfigError, match="moe_dense_layers"):
        hf_config(dataclasses.replace(glm, moe_dense_layers=(2,)))


# ---------------------------------------------------------------- published sizes
# (preset, total, active, what the card's active count leaves out). Totals: every parameter of the released main
# model, MTP layers not counted (GLM's cards: 355B / 106B without their MTP layer; Kimi K2 1.026T; MiniMax-M2 230B);
# within 1%. Active: the cards quote two significant figures; the count their publisher used is named.
CARDS = [("glm-4.5", 355e9, 32e9, "embedding and head"), ("glm-4.5-air", 106e9, 12e9, "embedding and head"),
         ("glm-4.6", 355e9, 32e9, "embedding and head"), ("glm-4.7", 355e9, 32e9, "embedding and head"),
         ("kimi-k2", 1.026e12, 32e9, "embedding"), ("minimax-m2", 230e9, 10e9, "embedding and head")]


@pytest.mark.parametrize("preset,total,active,without", CARDS)
def test_preset_sizes_match_model_cards(preset, total, active, without):
    cfg = MODEL_PRESETS[preset]
    cfg.validate()
    assert abs(cfg.num_params() / total - 1) < 0.01, cfg.num_params()
    emb = cfg.vocab_size * cfg.dim * (2 if without == "embedding and head" else 1)
    assert round((cfg.num_active_params() - emb) / 1e9) == active / 1e9, cfg.num_active_params() - emb


def test_glm_mtp_layer_loads_and_exports(saved, tmp_path):
    """GLM's MTP layer is layer n_layers of the checkpoint (transformers skips it): a seeded one exported with
    `--mtp-layers 1` reads back into every tensor, and transformers still loads the folder with the same logits."""
    from shardwise.mesh import Mesh
    from shardwise.parallelize import build_model

    cfg = dataclasses.replace(config_from_hf(saved["glm"]), mtp_layers=1)
    seeded = build_model(cfg, Mesh.single(), seed=3)
    hf.load_hf_into(seeded, saved["glm"], mtp_init="fresh")
    out = str(tmp_path / "mtp")
    hf.export_hf(seeded, cfg, out)
    assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 1
    back = plain_model(cfg)
    hf.load_hf_into(back, out)
    for (n, p), q in zip(seeded.named_parameters(), back.parameters()):
        assert torch.equal(p, q), n
    assert any(n.startswith("mtp.0.block.feed_forward.experts") for n, _ in back.named_parameters())
    tokens, _ = _tokens(2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert_close(back(tokens), ref(tokens).logits, **TOL)


# ---------------------------------------------------------------- layouts against transformers (one 2-rank fork)
LAYOUTS = {  # degrees; a global batch of 4 sequences of 16 tokens
    "tp2_sp": dict(tp=2, sequence_parallel=True),  # heads split: MiniMax's width norms all-reduce their statistics
    "dp2_ep2": dict(dp=2, ep=2),  # two experts per rank
    "cp2_ring": dict(cp=2),
    "cp2_ulysses": dict(cp=2, cp_impl="ulysses"),
    "pp2": dict(pp=2),
}
TRAIN_TOKENS = torch.randint(0, 64, (2048,), generator=torch.Generator().manual_seed(1))
LAYOUT_FAMILIES = ("glm", "minimax")


def _rank_steps(paths):
    """Inside each rank, for each family and layout: load the checkpoint, one forward+backward, the loss and this
    rank's reduced gradient slices."""
    from shardwise.training.trainer import Trainer, make_mesh

    out = {}
    for family in LAYOUT_FAMILIES:
        for layout, degrees in LAYOUTS.items():
            cfg = TrainConfig(model=config_from_hf(paths[family]), parallel=ParallelConfig(**degrees), steps=1,
                              seq_len=SEQ, micro_batch=2, global_batch=4, grad_clip=1e30, progress=False).resolved()
            trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")), tokens=TRAIN_TOKENS)
            hf.load_hf_into(trainer.model, paths[family])
            loss = trainer.forward_backward(0)
            trainer.finish_gradients()
            out[family, layout] = (loss, grad_slices(trainer))
    return out


@pytest.mark.slow
def test_layouts_match_transformers(saved, tmp_path):
    from shardwise.data import Loader

    per_rank = run_ranks(2, _rank_steps, saved, timeout_s=600)
    x, y = Loader(TRAIN_TOKENS, SEQ, 4, TrainConfig().seed).global_batch_at(0)
    for family in LAYOUT_FAMILIES:
        cfg = config_from_hf(saved[family])
        ref, _, ref_loss = _hf_step(saved[family], x, y)
        want = _hf_grads(ref, cfg, str(tmp_path / family))
        shapes = {n: t.shape for n, t in want.items()}
        for layout in LAYOUTS:
            loss = per_rank[0][family, layout][0]
            assert abs(loss - float(ref_loss)) <= 1e-6 * float(ref_loss), (family, layout, loss, float(ref_loss))
            ours = global_grads([g for r in per_rank for g in r[family, layout][1]], shapes)
            for n, g in ours.items():
                assert float(want[n].abs().max()) > 0, n
                assert_close(g, want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{family} {layout} {n}: {m}")


# ---------------------------------------------------------------- verify on mixed layouts (one 4-rank fork)
VERIFY_LAYOUTS = {  # (family, degrees, MTP depth): three AdamW steps each against one device
    "glm_mtp_dp2_tp2_sp_ep2": ("glm", ParallelConfig(dp=2, tp=2, sequence_parallel=True, ep=2), 1),
    "glm_pp2_cp2_ulysses": ("glm", ParallelConfig(pp=2, cp=2, cp_impl="ulysses"), 0),
    "minimax_tp2_cp2_ring": ("minimax", ParallelConfig(tp=2, cp=2), 0),
    "minimax_dp2_ep2_pp2_zero1": ("minimax", ParallelConfig(dp=2, ep=2, pp=2, zero=1), 0),
}


@pytest.mark.slow
def test_verify_mixed_layouts(saved):
    seed = fresh_seed()
    cfgs = []
    for family, parallel, mtp in VERIFY_LAYOUTS.values():
        model = dataclasses.replace(config_from_hf(saved[family]), vocab_size=257, mtp_layers=mtp,
                                    moe_bias_update_rate=0.01)
        cfgs.append(TrainConfig(model=model, parallel=parallel, seq_len=SEQ, micro_batch=1,
                                global_batch=2 * parallel.dp, steps=3, seed=seed, progress=False))
    try:
        results = run_ranks(4, verify_all, cfgs, timeout_s=600)[0]
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    for name, result in zip(VERIFY_LAYOUTS, results):
        assert result["passed"], (seed, name, result)


# ---------------------------------------------------------------- fine-tune, export, generate
@pytest.mark.slow
@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_finetune_export_generates_the_same_greedy_tokens(tmp_path, family):
    """`train --init-from-hf` on dp2×ep2 (vocabulary 300: the byte data fits), three steps, `hf-export`: the weights
    moved, `hf-compare` of the export on tp2+SP passes, transformers loads it, and its greedy `generate` equals
    shardwise's (from the checkpoint, its selection biases included) token for token."""
    from shardwise.cli import main
    from shardwise.training.generate import generate_ids, load_source

    path = _save(str(tmp_path / "hf"), family, vocab_size=300)
    run, out = str(tmp_path / "run"), str(tmp_path / "exported")
    text = tmp_path / "bytes.txt"
    text.write_text("shardwise fine-tunes a GLM or MiniMax model on a few bytes of text. " * 20)
    assert main(["train", "--init-from-hf", path, "--dp", "2", "--ep", "2", "--steps", "3", "--lr", "3e-3",
                 "--seq-len", "16", "--micro-batch", "1", "--save-every", "3", "--out", run, "--no-report",
                 "--no-progress", "--data", str(text)]) == 0
    assert main(["hf-export", os.path.join(run, "checkpoints"), out]) == 0
    assert main(["hf-compare", out, "--tp", "2", "--sequence-parallel", "--seq-len", "16"]) == 0
    before, after = hf.WeightFiles(path), hf.WeightFiles(out)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(before.read(name, (slice(0, 64),)), after.read(name, (slice(0, 64),)))
    prompt = [5, 17, 3, 99, 42, 8, 61]
    model, *_ = load_source(os.path.join(run, "checkpoints"))
    ours, _ = generate_ids(model, prompt, 12, eos_id=None)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              min_new_tokens=12, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist(), (ours, theirs)


# ---------------------------------------------------------------- the planner against `simulate`
def _check_simulated(report, activations=0.02, peak=0.03):
    """The planner's bounds: static bytes equal, saved activations within 2%, the live peak within 3%, every comm
    byte equal."""
    for r in report["ranks"]:
        assert r["static_bytes"]["measured"] == r["static_bytes"]["planned"], r["static_bytes"]
        assert all(v["measured"] == v["planned"] for v in r["comm_bytes"].values()), r["comm_bytes"]
        for key, tol in (("activation_bytes", activations), ("peak_bytes", peak)):
            m, p = r[key]["measured"], r[key]["planned"]
            assert abs(m - p) <= tol * p, (key, m, p, m / p)


def _small(preset, **changes):
    """A preset cut down to CPU size, its family's parts kept (biases, norms, partial rotary, routing)."""
    return dataclasses.replace(MODEL_PRESETS[preset], vocab_size=257, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                               moe_experts=4, moe_topk=2, moe_ffn_dim=32, ffn_dim=48, max_seq_len=512, **changes)


def _sim_run(model, dtype="bf16", microbatches=2, **parallel):
    p = ParallelConfig(**parallel)
    return TrainConfig(model=model, parallel=p, steps=2, seq_len=64, micro_batch=1,
                       global_batch=microbatches * p.dp, dtype=dtype)


SIMULATED = {  # small layouts of both families through `shardwise simulate`
    # MiniMax-M2's width norms: 4 tp all-reduces of [n, 1] per layer (6 under full recompute)
    "minimax_tp2_full": _sim_run(_small("minimax-m2", n_layers=2), tp=2, recompute="full"),
    # GLM-4.5: a dense layer, q/k/v biases, per-head norms, the shared expert, its MTP module on the last stage
    "glm_mtp_dp2_tp2_sp_ep2": _sim_run(_small("glm-4.5", n_layers=3, moe_dense_layers=(0,), mtp_layers=1),
                                       dp=2, tp=2, sequence_parallel=True, ep=2),
}


@pytest.mark.slow
def test_small_glm_layout_within_the_planners_bounds():
    from shardwise.simulate import sweep

    _check_simulated(sweep.simulate(SIMULATED["glm_mtp_dp2_tp2_sp_ep2"]))


@pytest.mark.slow
def test_width_norm_comm_is_planned(monkeypatch):
    """MiniMax-M2 on tp2 with full recompute within the planner's bounds; without its width-norm term the planner
    misses the ledger's tp bytes (the term is what makes them equal)."""
    import copy

    from shardwise.planner import comm_model
    from shardwise.simulate import sweep
    from shardwise.simulate.predict import planned
    from shardwise.training.assemble import assemble

    layout = SIMULATED["minimax_tp2_full"]
    report = sweep.simulate(layout)
    _check_simulated(report)
    measured = report["ranks"][0]["comm_bytes"]["tp"]["measured"]
    assert planned(assemble(copy.deepcopy(layout)), 0)["comm_bytes"]["tp"] == measured
    per_head = comm_model.tp_microbatch
    monkeypatch.setattr(comm_model, "tp_microbatch",
                        lambda led, spec, *a: per_head(led, dataclasses.replace(spec, qk_norm_full=False), *a))
    assert planned(assemble(copy.deepcopy(layout)), 0)["comm_bytes"]["tp"] != measured


# `plan --model glm-4.5 --gpus 1024 --global-batch 1024 --seq-len 4096 --uneven-pp`'s best row (7.58 s/step, MFU
# 0.138), with 2 microbatches per step in place of 512 (the same per-microbatch tensors and comm, fewer in flight)
GLM45_ROW = TrainConfig(model="glm-4.5", parallel=ParallelConfig(dp=2, tp=2, pp=16, cp=16, ep=32,
                                                                 sequence_parallel=True, zero=1,
                                                                 recompute="selective",
                                                                 pp_layers=[6] * 12 + [5] * 4),
                        steps=2, seq_len=4096, micro_batch=1, global_batch=4, dtype="bf16")


@pytest.mark.slow
def test_glm45_full_size_row_within_the_planners_bounds():
    """Stage 1 (six MoE layers, 5 of 160 experts per rank over ep 32, a cp 16 ring, tp 2 with SP) of the full-size
    GLM-4.5 row: static equal, activations and peak within 0.2%, comm equal."""
    from types import SimpleNamespace

    from shardwise.simulate import sweep
    from shardwise.simulate.cli import rank_of

    rank = rank_of(SimpleNamespace(pp=16, cp=16, tp=2), dict(dp=0, pp=1, cp=0, tp=0))
    _check_simulated(sweep.simulate(GLM45_ROW, str(rank)), activations=0.002, peak=0.003)


def test_plan_reads_the_config_json(saved, capsys):
    """`plan --model-config` of each family's config.json: rows whose command trains the same file."""
    import shlex

    from shardwise import cli

    for family in ("glm", "minimax"):
        assert cli.main(["plan", "--model-config", saved[family], "--gpus", "4", "--gpus-per-node", "4",
                         "--seq-len", "64", "--global-batch", "8", "--json", "--top", "1"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert rows[0]["command_refused"] is None, rows[0]
        assert shlex.split(rows[0]["command"])[2:4] == ["--model-config", saved[family]]


@pytest.mark.slow
def test_plan_full_size_preset(capsys):
    """`plan --model glm-4.5-air` on 128 GPUs (the others: docs/families-2026.md)."""
    from shardwise import cli

    assert cli.main(["plan", "--model", "glm-4.5-air", "--gpus", "128", "--global-batch", "256", "--seq-len", "4096",
                     "--json", "--top", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and rows[0]["command_refused"] is None and rows[0]["fits"] and rows[0]["step_time_s"] > 0, rows
