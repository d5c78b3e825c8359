"""Context parallelism against single-device SDPA, forward and backward.

Layout logic (sharding, block plans, the attention primitive) is checked with no processes. The
distributed checks take two forks — cp=2 on 2 ranks, cp=4 on 4 ranks (plus cp=2 × tp=2 there, whose
cp groups are strided) — and each rank runs every parity check on global tensors drawn from one
seed chosen by the parent, so all ranks see the same q, k, v and output gradient.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from shardwise.context_parallel import (block_plan, check_seq_len, chunk_ids, positions, ring_attention,
                                        shard_sequence, ulysses_attention, unshard_sequence)
from shardwise.context_parallel.ring_attention import block_backward, block_forward
from shardwise.mesh import Axis

from _dist import fresh_seed, make_mesh, run_ranks

TOL = dict(rtol=2e-5, atol=2e-5)
BF16_TOL = dict(rtol=3e-2, atol=3e-2)
ORDERS = ("balanced", "contiguous")
HEADS = ((4, 4), (4, 2), (4, 1))  # (hq, hkv): MHA, GQA, MQA
B, D = 2, 16


# ---------------------------------------------------------------- no processes
@pytest.mark.parametrize("c", [1, 2, 3, 4])
@pytest.mark.parametrize("order", ORDERS)
def test_shard_unshard_positions(c, order):
    s = 4 * c
    x = torch.arange(s).view(1, s, 1).expand(2, s, 3)
    parts = [shard_sequence(x, r, c, order) for r in range(c)]
    assert torch.equal(unshard_sequence(parts, c, order), x)
    for r, part in enumerate(parts):
        assert part.shape == (2, s // c, 3)
        assert torch.equal(positions(s, r, c, order), part[0, :, 0])  # x holds each token's position
    if order == "balanced" and c > 1:
        assert chunk_ids(0, c, order) == (0, 2 * c - 1)
        assert positions(8, 1, 2, order).tolist() == [2, 3, 4, 5]


def test_seq_len_errors_name_s_c_and_multiple():
    with pytest.raises(ValueError, match=r"s=10 .* c=4 .*multiple of 8"):
        check_seq_len(10, 4, "balanced")
    with pytest.raises(ValueError, match=r"s=10 .* c=4 .*multiple of 4"):
        check_seq_len(10, 4, "contiguous")
    with pytest.raises(ValueError, match="order"):
        check_seq_len(16, 2, "zigzag")
    assert check_seq_len(24, 4, "contiguous") == 6 and check_seq_len(7, 1, "balanced") == 7
    cp = Axis("cp", size=2)  # the length is checked before any communication
    q, kv = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4)
    for attn in (ring_attention, ulysses_attention):
        with pytest.raises(ValueError, match=r"s=6 .* c=2 .*multiple of 4"):
            attn(q, kv, kv, cp)


@pytest.mark.parametrize("c", [2, 3, 4])
@pytest.mark.parametrize("order", ORDERS)
def test_block_plan_covers_the_causal_mask_once(c, order):
    s = 4 * c
    s_local = s // c
    work = []
    for qr in range(c):
        pq_all = positions(s, qr, c, order)
        cover = torch.zeros(s, s, dtype=torch.long)
        area = 0.0
        for kr in range(c):
            pk_all = positions(s, kr, c, order)
            for qs, ks, is_causal in block_plan(qr, kr, c, order, True, s_local):
                pq, pk = pq_all[qs], pk_all[ks]
                if is_causal:  # square, aligned: the block's own triangle is the true mask
                    assert torch.equal(pq, pk)
                    seen = pk[None, :] <= pq[:, None]
                else:
                    seen = torch.ones(len(pq), len(pk), dtype=torch.bool)
                    assert (pk[None, :] < pq[:, None]).all()  # no masked pair computed unmasked
                cover[pq[:, None], pk[None, :]] += seen.long()
                area += seen.sum().item()
        assert torch.equal(cover[pq_all], torch.ones(s, s, dtype=torch.long).tril()[pq_all])
        work.append(area)
        assert block_plan(qr, (qr + 1) % c, c, order, False, s_local) == [(slice(0, s_local),) * 2 + (False,)]
    if order == "balanced":
        assert len(set(work)) == 1  # every rank attends to the same number of (q, k) pairs


@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_block_primitive_fused_matches_math(hq, hkv, causal):
    g = torch.Generator().manual_seed(fresh_seed())
    sk = 8 if causal else 12
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((hq, 8), (hkv, sk), (hkv, sk)))
    dout = torch.randn(B, hq, 8, D, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=hq != hkv)
    ref.backward(dout)
    for backend in ("auto", "math"):
        out, lse = block_forward(q, k, v, causal, D ** -0.5, backend)
        assert lse.dtype == torch.float32 and lse.shape == (B, hq, 8)
        assert_close(out, ref, **TOL)
        grads = block_backward(dout, q, k, v, out, lse, causal, D ** -0.5, backend)
        for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
            assert_close(got, want, **TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_single_device_axis_is_plain_sdpa(causal):
    g = torch.Generator().manual_seed(fresh_seed())
    q, k, v = (torch.randn(B, h, 12, D, generator=g) for h in (4, 2, 2))
    dout = torch.randn(B, 4, 12, D, generator=g)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=True)
    ref.backward(dout)
    for attn in (ring_attention, ulysses_attention):
        loc = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn(*loc, Axis("cp"), causal=causal)  # cp=1: any length, no communication
        out.backward(dout)
        for got, want in zip((out, *(t.grad for t in loc)), (ref, *(t.grad for t in ref_in))):
            assert_close(got, want, **TOL)


# ---------------------------------------------------------------- distributed
def _parity(axis, g, attn, causal, order, hq, hkv, dtype=torch.float32, **kw):
    c, r = axis.size, axis.rank
    s = 8 * c
    q, k, v = (torch.randn(B, h, s, D, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(B, hq, s, D, generator=g)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=hq != hkv)
    ref.backward(dout)

    def local(t):
        return shard_sequence(t, r, c, order, dim=2)

    loc = [local(t).to(dtype).requires_grad_() for t in (q, k, v)]
    out = attn(*loc, axis, causal=causal, order=order, **kw)
    out.backward(local(dout).to(dtype))
    tol = TOL if dtype == torch.float32 else BF16_TOL
    what = f"{attn.__name__} c={c} causal={causal} order={order} hq={hq} hkv={hkv} {dtype} {kw}"
    assert out.dtype == dtype, what
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in loc)),
                               (ref, *(t.grad for t in ref_in))):
        assert_close(got.float(), local(want), **tol, msg=lambda m: f"{what} {name}: {m}")


def _ledger(mesh, attn, hkv, backward):
    axis = mesh["cp"]
    q, k, v = torch.randn(B, 4, 8, D), torch.randn(B, hkv, 8, D), torch.randn(B, hkv, 8, D)
    if backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    mesh.ledger.reset()
    if backward:
        attn(q, k, v, axis).backward(torch.ones(B, 4, 8, D))
    else:
        with torch.no_grad():
            attn(q, k, v, axis)
    snap = mesh.ledger.snapshot().get("cp", {})
    assert set(snap) <= {"send", "recv", "all_to_all"}, snap
    return snap


def _rank_checks(seed, cp):
    g = torch.Generator().manual_seed(seed)
    mesh = make_mesh(cp=cp)
    axis = mesh["cp"]
    for attn in (ring_attention, ulysses_attention):
        for order in ORDERS:
            for causal in (True, False):
                for hq, hkv in HEADS:
                    _parity(axis, g, attn, causal, order, hq, hkv)
        _parity(axis, g, attn, True, "balanced", 4, 2, dtype=torch.bfloat16)
    _parity(axis, g, ring_attention, True, "balanced", 4, 2, backend="math")
    _parity(axis, g, ring_attention, True, "contiguous", 4, 1, backend="math")
    ledgers = {(name, hkv, bwd): _ledger(mesh, attn, hkv, bwd)
               for name, attn in (("ring", ring_attention), ("ulysses", ulysses_attention))
               for hkv in (1, 2) for bwd in (False, True)}
    if cp == 4:  # a strided cp group (cp=2 × tp=2): peers must be mapped through axis.ranks
        sub = make_mesh(cp=2, tp=2)["cp"]
        assert sub.ranks[1] - sub.ranks[0] == 2
        for attn in (ring_attention, ulysses_attention):
            _parity(sub, g, attn, True, "balanced", 4, 2)
    return ledgers


def _check_ledgers(per_rank, c):
    elem, s_local, hq = 4, 8, 4
    for ledgers in per_rank:
        for hkv in (1, 2):
            blk = B * hkv * s_local * D * elem
            fwd, total = ledgers[("ring", hkv, False)], ledgers[("ring", hkv, True)]
            # forward: c−1 K and c−1 V blocks; backward adds c−1 K, c−1 V, c−1 dK, c−1 dV
            assert fwd["send"] == {"count": 2 * (c - 1), "bytes": 2 * (c - 1) * blk, "wire_bytes": 2 * (c - 1) * blk}
            assert fwd["recv"]["count"] == 2 * (c - 1)
            assert total["send"]["count"] - fwd["send"]["count"] == 4 * (c - 1)
            assert total["send"]["bytes"] - fwd["send"]["bytes"] == 4 * (c - 1) * blk
            assert "all_to_all" not in total
            # ulysses: forward q, k, v, out (KV replicated up to c heads when hkv < c); backward their grads
            kv_heads = max(hkv, c)
            a2a = B * s_local * D * elem * (2 * hq + 2 * kv_heads)
            uf, ut = ledgers[("ulysses", hkv, False)], ledgers[("ulysses", hkv, True)]
            assert uf["all_to_all"]["count"] == 4 and uf["all_to_all"]["bytes"] == a2a
            assert ut["all_to_all"]["count"] == 8 and ut["all_to_all"]["bytes"] == 2 * a2a
            assert "send" not in ut


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_and_ulysses_match_sdpa(cp):
    seed = fresh_seed()
    try:
        per_rank = run_ranks(cp, _rank_checks, seed, cp)
    except Exception as e:
        raise AssertionError(f"seed {seed}: {e}") from e
    _check_ledgers(per_rank, cp)
