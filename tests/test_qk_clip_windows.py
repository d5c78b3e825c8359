"""MuonClip on gpt-oss-shaped attention: sliding windows, sinks and q/k biases.

One device: each head's recorded S_max equals the largest q·k·scale over exactly the pairs the layer attends (a
5-token window on layer 0 of a 32-token sequence, so the one-device path runs banded; layer 1 full causal), taken
here from an explicit s×s mask — and on the windowed layer the all-causal maximum is larger for some head, so a
maximum over the causal pairs instead of the window's fails; the sink logit is no q·k and stays out. The clip
then (τ between the K-head groups' middle two, so half of them clip) scales each K head's group by η^½ on Wq
*and* bq, η^½ on Wk *and* bk (q and k each scale by exactly η^½, so every logit of the group by η); the biases
are drawn as large as the weights' part of q and k, so leaving them out fails.

Several ranks (one 2-rank fork): `verify` with the clip at a τ below the heads' first-step logits at this init
(≈ 0.025–0.06: nearly every head clips, so its S_max sets its weights) on TP2, ring CP2 balanced and contiguous, and Ulysses CP2 — loss, gradients
and the clipped parameters equal the one-device run's, and so does every head's completed S_max of each step
(recorded from both clips verify runs) — and the planner's `qk_clip_comm` equals the ledger's "qk_clip" rows.
"""
import dataclasses

import torch
from torch.testing import assert_close

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.training.assemble import assemble
from shardwise.training.trainer import Trainer, make_mesh

from _dist import fresh_seed, run_ranks, verify_all

OSS = dataclasses.replace(ModelConfig(), name="tiny-oss", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                          ffn_dim=64, attention_bias=True, attention_out_bias=True, attention_sinks=True,
                          sliding_window=5, sliding_layers=(0,))
SEQ = 32


def _cfg(seed, tau, steps=2, **parallel):
    return TrainConfig(model=OSS, optimizer="muon", muon_qk_clip=tau, parallel=ParallelConfig(**parallel),
                       steps=steps, seq_len=SEQ, micro_batch=2, seed=seed, progress=False, warmup_steps=20,
                       lr_decay_steps=200)


