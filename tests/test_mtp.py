"""DeepSeek-V3 multi-token prediction (docs/mtp.md).

* Oracle: the report's equations written here in plain PyTorch — each depth on the *truncated* sequence
  (positions 0..S-k-1, no padding), its own RMSNorm, concatenation [enorm(Emb(t_{i+k})); hnorm(h^{k-1})],
  projection, the head, cross-entropies averaged per depth — on the same weights (the transformer blocks are
  called as black boxes: they are proven against transformers in test_hf.py), against shardwise's loss and
  every parameter gradient, with random tokens and random loss masks.
* verify with MTP on: TP+SP, TP, CP ring and Ulysses, EP, ZeRO-3, PP (1f1b, zb, interleaved, dualpipev, tied),
  and 4-rank compositions.
* Hugging Face: DeepSeek's checkpoint layout out and in (transformers loads it; its own decoder layer reproduces
  depth 1), per-rank import under PP, train --init-from-hf → checkpoint → resume on another layout → hf-export.
* Planner: parameters, static bytes and every collective per rank against real runs.
* Refusals.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from shardwise.mesh import Mesh
from shardwise.models.mtp import IGNORE, depth_counts, shift_inputs
from shardwise.parallelize import build_model
from shardwise.training.assemble import assemble
from shardwise.training.trainer import Trainer

from _dist import fresh_seed, run_ranks, verify_all

# test_model_families' DeepSeek-V3 shape (MLA with a q latent, layer 0 dense, sigmoid group-limited top-2 of 8)
# with two MTP modules; both MTP blocks are MoE blocks (layers 4 and 5), as DeepSeek-V3's layer 61.
DEEPSEEK_MTP = ModelConfig(name="deepseek-mtp", vocab_size=257, dim=64, n_layers=4, n_heads=4, n_kv_heads=4,
                           head_dim=16, ffn_dim=96, max_seq_len=64, norm_eps=1e-6, q_lora_rank=32, kv_lora_rank=24,
                           qk_rope_dim=8, v_head_dim=12, moe_experts=8, moe_topk=2, moe_ffn_dim=32,
                           moe_shared_experts=1, moe_dense_layers=(0,), moe_score="sigmoid", moe_n_group=4,
                           moe_topk_group=2, moe_routed_scaling=2.5, moe_bias_update_rate=0.01, mtp_layers=2)


def _cfg(seed, model=DEEPSEEK_MTP, global_batch=4, lam=0.3, dtype="fp32", **parallel):
    return TrainConfig(model=model, parallel=ParallelConfig(**parallel), steps=2, seq_len=32, micro_batch=2,
                       global_batch=global_batch, seed=seed, progress=False, mtp_loss_weight=lam, dtype=dtype)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _oracle(model, x, y, lam):
    """Main loss + λ/D Σ_k CE_k from the report's equations, each depth on its truncated sequence."""
    cfg = model.cfg
    emb, out_w = model.tok_embeddings.weight, model.output.weight
    s = x.shape[1]
    cos, sin = model.rope(s, x.device)
    h = F.embedding(x, emb)
    for block in model.layers.values():
        h = block(h, cos, sin)
    h = _rms(h, model.norm.weight, cfg.norm_eps)  # h^0: after the main model's final norm
    loss = F.cross_entropy((h @ out_w.T).flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="mean")
    mtp = []
    for k, layer in enumerate(model.mtp.values(), start=1):
        t = s - k  # depth k predicts t_{i+k+1} from h^{k-1}_i and Emb(t_{i+k}) for i < S - k
        cos, sin = model.rope(t, x.device)
        e = _rms(F.embedding(x[:, k:], emb), layer.enorm.weight, cfg.norm_eps)
        hk = _rms(h[:, :t], layer.hnorm.weight, cfg.norm_eps)
        h = layer.block(torch.cat([e, hk], -1) @ layer.eh_proj.weight.T, cos, sin)
        logits = _rms(h, layer.head_norm.weight, cfg.norm_eps) @ out_w.T
        mtp.append(F.cross_entropy(logits.flatten(0, 1), y[:, k:].flatten(), ignore_index=IGNORE, reduction="mean"))
    return loss + lam * sum(mtp) / len(mtp)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_loss_and_every_gradient_match_the_report_equations():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 257, (4 * 33 * 4,), generator=gen)
    lam = 0.3
    cfg = assemble(dataclasses.replace(_cfg(seed % 1000, lam=lam), overlap_grad_reduce=False))
    t = Trainer(cfg, Mesh.single(torch.device("cpu")), tokens)
    loss = t.forward_backward(0)  # two microbatches of 2: the per-depth means span the global batch
    got = _grads(t.model)
    x, y = t.loader.global_batch_at(0)
    model = build_model(cfg.model_config(), Mesh.single(torch.device("cpu")), cfg.seed)  # same seeded weights
    ref = _oracle(model, x, y, lam)
    ref.backward()
    want = _grads(model)
    assert abs(loss - ref.item()) < 1e-5 * abs(ref.item()), (seed, loss, ref.item())
    assert any(n.startswith("mtp.1.") for n in want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n} (seed {seed}): {m}")

    # loss masks (SFT prompts): random ignored targets, through the model's own MTP inputs
    y_masked = torch.where(torch.rand(y.shape, generator=gen) < 0.3, IGNORE, y)
    for p in model.parameters():
        p.grad = None
    ids, labels = shift_inputs(x, y_masked, 2)
    counts = depth_counts(y_masked, 4, 32, 2)
    scale = torch.tensor([lam / (2 * n) for n in counts])
    logits = model(x, mtp_ids=ids, mtp_labels=labels, mtp_scale=scale)
    n_main = int((y_masked != IGNORE).sum())
    mine = model.loss_fn(logits, y_masked).sum() / n_main
    mine.backward()
    value = mine.item() + model.mtp_loss.item()
    got = _grads(model)
    for p in model.parameters():
        p.grad = None
    ref = _oracle(model, x, y_masked, lam)
    ref.backward()
    assert abs(value - ref.item()) < 1e-5 * abs(ref.item()), (seed, value, ref.item())
    for n, g in _grads(model).items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"masked {n} (seed {seed}): {m}")


