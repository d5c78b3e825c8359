"""Muon: the single-device step against a plain Muon written here from the equations, the deal that spreads
Newton–Schulz over ranks, and every layout against the single-device Muon (`verify --optimizer muon`)."""
import dataclasses
import math

import pytest
import torch

from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from shardwise.optim import is_muon_param
from shardwise.rules.muon import deal
from shardwise.training.assemble import assemble
from shardwise.training.trainer import Trainer, lr_at, make_mesh

from _dist import fresh_seed, run_ranks, verify_all


def plain_muon_update(g, steps=5):
    """0.2·√max(r, c)·NS⁵(g / (‖g‖_F + 1e-7)), transposed while wide is not the case."""
    x = g / (g.norm() + 1e-7)
    if x.shape[0] > x.shape[1]:
        return plain_muon_update(g.T, steps).T
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return 0.2 * math.sqrt(max(g.shape)) * x


def _cfg(model="tiny", **kw):
    return assemble(TrainConfig(model=model, optimizer="muon", steps=3, seq_len=32, micro_batch=2, progress=False,
                                seed=kw.pop("seed", 1234), **kw))


def plain_max_logits(q, k, scale):
    """Per query head, the largest causal q·kᵀ·scale (GQA: K heads repeated over their query heads)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.amax(dim=(0, 2, 3))


def plain_qk_clip(model, seen, tau, want):
    """MuonClip from its equations on the updated weights `want`: η = min(1, τ / S_max) per head (GQA: per K head,
    over its query heads); q rows × η^½, k rows × η^½ (MLA: q_nope η^½, q_rope η, k_nope η^½, shared k_rope and
    v as they are). Returns how many heads (groups) were clipped."""
    clipped = 0
    for name, attn in model.named_modules():
        if not hasattr(attn, "core"):
            continue
        q, k = seen[name]
        scale = attn.core.scale or q[0].shape[-1] ** -0.5
        smax = torch.stack([plain_max_logits(qi, ki, scale) for qi, ki in zip(q, k)]).amax(0)
        if hasattr(attn, "wkv_b"):
            eta = torch.clamp(tau / smax, max=1.0)
            wq = f"{name}.wq_b.weight" if hasattr(attn, "wq_b") else f"{name}.wq.weight"
            nope, rope, vd = attn.nope, attn.rope, attn.v_dim
            wq_rows = torch.stack([eta.sqrt()] * nope + [eta] * rope, 1).reshape(-1)
            kv_rows = torch.stack([eta.sqrt()] * nope + [torch.ones_like(eta)] * vd, 1).reshape(-1)
            want[wq] = want[wq] * wq_rows[:, None]
            want[f"{name}.wkv_b.weight"] = want[f"{name}.wkv_b.weight"] * kv_rows[:, None]
        else:
            g = attn.wq.weight.shape[0] // attn.wk.weight.shape[0]
            eta = torch.clamp(tau / smax.view(-1, g).amax(1), max=1.0)
            hd = attn.head_dim
            want[f"{name}.wq.weight"] = want[f"{name}.wq.weight"] * eta.sqrt().repeat_interleave(g * hd)[:, None]
            want[f"{name}.wk.weight"] = want[f"{name}.wk.weight"] * eta.sqrt().repeat_interleave(hd)[:, None]
        clipped += int((eta < 1).sum())
    return clipped


@pytest.mark.parametrize("model,tau", [("tiny", 0.0), ("tiny-moe", 0.0), ("tiny", 0.13), ("deepseek", 0.045)])
def test_single_device_matches_plain_muon(model, tau):
    """The trainer's Muon (and with τ, MuonClip) step against the equations; τ sits among the heads' logits, so
    some heads clip and some do not."""
    from test_model_families import DEEPSEEK

    cfg = _cfg(DEEPSEEK if model == "deepseek" else model, weight_decay=0.1, muon_qk_clip=tau)
    t = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
    named = dict(t.model.named_parameters())
    hidden = {n for n, p in named.items() if is_muon_param(n, p)}
    assert any("experts" in n for n in hidden) == (model in ("tiny-moe", "deepseek"))
    assert not any(k in n for n in hidden for k in ("tok_embeddings", "output", "router", "norm"))
    seen = {}

    def keep(name):
        def hook(module, args):
            q, k = seen.setdefault(name, ([], []))
            q.append(args[0].detach())
            k.append(args[1].detach())
        return hook

    for name, attn in t.model.named_modules():
        if hasattr(attn, "core"):
            attn.core.register_forward_pre_hook(keep(name))
    momentum = {n: torch.zeros_like(named[n]) for n in hidden}
    clipped = 0
    for step in range(3):
        seen.clear()
        t.forward_backward(step)
        t.finish_gradients()
        before = {n: named[n].detach().clone() for n in hidden}
        grads = {n: named[n].grad.detach().clone() for n in hidden}
        t.optimizer_step(step)
        lr = lr_at(step, cfg)
        want = {}
        for n in hidden:
            momentum[n] = 0.95 * momentum[n] + grads[n]
            nest = grads[n] + 0.95 * momentum[n]
            upd = (torch.stack([plain_muon_update(e) for e in nest]) if nest.ndim == 3 else plain_muon_update(nest))
            want[n] = before[n] * (1 - lr * 0.1) - lr * upd
        if tau:
            clipped += plain_qk_clip(t.model, seen, tau, want)
        for n in hidden:
            torch.testing.assert_close(named[n].detach(), want[n], rtol=1e-5, atol=1e-7, msg=f"{n} step {step + 1}")
    assert (clipped > 0) == bool(tau)


def test_orthogonal_and_rms_matched():
    g = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    from shardwise.optim.muon import orthogonalise, muon_update

    s = torch.linalg.svdvals(orthogonalise(g, 5))
    assert 0.6 < s.min() and s.max() < 1.25  # the quintic's band, not exactly 1
    assert 0.15 < muon_update(g, 5).pow(2).mean().sqrt() < 0.25


def test_deal_balances():
    shapes = [(96, 96)] * 4 + [(48, 96)] * 4 + [(256, 96)] * 6 + [(96, 256)] * 3
    owner = deal(shapes, 4)
    load = [0] * 4
    for s, r in zip(shapes, owner):
        load[r] += s[0] * s[1] * min(s)
    assert max(load) - min(load) <= max(s[0] * s[1] * min(s) for s in shapes)
    assert set(owner) == {0, 1, 2, 3}


def test_flags_validate():
    with pytest.raises(ConfigError, match="--optimizer"):
        TrainConfig(optimizer="sgd").validate(1)
    with pytest.raises(ConfigError, match="--muon-momentum"):
        TrainConfig(optimizer="muon", muon_momentum=1.0).validate(1)
    with pytest.raises(ConfigError, match="--muon-qk-clip -1.0 must be a logit threshold > 0"):
        TrainConfig(optimizer="muon", muon_qk_clip=-1.0).validate(1)
    with pytest.raises(ConfigError, match="clips after Muon's step: add --optimizer muon"):
        TrainConfig(muon_qk_clip=50.0).validate(1)
    with pytest.raises(ConfigError, match="'qwen3-0.6b' normalises each head's q and k"):
        TrainConfig(model="qwen3-0.6b", optimizer="muon", muon_qk_clip=50.0).validate(1)
    TrainConfig(model="gpt-oss-20b", optimizer="muon", muon_qk_clip=50.0).validate(1)  # windows, sinks: clipped


def _verify_cfg(model="tiny", seed=None, muon_qk_clip=0.0, **parallel):
    extra = {"global_batch": 4} if parallel.get("pp", 1) > 1 else {}
    extra["muon_qk_clip"] = muon_qk_clip
    return TrainConfig(model=model, optimizer="muon", parallel=ParallelConfig(**parallel), steps=3, seq_len=32,
                       micro_batch=2, seed=seed, progress=False, warmup_steps=20, lr_decay_steps=200, **extra)


TWO_RANK = [dict(tp=2, sequence_parallel=True), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3),
            dict(pp=2), dict(cp=2)]


def _check(results, cfgs):
    for r, c in zip(results, cfgs):
        assert r["passed"], (c.seed, c.parallel, r)


def test_verify_muon_two_ranks():
    seed = fresh_seed()
    cfgs = [_verify_cfg(seed=seed, **p) for p in TWO_RANK] + [_verify_cfg("tiny-moe", seed=seed, dp=2, ep=2)]
    _check(run_ranks(2, verify_all, cfgs)[0], cfgs)


def _clip_cfgs(seed):
    """MuonClip on every axis it touches: heads over tp (and a K head shared by both TP ranks, so a group's
    S_max spans them), S_max over cp's blocks (ring, and MLA's q/k rows under Ulysses), pp, and MLA's rows cut
    across two ZeRO-3 shards."""
    from test_model_families import DEEPSEEK

    mqa = dataclasses.replace(ModelConfig(), name="tiny-mqa", n_kv_heads=1)
    clip = dict(muon_qk_clip=0.12)
    return [_verify_cfg(seed=seed, tp=2, sequence_parallel=True, **clip), _verify_cfg(mqa, seed, tp=2, **clip),
            _verify_cfg(seed=seed, cp=2, **clip), _verify_cfg(seed=seed, pp=2, **clip),
            _verify_cfg(DEEPSEEK, seed, cp=2, cp_impl="ulysses", muon_qk_clip=0.045),
            _verify_cfg(DEEPSEEK, seed, dp=2, zero=3, muon_qk_clip=0.045)]


def test_verify_muon_qk_clip_two_ranks():
    seed = fresh_seed()
    cfgs = _clip_cfgs(seed)
    _check(run_ranks(2, verify_all, cfgs, timeout_s=600)[0], cfgs)


def _broken_verify(cfgs):
    """Inside ranks: verify each config with one part of Muon broken on purpose: each rank orthogonalising its own
    TP pieces; MuonClip scaling the wrong heads (η in reverse head order); S_max not completed over cp."""
    from shardwise.optim import qk_clip
    from shardwise.optim.sharded import Muon

    row_scales, init = qk_clip._Layer.row_scales, qk_clip.QKClip.__init__

    def one_rank_s_max(self, *args):
        init(self, *args)
        self.data = self.reducer.mesh["dp_replicate"]  # an inactive axis: the all-reduce over dp×cp is skipped

    breaks = [(Muon, "_tp_split", lambda self, p: False),
              (qk_clip._Layer, "row_scales", lambda self, m, tau: row_scales(self, m.flip(0), tau)),
              (qk_clip.QKClip, "__init__", one_rank_s_max)]
    out = []
    for cfg, (owner, name, broken) in zip(cfgs, breaks):
        kept = owner.__dict__[name]
        setattr(owner, name, broken)
        try:
            out.append(verify_all([cfg])[0])
        finally:
            setattr(owner, name, kept)
    return out


def test_broken_muon_fails_verify():
    """A per-shard orthogonalisation, a clip of the wrong heads, and a clip from one cp rank's S_max each fail."""
    seed = fresh_seed()
    cfgs = [_verify_cfg(seed=seed, tp=2), _verify_cfg(seed=seed, tp=2, muon_qk_clip=0.12),
            _verify_cfg(seed=seed, cp=2, muon_qk_clip=0.12)]
    for cfg, r in zip(cfgs, run_ranks(2, _broken_verify, cfgs)[0]):
        assert not r["passed"] and r["first_step_update_rel_diff"] > 0.05, (seed, cfg.parallel, cfg.muon_qk_clip, r)


