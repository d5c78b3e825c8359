"""RNG tracker: TP-sharded dropout differs per TP rank, replicated/SP dropout matches single device."""
import torch
from torch.testing import assert_close

from shardwise import comm
from shardwise.tensor_parallel.random import RNGTracker, replicated_dropout

from _dist import fresh_seed, make_mesh, run_ranks


def _masks(seed):
    mesh = make_mesh(tp=2)
    tp = mesh["tp"]
    tracker = RNGTracker(seed, tp.rank)
    before = torch.get_rng_state()
    with tracker.fork("tp"):
        sharded = torch.nn.functional.dropout(torch.ones(64, 64), 0.5)
    assert torch.equal(torch.get_rng_state(), before)  # fork leaves the default stream untouched
    replicated = replicated_dropout(torch.ones(2, 8, 16), 0.5, tracker)
    sp_shard = replicated_dropout(torch.ones(2, 4, 16), 0.5, RNGTracker(seed, tp.rank), tp)
    gather = lambda t: comm.all_gather(t.unsqueeze(0).contiguous(), tp, 0)
    return gather(sharded), gather(replicated), comm.all_gather(sp_shard, tp, 1)


def test_dropout_streams():
    seed = fresh_seed()
    sharded, replicated, sp_full = run_ranks(2, _masks, seed)[0]
    assert not torch.equal(sharded[0], sharded[1])  # attention heads on different ranks: independent masks
    assert torch.equal(replicated[0], replicated[1])  # replicated tensors: one mask on every rank
    single = replicated_dropout(torch.ones(2, 8, 16), 0.5, RNGTracker(seed, 0))
    assert_close(sp_full, single)  # SP shards cut the single-device mask
    assert_close(replicated[0], sp_full)
