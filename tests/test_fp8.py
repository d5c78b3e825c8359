"""FP8 training (`--fp8`): the recipes' casts and GEMMs on one process, then every layout equal to single-device FP8.

One process: `torch._scaled_mm` equals the emulated GEMM where both run; tensorwise and rowwise follow torchao's
Float8Linear (its formulas written out here, and torchao itself where it is installed); block scales are what the
recipes state; the flag's bad combinations exit with one line. Two ranks (one spawn for the layers, one for the
model): a linear under TP (with and without SP), tokens split over cp and dp, and an expert group over edp give the
single device's FP8 results bit for bit or to fp32's rounding of the partial sums; the model under tp2+SP, cp2, ep2 and
ZeRO-3 matches the single-device FP8 model in loss and gradients and shows its amax all-reduces in the ledger; and
with per-shard scales (the wrong scale group) each of those checks fails.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from shardwise.config import ConfigError, ParallelConfig, TrainConfig
from shardwise.fp8 import scaling
from shardwise.fp8.linear import Fp8Config, LinearLayout, emulated_gemm, fp8_linear, fp8_linears, gemm
from shardwise.fp8.recipes import recipe, scaled_mm_kind
from shardwise.fp8.scaling import Layout, as3d, quantize_all

from _dist import fresh_seed, make_mesh, run_ranks


FLIP_SEED = 18
"""tp2+SP tensorwise, 2 layers: without FP8 replay the layout's backward flips one rounding of layer 1's w3 gradient
that the reference does not (within fp32 error of the boundary), and layer 0's gradients end 5e-2 apart."""


def _shard_local(amaxes, axes_per):
    """The wrong scale group, patched in for `scaling.reduce_amaxes`: every scale from this rank's part alone."""
    return list(amaxes)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------- one process
