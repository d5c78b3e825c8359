"""Tensor-parallel layers against their single-device counterparts, forward and backward.

Two spawns (tp=2 on 2 ranks, tp=4 on 4 ranks); each rank runs every check with fresh random
inputs drawn from a seed chosen by the parent, so all ranks see the same global tensors.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from shardwise import comm
from shardwise.config import ModelConfig, ParallelConfig
from shardwise.data_parallel import GradReducer
from shardwise.mesh import Mesh
from shardwise.parallelize import build_model
from shardwise.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardwise.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                              get_spec)

from _dist import fresh_seed, make_mesh, run_ranks

TOL = dict(rtol=1e-5, atol=1e-5)


def _load(layer, full_w, full_b=None):
    with torch.no_grad():
        layer.weight.copy_(get_spec(layer.weight).local_slice(full_w))
        if full_b is not None:
            layer.bias.copy_(get_spec(layer.bias).local_slice(full_b))


def _shard_grad_close(p, full_grad):
    assert_close(p.grad, get_spec(p).local_slice(full_grad), **TOL)


def _reference_mlp(h, f, w1, b1, w2, b2):
    l1, l2 = torch.nn.Linear(h, f), torch.nn.Linear(f, h)
    with torch.no_grad():
        l1.weight.copy_(w1), l1.bias.copy_(b1), l2.weight.copy_(w2), l2.bias.copy_(b2)
    return l1, l2


def check_column_row(tp, g):
    b, s, h, f = 2, 6, 8, 12 * tp.size
    x = torch.randn(b, s, h, generator=g)
    w1, b1 = torch.randn(f, h, generator=g), torch.randn(f, generator=g)
    w2, b2 = torch.randn(h, f, generator=g), torch.randn(h, generator=g)
    dy = torch.randn(b, s, h, generator=g)
    l1, l2 = _reference_mlp(h, f, w1, b1, w2, b2)
    xr = x.clone().requires_grad_()
    ref = l2(F.gelu(l1(xr)))
    ref.backward(dy)

    # column -> row (Megatron MLP)
    col, row = ColumnParallelLinear(h, f, tp, bias=True), RowParallelLinear(f, h, tp, bias=True)
    _load(col, w1, b1), _load(row, w2, b2)
    xp = x.clone().requires_grad_()
    out = row(F.gelu(col(xp)))
    out.backward(dy)
    assert_close(out, ref, **TOL)
    assert_close(xp.grad, xr.grad, **TOL)
    _shard_grad_close(col.weight, l1.weight.grad)
    _shard_grad_close(col.bias, l1.bias.grad)
    _shard_grad_close(row.weight, l2.weight.grad)
    assert_close(row.bias.grad, l2.bias.grad, **TOL)  # bias added once, after the reduce

    # column with gather_output, then row with a replicated (not yet split) input
    col_g = ColumnParallelLinear(h, f, tp, bias=True, gather_output=True)
    row_np = RowParallelLinear(f, h, tp, bias=True, input_is_parallel=False)
    _load(col_g, w1, b1), _load(row_np, w2, b2)
    xp = x.clone().requires_grad_()
    mid = col_g(xp)
    assert_close(mid, l1(x), **TOL)
    out = row_np(F.gelu(mid))
    out.backward(dy)
    assert_close(out, ref, **TOL)
    assert_close(xp.grad, xr.grad, **TOL)
    _shard_grad_close(col_g.weight, l1.weight.grad)
    _shard_grad_close(row_np.weight, l2.weight.grad)

    # sequence parallel: input and output are sequence shards [b, s/tp, h]
    s_sp = 2 * tp.size
    x = torch.randn(b, s_sp, h, generator=g)
    dy = torch.randn(b, s_sp, h, generator=g)
    l1, l2 = _reference_mlp(h, f, w1, b1, w2, b2)
    xr = x.clone().requires_grad_()
    ref = l2(F.gelu(l1(xr)))
    ref.backward(dy)
    col = ColumnParallelLinear(h, f, tp, bias=True, sequence_parallel=True)
    row = RowParallelLinear(f, h, tp, bias=True, sequence_parallel=True)
    _load(col, w1, b1), _load(row, w2, b2)
    mine = slice(tp.rank * s_sp // tp.size, (tp.rank + 1) * s_sp // tp.size)
    xp = x[:, mine].clone().requires_grad_()
    out = row(F.gelu(col(xp)))
    out.backward(dy[:, mine].contiguous())
    assert out.shape == (b, s_sp // tp.size, h)
    assert_close(out, ref[:, mine], **TOL)
    assert_close(xp.grad, xr.grad[:, mine], **TOL)
    _shard_grad_close(col.weight, l1.weight.grad)
    _shard_grad_close(row.weight, l2.weight.grad)
    assert get_spec(row.bias).grad_reduce == "tp_sum"  # partial under SP; GradReducer sums it over TP
    assert_close(comm.all_reduce(row.bias.grad.clone(), tp), l2.bias.grad, **TOL)


def check_embedding(tp, g):
    vocab, h = 13, 6  # not a multiple of 2 or 4: the last shard carries padding rows
    w = torch.randn(vocab, h, generator=g)
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    ids[0, 0], ids[0, 1] = 0, vocab - 1
    dy = torch.randn(3, 7, h, generator=g)
    wr = w.clone().requires_grad_()
    ref = F.embedding(ids, wr)
    ref.backward(dy)
    emb = VocabParallelEmbedding(vocab, h, tp)
    spec = get_spec(emb.weight)
    assert emb.weight.shape[0] * tp.size == -(-vocab // tp.size) * tp.size
    _load(emb, w)
    out = emb(ids)
    out.backward(dy)
    assert_close(out, ref, **TOL)
    _shard_grad_close(emb.weight, wr.grad)
    assert torch.all(emb.weight.grad[spec.valid:] == 0)
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            emb(torch.tensor([[1, bad]]))


def check_cross_entropy(tp, g):
    vocab, n = 13, 17
    per = -(-vocab // tp.size)
    start = tp.rank * per
    valid = max(0, min(per, vocab - start))
    for dtype in (torch.float32, torch.bfloat16):
        for smoothing in (0.0, 0.1):
            logits = (3 * torch.randn(n, vocab, generator=g)).to(dtype)
            target = torch.randint(0, vocab, (n,), generator=g)
            target[::5] = -100
            lr = logits.clone().float().requires_grad_()
            ref = F.cross_entropy(lr, target, ignore_index=-100, label_smoothing=smoothing, reduction="sum")
            ref.backward()
            local = torch.zeros(n, per, dtype=dtype)
            local[:, :valid] = logits[:, start:start + valid]
            local[:, valid:] = 1e4  # padding columns must be ignored whatever they hold
            before = local.clone()
            lp = local.clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(lp, target, tp, start, vocab, -100, smoothing)
            loss.sum().backward()
            tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            assert_close(loss.sum(), ref, **tol)
            assert torch.all(loss[target == -100] == 0)
            assert_close(lp.grad[:, :valid].float(), lr.grad[:, start:start + valid], **tol)
            assert torch.all(lp.grad[:, valid:] == 0)
            assert lp.grad.dtype == dtype
            assert torch.equal(lp.detach(), before)  # the input logits are never modified


def check_full_model(mesh, g, cfg: ModelConfig, sp: bool):
    """Whole model (GQA attention, MLP, embedding, head, CE) on tp ranks vs the single-device model."""
    seed = int(torch.randint(0, 2**31, (1,), generator=g))
    model = build_model(cfg, mesh, seed, ParallelConfig(tp=mesh["tp"].size, sequence_parallel=sp))
    ref = build_model(cfg, Mesh.single(), seed)
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
    target = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
    logits, ref_logits = model(tokens), ref(tokens)
    assert_close(logits, get_spec(model.output.weight).local_slice(ref_logits.transpose(0, -1)).transpose(0, -1),
                 **TOL)
    loss = model.loss_fn(logits, target).mean()
    ref_loss = ref.loss_fn(ref_logits, target).mean()
    assert_close(loss, ref_loss, **TOL)
    assert_close(ref_loss, F.cross_entropy(ref_logits.flatten(0, 1), target.flatten()), **TOL)
    loss.backward()
    ref_loss.backward()
    GradReducer(model, mesh).reduce_and_clip(0.0)  # TP reductions of SP norms / shared K/V heads
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(p.grad, get_spec(p).local_slice(ref_params[name].grad), **TOL, msg=lambda m: f"{name}: {m}")
    return get_spec(model.layers["0"].attention.wk.weight).grad_reduce


def _rank_checks(seed, kv_heads_list):
    mesh = make_mesh(tp=torch.distributed.get_world_size())
    tp = mesh["tp"]
    g = torch.Generator().manual_seed(seed)
    check_column_row(tp, g)
    check_embedding(tp, g)
    check_cross_entropy(tp, g)
    base = ModelConfig(name="t", vocab_size=29, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=48,
                       max_seq_len=16)
    modes = set()
    for kv in kv_heads_list:
        for sp in (False, True):
            for tie in (False, True):
                modes.add(check_full_model(mesh, g, dataclasses.replace(base, n_kv_heads=kv, tie_embeddings=tie), sp))
    return modes


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_parity(tp):
    seed = fresh_seed()
    kv_list = [4, 2] if tp == 4 else [4, 2, 1]  # n_kv >= tp (sharded K/V) and n_kv < tp (shared K/V heads)
    modes = run_ranks(tp, _rank_checks, seed, kv_list)[0]
    assert modes == {None, "tp_kv"}, (seed, modes)
