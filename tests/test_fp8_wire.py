"""`--fp8-all-gather`: ZeRO-3 weight gathers and SP activation gathers in FP8 (shardwise/fp8/wire.py).

One process: the recipes the flag refuses exit with one line, and agree with the recipes' casts; a weight cut
anywhere into shards gets, from its shards' amaxes, the scales and FP8 bytes of the whole (every recipe's W cast).
Two ranks (one spawn): ZeRO-3 (dp2) and tp2+SP runs with the flag equal the same runs without it bit for bit (loss,
logits, gradients, two steps), equal single-device FP8 as test_fp8's model check does, and their ledgers show the
FP8 gathers at exactly a quarter of the fp32 bytes plus one fp32 amax per scale; with a per-shard scale (the
gather's axis left out of the amax reduction) the bit-equality fails.
"""
import dataclasses

import pytest
import torch

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.fp8 import wire
from shardwise.fp8.recipes import RECIPES, recipe
from shardwise.fp8.scaling import Layout, as3d, block_plan, local_amax, quantize_all
from shardwise.rules.validation import FP8_WIRE_ACTIVATIONS, FP8_WIRE_WEIGHTS

from _dist import fresh_seed, run_ranks


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("name, parallel, says", [
    ("rowwise", ParallelConfig(dp=2, zero=3), "--fp8-all-gather with --fp8 rowwise casts W along its rows"),
    ("mxfp8", ParallelConfig(dp=2, zero=3), "--fp8-all-gather with --fp8 mxfp8 casts W along its rows"),
    ("blockwise", ParallelConfig(tp=2, sequence_parallel=True), "use --fp8 tensorwise, or drop --sequence-parallel"),
])
def test_refused_where_one_fp8_copy_cannot_feed_both_gemms(name, parallel, says):
    with pytest.raises(ConfigError) as e:
        TrainConfig(fp8=name, fp8_all_gather=True, parallel=parallel).resolved(2)
    assert says in str(e.value) and "\n" not in str(e.value)
    TrainConfig(fp8=name, parallel=parallel).resolved(2)  # without the flag it runs
    for ok in (ParallelConfig(dp=2, zero=3), ParallelConfig(tp=2, sequence_parallel=True)):
        TrainConfig(fp8="tensorwise", fp8_all_gather=True, parallel=ok).resolved(2)
    TrainConfig(fp8="blockwise", fp8_all_gather=True, parallel=ParallelConfig(dp=2, zero=3)).resolved(2)
    # the torch-free rule says what the recipes' casts say
    assert [n for n in RECIPES if wire.weights_exact(recipe(n))] == list(FP8_WIRE_WEIGHTS)
    assert [n for n in RECIPES if wire.activations_exact(recipe(n))] == list(FP8_WIRE_ACTIVATIONS)


