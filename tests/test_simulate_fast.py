"""simulate's fast path (`simulate_rank(fast=True)`: the static-shape dispatch key, device queries answered by
the live-memory trace, p2p batches that skip the fake backend) reports exactly what the plain path does."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState

from shardwise.simulate.dispatch_key import STATIC, StaticKeyMode


def _config(argv: list[str]):
    """The run of `simulate ARGV` with 4 layers of the preset's 8: one or two per pipeline chunk, every layer kind
    (MoE, dense) on each stage of tiny-moe, and half the ops to trace (both runs compared trace the same layers)."""
    from dataclasses import replace

    from shardwise.cli import build_parser, config_from_args
    from shardwise.training.assemble import assemble

    cfg = config_from_args(build_parser().parse_args(["simulate", *argv]), None)
    return assemble(replace(cfg, resolved_model=None, model_overrides={**cfg.model_overrides, "n_layers": 4}))


LAYOUTS = {  # layout, the stage compared: p2p on the pipeline and on the cp ring, MoE's all-to-alls with split
    # sizes, ZeRO-3's resized unit buffers, recompute, fp32 and bf16 (bf16 and fp32 tensors of one shape meet)
    "1f1b-moe-ep2-tp-sp-zero3-bf16": (["--model", "tiny-moe", "--pp", "2", "--dp", "2", "--ep", "2", "--tp", "2",
                                       "--sequence-parallel", "--zero", "3", "--dtype", "bf16",
                                       "--microbatches", "3"], 1),
    "interleaved-cp2-ring-zero2-selective": (["--pp", "2", "--schedule", "interleaved", "--vp", "2", "--cp", "2",
                                              "--zero", "2", "--recompute", "selective", "--microbatches", "4"], 0),
    "no-pp-cp2-ulysses-zero1-full-bf16": (["--dp", "2", "--cp", "2", "--cp-impl", "ulysses", "--zero", "1",
                                           "--recompute", "full", "--dtype", "bf16", "--microbatches", "2"], 0),
}
SAME = ("peak_bytes", "peak_phase", "top_live", "static_bytes", "activation_bytes", "build_peak_bytes", "ledger",
        "comm_bytes", "stage", "microbatches_run", "microbatches_scaled")


def test_the_fast_path_reports_what_the_plain_path_does():
    """Every figure simulate reports — live peak, its moment and largest groups, static, activation and build
    bytes, and the ledger row by row — is the same on the fast path as on the plain one, on several layouts."""
    from shardwise.simulate.world import simulate_rank

    FakeTensorMode.cache.clear()
    for name, (argv, stage) in LAYOUTS.items():
        cfg = _config(["--seq-len", "16", "--micro-batch", "1", "--steps", "2", *argv])
        rank = stage * cfg.parallel.cp * cfg.parallel.tp
        fast, plain = simulate_rank(cfg, rank), simulate_rank(cfg, rank, fast=False)
        for key in SAME:
            assert fast[key] == plain[key], (name, key)
    assert sum(k.key[0] == STATIC for k in FakeTensorMode.cache) > 100  # the fast path did key its ops


def test_the_static_key_tells_apart_what_changes_an_output():
    """Each op gets a key of its own kind; a key differs when an argument's dtype, sizes, strides, storage offset,
    requires_grad or a plain value differs, and anything else (here: a tensor of another fake mode) takes
    FakeTensorMode's own key."""
    FakeTensorMode.cache.clear()
    with StaticKeyMode() as mode:
        x, base = torch.empty(4, 6), torch.empty(30)
        variants = [x,  # and tensors that differ from it, or from one another, in one property only:
                    x.view(torch.int32),  # dtype (the same bytes)
                    torch.empty(6, 4).t(),  # strides
                    base[:24].view(4, 6), base[6:].view(4, 6),  # the storage's size; the storage offset
                    x[:, :3], x[:, :4],  # sizes
                    torch.empty(4, 6, requires_grad=True)]
        keys = {mode._cache_key(None, torch.ops.aten.neg.default, (v,), {}) for v in variants}
        assert len(keys) == len(variants)
        assert all(k.key[0] == STATIC for k in keys)
        add = [mode._cache_key(None, torch.ops.aten.add.Tensor, (x, x), {"alpha": a}) for a in (1, 1.0, True, 2)]
        assert len(set(add)) == 4
        other = FakeTensorMode().from_tensor(torch.empty(4, 6))
    with pytest.raises(Exception, match="not our fake"):  # FakeTensorMode's key refuses it: no cache entry
        mode._cache_key(_CacheKeyState(None), torch.ops.aten.neg.default, (other,), {})


def test_a_cache_hit_makes_what_fake_tensor_mode_makes():
    """`StaticKeyMode.dispatch` answers a hit itself: a new tensor with FakeTensor.__new__'s attributes and metadata,
    a view on its base's storage, an in-place op's own argument, a tuple op's every output — as FakeTensorMode's own
    hit path makes them (run here on the same entry)."""
    FakeTensorMode.cache.clear()
    with StaticKeyMode():
        x = torch.empty(4, 6, requires_grad=True)
        ops = {"new": lambda: x * 2, "view": lambda: x.detach()[1:].t(), "in place": lambda: x.detach().add_(1),
               "tuple": lambda: x.detach().max(dim=1)}
        for name, op in ops.items():
            op()  # the miss fills the cache
            hits = FakeTensorMode.cache_hits
            ours = op()
            assert FakeTensorMode.cache_hits > hits, name
            StaticKeyMode.dispatch, saved = FakeTensorMode.dispatch, StaticKeyMode.dispatch
            try:
                theirs = op()
            finally:
                StaticKeyMode.dispatch = saved
            for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (ours, theirs))):
                assert type(a) is type(b) and a.__dict__ == b.__dict__, name
                assert (a.shape, a.stride(), a.dtype, a.device, a.storage_offset(), a.requires_grad) == \
                       (b.shape, b.stride(), b.dtype, b.device, b.storage_offset(), b.requires_grad), name
                assert (a.untyped_storage()._cdata == b.untyped_storage()._cdata) == (name in ("view", "in place"))
