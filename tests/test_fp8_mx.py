"""`--fp8 mxfp8`'s cast is torchao 0.18's MX cast in RCEIL mode (cuBLAS's e8m0 rule), bit for bit on CPU; OCP's
FLOOR rule, which it replaced, saturates a block whose top passes 1.75·2^k."""
import pytest
import torch

from shardwise.fp8.recipes import E4M3, E5M2, Cast, recipe
from shardwise.fp8.scaling import Layout, as3d, quantize_all

from _dist import fresh_seed

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
Mode = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode


def _outliers(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Normal values spread over 12 decades, a few 1e3× outliers, whole zero and subnormal-tiny 32-blocks, and
    blocks whose amax sits exactly on an RCEIL edge (448·2^k) and one fp32 ulp either side of it."""
    x = torch.randn(*shape, generator=g) * torch.logspace(-6, 6, shape[-1]).roll(int(torch.randint(32, (1,))), -1)
    x.view(-1)[torch.randint(x.numel(), (x.numel() // 97,), generator=g)] *= 1e3
    flat = x.view(-1, 32)
    flat[0] = 0.0
    flat[1] = torch.randn(32, generator=g) * 1e-38
    flat[2] *= 1e-30
    edge = torch.tensor(448 * 2.0 ** -9)
    for i, v in enumerate((edge, edge.nextafter(torch.tensor(1.0)), edge.nextafter(torch.tensor(0.0)))):
        flat[3 + i] = flat[3 + i].clamp(-v / 2, v / 2)
        flat[3 + i, i] = -v
    return x


def _torchao(x: torch.Tensor, dtype, mode):
    """torchao's (data, multiplier): the e8m0 exponent e (biased) multiplies by 2^(127 − e), by 1 where e = 0."""
    e, data = mx.to_mx(x.contiguous(), dtype, 32, mode)
    e = e.view(torch.uint8).float()
    return data, torch.where(e == 0, 1.0, torch.exp2(127 - e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_cast_equals_torchao_rceil(dtype):
    """Every cast of the recipe (1×32 blocks along `in`, 32×1 along the tokens) gives torchao's RCEIL codes and
    multipliers bitwise, on fp32 and bf16 inputs; e5m2 data too (the rule takes the element type's max)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    m = recipe("mxfp8")
    x = _outliers(g, 3, 16, 256).to(dtype)
    w = _outliers(g, 96, 256).to(dtype)
    qx, qw, qt = quantize_all([(x, m.x, Layout()), (as3d(w), m.w, Layout()), (as3d(w), m.w_dgrad, Layout())])
    for q, ref in ((qx, _torchao(x, E4M3, Mode.RCEIL)), (qw, _torchao(w, E4M3, Mode.RCEIL))):
        assert torch.equal(q.data.view(torch.uint8), ref[0].view(q.data.shape).view(torch.uint8)), seed
        assert torch.equal(q.scale, ref[1].view(q.scale.shape)), seed
    data, mult = _torchao(w.t(), E4M3, Mode.RCEIL)  # 32×1 blocks: torchao's dim-1 cast is to_mx of the transpose
    assert torch.equal(qt.data[0].view(torch.uint8), data.t().view(torch.uint8)), seed
    assert torch.equal(qt.scale[0], mult.t()), seed
    (q5,) = quantize_all([(x, Cast(E5M2, (1, 32), e8m0=True), Layout())])
    data, mult = _torchao(x, E5M2, Mode.RCEIL)
    assert torch.equal(q5.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(q5.scale, mult), seed
    assert torch.equal(qx.scale.to(torch.float8_e8m0fnu).float(), qx.scale)  # every multiplier a power of two
    top = qx.data.float().abs().view(-1, 32).amax(-1)
    assert bool(((top >= 224) & (top <= 448) | (top == 0)).all()), seed  # top in [max/2, max]: none clipped


def test_floor_would_saturate():
    """A block whose amax is 1.9·2^k: OCP's FLOOR scale 2^(k−8) clips its top to 448·2^(k−8) = 1.75·2^k (8 % low);
    RCEIL's 2^(k−7) keeps it to e4m3's rounding. On outlier tensors FLOOR clips a share of all blocks, RCEIL none."""
    x = torch.full((1, 1, 32), 0.01)
    x[0, 0, 5] = 1.9 * 2.0 ** 3
    data, mult = _torchao(x, E4M3, Mode.FLOOR)
    assert data.float()[0, 0, 5] == 448 and mult[0, 0, 0] == 2.0 ** 5
    assert (x[0, 0, 5] - data.float()[0, 0, 5] / mult[0, 0, 0]) / x[0, 0, 5] > 0.07
    (q,) = quantize_all([(x, recipe("mxfp8").x, Layout())])
    assert q.scale.item() == 2.0 ** 4 and abs(q.dequantize()[0, 0, 5] / x[0, 0, 5] - 1) <= 2.0 ** -4
    g = torch.Generator().manual_seed(fresh_seed())
    x = torch.randn(64, 1024, generator=g) * torch.logspace(-2, 2, 1024)
    amax = x.abs().view(64, -1, 32).amax(-1)
    floor_data, _ = _torchao(x, E4M3, Mode.FLOOR)
    (q,) = quantize_all([(as3d(x), recipe("mxfp8").x, Layout())])
    clipped = (amax * 2.0 ** (8 - torch.floor(torch.log2(amax)))) > 448  # FLOOR's top would pass 448
    assert clipped.float().mean() > 0.1
    assert torch.equal(floor_data.float().abs().view(64, -1, 32).amax(-1)[clipped], torch.full_like(amax[clipped], 448))
    assert bool((x.abs().view(64, -1, 32).amax(-1) * q.scale[0] <= 448).all())