def _families(seed):
    from test_model_families import DEEPSEEK
    from test_mtp import DEEPSEEK_MTP

    two = [_verify_cfg(DEEPSEEK, seed, tp=2, sequence_parallel=True), _verify_cfg(DEEPSEEK, seed, cp=2),
           _verify_cfg(DEEPSEEK, seed, dp=2, ep=2, zero=3),
           _verify_cfg(DEEPSEEK_MTP, seed, tp=2, sequence_parallel=True)]
    two += [dataclasses.replace(_verify_cfg(DEEPSEEK, seed, pp=2, schedule=s, vp=2 if s == "interleaved" else 1),
                                global_batch=8) for s in ("1f1b", "interleaved", "zb", "dualpipev")]
    four = [_verify_cfg(seed=seed, dp=2, tp=2, sequence_parallel=True, zero=1),
            _verify_cfg(seed=seed, tp=4, sequence_parallel=True), _verify_cfg(seed=seed, dp=2, tp=2, zero=3),
            _verify_cfg(seed=seed, dp=4, dp_shard=2, zero=2), _verify_cfg(seed=seed, dp=4, dp_shard=2, zero=3),
            _verify_cfg(DEEPSEEK, seed, dp=2, ep=2, tp=2, sequence_parallel=True),
            dataclasses.replace(_verify_cfg(DEEPSEEK, seed, pp=2, tp=2, schedule="zb"), global_batch=8)]
    return two, four