@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_scaled_mm_equals_emulation(name):
    """The three GEMMs through torch._scaled_mm equal dequantise-then-fp32-matmul (the path blockwise and MX take)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    r = recipe(name)
    x, w = torch.randn(2, 24, 64, generator=g), torch.randn(48, 64, generator=g)
    dy = torch.randn(2, 24, 48, generator=g)
    qx, qw, qg_d, qw_d, qg_w, qx_w = quantize_all([(as3d(x), r.x, Layout()), (as3d(w), r.w, Layout()),
                                                   (as3d(dy), r.g_dgrad, Layout()), (as3d(w), r.w_dgrad, Layout()),
                                                   (as3d(dy), r.g_wgrad, Layout()), (as3d(x), r.x_wgrad, Layout())])
    for a, ta, ca, b, tb, cb in ((qx, False, r.x, qw, False, r.w), (qg_d, False, r.g_dgrad, qw_d, True, r.w_dgrad),
                                 (qg_w, True, r.g_wgrad, qx_w, True, r.x_wgrad)):
        assert scaled_mm_kind(ca, cb, ta, tb) is not None  # this GEMM takes torch._scaled_mm
        assert_close(gemm(a, ta, ca, b, tb, cb), emulated_gemm(a, ta, b, tb), rtol=2e-6, atol=1e-5)


def _ao_cast(t, dtype, dim=None, pow2=False):
    """torchao's hp_tensor_to_float8_dynamic: amax (tensorwise, or along `dim`), finfo.max / clamp(amax, 1e-12) in
    float64 then fp32 (rounded down to a power of two for rowwise), x·scale saturated, cast."""
    amax = t.abs().max() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    big = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-big, big).to(dtype), scale


def _ao_mm(a, sa, b, sb):
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=torch.float32)


def _torchao_linear(name, x, w, dy):
    """torchao Float8Linear's output, input gradient and weight gradient (its `matmul_with_hp_or_float8_args`),
    written out: tensorwise e4m3/e4m3/e5m2; rowwise (ROWWISE) axiswise e4m3 with power-of-two scales."""
    x2, g2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if name == "tensorwise":
        (qx, sx), (qw, sw), (qg, sg) = _ao_cast(x2, E4M3), _ao_cast(w, E4M3), _ao_cast(g2, E5M2)
        return _ao_mm(qx, sx, qw.t(), sw), _ao_mm(qg, sg, qw, sw), _ao_mm(qg.t(), sg, qx, sx)
    qx, sx = _ao_cast(x2, E4M3, -1, True)
    qw, sw = _ao_cast(w, E4M3, -1, True)
    y = _ao_mm(qx, sx, qw.t(), sw.t())
    qg, sg = _ao_cast(g2, E4M3, -1, True)
    qw0, sw0 = _ao_cast(w, E4M3, 0, True)
    dx = _ao_mm(qg, sg, qw0, sw0)
    qg0, sg0 = _ao_cast(g2, E4M3, 0, True)
    qx0, sx0 = _ao_cast(x2, E4M3, 0, True)
    return y, dx, _ao_mm(qg0.t(), sg0.t(), qx0, sx0)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_linear_follows_torchao(name):
    """fp8_linear's forward and both backward GEMMs are torchao's Float8Linear's, bit for bit."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 64, generator=g).requires_grad_()
    w = (torch.randn(32, 64, generator=g) * 0.05).requires_grad_()
    dy = torch.randn(2, 16, 32, generator=g) * 1e-3
    y = fp8_linear(Fp8Config(recipe(name)), x, w)
    y.backward(dy)
    ry, rdx, rdw = _torchao_linear(name, x.detach(), w.detach(), dy)
    assert_close(y.reshape(-1, 32), ry, rtol=0, atol=0)
    assert_close(x.grad.reshape(-1, 64), rdx, rtol=0, atol=0)
    assert_close(w.grad, rdw, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_linear_equals_torchao_float8linear(name):
    """The same against torchao's own Float8Linear (the test extra installs torchao 0.18): bit for bit against its
    emulated GEMM (the same quantised operands, an fp32 product), and against its real `_scaled_mm` path within
    that kernel's output rounding — on CPU torchao's rowwise GEMM returns bf16-rounded products (2**-8)."""
    import dataclasses as dc

    ao = pytest.importorskip("torchao.float8")
    seed = fresh_seed()
    torch.manual_seed(seed)
    w0 = torch.nn.Linear(64, 32, bias=False).weight.detach()
    x, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 32)
    xb, w = x.clone().requires_grad_(), w0.clone().requires_grad_()
    yb = fp8_linear(Fp8Config(recipe(name)), xb, w)
    yb.backward(dy)
    config = ao.Float8LinearConfig.from_recipe_name(name)
    for emulate, tol in ((True, {}), (False, {} if name == "tensorwise" else dict(rtol=2**-8, atol=1e-5))):
        lin = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
        lin[0].weight.data.copy_(w0)
        ao.convert_to_float8_training(lin, config=dc.replace(config, emulate=emulate))
        xa = x.clone().requires_grad_()
        ya = lin(xa)
        ya.backward(dy)
        assert_close(yb, ya, **tol, msg=lambda m: f"seed {seed} emulate={emulate}: {m}")
        assert_close(xb.grad, xa.grad, **tol, msg=lambda m: f"seed {seed} emulate={emulate}: {m}")
        assert_close(w.grad, lin[0].weight.grad, **tol, msg=lambda m: f"seed {seed} emulate={emulate}: {m}")


def test_block_scales():
    """blockwise: each 1×128 activation tile and 128×128 weight block reaches ±448 at its amax; mxfp8: scales are
    powers of two (exact in e8m0), each 32-block's largest element lands in [224, 448] (RCEIL: amax·scale in
    (224, 448], none saturates), every element within e4m3's rounding."""
    g = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(2, 8, 256, generator=g) * torch.logspace(-3, 3, 256)
    w = torch.randn(256, 384, generator=g)
    b = recipe("blockwise")
    qx, qw = quantize_all([(x, b.x, Layout()), (as3d(w), b.w, Layout())])
    assert qx.scale.shape == (2, 8, 2) and qw.scale.shape == (1, 2, 3)
    assert torch.equal(qx.data.float().abs().view(2, 8, 2, 128).amax(-1), torch.full((2, 8, 2), 448.0))
    assert torch.equal(qw.data.float().abs().view(2, 128, 3, 128).amax((1, 3)), torch.full((2, 3), 448.0))
    m = recipe("mxfp8")
    (qm,) = quantize_all([(x, m.x, Layout())])
    assert qm.scale.shape == (2, 8, 8)
    assert torch.equal(qm.scale.to(torch.float8_e8m0fnu).float(), qm.scale)
    top = qm.data.float().abs().view(2, 8, 8, 32).amax(-1)
    assert bool(((top >= 224) & (top <= 448)).all())
    block_amax = x.abs().view(2, 8, 8, 32).amax(-1, keepdim=True).expand(-1, -1, -1, 32).reshape(x.shape)
    assert bool(((qm.dequantize() - x).abs() <= 2.0 ** -4 * x.abs() + block_amax * 2.0 ** -16).all())


