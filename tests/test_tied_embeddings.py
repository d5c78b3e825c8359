"""Tied embeddings under pipeline parallelism (Megatron's embedding group), in one 4-rank spawn.

Layouts: pp2×tp2 (1f1b; the emb group reuses the pp group), pp2×dp2 interleaved vp2 with ZeRO-1,
dualpipev pp2×dp2 (rank 0 holds both ends: one Parameter, nothing reduced), pp4 (a new two-rank
group; the middle stages hold neither copy). For each: `verify_main` passes (first-step gradients of
both copies against the single-device tied gradient within 1e-5); the global grad norm equals the
single device's (the matrix counted once); the ledger shows one all-reduce of the local vocab shard on
axis "emb" on the end stages and none elsewhere; both copies stay bitwise equal after AdamW. A pp2×tp2
checkpoint stores the matrix once, as `tok_embeddings.weight`, and loads into pp4 with both copies
filled from it.
"""
import numpy as np
import pytest
import torch

from shardwise import comm
from shardwise.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from shardwise.pipeline.tied_embedding import emb_stages

from _dist import fresh_seed, run_ranks

MODEL = ModelConfig(name="tied4", vocab_size=257, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    max_seq_len=64, tie_embeddings=True)
LAYOUTS = {
    "pp2_tp2": dict(pp=2, tp=2),
    "pp2_dp2_interleaved_zero1": dict(pp=2, dp=2, schedule="interleaved", vp=2, zero=1),
    "pp2_dp2_dualpipev": dict(pp=2, dp=2, schedule="dualpipev"),
    # ZeRO-2/3 reduce-scatter during backward: the tied bucket must wait for the emb sum
    "pp2_dp2_zero2": dict(pp=2, dp=2, zero=2),
    "pp2_dp2_zero3": dict(pp=2, dp=2, zero=3),
    "pp4": dict(pp=4),
}


def _cfg(degrees, seed):
    cfg = TrainConfig(model=MODEL, parallel=ParallelConfig(**degrees), steps=2, seq_len=32, micro_batch=1,
                      global_batch=8, seed=seed, progress=False)
    cfg = cfg.resolved()
    return cfg


def _tied_local(model):
    """This rank's copies of the shared matrix: {name: numpy} (one entry when one Parameter is both)."""
    out, seen = {}, set()
    for part, name in ((model.tok_embeddings, "tok_embeddings.weight"), (model.output, "output.weight")):
        if part is not None and id(part.weight) not in seen:
            seen.add(id(part.weight))
            out[name] = part.weight.detach().numpy().copy()
    return out