def test_shift_pads_past_the_window():
    x = torch.arange(10).view(2, 5)
    y = x + 1
    y[0, 3] = IGNORE
    ids, labels = shift_inputs(x, y, 2)
    assert ids[0].tolist() == [[1, 2, 3, 4, 0], [6, 7, 8, 9, 0]]
    assert labels[1].tolist() == [[3, IGNORE, 5, IGNORE, IGNORE], [8, 9, 10, IGNORE, IGNORE]]
    assert depth_counts(y, 2, 5, 2) == [7, 5] and depth_counts(None, 2, 5, 2) == [8, 6]


def _check(cfgs, world, seed):
    for cfg, result in zip(cfgs, run_ranks(world, verify_all, cfgs, timeout_s=300)[0]):
        assert result["passed"] and result["first_step_grad_rel_diff"] < 1e-5, (seed, cfg.parallel, result)


def test_verify_two_rank_layouts():
    """TP+SP and TP (eh_proj replicated: its gradient is TP-partial under SP), CP ring and Ulysses (shifted on
    the host before the cut: no extra communication), EP with the MTP block's experts, ZeRO-3; PP 1f1b, zb and
    interleaved (the MTP modules on the last stage with a copy of the embedding, summed over emb), dualpipev (both
    ends on rank 0: one matrix used by two chunks), tied embeddings under PP (MTP reads the head's copy)."""
    seed = fresh_seed()
    tied = dataclasses.replace(DEEPSEEK_MTP, tie_embeddings=True)
    cfgs = [_cfg(seed, tp=2, sequence_parallel=True), _cfg(seed, tp=2), _cfg(seed, cp=2),
            _cfg(seed, cp=2, cp_impl="ulysses"), _cfg(seed, dp=2, ep=2),
            _cfg(seed, global_batch=8, dp=2, ep=2, zero=3),
            _cfg(seed, global_batch=8, pp=2, schedule="1f1b"), _cfg(seed, global_batch=8, pp=2, schedule="zb"),
            _cfg(seed, global_batch=8, pp=2, schedule="interleaved", vp=2),
            _cfg(seed, global_batch=8, pp=2, schedule="dualpipev"),
            _cfg(seed, tied, global_batch=8, pp=2, schedule="1f1b")]
    _check(cfgs, 2, seed)