def test_empty_expert_rows():
    """An expert with no rows: zero output and gradients, no NaN from an empty amax."""
    r = Fp8Config(recipe("tensorwise"))
    xs = [torch.zeros(0, 16, requires_grad=True), torch.randn(5, 16, requires_grad=True)]
    ws = [torch.randn(8, 16, requires_grad=True) for _ in range(2)]
    ys = fp8_linears(r, xs, ws, [None, None])
    sum(y.sum() for y in ys).backward()
    assert ys[0].shape == (0, 8) and torch.equal(ws[0].grad, torch.zeros(8, 16)) and ws[1].grad.isfinite().all()


@pytest.mark.parametrize("kw, says", [
    (dict(fp8="fp4"), "--fp8 'fp4' is unknown; valid: tensorwise, rowwise, blockwise, mxfp8"),
    (dict(fp8="tensorwise", fp8_all_gather=True, parallel=ParallelConfig(tp=2, sequence_parallel=True,
                                                                        tp_overlap=True)),
     "--fp8-all-gather with --tp-overlap"),
    (dict(fp8="blockwise", seq_len=256, parallel=ParallelConfig(cp=2)), "128-token tiles across cp ranks"),
])
def test_bad_combinations(kw, says):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kw).resolved(2 if "parallel" in kw else 1)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_cli_exits_2_with_one_line(capsys):
    from shardwise.cli import main

    code = main(["train", "--fp8", "tensorwise", "--fp8-all-gather", "--tp", "2", "--sequence-parallel",
                 "--tp-overlap", "--print-config"])
    err = capsys.readouterr().err.strip().splitlines()
    said = ("shardwise train: error: --fp8-all-gather with --tp-overlap: the overlapped chunks gather in high "
            "precision (--fp8 tensorwise runs with --tp-overlap); drop one of them")
    assert code == 2 and err == [said], err


def test_which_layers():
    """FP8 on attention, dense MLPs, shared experts (nn.Linear → Float8Linear, same parameters) and the routed expert
    group; not on the embedding, the LM head, the norms or the router."""
    from shardwise.fp8.apply import Float8Linear, apply_fp8
    from shardwise.mesh import Mesh
    from shardwise.parallelize import all_blocks, build_model

    mesh = Mesh.single("cpu")
    m = build_model(TrainConfig(model="tiny-moe", model_overrides={"n_layers": 2}).model_config(), mesh, 0)
    names = [n for n, _ in m.named_parameters()]
    count = apply_fp8(all_blocks(m), mesh, ParallelConfig(), "rowwise")
    assert count == 2 * 4 + 3 + 3 + 1, count  # attention ×2, one dense MLP, one MoE: shared w1/w3/w2 + the experts
    assert [n for n, _ in m.named_parameters()] == names
    assert getattr(m.output, "fp8", None) is None and not hasattr(m.tok_embeddings, "fp8")
    moe = m.layers["0"].feed_forward
    assert isinstance(moe.shared.w1, Float8Linear) and moe.experts.fp8 is not None
    assert not hasattr(moe.router, "fp8") and m.layers["0"].attention.wq.fp8 is not None