@pytest.mark.parametrize("name", RECIPES)
def test_shards_give_the_whole_weights_scales_and_bytes(name):
    """A [300, 260] weight cut at random flat offsets (through rows and blocks): the max of the shards'
    `segment_amax` is the whole weight's block amax, and each shard cast with `_segment_scales` gives the whole
    weight's FP8 bytes for its elements."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 260, generator=g) * torch.logspace(-2, 2, 260)
    cast = recipe(name).w
    (q,) = quantize_all([(as3d(w), cast, Layout())])
    br, bc, _ = block_plan(as3d(w), cast, Layout())
    cuts = [0, *sorted(torch.randint(1, w.numel(), (3,), generator=g).tolist()), w.numel()]
    flat = w.reshape(-1)
    amax = torch.stack([wire.segment_amax(flat[a:b], a, tuple(w.shape), cast, br, bc)
                        for a, b in zip(cuts, cuts[1:])]).amax(0)
    assert torch.equal(amax, local_amax(as3d(w), cast, br, bc)), f"seed {seed}"
    scale = q.scale
    data = torch.cat([wire._cast(flat[a:b], wire._segment_scales(scale, tuple(w.shape), br, bc, a, b - a), cast)
                      for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(data.view(torch.uint8), q.data.reshape(-1).view(torch.uint8)), f"seed {seed}"


# ---------------------------------------------------------------- two ranks
def _sabotage(gather_axis, axes):
    """The wrong scale group, patched in for `wire._scale_axes`: each rank scales its own shard."""
    return list(axes)


def _runs(cfgs: list[TrainConfig]) -> list[dict]:
    """Inside ranks, per layout: the run without the flag, with it, with it and per-shard scales, and the
    single-device FP8 reference — losses, logits and gradients of two steps, and step 0's ledger."""
    from shardwise.training.trainer import Trainer, make_mesh
    from shardwise.verify import compare
    from shardwise.verify.reference import reference

    torch.set_num_threads(1)
    dev = torch.device("cpu")

    def run(cfg, steps, ref_grads=None):
        mesh = make_mesh(cfg, dev)
        tr = Trainer(cfg, mesh)
        logits = []
        tr.model.output.register_forward_hook(lambda m, a, y: logits.append(y.detach().clone()))
        out = dict(loss=[], grads=[], logits=logits)
        for step in range(steps):
            out["loss"].append(tr.forward_backward(step))
            tr.finish_gradients()
            out["grads"].append([v[2].clone() for v in compare.grad_views(tr)])
            if step == 0:
                out["ledger"] = {ax: {op: dict(v) for op, v in ops.items()}
                                 for ax, ops in mesh.ledger.snapshot().items()}
                out["buckets"] = [(b.per, len(b.fp8.items)) for b in tr.reducer.buckets
                                  if getattr(b, "fp8", None) is not None]
                if ref_grads is not None:
                    rel = compare.per_param_rel(compare.against(compare.grad_views(tr), ref_grads),
                                                sorted(ref_grads), mesh["world"])
                    out["median_rel"] = float(rel.median())
            tr.optimizer_step(step)
            mesh.ledger.end_step(step + 1)
        return out

    res = []
    for cfg in cfgs:
        ref = reference(cfg, dev)
        ref_loss = ref.forward_backward(0)
        ref.finish_gradients()
        ref_grads = {n: p.grad for n, p in ref.model.named_parameters(remove_duplicate=False)}
        plain = run(dataclasses.replace(cfg, fp8_all_gather=False), 2)
        fp8 = run(cfg, 2, ref_grads)
        same = (plain["loss"] == fp8["loss"] and len(plain["logits"]) == len(fp8["logits"]) == 2
                and all(torch.equal(a, b) for a, b in zip(plain["logits"], fp8["logits"]))
                and all(torch.equal(a, b) for s, t in zip(plain["grads"], fp8["grads"]) for a, b in zip(s, t)))
        wire_orig = wire._scale_axes
        wire._scale_axes = _sabotage
        try:
            broken = run(cfg, 1)
        finally:
            wire._scale_axes = wire_orig
        res.append(dict(
            same=same, loss=fp8["loss"][0], ref_loss=ref_loss, median_rel=fp8["median_rel"],
            plain_ledger=plain["ledger"], ledger=fp8["ledger"], buckets=fp8["buckets"],
            broken_loss=abs(broken["loss"][0] - plain["loss"][0]),
            broken_grad=max(float((a - b).norm() / b.norm()) for a, b in zip(broken["grads"][0], plain["grads"][0])
                            if b.norm() > 0)))
    return res


def _op(ledger, axis, op):
    return ledger.get(axis, {}).get(op, {"count": 0, "bytes": 0, "wire_bytes": 0})


def test_fp8_all_gather_equals_the_high_precision_gather():
    seed = fresh_seed()
    base = dict(steps=2, seq_len=64, micro_batch=2, progress=False, seed=seed, fp8="tensorwise", fp8_all_gather=True,
                model_overrides={"n_layers": 2})
    cfgs = [TrainConfig(parallel=ParallelConfig(dp=2, zero=3), **base).resolved(2),
            TrainConfig(parallel=ParallelConfig(tp=2, sequence_parallel=True), **base).resolved(2)]
    dim = cfgs[0].model_config().dim
    zero3, sp = run_ranks(2, _runs, cfgs)[0]
    for r in (zero3, sp):
        assert r["same"], f"seed {seed}: the FP8 gather changed the run"
        # single-device FP8, test_fp8's model bounds (fp32 rounding, unless it flipped an FP8 rounding)
        assert abs(r["loss"] - r["ref_loss"]) < 1e-3 and r["median_rel"] < 3e-2, (seed, r["loss"], r["median_rel"])
        # per-shard scales: the gathered weights / activations come back wrongly scaled
        assert r["broken_grad"] > 1e-2, (seed, r["broken_loss"], r["broken_grad"])

    # ZeRO-3: every block's matrix bucket (all FP8 linears) gathered twice (forward, backward) as 1 byte per element,
    # a quarter of the fp32 gather it replaces; one amax all-reduce of one fp32 per weight per gather.
    ax, ledger, plain = "dp_cp", zero3["ledger"], zero3["plain_ledger"]
    assert len(zero3["buckets"]) == 2 and all(k == 7 for _, k in zero3["buckets"]), zero3["buckets"]
    fp8 = _op(ledger, ax, "all_gather:fp8")
    assert fp8["count"] == 2 * 2 and fp8["bytes"] == 2 * sum(per for per, _ in zero3["buckets"]), fp8
    assert fp8["wire_bytes"] == fp8["bytes"]  # (t − 1)·shard at t = 2
    hp, hp_plain = _op(ledger, ax, "all_gather"), _op(plain, ax, "all_gather")
    assert hp["count"] + fp8["count"] == hp_plain["count"] and hp_plain["bytes"] - hp["bytes"] == 4 * fp8["bytes"]
    amax, amax_plain = _op(ledger, ax, "all_reduce:fp8_amax"), _op(plain, ax, "all_reduce:fp8_amax")
    assert amax["count"] - amax_plain["count"] == 4 and amax["bytes"] - amax_plain["bytes"] == 2 * 4 * (7 + 7)
    assert _op(ledger, ax, "reduce_scatter") == _op(plain, ax, "reduce_scatter")  # the backward as before

    # tp2+SP: attention's and the MLP's input gathered per block, micro_batch × seq/tp × dim bytes from each rank;
    # one amax (one fp32 over tp) each; the head's gather (not FP8) and the reduce-scatters as before.
    ledger, plain = sp["ledger"], sp["plain_ledger"]
    fp8 = _op(ledger, "tp", "all_gather:fp8")
    assert fp8["count"] == 2 * 2 and fp8["bytes"] == 4 * 2 * 32 * dim, fp8
    hp, hp_plain = _op(ledger, "tp", "all_gather"), _op(plain, "tp", "all_gather")
    assert hp["count"] + fp8["count"] == hp_plain["count"] and hp_plain["bytes"] - hp["bytes"] == 4 * fp8["bytes"]
    amax, amax_plain = _op(ledger, "tp", "all_reduce:fp8_amax"), _op(plain, "tp", "all_reduce:fp8_amax")
    assert amax["count"] - amax_plain["count"] == 4 and amax["bytes"] - amax_plain["bytes"] == 4 * 4
    assert _op(ledger, "tp", "reduce_scatter") == _op(plain, "tp", "reduce_scatter")


