"""Raw comm ops that later axes build on: variable-split all-to-all and batched p2p, with their ledger rows."""
import torch

from shardwise import comm

from _dist import make_mesh, run_ranks


def _ops():
    mesh = make_mesh(dp=2)
    ax = mesh["dp"]
    r = ax.rank
    # rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 to rank 0 and 0 to itself
    in_splits = [[1, 3], [2, 0]][r]
    out_splits = [[1, 2], [3, 0]][r]
    inp = torch.arange(sum(in_splits) * 2, dtype=torch.float32).view(-1, 2) + 100 * r
    out = comm.all_to_all(inp, ax, in_splits, out_splits)
    buf = torch.empty(3)
    peer = 1 - r
    works = comm.p2p([("send", torch.full((3,), float(r)), ax, peer), ("recv", buf, ax, peer)])
    for w in works:
        w.wait()
    return out, buf, mesh.ledger.snapshot()["dp"]


def test_all_to_all_variable_splits_and_p2p():
    (out0, buf0, led0), (out1, buf1, led1) = run_ranks(2, _ops)
    assert torch.equal(out0, torch.tensor([[0., 1.], [100., 101.], [102., 103.]]))
    assert torch.equal(out1, torch.tensor([[2., 3.], [4., 5.], [6., 7.]]))
    assert torch.equal(buf0, torch.ones(3)) and torch.equal(buf1, torch.zeros(3))
    assert led0["all_to_all"] == {"count": 1, "bytes": 4 * 2 * 4, "wire_bytes": 3 * 2 * 4}
    assert led1["all_to_all"] == {"count": 1, "bytes": 2 * 2 * 4, "wire_bytes": 2 * 2 * 4}
    assert led0["send"] == {"count": 1, "bytes": 12, "wire_bytes": 12}
    assert led0["recv"] == {"count": 1, "bytes": 0, "wire_bytes": 0}