def test_verify_four_rank_compositions():
    """pp×tp×SP zb, dp×ep×tp×SP, dp×pp ZeRO-3 (the embedding copy is a ZeRO-3 unit), pp4 (middle stages hold
    neither end)."""
    seed = fresh_seed()
    cfgs = [_cfg(seed, global_batch=8, pp=2, tp=2, sequence_parallel=True, schedule="zb"),
            _cfg(seed, global_batch=8, dp=2, ep=2, tp=2, sequence_parallel=True),
            _cfg(seed, global_batch=8, dp=2, pp=2, zero=3), _cfg(seed, global_batch=8, pp=4, schedule="1f1b")]
    _check(cfgs, 4, seed)


def test_refusals():
    dense = dataclasses.replace(DEEPSEEK_MTP, mtp_layers=0)
    with pytest.raises(ConfigError, match=r"--mtp-layers 1: model 'tiny' has no multi-token prediction; valid only "
                                          r"on DeepSeek-V3-architecture"):
        assemble(TrainConfig(model="tiny", model_overrides={"mtp_layers": 1}))
    with pytest.raises(ConfigError, match=r"--mtp-layers -1 must be an integer >= 0"):
        dataclasses.replace(dense, mtp_layers=-1).validate()
    with pytest.raises(ConfigError, match=r"--mtp-loss-weight -0.1 must be a finite number >= 0"):
        assemble(_cfg(0, lam=-0.1))
    with pytest.raises(ConfigError, match=r"aux loss pooled over all layers .* valid: moe_aux_loss_scope='layer'"):
        dataclasses.replace(DEEPSEEK_MTP, moe_aux_loss_coef=0.1, moe_aux_loss_scope="model").validate()


def _export(tmp_path, seed=3):
    from shardwise.hf import weights as hf

    model = build_model(DEEPSEEK_MTP, Mesh.single(torch.device("cpu")), seed)
    with torch.no_grad():
        for n, b in model.named_buffers():  # a random selection bias: the MTP block's must travel too
            if n.endswith("expert_bias"):
                b.normal_(0.0, 0.3)
    return model, hf.export_hf(model, DEEPSEEK_MTP, str(tmp_path / "export"))


def _loaded_slices_equal(path):
    """Inside ranks (pp2): every tensor this rank holds, the last stage's MTP embedding copy included, equals the
    single-device model's slice after --init-from-hf's loader read only this rank's slices."""
    from shardwise.hf import weights as hf
    from shardwise.config import ParallelConfig as PC
    from shardwise.rules.schedules import build_schedule
    from shardwise.pipeline.tied_embedding import tied_name
    from shardwise.tensor_parallel.layers import get_spec
    from shardwise.training.trainer import make_mesh

    cfg = assemble(TrainConfig(model=DEEPSEEK_MTP, parallel=PC(pp=2, tp=1), global_batch=4, micro_batch=2, seq_len=32))
    mesh = make_mesh(cfg, torch.device("cpu"))
    sched = build_schedule("1f1b", 2, 2, 1)
    model = build_model(DEEPSEEK_MTP, mesh, 99, schedule=sched)
    hf.load_hf_into(model, path, mesh)
    ref = build_model(DEEPSEEK_MTP, Mesh.single(torch.device("cpu")), 99)
    hf.load_hf_into(ref, path)
    ref_params = dict(ref.named_parameters())
    names = []
    for n, p in model.named_parameters():
        assert torch.equal(p, get_spec(p).local_slice(ref_params[tied_name(n, p)])), n
        names.append(n)
    ref_bufs = dict(ref.named_buffers())
    for n, b in model.named_buffers():
        if n.endswith("expert_bias"):
            assert torch.equal(b, ref_bufs[n]), n
    return names