# ---------------------------------------------------------------- deferred weight gradients (zb, dualpipev)
def _pipeline_runs(cfgs: list[TrainConfig]) -> list[tuple]:
    """Inside ranks, per config: (|Δloss| and the median parameter's gradient rel against single-device FP8 at step
    0, the layout's gradient views)."""
    from shardwise.training.trainer import Trainer, make_mesh
    from shardwise.verify import compare
    from shardwise.verify.reference import reference

    torch.set_num_threads(1)
    dev, out = torch.device("cpu"), []
    ref = reference(cfgs[0], dev)  # one for all: the configs differ only in the schedule
    ref_loss = ref.forward_backward(0)
    ref.finish_gradients()
    ref_grads = {n: p.grad for n, p in ref.model.named_parameters(remove_duplicate=False)}
    for cfg in cfgs:
        mesh = make_mesh(cfg, dev)
        tr = Trainer(cfg, mesh)
        store, fp8 = tr.model.grad_store, {id(m.weight) for m in tr.model.modules() if getattr(m, "fp8", None)}
        deferred = []
        if store is not None:  # count the FP8 linears' dW GEMMs handed to the store
            defer = store.defer
            store.defer = lambda params, fn: (deferred.append(id(params[0]) in fp8), defer(params, fn))
        loss = tr.forward_backward(0)
        tr.finish_gradients()
        rel = compare.per_param_rel(compare.against(compare.grad_views(tr), ref_grads), sorted(ref_grads),
                                    mesh["world"])
        out.append((abs(loss - ref_loss), float(rel.median()), float(rel.max()), sum(deferred), len(fp8),
                    [v[2].clone() for v in compare.grad_views(tr)]))
    return out


def test_fp8_defers_weight_gradients_under_zero_bubble_schedules():
    """--fp8 under zb and dualpipev (pp2, 4 microbatches): the FP8 linears hand their dW GEMMs to the weight-gradient
    store and run them at W; the gradients equal single-device FP8 (test_fp8's bounds) and zb's equal 1f1b's bit
    for bit."""
    seed = fresh_seed()
    base = dict(steps=1, seq_len=32, micro_batch=1, global_batch=4, progress=False, seed=seed, fp8="tensorwise",
                model_overrides={"n_layers": 4})
    cfgs = [TrainConfig(parallel=ParallelConfig(pp=2, schedule=s), **base).resolved(2)
            for s in ("1f1b", "zb", "dualpipev")]
    runs = run_ranks(2, _pipeline_runs, cfgs)
    for dloss, median, worst, _, _, _ in runs[0]:
        assert dloss < 1e-3 and median < 3e-2, (seed, dloss, median, worst)
    for rank in runs:  # each rank's two layers' 7 FP8 linears, every microbatch, deferred under zb and dualpipev
        assert [r[3:5] for r in rank] == [(0, 14), (14 * 4, 14), (14 * 4, 14)], [r[3:5] for r in rank]
    for rank in runs:
        (*_, f1b), (*_, zb) = rank[0], rank[1]
        assert all(torch.equal(a, b) for a, b in zip(f1b, zb)), f"seed {seed}"
