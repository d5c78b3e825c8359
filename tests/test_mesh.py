"""Mesh: degree validation (no processes) and the groups every axis gets (8 ranks)."""
import pytest
import torch

from shardwise import comm

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.config import ParallelConfig

from _dist import make_mesh, run_ranks


def test_degrees_validated_with_every_degree_named():
    assert ParallelConfig.build(8, dp=-1, tp=2, pp=2) == ParallelConfig(dp=2, pp=2, cp=1, tp=2, ep=1)
    with pytest.raises(ConfigError, match=r"dp=3, pp=1, cp=1, tp=2, ep=1, world size=8"):
        ParallelConfig.build(8, dp=3, tp=2)
    with pytest.raises(ConfigError, match="world size not divisible"):
        ParallelConfig.build(6, dp=-1, tp=4)
    with pytest.raises(ConfigError, match="ep=4 must divide dp×cp=2"):
        ParallelConfig.build(4, dp=2, tp=2, ep=4)
    with pytest.raises(ConfigError, match="tp must be >= 1"):
        ParallelConfig.build(4, tp=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "does not divide n_heads=8"),
    (dict(cp=3), "s must be a positive multiple of 6"),
    (dict(cp=2, cp_impl="nope"), "--cp-impl 'nope' is unknown"),
    (dict(ep=2, dp=2), "--ep 2 needs an MoE model"),
    (dict(zero=4, dp=2), "--zero 4"),
    (dict(tp=1, sequence_parallel=True), "needs --tp > 1"),
    (dict(dp=0), "--dp 0 must be a positive integer"),
])
def test_train_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(parallel=ParallelConfig(**kwargs)).resolve_world()


def _groups():
    mesh = make_mesh(dp=2, cp=2, tp=2, ep=2)
    return {name: mesh[name].ranks for name in ("dp", "cp", "tp", "pp", "dp_cp", "ep", "edp")} | \
        {"coords": mesh.coords}


def test_groups_tp_innermost():
    out = run_ranks(8, _groups)
    # grid (dp, pp, cp, tp) = (2, 1, 2, 2): rank = dp*4 + cp*2 + tp
    assert out[0]["tp"] == (0, 1) and out[5]["tp"] == (4, 5)
    assert out[0]["cp"] == (0, 2) and out[0]["dp"] == (0, 4)
    assert out[1]["dp_cp"] == (1, 3, 5, 7)
    assert out[1]["ep"] == (1, 3) and out[1]["edp"] == (1, 5)
    assert out[7]["coords"] == {"dp": 1, "pp": 0, "cp": 1, "tp": 1}
    for r, o in enumerate(out):
        assert r in o["tp"] and r in o["dp_cp"] and r in o["ep"] and r in o["edp"]
        assert len(set(o["ep"]) & set(o["edp"])) == 1  # ep × edp tiles dp×cp


def _group_calls():
    import torch.distributed as dist

    calls = []
    for fn in ("new_subgroups_by_enumeration", "new_group", "split_group"):
        orig = getattr(dist, fn)
        setattr(dist, fn, lambda *a, _f=orig, _n=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    mesh = make_mesh(dp=2, cp=2, tp=2, ep=2)
    for name in ("dp", "cp", "tp", "dp_cp", "ep", "edp", "ckpt"):  # every group works
        t = torch.ones(1)
        comm.all_reduce(t, mesh[name])
        assert t.item() == mesh[name].size
    return calls, mesh["pp"].group, mesh.build_s, mesh.device_mesh.mesh_dim_names


def test_one_group_call_per_axis_and_none_for_size_one():
    calls, pp_group, build_s, names = run_ranks(8, _group_calls)[3]
    # dp, cp, tp, dp_cp, ep, edp: one enumeration each (pp has size 1: no group); the gloo checkpoint group
    assert sorted(calls) == sorted(["new_subgroups_by_enumeration"] * 6 + ["new_group"])
    assert pp_group is None and 0 < build_s < 30 and names == ("dp", "cp", "tp")