def test_hf_export_loads_in_transformers_and_round_trips(tmp_path):
    """hf-export writes DeepSeek's layout (model.layers.{L+k}: enorm, hnorm, eh_proj, shared_head.norm, the
    block's usual names, embed_tokens and shared_head.head copies; num_nextn_predict_layers = D);
    DeepseekV3ForCausalLM loads it (the extra layers ignored) with equal logits; transformers' own decoder layer
    run on layer L's tensors with the report's combination reproduces shardwise's depth-1 MTP logits; the import
    reads every MTP tensor back exactly, per rank, under pp2 (the MTP embedding copy reads embed_tokens)."""
    import json

    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    model, path = _export(tmp_path)
    with open(f"{path}/config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 2
    tensors = load_file(f"{path}/model.safetensors")
    layer4 = {k[len("model.layers.4."):]: v for k, v in tensors.items() if k.startswith("model.layers.4.")}
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                 "shared_head.head.weight", "self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert name in layer4, name
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(fresh_seed()))
    y = torch.roll(x, -1, 1)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(x).logits, model(x), rtol=1e-5, atol=1e-5)
        # depth 1 as a transformers-layout consumer (vLLM's deepseek_mtp.py) computes it from these tensors
        # transformers' own loading of layer 4's block (its per-expert tensors fused as it fuses every layer's)
        block = transformers.AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=5).model.layers[4].eval()
        assert isinstance(block, DeepseekV3DecoderLayer)
        eps = hf_model.config.rms_norm_eps
        h0 = hf_model.model(x).last_hidden_state  # after the final norm
        emb = F.embedding(x[:, 1:], layer4["embed_tokens.weight"])
        cat = torch.cat([_rms(emb, layer4["enorm.weight"], eps), _rms(h0[:, :-1], layer4["hnorm.weight"], eps)], -1)
        pos = torch.arange(15).unsqueeze(0)
        h1 = block(cat @ layer4["eh_proj.weight"].T, position_ids=pos,
                   position_embeddings=hf_model.model.rotary_emb(cat, pos))
        want = _rms(h1, layer4["shared_head.norm.weight"], eps) @ layer4["shared_head.head.weight"].T
        ids, _ = shift_inputs(x, y, 2)
        cos, sin = model.rope(16, x.device)
        h = model.norm(_main_hidden(model, x))
        normed = model.mtp["0"](h, model.tok_embeddings(ids[0]), cos, sin).unbind(0)[1]
        torch.testing.assert_close(model.output(normed)[:, :-1], want, rtol=1e-4, atol=1e-5)
    names = run_ranks(2, _loaded_slices_equal, path)
    assert "mtp_embed.weight" in names[1] and "mtp.1.eh_proj.weight" in names[1] and "mtp.0.enorm.weight" not in names[0]


def _main_hidden(model, x):
    cos, sin = model.rope(x.shape[1], x.device)
    h = model.tok_embeddings(x)
    for block in model.layers.values():
        h = block(h, cos, sin)
    return h


