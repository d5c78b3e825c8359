"""The Gated DeltaNet layer's precision and memory (`models/gated_deltanet.py`): the chunk rule and the cp state
composition are fp32 whatever autocast is on, and the gated norm's autograd Function is the plain computation bit
for bit. (Its numerics against transformers: tests/test_qwen3_next.py; its saved bytes against the planner:
tests/test_planner_new_families.py.)"""
import types

import pytest
import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.context_parallel import linear_attention as cp_rule
from shardwise.models.gated_deltanet import GatedNormFunction, chunk_gated_delta_rule, l2norm

from _dist import fresh_seed


def _plain_gated_norm(x, z, weight, eps):
    """transformers' Qwen3NextRMSNormGated, through plain autograd."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.bfloat16, torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16, torch.float32), (torch.bfloat16,) * 3])
def test_gated_norm_function_is_the_plain_norm(dtypes):
    """Output and the gradients of x, z and the weight equal plain autograd's exactly, for every dtype mix the layer
    meets (fp32; bf16 activations with an fp32 weight; an fp32 rule output with a bf16 gate; all bf16)."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    xd, zd, wd = dtypes
    x = torch.randn(2, 37, 4, 16, generator=g).to(xd).requires_grad_()
    z = (2 * torch.randn(2, 37, 4, 16, generator=g)).to(zd).requires_grad_()
    w = torch.randn(16, generator=g).to(wd).requires_grad_()
    dy = torch.randn(2, 37, 4, 16, generator=g).to(xd)
    got, want = ((f(x, z, w, 1e-6), *torch.autograd.grad(f(x, z, w, 1e-6), (x, z, w), dy))
                 for f in (GatedNormFunction.apply, _plain_gated_norm))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (seed, (a - b).abs().max())


def _rule_inputs(g, b=2, h=3, s=150, dk=8, dv=6):
    q, k = l2norm(torch.randn(b, h, s, dk, generator=g)), l2norm(torch.randn(b, h, s, dk, generator=g))
    v = torch.randn(b, h, s, dv, generator=g)
    decay = -torch.rand(b, h, s, generator=g) * 0.05  # weak: the state crosses chunks
    beta = torch.rand(b, h, s, generator=g)
    return [t.requires_grad_() for t in (q * dk ** -0.5, k, v, decay, beta)]


def _outputs_and_grads(fn, inputs, autocast: bool):
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = fn(*inputs)
    flat = [t for t in out if t is not None]
    grads = torch.autograd.grad(sum((t.float() * torch.cos(torch.arange(t.numel()).view(t.shape))).sum()
                                    for t in flat), inputs)
    return [t.detach() for t in flat] + list(grads)


def test_chunk_rule_ignores_autocast():
    """Under bf16 autocast the rule (two chunks and a padded tail, from an initial state, with the state map and
    effective queries) gives the fp32 run's outputs and input gradients exactly: every matmul ran in fp32."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    inputs = _rule_inputs(g)
    state = torch.randn(2, 3, 8, 6, generator=g)

    def rule(q, k, v, d, beta):
        o, final, (m, read) = chunk_gated_delta_rule(q, k, v, d, beta, initial_state=state, transition=True)
        return o, final, m, read

    fp32, mixed = (_outputs_and_grads(rule, inputs, a) for a in (False, True))
    for a, b in zip(fp32, mixed):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (seed, (a - b).abs().max())


@pytest.mark.parametrize("order", ["contiguous", "balanced"])
def test_cp_composition_ignores_autocast(monkeypatch, order):
    """Every rank of cp 2 (the gathers standing in by concatenation of this rank's maps): the state composition and
    the Q·S_in reads run in fp32 under bf16 autocast, so outputs and gradients equal the fp32 run exactly."""
    monkeypatch.setattr(comm, "gather_from_sequence", lambda x, axis, dim: torch.cat([x] * axis.size, dim))
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    inputs = _rule_inputs(g, s=256)
    for rank in range(2):
        axis = types.SimpleNamespace(rank=rank, size=2)

        def rule(q, k, v, d, beta):
            return (cp_rule.delta_rule(q, k, v, d, beta, axis, order),)

        fp32, mixed = (_outputs_and_grads(rule, inputs, a) for a in (False, True))
        for a, b in zip(fp32, mixed):
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), (seed, rank, (a - b).abs().max())
