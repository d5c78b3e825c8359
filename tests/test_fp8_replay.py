"""FP8 replay's explanation check (`verify/fp8_replay.explain`) on one process: a flip whose two values straddle a
rounding boundary within fp32's reordering error is explained; a flip farther apart, or a scale block whose amax moved
by more, is not — so a replay that accepted such flips would pass a wrong layout, and this test would fail.
The model-level checks (seed 18 under tp2+SP passes only with the replay; per-shard scales fail its scale-group check)
run in tests/test_fp8.py's model spawn."""
import pytest
import torch

from shardwise.fp8.recipes import recipe
from shardwise.fp8.scaling import Layout, quantize_all
from shardwise.verify import fp8_replay
from shardwise.verify.fp8_replay import RHO, explain

from _dist import fresh_seed


def _cast(x, cast):
    return quantize_all([(x, cast, Layout())])[0]


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8"])
def test_flips_explained_only_near_a_boundary(name):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    cast = recipe(name).x
    xr = torch.randn(2, 8, 256, generator=g)
    qr = _cast(xr, cast)
    # fp32 reordering: every element moved by a few ulp — whatever flips is explained
    xl = xr * (1 + 8 * torch.finfo(torch.float32).eps * torch.randn(xr.shape, generator=g))
    n, dist, ok = explain(xr, qr, xl, _cast(xl, cast), cast)
    assert ok and dist <= 1.0, (seed, name, n, dist)
    # one element pushed just across its rounding boundary: one flip, explained; a whole FP8 step across: not
    s = qr.scale_full()
    i = tuple(int(j) for j in ((qr.data.float() > 1) & (qr.data.float() < 100)).nonzero()[0])  # not a block's max
    lo = qr.data.float()[i]
    up = (qr.data[i].view(torch.uint8) + 1).view(cast.dtype).float()  # the next FP8 value above
    boundary = float((lo + up) / 2)
    near, near_l, far_l = xr.clone(), xr.clone(), xr.clone()
    near[i] = boundary * (1 - 1e-6) / s[i]
    near_l[i] = boundary * (1 + 1e-6) / s[i]
    far_l[i] = up / s[i]
    far = near
    qn = _cast(near, cast)
    n, dist, ok = explain(near, qn, near_l, _cast(near_l, cast), cast)
    assert n >= 1 and dist <= 1.0 and ok, (seed, name, n, dist)
    n, dist, ok = explain(far, qn, far_l, _cast(far_l, cast), cast)
    assert n >= 1 and dist > 1.0, (seed, name, n, dist)
    # a scale block whose amax moved by more than RHO (a wrong scale group moves it by far more)
    big = xr.clone()
    big.view(-1)[xr.abs().view(-1).argmax()] *= 1 + 4 * RHO
    _, _, ok = explain(xr, qr, big, _cast(big, cast), cast)
    assert not ok, (seed, name)


def test_a_lax_bound_would_pass_a_far_flip(monkeypatch):
    """The check's teeth: with the bound loosened to an FP8 step, the far flip above would pass."""
    monkeypatch.setattr(fp8_replay, "RHO", 0.5)
    cast = recipe("tensorwise").x
    x = torch.tensor([[[448.0, 1.0]]])
    y = torch.tensor([[[448.0, 1.125]]])  # one e4m3 step above 1.0
    n, dist, ok = explain(x, _cast(x, cast), y, _cast(y, cast), cast)
    assert n == 1 and dist <= 1.0 and ok


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_a_power_of_two_scale_may_double(name):
    """A block's amax nudged across a power of two (fp32 error) halves its power-of-two scale: explained, no flip."""
    cast = recipe(name).x
    edge = 3.5 if name == "rowwise" else 1.75  # rowwise: 448 / amax rounded down to 2^k; MX: 2^ceil(log2(amax/448))
    x = torch.full((1, 1, 32), 0.25)
    x[0, 0, 0] = edge * (1 + 2**-20)
    y = x.clone()
    y[0, 0, 0] = edge
    qx, qy = _cast(x, cast), _cast(y, cast)
    assert not torch.equal(qx.scale, qy.scale)
    n, dist, ok = explain(x, qx, y, qy, cast)
    assert ok and dist <= 1.0, (n, dist)
