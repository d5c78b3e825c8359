"""Load-balanced expert placement (`--expert-placement balanced`, `--expert-replicas R`): the torch-free rule, verify
against one device with a permuted and a replicated placement (and a wrong slot map caught), and a checkpoint
written under one placement resumed under others (logical expert ids)."""
from __future__ import annotations

import json

import pytest
import torch

from shardwise.checkpoint import load_checkpoint, load_global_tensors, save_checkpoint
from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.rules.placement import balanced, contiguous, layout_for, read_histogram
from shardwise.rules.routing import skew_of

from _dist import fresh_seed, run_ranks, verify_all

# tiny-moe: 8 experts, MoE layers 0, 2, 4, 6; skewed so contiguous placement is far from even at ep=4
HIST = {"0": [90, 80, 5, 5, 4, 3, 2, 1], "2": [1, 2, 3, 60, 70, 5, 5, 4], "4": [9, 1, 1, 1, 1, 1, 1, 9],
        "6": [1, 9, 1, 1, 1, 1, 9, 1]}


def _routing(tmp_path) -> str:
    (tmp_path / "routing.jsonl").write_text(json.dumps({"step": 1, "tokens_per_expert": HIST}) + "\n")
    return str(tmp_path)


def test_the_placement_rule(tmp_path):
    """LPT with equal slots evens the expected load (a flat histogram stays flat); R replicas put the ep hottest
    experts on R distinct ranks each (E/ep − 1 + R slots per rank) and even the load further."""
    counts = HIST["0"]
    even = balanced(counts, 4)
    assert sorted(e for rank in even.slots for e in rank) == list(range(8)) and not even.identity
    assert max(even.rank_loads(counts)) < max(contiguous(8, 4).rank_loads(counts))
    assert max(even.rank_loads(counts)) == 91  # expert 0 (90) can do no better without a replica
    assert balanced([5.0] * 8, 4).rank_loads([5.0] * 8) == [10.0] * 4 and layout_for("contiguous", 8, 4, counts).identity
    rep = balanced(counts, 4, replicas=2)
    assert rep.n_local == 3 and rep.replicas() == 2
    hot = sorted(range(8), key=lambda e: -counts[e])[:4]
    assert all(len(set(c // 3 for c in rep.copies(e))) == 2 for e in hot)
    assert max(rep.rank_loads(counts)) < 50 < max(even.rank_loads(counts))
    assert [sum(rep.primary(r)) for r in range(4)] and sum(sum(rep.primary(r)) for r in range(4)) == 8
    assert skew_of(counts, 4) > skew_of(counts, 4, [r for e in range(8) for r in range(4) if e in even.slots[r]])
    assert read_histogram(_routing(tmp_path))[2] == [float(c) for c in HIST["2"]]
    with pytest.raises(ValueError, match="expert replicas 5"):
        balanced(counts, 4, replicas=5)


def test_flags_are_checked():
    for bad, match in ((dict(expert_placement="balanced"), "needs --expert-routing"),
                       (dict(expert_replicas=2), "needs --expert-placement balanced"),
                       (dict(expert_placement="hashed"), "is unknown")):
        with pytest.raises(ConfigError, match=match):
            TrainConfig(model="tiny-moe", parallel=ParallelConfig(dp=4, ep=4, **bad)).validate(4)


def _verify_and_sabotage(cfgs, broken):
    """Inside ranks: verify each config, then `broken` with the dispatcher sending rows to the contiguous slots
    while the weights sit where the placement put them (the inverse map left out)."""
    from shardwise.expert_parallel.dispatch import AllToAllDispatcher

    out = verify_all(cfgs)
    AllToAllDispatcher._slots = lambda self, flat_e, k: flat_e % (self.axis.size * self.n_local)
    return out + verify_all([broken])


def _cfg(seed, routing, steps=2, **placement) -> TrainConfig:
    return TrainConfig(model="tiny-moe", parallel=ParallelConfig(dp=4, ep=4, expert_routing=routing, **placement),
                       steps=steps, seq_len=32, micro_batch=2, global_batch=8, seed=seed, progress=False)


def test_verify_with_permuted_and_replicated_placement(tmp_path):
    """Loss, gradients, updates and parameters against one device (verify) on 4 gloo ranks (dp=4 × ep=4), a fresh
    seed: a permuted placement and one with 2 replicas of the 4 hottest experts pass; a wrong slot map fails."""
    seed, routing = fresh_seed(), _routing(tmp_path)
    cfgs = [_cfg(seed, routing, expert_placement="balanced"),
            _cfg(seed, routing, expert_placement="balanced", expert_replicas=2, zero=1)]
    results = run_ranks(4, _verify_and_sabotage, cfgs, _cfg(seed, routing, 1, expert_placement="balanced"),
                        timeout_s=300)[0]
    for name, r in zip(("permuted", "replicas=2"), results):
        assert r["passed"] and r["first_step_grad_rel_diff"] < 1e-5 and r["max_loss_abs_diff"] < 1e-5, (name, seed, r)
    assert not results[2]["passed"] and results[2]["first_step_grad_rel_diff"] > 1e-3, (seed, results[2])


def _logits(trainer, x) -> torch.Tensor:
    trainer.model.eval()
    with torch.no_grad():
        out = trainer.model(x)
    trainer.model.train()
    return out


def _resume_across(cfgs, root):
    """Inside ranks: train cfgs[0] two steps and save; every config (cfgs[0] again, then other placements) loads it:
    its shards equal the saved logical rows, its logits and next loss equal the saving run's."""
    from shardwise.tensor_parallel.layers import get_spec
    from shardwise.training.trainer import Trainer, make_mesh

    def trainer(cfg):
        return Trainer(cfg, make_mesh(cfg, torch.device("cpu")))

    t = trainer(cfgs[0])
    x = t.loader.global_batch_at(0)[0][:2]
    for step in range(2):
        t.train_step(step)
    path = save_checkpoint(root, 2, t, {"completed": 2})
    saved = load_global_tensors(path, "model.")
    ref = (_logits(t, x), t.train_step(2)["loss"])
    out = []
    for cfg in cfgs:
        u = trainer(cfg)
        load_checkpoint(root, u)
        shard = max(float((p.detach() - get_spec(p).local_slice(saved[n])).abs().max())
                    for n, p in u.reducer.named)
        logits = _logits(u, x)
        out.append((shard, float((logits - ref[0]).abs().max()), abs(u.train_step(2)["loss"] - ref[1])))
    return out


@pytest.mark.slow
def test_a_checkpoint_resumes_under_another_placement(tmp_path):
    """Checkpoints hold logical expert ids: saved under 2 replicas of a balanced placement, loaded under the same,
    contiguous and a permutation without replicas; shards, logits and the next step's loss agree."""
    seed, routing = fresh_seed(), _routing(tmp_path)
    cfgs = [_cfg(seed, routing, expert_placement="balanced", expert_replicas=2), _cfg(seed, routing),
            _cfg(seed, routing, expert_placement="balanced")]
    for name, (shard, logits, loss) in zip(("same", "contiguous", "permuted"),
                                           run_ranks(4, _resume_across, cfgs, str(tmp_path / "ckpt"),
                                                     timeout_s=300)[0]):
        assert shard == 0.0 and logits < 1e-5 and loss < 1e-5, (name, seed, shard, logits, loss)


def test_the_plan_reads_the_placement():
    """`plan --expert-placement balanced` plans the busiest rank after placement: a recorded histogram's S is the
    balanced layout's (what `--explain` shows as the what-if), a stated S spreads its hot rank's experts over ranks; less
    memory and time than contiguous, never below the mean."""
    from dataclasses import replace

    from shardwise.planner import Cluster, estimate, get_gpu
    from shardwise.planner.layout import Layout, Workload
    from shardwise.planner.models import get_model
    from shardwise.planner.moe_skew import balanced_skew, skew

    spec = get_model("mixtral-8x7b")
    lay = Layout(dp=16, tp=4, pp=2, ep=4, mb=1, m=4, zero=1, recompute="selective", sequence_parallel=True)
    hist = ((900, 800, 50, 50, 40, 30, 20, 10), (10, 20, 30, 600, 700, 50, 50, 40))
    routed = Workload(4096, 64, "bf16", moe_routing=hist)
    placed = replace(routed, expert_placement="balanced")
    assert skew(spec, lay, placed) == balanced_skew(spec, lay, routed) < skew(spec, lay, routed)
    # S = 3 on E = 8 over ep = 4: the hot rank's two experts carry 3/8 of the rows each, one per rank after placement
    stated = skew(spec, lay, replace(Workload(4096, 64, "bf16", moe_skew=3.0), expert_placement="balanced"))
    assert stated == pytest.approx(4 * (3 / 8 + (1 - 3 / 4) / 6), rel=1e-3)
    cluster = Cluster(get_gpu("h100-80gb"), lay.world_size, 8)
    a, b = (estimate(spec, cluster, lay, wl, detail=True) for wl in (routed, placed))
    assert b["peak_bytes_per_rank"] < a["peak_bytes_per_rank"] and b["step_time_s"] < a["step_time_s"]
    assert b["moe_skew"] >= 1.0


@pytest.mark.slow
def test_hf_round_trip_under_a_placement(tmp_path):
    """`train --init-from-hf` of a DeepSeek-V3 checkpoint on dp4×ep4 with a balanced placement and 2 replicas, at lr
    0, then `hf-export`: each rank's slots read their logical experts, the checkpoint holds logical ids, and every
    exported tensor equals the source's."""
    import argparse
    import os

    from safetensors.torch import load_file

    from shardwise.cli import main
    from shardwise.commands.hf import run_export
    from shardwise.hf import weights as hf
    from test_hf import DEEPSEEK, _save, _tokenizer, tmp_path_factory_shim

    path = _tokenizer(_save(tmp_path_factory_shim(tmp_path), "ft_deepseek", "DeepseekV3", norms=True,
                            shape=DEEPSEEK | dict(vocab_size=300)), 280)
    hist = tmp_path / "routing.jsonl"
    hist.write_text(json.dumps({"step": 1, "tokens_per_expert": {str(i): HIST["0"] for i in range(1, 8)}}) + "\n")
    text = tmp_path / "bytes.txt"
    text.write_text("shardwise fine-tunes a DeepSeek model on a few bytes of text. " * 20)
    run = str(tmp_path / "run")
    assert main(["train", "--init-from-hf", path, "--dp", "4", "--ep", "4", "--expert-placement", "balanced",
                 "--expert-routing", str(hist), "--expert-replicas", "2", "--lr", "0", "--steps", "1", "--seq-len",
                 "16", "--micro-batch", "1", "--save-every", "1", "--out", run, "--no-report", "--no-progress",
                 "--data", str(text)]) == 0
    out = str(tmp_path / "exported")
    assert run_export(argparse.Namespace(ckpt_dir=os.path.join(run, "checkpoints"), out_dir=out)) == 0
    files = hf.WeightFiles(path)
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(exported) == sorted(files.where)
    for n in files.where:
        want = files.read(n, tuple(slice(0, s) for s in files.shape(n)))
        torch.testing.assert_close(exported[n], want, atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")