@pytest.mark.slow
def test_verify_muon_mla_mtp_pipeline_two_ranks():
    seed = fresh_seed()
    cfgs = _families(seed)[0]
    _check(run_ranks(2, verify_all, cfgs, timeout_s=600)[0], cfgs)


@pytest.mark.slow
def test_verify_muon_four_ranks():
    seed = fresh_seed()
    cfgs = _families(seed)[1]
    _check(run_ranks(4, verify_all, cfgs, timeout_s=600)[0], cfgs)


def _shardwise(capfd, *args) -> tuple[int, str]:
    """`shardwise <args>` through the CLI's own `main` in this process, its ranks forked from it (no interpreter
    start per run): (exit status, what the run wrote to stderr)."""
    from shardwise.cli import main

    capfd.readouterr()
    code = main(list(args))
    return code, capfd.readouterr().err


def _losses(run_dir):
    import json

    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_checkpoint_resumes_bitwise_reshards_and_refuses_adamw(tmp_path, capfd):
    common = ["train", "--optimizer", "muon", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "4",
              "--lr-decay-steps", "4", "--no-progress", "--no-report"]
    tp = ["--tp", "2", "--sequence-parallel"]
    full, run = tmp_path / "full", tmp_path / "run"
    assert _shardwise(capfd, *common, *tp, "--steps", "4", "--out", str(full), "--no-checkpoint")[0] == 0
    code, err = _shardwise(capfd, *common, *tp, "--steps", "2", "--out", str(run), "--save-every", "2")
    assert code == 0, err
    code, err = _shardwise(capfd, *common, *tp, "--steps", "4", "--out", str(run), "--resume", "--no-checkpoint")
    assert code == 0, err
    assert _losses(run) == _losses(full)  # bitwise: the momentum came back exactly
    saved = run / "checkpoints"
    for name, layout in (("zero3", ["--dp", "2", "--zero", "3"]), ("zero1", ["--dp", "2", "--zero", "1"])):
        other = tmp_path / name
        code, err = _shardwise(capfd, *common, *layout, "--steps", "4", "--out", str(other), "--checkpoint-dir",
                               str(saved), "--resume", "--no-checkpoint")
        assert code == 0, err
        assert _losses(other) == pytest.approx(_losses(full)[2:], rel=1e-5), name
    code, err = _shardwise(capfd, *common[:1], *common[3:], *tp, "--steps", "4", "--out", str(tmp_path / "adamw"),
                           "--checkpoint-dir", str(saved), "--resume", "--no-checkpoint")
    assert code != 0 and "holds muon state; resume it with --optimizer muon" in err, err