def _rank(seed, ckpt_dir):
    from shardwise.checkpoint import load_checkpoint, save_checkpoint
    from shardwise.training.trainer import Trainer, make_mesh
    from shardwise.verify.main import verify_main
    from shardwise.verify.reference import reference

    out = {}
    for name, degrees in LAYOUTS.items():
        cfg = _cfg(degrees, seed)
        res = verify_main(cfg)
        mesh = make_mesh(cfg, torch.device("cpu"))
        trainer, ref = Trainer(cfg, mesh), reference(cfg, torch.device("cpu"))
        trainer.forward_backward(0)
        ref.forward_backward(0)
        norm, ref_norm = trainer.finish_gradients(), ref.finish_gradients()
        trainer.optimizer_step(0)
        emb_ops = mesh.ledger.snapshot().get("emb", {})
        out[name] = dict(res=res, norm=norm, ref_norm=ref_norm, emb_ops=emb_ops, coords=mesh.coords,
                         tied=_tied_local(trainer.model), emb_size=mesh["emb"].size)
        if name == "pp2_tp2":
            save_checkpoint(ckpt_dir, 1, trainer)
    cfg = _cfg(LAYOUTS["pp4"], seed + 1)  # other seed: the load must overwrite both copies
    trainer = Trainer(cfg, make_mesh(cfg, torch.device("cpu")))
    load_checkpoint(ckpt_dir, trainer)
    out["loaded_pp4"] = dict(tied=_tied_local(trainer.model), coords=trainer.mesh.coords)
    comm.barrier(trainer.mesh["world"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    seed = fresh_seed()
    ckpt = str(tmp_path_factory.mktemp("tied_ckpt"))
    return seed, ckpt, run_ranks(4, _rank, seed, ckpt, timeout_s=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tied_verify_norm_ledger_and_equal_copies(results, name):
    seed, _, ranks = results
    reps = [r[name] for r in ranks]
    res = reps[0]["res"]
    assert res["passed"] and res["first_step_grad_rel_diff"] < 1e-5 and res["max_loss_abs_diff"] < 1e-5, (seed, res)
    for rep in reps:
        assert rep["norm"] == pytest.approx(rep["ref_norm"], rel=1e-5), (seed, name, rep["norm"], rep["ref_norm"])
    cfg = _cfg(LAYOUTS[name], seed)
    first, last = emb_stages(cfg.parallel)
    tp = cfg.parallel.tp
    shard_bytes = -(-MODEL.vocab_size // tp) * MODEL.dim * 4
    for rep in reps:
        pp = rep["coords"]["pp"]
        if first != last and pp in (first, last):
            assert rep["emb_size"] == 2
            assert rep["emb_ops"] == {"all_reduce": {"count": 1, "bytes": shard_bytes, "wire_bytes": shard_bytes}}
        else:
            assert rep["emb_size"] == 1 and rep["emb_ops"] == {}, (name, rep["coords"])
    if cfg.parallel.zero >= 3:  # full parameters exist only while gathered; verify compared both copies' shards
        return
    # the copies on the first and last stage (same dp/tp coordinates) are bitwise equal after AdamW
    by_pos = {}
    for rep in reps:
        for copy in rep["tied"].values():
            by_pos.setdefault((rep["coords"]["dp"], rep["coords"]["tp"]), []).append(copy)
    for pos, copies in by_pos.items():
        assert len(copies) == (2 if first != last else 1), (name, pos)
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])


def test_tied_checkpoint_stored_once_and_resharded(results):
    from shardwise.checkpoint import list_checkpoints, load_global_tensors

    seed, ckpt, ranks = results
    path = list_checkpoints(ckpt)[0][1]
    weights = load_global_tensors(path)
    assert "tok_embeddings.weight" in weights and "output.weight" not in weights
    optim = load_global_tensors(path, prefix="optim.")
    assert "tok_embeddings.weight.exp_avg" in optim and not [k for k in optim if k.startswith("output.")]
    emb = weights["tok_embeddings.weight"].numpy()
    saved = [r["pp2_tp2"] for r in ranks if r["pp2_tp2"]["coords"]["pp"] == 0]
    per = -(-MODEL.vocab_size // 2)
    for rep in saved:  # the first stage's TP shards are what was written
        t = rep["coords"]["tp"]
        np.testing.assert_array_equal(rep["tied"]["tok_embeddings.weight"][:MODEL.vocab_size - t * per],
                                      emb[t * per:(t + 1) * per])
    loaded = {r["loaded_pp4"]["coords"]["pp"]: r["loaded_pp4"]["tied"] for r in ranks}
    np.testing.assert_array_equal(loaded[0]["tok_embeddings.weight"], emb)
    np.testing.assert_array_equal(loaded[3]["output.weight"], emb)
    assert loaded[1] == {} and loaded[2] == {}


def test_tied_pp_config_accepted_and_stages():
    assert emb_stages(ParallelConfig(pp=2)) == (0, 1)
    assert emb_stages(ParallelConfig(pp=4, schedule="interleaved", vp=2)) == (0, 3)
    assert emb_stages(ParallelConfig(pp=2, schedule="dualpipev", vp=2)) == (0, 0)
    assert emb_stages(ParallelConfig()) is None
    assert _cfg(dict(pp=2), 0).model_config().tie_embeddings  # no longer refused
    with pytest.raises(ConfigError):
        _cfg(dict(pp=3), 0)  # 4 layers over 3 stages: still refused for its own reason, not for tying