def explicit_max_logits(q, k, scale, window):
    """Per query head, the largest q·kᵀ·scale over the causal pairs within `window` (0: all causal), dense."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.float() @ k.float().transpose(-1, -2) * scale
    i = torch.arange(s.shape[-1])
    diff = i[:, None] - i[None, :]
    seen = (diff >= 0) & (diff < window) if window else diff >= 0
    return s.masked_fill(~seen, float("-inf")).amax(dim=(0, 2, 3))


# A seed whose draw has the window hide a larger causal logit at both steps (`_window_max_and_clip`).
HIDING_SEED = 1234


def test_single_device_window_max_and_biased_clip():
    """The fresh seed checks the code (S_max over the window's pairs, the clip of weights and biases). Whether the
    window hides a larger causal logit — what makes a maximum over all causal pairs fail — is a property of the draw,
    not of the code: on 9 of 300 fresh seeds, at some step, every head's largest causal logit lies inside the window
    (seed 3179881137), so that is asserted on a pinned seed, where it holds at both steps by 11% or more."""
    seed = fresh_seed()
    _window_max_and_clip(seed)
    assert _window_max_and_clip(HIDING_SEED) == [True, True], HIDING_SEED


def _window_max_and_clip(seed: int) -> list[bool]:
    """Two steps of the one-device run, each clip checked against the explicit maxima; per step, whether the
    windowed layer's window hid a larger causal logit of some head."""
    cfg = assemble(_cfg(seed, tau=1e9))  # τ set per step below, among the heads' logits
    t = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
    attns = {name: m for name, m in t.model.named_modules() if hasattr(m, "core")}
    with torch.no_grad():
        for a in attns.values():  # biases as large as the weights' part of q and k: a clip ignoring them shows, and
            for lin in (a.wq, a.wk):  # the logits still vary enough with the tokens for the window to hide the largest
                lin.bias.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
    seen = {}
    for name, a in attns.items():
        a.core.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, []).append(args[:2]))
    clip = t.reducer.muon.clip
    apply, take = clip.apply, clip.recorder.take
    recorded, checked, hidden = {}, [], []

    def take_and_keep():
        got = take()
        recorded.update(got)
        return got

    def checked_apply():
        want_max, causal_max = {}, {}
        for name, a in attns.items():
            scale = a.core.scale or a.head_dim ** -0.5
            per_mb = [(explicit_max_logits(q, k, scale, a.core.window), explicit_max_logits(q, k, scale, 0))
                      for q, k in seen[name]]
            want_max[name] = torch.stack([w for w, _ in per_mb]).amax(0)
            causal_max[name] = torch.stack([c for _, c in per_mb]).amax(0)
        groups = [m.view(-1, a.wq.weight.shape[0] // a.wk.weight.shape[0]).amax(1)
                  for m, a in zip(want_max.values(), attns.values())]
        ranked = torch.cat(groups).sort().values
        clip.tau = float(ranked[1:3].mean())  # between the 2nd and 3rd of the 4 K-head groups: two clip, two do not
        before = {f"{n}.{w}.{p}": getattr(getattr(a, w), p).detach().clone()
                  for n, a in attns.items() for w in ("wq", "wk") for p in ("weight", "bias")}
        apply()
        for name, a in attns.items():
            got = recorded[a.core.layer_id]
            assert_close(got, want_max[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed} {name} S_max: {m}")
            if a.core.window:  # the window hides a larger causal logit of some head: a causal max would clip wrongly
                hidden.append(bool((causal_max[name] > want_max[name] * 1.01).any()))
            g = a.wq.weight.shape[0] // a.wk.weight.shape[0]
            m = want_max[name].view(-1, g).amax(1)
            eta = torch.where(m > clip.tau, clip.tau / m, 1.0)
            checked.append(int((eta < 1).sum()))
            hd = a.head_dim
            for w, rows in (("wq", eta.sqrt().repeat_interleave(g * hd)), ("wk", eta.sqrt().repeat_interleave(hd))):
                for p in ("weight", "bias"):
                    key = f"{name}.{w}.{p}"
                    want = before[key] * (rows[:, None] if p == "weight" else rows)
                    assert_close(getattr(getattr(a, w), p).detach(), want, rtol=1e-6, atol=0,
                                 msg=lambda m: f"seed {seed} {key}: {m}")
        recorded.clear()
        seen.clear()

    clip.apply, clip.recorder.take = checked_apply, take_and_keep
    for step in range(2):
        t.train_step(step)
    assert len(checked) == 4 and sum(checked) == 4, (seed, checked)  # both layers, both steps; 2 of 4 groups each step
    return hidden


def _s_max_gaps(seen) -> list[float]:
    """Per step, the largest |S_max(layout) − S_max(one device)| over every layer and head this rank holds: verify
    clips the layout's trainer, then its one-device reference (`seen`: (tp rank, per-layer S_max) per clip)."""
    gaps = []
    for (rank, mine), (_, ref) in zip(seen[0::2], seen[1::2]):
        gaps.append(max(float((m - r[rank * m.numel():(rank + 1) * m.numel()]).abs().max())
                        for m, r in zip(mine, ref)))
    return gaps


def _ranks(cfgs):
    """Inside ranks: verify each config (the clip against one device) recording every completed S_max, then one
    step's "qk_clip" ledger rows."""
    from shardwise.optim import qk_clip

    apply, row_scales = qk_clip.QKClip.apply, qk_clip._Layer.row_scales
    seen = []

    def recording_apply(self):
        seen.append((self.tp.rank if self.tp.active else 0, []))
        apply(self)

    def recording_rows(self, per_head, tau):
        seen[-1][1].append(per_head.clone())
        return row_scales(self, per_head, tau)

    results = []
    qk_clip.QKClip.apply, qk_clip._Layer.row_scales = recording_apply, recording_rows
    try:
        for cfg in cfgs:
            seen.clear()
            results.append((verify_all([cfg])[0], _s_max_gaps(seen)))
    finally:
        qk_clip.QKClip.apply, qk_clip._Layer.row_scales = apply, row_scales
    ledgers = []
    for cfg in cfgs:
        cfg = assemble(dataclasses.replace(cfg, steps=1))
        t = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
        t.train_step(0)
        axes = t.mesh.ledger.steps[-1]["axes"]
        ledgers.append({(a, op): (v["count"], v["bytes"]) for a, ops in axes.items() for op, v in ops.items()
                        if op.endswith(":qk_clip")})
    return results, ledgers


LAYOUTS = {"tp2": dict(tp=2), "ring_balanced": dict(cp=2), "ring_contiguous": dict(cp=2, cp_order="contiguous"),
           "ulysses": dict(cp=2, cp_impl="ulysses")}


def test_layouts_clip_as_one_device_and_planner_counts_it():
    from shardwise.planner.comm_model import step_comm
    from shardwise.planner.layout import from_train_config, stages
    from shardwise.planner.memory import stage_params

    seed = fresh_seed()
    # τ below the heads' first-step logits (≈ 0.025–0.06 at this init): each clipped head's S_max sets its rows
    cfgs = [_cfg(seed, tau=0.02, **p) for p in LAYOUTS.values()]
    try:
        per_rank = run_ranks(2, _ranks, cfgs, timeout_s=300)
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    for results, _ in per_rank:
        for name, (r, gaps) in zip(LAYOUTS, results):
            assert r["passed"], (seed, name, r)
            # every head's completed S_max equals the one device's, both steps (a causal max instead: ≥ 1e-2 off)
            assert len(gaps) == 2 and max(gaps) < 1e-6, (seed, name, gaps)
    for i, (name, cfg) in enumerate(zip(LAYOUTS, cfgs)):
        spec, lay, wl = from_train_config(assemble(cfg))
        st = stages(spec, lay)[0]
        led = step_comm(spec, st, lay, wl, stage_params(spec, st, lay))[2]
        want = {(a, op): (c, b) for a, ops in led.ops.items() for op, (c, b, _) in ops.items()
                if op.endswith(":qk_clip")}
        assert bool(want) == (cfg.parallel.cp > 1), (name, want)  # tp2: one K head per rank, nothing to gather
        for _, ledgers in per_rank:
            assert ledgers[i] == want, (name, ledgers[i], want)