def _muon_ledger_and_state(cfgs):
    """Inside ranks: per config, this rank's pp coordinate, the step's Muon-tagged ledger entries and the bytes
    of every optimizer state tensor (after one step)."""
    from shardwise.optim import optimizers

    out = []
    for cfg in cfgs:
        cfg = assemble(cfg)
        t = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        t.train_step(0)
        axes = t.mesh.ledger.steps[-1]["axes"]
        muon = {(a, op): (v["count"], v["bytes"], v["wire_bytes"]) for a, ops in axes.items()
                for op, v in ops.items() if op.endswith((":muon", ":qk_clip"))}
        state = sum(x.numel() * x.element_size() for o in optimizers(t.reducer) for st in o.state.values()
                    for x in st.values() if torch.is_tensor(x) and x.dim() > 0)
        out.append((t.mesh.coords["pp"], muon, state, sum(p.numel() for p in t.model.parameters())))
    return out


def test_planner_counts_muon_ledger_and_state():
    from test_model_families import DEEPSEEK
    from shardwise.planner.comm_model import step_comm
    from shardwise.planner.layout import from_train_config, stages
    from shardwise.planner.memory import stage_params
    from shardwise.planner.muon import optimizer_bytes

    seed = fresh_seed()
    cfgs = [_verify_cfg(seed=seed, tp=2, sequence_parallel=True), _verify_cfg(seed=seed, dp=2),
            _verify_cfg("tiny-moe", seed=seed, dp=2, ep=2), _verify_cfg(DEEPSEEK, seed, tp=2),
            _verify_cfg(seed=seed, dp=2, zero=1), _verify_cfg(DEEPSEEK, seed, dp=2, ep=2, zero=3),
            dataclasses.replace(_verify_cfg(DEEPSEEK, seed, pp=2), global_batch=4)] + _clip_cfgs(seed)
    per_rank = run_ranks(2, _muon_ledger_and_state, cfgs)
    for i, cfg in enumerate(cfgs):
        spec, lay, wl = from_train_config(assemble(cfg))
        for rank in per_rank:
            pp, measured, state, numel = rank[i]
            st = stages(spec, lay)[pp]
            led = step_comm(spec, st, lay, wl, stage_params(spec, st, lay))[2]
            want = {(a, op): (c, b, round(w)) for a, ops in led.ops.items() for op, (c, b, w) in ops.items()
                    if op.endswith((":muon", ":qk_clip"))}
            assert measured == want, (cfg.parallel, pp)
            if not lay.zero:
                assert state == optimizer_bytes(numel, spec, st, lay), (cfg.parallel, pp)


def test_simulate_bounds_hold_for_muon(capsys):
    """`simulate --optimizer muon`: static 1%, saved activations 2%, live peak 3% and every ledger row equal on
    tp2×dp2 ZeRO-1 (where Muon's step is the peak: without its transients the plan is 0.62× the trace) and
    tiny-moe dp4×ep2 ZeRO-1 (experts over edp; Muon's and AdamW's buckets pad apart)."""
    import json

    from shardwise.cli import main

    tiny = ["--seq-len", "64", "--micro-batch", "2", "--optimizer", "muon"]
    for flags in (["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero", "1"],
                  ["--model", "tiny-moe", "--dp", "4", "--ep", "2", "--zero", "1"]):
        rc = main(["simulate", *tiny, *flags, "--json"])
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        for r in report["ranks"]:
            for key, tol in (("static_bytes", 0.01), ("activation_bytes", 0.02), ("peak_bytes", 0.03)):
                m, p = r[key]["measured"], r[key]["planned"]
                assert abs(m - p) <= tol * p, (flags, r["rank"], key, m, p)
            assert all(v["measured"] == v["planned"] for v in r["comm_bytes"].values()), (flags, r["comm_bytes"])
        assert rc == 0 and report["passed"], flags