def test_init_from_hf_refuses_more_mtp_layers_than_the_checkpoint(tmp_path, capsys):
    from shardwise.cli import main
    from shardwise.hf.config import init_model_config

    _, path = _export(tmp_path)
    assert init_model_config(path, None, {"mtp_layers": 1}).mtp_layers == 1
    assert init_model_config(path, None, {}).mtp_layers == 0  # read, but off unless asked
    with pytest.raises(ConfigError, match=r"--mtp-layers 3 exceeds the MTP modules of --init-from-hf .*"
                                          r"num_nextn_predict_layers=2; valid: 0..2"):
        init_model_config(path, None, {"mtp_layers": 3})
    for argv, message in ((["--init-from-hf", path, "--mtp-layers", "3"], "--mtp-layers 3 exceeds the MTP modules"),
                          (["--model", "tiny", "--mtp-layers", "1"], "--mtp-layers 1: model 'tiny' has no multi-token"),
                          (["--model", "deepseek-v3", "--mtp-layers", "-1"], "--mtp-layers -1 must be an integer >= 0"),
                          (["--model", "deepseek-v3", "--mtp-layers", "1", "--mtp-loss-weight", "-1"],
                           "--mtp-loss-weight -1.0 must be a finite number >= 0")):
        assert main(["train", *argv, "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


# (world, ParallelConfig kwargs, global batch): the embedding copy (pp2, untied), tp-sharded MTP blocks with
# SP-partial eh_proj and norms (and without SP: MLA's per-head partial grads), EP experts in the MTP blocks, ring
# attention in them, ZeRO-1 and ZeRO-3 units (the head and the embedding re-gathered per depth; under PP the copy as
# a unit, the embeddings reduced at the step's end but released after each backward; tied, one bucket for the
# embedding and the head, or under PP for the head and the copy); bf16 (the MTP linears' weight copies, bf16 hnorm
# inputs) on tp2×SP and on pp2 with full recompute (which does not reach the MTP blocks). Under ZeRO-3 and PP: zb
# and dualpipev (the head's deferred dW, used 1 + D times per microbatch, reduce-scattered once per microbatch),
# tied 1f1b and dualpipev (the tied copies reduce-scattered once, after the emb sum), and tied without MTP.
TIED_MTP = dataclasses.replace(DEEPSEEK_MTP, tie_embeddings=True)
PLANNER_LAYOUTS = [(2, dict(pp=2), 4), (2, dict(tp=2, sequence_parallel=True), 4), (2, dict(dp=2, ep=2, zero=1), 8),
                   (2, dict(cp=2), 4), (2, dict(tp=2), 4), (2, dict(tp=2, sequence_parallel=True, dtype="bf16"), 4),
                   (2, dict(pp=2, recompute="full", dtype="bf16"), 4),
                   (2, dict(dp=2, zero=3), 8), (2, dict(dp=2, zero=3, model=TIED_MTP), 8),
                   (4, dict(dp=2, pp=2, zero=3), 16),
                   (4, dict(dp=2, pp=2, zero=3, schedule="interleaved", vp=2), 16),
                   (4, dict(dp=2, pp=2, tp=1, schedule="dualpipev", zero=1), 16),
                   (4, dict(dp=2, pp=2, zero=3, schedule="zb"), 16),
                   (4, dict(dp=2, pp=2, zero=3, schedule="dualpipev"), 16),
                   (4, dict(dp=2, pp=2, zero=3, model=TIED_MTP), 16),
                   (4, dict(dp=2, pp=2, zero=3, schedule="dualpipev", model=TIED_MTP), 16),
                   (4, dict(dp=2, pp=2, zero=3, model=dataclasses.replace(TIED_MTP, mtp_layers=0)), 16)]


def _measure(layouts, seed):
    """Inside ranks: per layout, this rank's pp stage, parameters by kind, static bytes and the emb ledger."""
    out = []
    for world, par, gb in layouts:
        if world != torch.distributed.get_world_size():
            continue
        cfg = assemble(_cfg(seed, global_batch=gb, **par))
        from shardwise.training.trainer import make_mesh

        mesh = make_mesh(cfg, torch.device("cpu"))
        t = Trainer(cfg, mesh)
        mesh.ledger.reset()
        t.train_step(0)
        params = list(t.model.parameters())
        red = t.reducer
        weights = sum(b.shard.numel() for b in red.buckets) if red.zero >= 3 else sum(q.numel() for q in params)
        state = red.optimizer.state.values()
        out.append(dict(pp=mesh["pp"].rank, weights=weights * 4, axes=mesh.ledger.steps[-1]["axes"],
                        activation=_microbatch_activation(t), rank=mesh.rank, ep_ranks=mesh["ep"].ranks,
                        optimizer=sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in state) * 4,
                        numel=sum(q.numel() for q in params)))
    return out


def _microbatch_activation(trainer) -> int:
    """Bytes autograd saves for one microbatch's forward through this rank's chunks with the MTP inputs on (as
    test_planner_ledger measures it; the side inputs cloned, as the ids: the loader's are views of the batch)."""
    from test_planner_ledger import _saved_bytes

    xs, ys, side = trainer.microbatches(trainer.loader, 0, mtp=True)
    x, y, kw = xs[0].clone(), ys[0].clone(), {k: v.clone() for k, v in (side[0] if side else {}).items()}
    params, total = list(trainer.model.parameters()), 0
    for chunk in trainer.model.chunks or [None]:
        if chunk is None:
            inp, run, last = x, trainer.model, True
        else:
            inp = x if chunk.first else torch.randn(trainer.executor.act_shape, dtype=trainer.executor.act_dtype,
                                                    requires_grad=True)
            run, last = chunk, chunk.last

        def forward():
            with trainer._autocast():
                out = run(inp, **kw)
            return trainer.model.loss_fn(out, y, IGNORE).sum() if last else out

        total += _saved_bytes(forward, params)[0]
    trainer.model.mtp_loss = None
    return total


def par_key(par):
    return tuple(sorted(par.items()))


def test_planner_counts_mtp_exactly():
    """Parameters per rank, static weight and AdamW bytes (ZeRO-3: the shards) and every collective of the step
    (the MTP blocks' TP, EP and router ones, the emb all-reduce of the embedding copy, ZeRO-3's per-depth
    all-gathers of the head and the embeddings) equal the planner's; total and active counts equal ModelConfig's (DeepSeek-V3 with one MTP
    module: 682.6B, 671B + 11.6B; DeepSeek counts 14B with the module's embedding and head copies)."""
    from shardwise.config import get_model_config
    from shardwise.planner import Cluster, estimate, get_gpu
    from shardwise.planner.layout import from_train_config, stages
    from shardwise.planner.activations import microbatch_activation_bytes
    from shardwise.planner.memory import stage_params, static_bytes, zero_buckets
    from shardwise.planner.models import ModelSpec, active_params, padded_vocab, total_params

    for m in (DEEPSEEK_MTP, get_model_config("deepseek-v3", mtp_layers=1)):
        spec = ModelSpec.of(m)
        assert (total_params(spec), active_params(spec)) == (m.num_params(), m.num_active_params())
    assert round(get_model_config("deepseek-v3", mtp_layers=1).num_params() / 1e9, 2) == 682.64
    _check_flops()
    seed = fresh_seed()
    for world in (2, 4):
        ranks = run_ranks(world, _measure, PLANNER_LAYOUTS, seed)
        mine = [lay for lay in PLANNER_LAYOUTS if lay[0] == world]
        for i, (_, par, gb) in enumerate(mine):
            cfg = assemble(_cfg(seed, global_batch=gb, **par))
            cfg.resolve_world(world)
            spec, lay, wl = from_train_config(cfg)
            est = {par_key(par): estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)}
            # one microbatch's saved activations (the MTP modules' blocks, combination, heads, ids) within the
            # ledger test's 0.1%; MoE: per ep group, whose ranks share out the routed rows
            groups = {}
            for rep in (r[i] for r in ranks):
                groups.setdefault(rep["ep_ranks"], []).append(rep)
            for reps in groups.values():
                want = sum(microbatch_activation_bytes(spec, stages(spec, lay)[r["pp"]], lay, wl)["total"] for r in reps)
                got = sum(r["activation"] for r in reps)
                assert got == pytest.approx(want, rel=1e-3), (par, [r["rank"] for r in reps], got, want)
            for rep in (r[i] for r in ranks):
                st = stages(spec, lay)[rep["pp"]]
                local = stage_params(spec, st, lay)
                static = static_bytes(local, lay, zero_buckets(spec, st, lay) if lay.zero else None)
                assert (local.total, static["weights"], static["optimizer"]) == \
                    (rep["numel"], rep["weights"], rep["optimizer"]), (par, rep["pp"])
                emb = rep["axes"].get("emb", {}).get("all_reduce", {}).get("bytes", 0)
                split = par.get("pp", 1) > 1 and par.get("schedule") != "dualpipev"
                assert emb == (padded_vocab(spec, lay.tp) // lay.tp * spec.dim * 4 if split else 0), (par, rep)
                # every collective of the step (the MTP blocks' TP/CP/EP ones, their router statistics, the emb
                # sum) as the planner counts it; routed all-to-alls follow the routing: their counts only
                predicted = est[par_key(par)]["stages"][rep["pp"]]["comm_ops_per_step"]
                got = {a: {op: m for op, m in ops.items() if op.partition(":")[2] not in ("metrics", "grad_norm")}
                       for a, ops in rep["axes"].items()}
                got = {a: ops for a, ops in got.items() if ops}
                assert set(got) == set(predicted), (par, rep["pp"], set(got), set(predicted))
                for axis, ops in got.items():
                    assert set(ops) == set(predicted[axis]), (par, axis, set(ops), set(predicted[axis]))
                    for op, m in ops.items():
                        want = predicted[axis][op]
                        routed = axis == "ep" and op != "all_to_all:counts"
                        assert (m["count"] if routed else m) == (want["count"] if routed else want), (par, axis, op)


def test_init_from_hf_pp2_lr0_checkpoint_exports_every_mtp_tensor(tmp_path):
    """`train --init-from-hf DIR --mtp-layers 2` on pp2 (the MTP modules and the embedding copy on stage 1) at
    lr 0, checkpoint, `hf-export`: every tensor of DeepSeek's layout comes back exactly (the copy is not
    checkpointed; the export writes DeepSeek's embed_tokens / shared_head.head copies from the model's); the
    checkpoint resumes on tp2 and exports the same tensors again."""
    import argparse
    import os

    from safetensors.torch import load_file

    from shardwise.cli import main
    from shardwise.commands.hf import run_export
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    _, path = _export(tmp_path)
    Tokenizer(WordLevel({f"t{i}": i for i in range(250)}, unk_token="t0")).save(os.path.join(path, "tokenizer.json"))
    text = tmp_path / "bytes.txt"
    text.write_text("multi-token prediction on the last pipeline stage. " * 20)
    run = str(tmp_path / "run")
    assert main(["train", "--init-from-hf", path, "--mtp-layers", "2", "--pp", "2", "--lr", "0", "--steps", "1",
                 "--seq-len", "16", "--micro-batch", "1", "--global-batch", "2", "--save-every", "1", "--out", run,
                 "--no-report", "--no-progress", "--data", str(text)]) == 0
    out = str(tmp_path / "exported")
    assert run_export(argparse.Namespace(ckpt_dir=os.path.join(run, "checkpoints"), out_dir=out)) == 0
    original, exported = load_file(os.path.join(path, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(original) and "model.layers.5.shared_head.head.weight" in exported
    for n, t in original.items():
        torch.testing.assert_close(exported[n], t, atol=0, rtol=0, msg=lambda m: f"{n}: {m}")
    # the pp2 checkpoint (no copy of the embedding in it) resumes on tp2: every MTP tensor found, resharded
    assert main(["train", "--init-from-hf", path, "--mtp-layers", "2", "--tp", "2", "--lr", "0", "--steps", "2",
                 "--seq-len", "16", "--micro-batch", "2", "--global-batch", "2", "--save-every", "1", "--out", run,
                 "--resume", "--no-report", "--no-progress", "--data", str(text)]) == 0
    out2 = str(tmp_path / "exported2")
    assert run_export(argparse.Namespace(ckpt_dir=os.path.join(run, "checkpoints"), out_dir=out2)) == 0
    again = load_file(os.path.join(out2, "model.safetensors"))
    for n, t in original.items():
        torch.testing.assert_close(again[n], t, atol=0, rtol=0, msg=lambda m: f"resumed {n}: {m}")


def _check_flops():
    """The planner's forward matmul FLOPs of the MTP modules against torch's FlopCounterMode on one device (the MTP
    run minus the main-only run), plus the routed experts' grouped GEMM, for which the counter has no formula."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.planner.estimate import layer_flops_per_token
    from shardwise.planner.models import ModelSpec
    from shardwise.rules.flops import mtp_flops_per_token

    model = build_model(DEEPSEEK_MTP, Mesh.single(torch.device("cpu")), 1)
    x = torch.randint(0, 257, (2, 32))
    ids, labels = shift_inputs(x, torch.roll(x, -1, 1), 2)

    def flops(**kw):
        with FlopCounterMode(display=False) as fc, torch.no_grad():
            model(x, **kw)
        return fc.get_total_flops()

    measured = flops(mtp_ids=ids, mtp_labels=labels, mtp_scale=torch.ones(2)) - flops()
    spec, tokens = ModelSpec.of(DEEPSEEK_MTP), 64
    grouped = 2 * DEEPSEEK_MTP.moe_topk * 3 * spec.dim * spec.expert_ffn_dim * tokens * 2  # both MTP blocks are MoE
    mm, core = mtp_flops_per_token(spec, lambda moe: layer_flops_per_token(spec, moe, 32), spec.vocab_size)
    # MLA's core runs SDPA's flash kernel (v zero-padded, docs/models.md), for which the counter has no CPU formula:
    # the counter sees the matmuls, which must equal the planner's exactly; the core is the planner's unpadded count
    assert measured + grouped == tokens * mm, (measured, grouped, tokens * mm)
    assert core > 0


def test_planner_zero3_mtp_held_equals_the_traced_gathers():
    """ZeRO-3 units gathered at the traced peak (`simulate`, fake tensors) equal the planner's at its peak moment:
    the pair running plus `zero3_mtp_held` — without a pipeline the final norm the head's backward prefetched and
    the first layer the embedding's MTP calls prefetched (the embedding itself, held to the backward's end, beside
    every main layer); on a pipeline's last stage the norm and the embedding copy the head's last forward use left
    prefetched, and beside the head's own backward (a large vocabulary: the peak) that copy and the first MTP
    module the copy's second call prefetched."""
    from shardwise.planner import Cluster, estimate, get_gpu
    from shardwise.planner.layout import from_train_config, stages
    from shardwise.planner.zero3_inflight import unit_bytes
    from shardwise.simulate import world
    from shardwise.simulate.live import LiveMemory

    at_peak = {}

    class Live(LiveMemory):
        """Records the bytes of ZeRO-3 unit buffers gathered whenever the peak rises."""

        def watch(self, tensors):
            self.flats = list(tensors)
            super().watch(tensors)

        def _check_peak(self):
            peak = self.peak
            super()._check_peak()
            if self.peak != peak and hasattr(self, "flats"):
                at_peak["gathered"] = sum(t.untyped_storage().nbytes() for t in self.flats)

    # (layout, global batch, rank, the units held beside the pair: names of planner units by role)
    big = dataclasses.replace(DEEPSEEK_MTP, vocab_size=16384)  # the head's backward is the peak
    layouts = [(dict(dp=2, zero=3), 8, 0, ("first layer", "norm")), (dict(dp=2, pp=2, zero=3), 16, 1, ("copy", "norm")),
               (dict(dp=2, pp=2, zero=3, model=big), 16, 1, ("copy", "first module"))]
    original = world.LiveMemory
    world.LiveMemory = Live
    try:
        for par, gb, rank, held in layouts:
            cfg = assemble(_cfg(1, global_batch=gb, **par))
            world.simulate_rank(cfg, rank, steps=1)
            cfg.resolve_world(2 * par.get("pp", 1))
            spec, lay, wl = from_train_config(cfg)
            est = estimate(spec, Cluster(get_gpu("h100-80gb"), lay.world, 8), lay, wl, detail=True)
            terms = est["stages"][rank]["peak_terms"]
            units = [full for _, full, _, _ in unit_bytes(spec, stages(spec, lay)[rank], lay)]
            head = len(units) - spec.mtp_layers - (lay.pp > 1) - 1
            role = {"first layer": units[1], "norm": units[head - 1], "copy": units[head + 1],
                    "first module": units[head + 2]}
            assert terms["zero3_mtp_held"] == sum(role[r] for r in held), (par, terms)
            assert terms["zero3_gathered"] + terms["zero3_mtp_held"] == at_peak["gathered"], (par, terms, at_peak)
    finally:
        world.LiveMemory = original



def test_interleaved_zero3_bf16_head_stage_within_bounds():
    """The head's stage of an interleaved pipeline with MTP under ZeRO-3 and bf16 (DeepSeek-V3's dp128 pp8 vp4
    layout, whose head stage holds chunks of 2, 2, 2 and 1 layers, in small): `simulate`'s saved activations within
    2% of the plan and its live peak within 3%, static bytes exact.
    * Full recompute: recompute never reaches the MTP modules, so their bf16 weight casts are saved per microbatch
      and freed by its last-chunk backward, like the head's: counted once, not once per microbatch in flight (per
      microbatch in flight the activations plan 0.82 and the peak 0.955).
    * Chunks of 2 and 1 layers on the head's stage (--pp-layers 1,2,2,1): the warm-up holds two microbatches of
      the 2-layer chunk and one of the 1-layer chunk, 5 layers, where in_flight × the stage's layers says 4.5
      (the activations plan 1.069)."""
    from shardwise.simulate import world
    from shardwise.simulate.predict import planned

    six = dataclasses.replace(DEEPSEEK_MTP, n_layers=6)
    for rec, extra in (("full", {}), ("none", dict(model=six, pp_layers=[1, 2, 2, 1]))):
        cfg = assemble(dataclasses.replace(_cfg(1, global_batch=8, dtype="bf16", dp=2, pp=2, vp=2, zero=3,
                                                schedule="interleaved", recompute=rec, **extra),
                                           seq_len=16, micro_batch=1))
        measured = world.simulate_rank(cfg, 1, steps=2)  # step 2: the optimizer state exists
        cfg.resolve_world(4)
        plan = planned(cfg, measured["stage"])
        assert measured["static_bytes"] == plan["static_bytes"], rec
        for key, tol in (("activation_bytes", 0.02), ("peak_bytes", 0.03)):
            assert measured[key] == pytest.approx(plan[key], rel=tol), (rec, key, measured[key], plan[key])