# ---------------------------------------------------------------- two ranks: the layers
def _layer_checks(seed: int) -> list[str]:
    """Inside 2 ranks: every recipe's linear under tp2 (column→row, with and without SP), with its tokens split over
    cp (balanced order) and over dp, and an expert group over edp, against fp8_linear on the whole tensors."""
    from shardwise import comm
    from shardwise.fp8.apply import layer_layout
    from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, get_spec

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    tol = dict(rtol=1e-5, atol=1e-5)  # fp32 rounding of other GEMM shapes and partial sums; the scales are exact
    wtol = dict(rtol=1e-5, atol=1e-4)  # a weight gradient summed over token shards: another order of ~100 products
    done = []
    tp_mesh, cp_mesh, dp_mesh = make_mesh(tp=2), make_mesh(cp=2), make_mesh()
    for name in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        r = Fp8Config(recipe(name))
        b, s, h, f = 2, 128, 128, 256
        x, dy = torch.randn(b, s, h, generator=g), torch.randn(b, s, h, generator=g)
        w1, w2 = torch.randn(f, h, generator=g) * 0.1, torch.randn(h, f, generator=g) * 0.1
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        ref = fp8_linear(r, F.gelu(fp8_linear(r, xr, w1r)), w2r)
        ref.backward(dy)
        tp = tp_mesh["tp"]
        for sp in (False, True):
            par = ParallelConfig(tp=2, sequence_parallel=sp)
            col = ColumnParallelLinear(h, f, tp, sequence_parallel=sp)
            row = RowParallelLinear(f, h, tp, sequence_parallel=sp)
            with torch.no_grad():
                col.weight.copy_(get_spec(col.weight).local_slice(w1))
                row.weight.copy_(get_spec(row.weight).local_slice(w2))
            col.fp8, row.fp8 = (Fp8Config(r.recipe, layer_layout(m, tp_mesh, par)) for m in (col, row))
            mine = slice(tp.rank * s // 2, (tp.rank + 1) * s // 2) if sp else slice(None)
            xp = x[:, mine].clone().requires_grad_()
            out = row(F.gelu(col(xp)))
            out.backward(dy[:, mine].contiguous())
            assert_close(out, ref[:, mine], **tol)
            assert_close(xp.grad, xr.grad[:, mine], **tol)
            assert_close(col.weight.grad, get_spec(col.weight).local_slice(w1r.grad), **tol)
            assert_close(row.weight.grad, get_spec(row.weight).local_slice(w2r.grad), **tol)
            done.append(f"{name} tp2{' sp' if sp else ''}")
        # tokens split: over cp (rank r holds chunks r and 3 - r of 4) and over dp (sequences)
        cp = cp_mesh["cp"]
        for mesh, part, lay in ((cp_mesh, lambda t: torch.cat([t.chunk(4, 1)[cp.rank], t.chunk(4, 1)[3 - cp.rank]], 1),
                                 LinearLayout(seq=(cp_mesh["cp"],), rows_all=(cp_mesh["dp_cp"],), seq_chunks=2)),
                                (dp_mesh, lambda t: t[dp_mesh["dp"].rank:dp_mesh["dp"].rank + 1],
                                 LinearLayout(batch=(dp_mesh["dp"],), rows_all=(dp_mesh["dp_cp"],)))):
            xp, wp = part(x).requires_grad_(), w1.clone().requires_grad_()
            xr1, w1r1 = x.clone().requires_grad_(), w1.clone().requires_grad_()
            ref1 = fp8_linear(r, xr1, w1r1)
            d1 = torch.randn(ref1.shape, generator=g)
            ref1.backward(d1)
            y = fp8_linear(Fp8Config(r.recipe, lay), xp, wp)
            y.backward(part(d1))
            assert_close(y, part(ref1), **tol)
            assert_close(xp.grad, part(xr1.grad), **tol)
            assert_close(comm.all_reduce(wp.grad.clone(), mesh["dp_cp"]), w1r1.grad, **wtol)
            done.append(f"{name} tokens over {'cp' if mesh is cp_mesh else 'dp'}")
        # an expert group: each expert's rows split over edp
        edp = dp_mesh["edp"]
        rows = [torch.randn(n, h, generator=g) for n in (6, 0, 10)]
        ws = [torch.randn(f, h, generator=g) * 0.1 for _ in rows]
        ref_x, ref_w = [t.clone().requires_grad_() for t in rows], [t.clone().requires_grad_() for t in ws]
        ref_y = fp8_linears(r, ref_x, ref_w, [None] * 3)
        dys = [torch.randn(y.shape, generator=g) for y in ref_y]
        torch.autograd.backward(ref_y, dys)
        half = [t.shape[0] // 2 for t in rows]
        pick = (lambda t, k: t[:k]) if edp.rank == 0 else (lambda t, k: t[k:])
        my_x = [pick(t, k).clone().requires_grad_() for t, k in zip(rows, half)]
        my_w = [t.clone().requires_grad_() for t in ws]
        lay = LinearLayout(seq=(edp,), rows_all=(edp,), seq_global=0)
        my_y = fp8_linears(Fp8Config(r.recipe, lay), my_x, my_w, [None] * 3)
        torch.autograd.backward(my_y, [pick(d, k) for d, k in zip(dys, half)])
        for y, ry, k, xg, rxg, wg, rwg in zip(my_y, ref_y, half, my_x, ref_x, my_w, ref_w):
            assert_close(y, pick(ry, k), **tol)
            assert_close(xg.grad, pick(rxg.grad, k), **tol)
            if name in ("tensorwise", "rowwise"):  # blockwise/MX tile an expert's rows as this rank holds them
                full = comm.all_reduce(wg.grad.clone(), edp)
                assert_close(full, rwg.grad, **wtol, msg=lambda m: f"{name} {k}: {m}")
        done.append(f"{name} experts over edp")
    # the wrong scale group: per-shard amaxes give another result under TP, and over the tokens
    reduce = scaling.reduce_amaxes
    scaling.reduce_amaxes = _shard_local
    try:
        r = Fp8Config(recipe("tensorwise"))
        x = torch.randn(2, 64, 128, generator=g)
        w = torch.randn(256, 128, generator=g)
        ref = fp8_linear(r, x, w)
        col = ColumnParallelLinear(128, 256, tp_mesh["tp"])
        with torch.no_grad():
            col.weight.copy_(get_spec(col.weight).local_slice(w))
        col.fp8 = Fp8Config(r.recipe, layer_layout(col, tp_mesh, ParallelConfig(tp=2)))
        rel = _rel(col(x), get_spec(col.weight).local_slice(ref.transpose(0, 2)).transpose(0, 2))
        rel = float(comm.all_reduce(torch.tensor([rel]), tp_mesh["tp"], "max"))  # the rank holding W's amax agrees
        assert rel > 1e-3, rel
        done.append("per-shard scale fails")
    finally:
        scaling.reduce_amaxes = reduce
    return done


def test_layers_under_layouts():
    seed = fresh_seed()
    done = run_ranks(2, _layer_checks, seed)[0]
    assert len(done) == 4 * 5 + 1, done


# ---------------------------------------------------------------- two ranks: the model
def _model_runs(cfgs: list[TrainConfig], local: bool) -> list[tuple]:
    """Inside ranks: each layout and its single-device FP8 reference (verify's SideBySide) for two steps: (layout,
    |Δloss| per step, the median parameter's gradient rel per step, the step-0 ledger's fp8_amax entries)."""
    from shardwise.verify.side_by_side import SideBySide

    torch.set_num_threads(1)
    if local:
        scaling.reduce_amaxes = _shard_local
    out = []
    for cfg in cfgs:
        runs = SideBySide(cfg, torch.device("cpu"))
        losses, grads, amax = [], [], {}
        for step in range(2):
            loss, refs = runs.backward(step)
            losses.append(abs(loss - refs[0]))
            grads.append(float(runs.rel(runs.grad_views(), runs.ref_grads()).median()))
            if step == 0:
                amax = {ax: v for ax, ops in runs.mesh.ledger.snapshot().items() for op, v in ops.items()
                        if op == "all_reduce:fp8_amax"}
            runs.optimizer_step(step)
            runs.mesh.ledger.end_step(step + 1)
        out.append((cfg.parallel.as_dict(), losses, grads, amax))
    from shardwise.verify.fp8_replay import Fp8Replay
    from shardwise.verify.main import verify_main

    verdicts = [verify_main(cfgs[0])]  # verify --fp8 on tp2+SP, FP8 replay on
    if not local:
        pinned = dataclasses.replace(cfgs[0], seed=FLIP_SEED)
        verdicts.append(verify_main(pinned))
        cast = Fp8Replay._cast  # the replay broken on purpose: the references keep their own roundings

        def own(self, call, t, c, lay, q):
            mine = cast(self, call, t, c, lay, q)
            return mine if self.owner.get(id(call.weights[0]), ("layout",))[0] == "layout" else q
        Fp8Replay._cast = own
        try:
            verdicts.append(verify_main(pinned))
        finally:
            Fp8Replay._cast = cast
    out.append([(v["passed"], v["fp8_budget"]["ratios"], v["fp8_replay"]["flips"], v["fp8_replay"]["unexplained"])
                for v in verdicts])
    return out


def test_model_under_layouts():
    """tensorwise FP8 under tp2+SP, cp2, ep2 (MoE) and ZeRO-3 equals single-device FP8 to fp32's rounding, with its
    amax all-reduces in the ledger on the axis that splits the logical tensors; per-shard scales move the median
    gradient by more than 3e-2 in step 0 or 1. `verify` (FP8 replay, then its FP8 budget) passes the tp2+SP run on
    the fresh seed and on FLIP_SEED, fails FLIP_SEED with the replay broken (the references keeping their own
    roundings: an unexplained flip), and fails per-shard scales at the replay's scale-group check.
    (Other recipes: their layers above; at the model level a one-ulp difference of fp32 partial sums can flip an FP8
    rounding, which the single-device model shows too under one-ulp weight perturbations — docs/fp8.md.)"""
    seed = fresh_seed()
    base = dict(steps=2, seq_len=64, micro_batch=2, progress=False, seed=seed, fp8="tensorwise",
                model_overrides={"n_layers": 2})
    cfgs = [TrainConfig(parallel=ParallelConfig(tp=2, sequence_parallel=True), **base),
            TrainConfig(parallel=ParallelConfig(cp=2), **base),
            TrainConfig(model="tiny-moe", parallel=ParallelConfig(dp=2, ep=2), **base),
            TrainConfig(parallel=ParallelConfig(dp=2, zero=3), **base)]
    cfgs = [c.resolved(2) for c in cfgs]
    axes = ["tp", "dp_cp", "dp_cp", "dp_cp"]
    *runs, verdicts = run_ranks(2, _model_runs, cfgs, False)[0]
    (fresh, *_), (pinned, _, flips, _), (own, _, own_flips, unexplained) = verdicts
    assert fresh, (seed, verdicts[0])  # the replay explains every flip: a correct layout passes on every seed
    assert pinned and not own and unexplained["what"] == "unexplained FP8 difference", (pinned, verdicts[1:])
    for (layout, losses, grads, amax), axis in zip(runs, axes):
        # the median parameter: fp32 rounding (~1e-6), unless it flipped an FP8 rounding, which can carry a layer's
        # small-norm gradients (attention's q/k at initialisation) to ~1e-2 (seed 2822233804); per-shard scales move
        # every gradient. Step 1 follows Adam's first step, lr·sign(g): a near-zero gradient whose sign flipped moves
        # its element by 2·lr, which moved the loss by 3.7e-3 (seed 3657390948).
        assert losses[0] < 1e-3 and grads[0] < 3e-2, (layout, losses, grads)
        assert losses[1] < 2e-2 and grads[1] < 2e-1, (layout, losses, grads)
        assert list(amax) == [axis] and amax[axis]["count"] == 28, (layout, amax)
    *runs, [(passed, ratios, _, unexplained)] = run_ranks(2, _model_runs, cfgs, True)[0]
    assert not passed and unexplained["what"] == "scale group", (ratios, unexplained)  # verify --fp8 fails them too
    for layout, losses, grads, amax in runs:
        assert max(grads) > 3e-2, (layout, grads)  # step 0 alone can stay under (cp2, seed 14: 2.4e-2, then 0.11)
        assert not amax
