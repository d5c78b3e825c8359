"""`expert_parallel.positions`: on the rank computing an expert, each received row's single-device token and its row
within the expert, held equal to the single device's dispatch order on four gloo ranks under dp×cp (balanced cut),
tp with SP, ep < dp (edp 2) and an expert placement with a replicated expert; routing drawn fresh, so runs of ids,
empty experts and uneven loads vary."""
import torch

from shardwise.expert_parallel.dispatch import AllToAllDispatcher
from shardwise.expert_parallel.positions import TokenLayout, expert_rows, token_ids
from shardwise.rules.placement import ExpertLayout

from _dist import fresh_seed, make_mesh, run_ranks

E, K, SEQ, MB = 8, 2, 16, 2
LAYOUTS = {  # name: (mesh degrees, sequence parallel, placement slots per ep rank)
    "dp2_cp2_ep2": (dict(dp=2, cp=2, ep=2), False, None),
    "dp2_tp2_sp_ep1": (dict(dp=2, tp=2), True, None),
    "dp4_ep2": (dict(dp=4, ep=2), False, None),
    "cp2_tp2_sp_ep2": (dict(dp=1, cp=2, tp=2, ep=2), True, None),
    "dp4_ep4_placed": (dict(dp=4, ep=4), False, ((3, 0, 5), (1, 2, 7), (4, 6, 0), (0, 1, 2))),
}


def _choices(seed: int, n_global: int) -> torch.Tensor:
    """[tokens, K] distinct experts per token, skewed so some experts get few or no rows."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n_global, E, generator=gen) * torch.linspace(1.0, 0.2, E)
    return scores.topk(K, dim=1).indices


def _single_device(choices: torch.Tensor) -> list[torch.Tensor]:
    """Per expert: its rows' tokens in the single device's order (the dispatcher's stable sort by expert)."""
    flat = choices.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    tokens = perm // K
    return [tokens[flat[perm] == e] for e in range(E)]


def _check(name: str, seed: int) -> list[str]:
    degrees, sp, slots = LAYOUTS[name]
    mesh = make_mesh(**degrees)
    lay = TokenLayout.of(mesh, SEQ, "balanced", sp)
    choices = _choices(seed, mesh.dims.dp * MB * SEQ)
    want = _single_device(choices)
    ids = token_ids(lay, MB)
    placement = None if slots is None else ExpertLayout(E, slots)
    disp = AllToAllDispatcher(E, mesh["ep"], layout=placement)
    x = ids.double()[:, None].repeat(1, 3)  # each row carries its token id through the dispatch
    indices = choices[ids]
    rows, handle = disp.dispatch(x, indices, torch.ones(indices.shape, dtype=torch.float64))
    where = expert_rows(lay, ids, indices, handle, disp, "positions", with_token=True)
    bad = []
    if not torch.equal(where.totals, torch.tensor([len(w) for w in want])):
        bad.append(f"{name}: totals {where.totals.tolist()}")
    if not torch.equal(where.token, rows[:, 0].long()):
        bad.append(f"{name}: tokens are not the rows' tokens")
    experts = slots[mesh["ep"].rank] if slots is not None else range(
        mesh["ep"].rank * disp.n_local, (mesh["ep"].rank + 1) * disp.n_local)
    for e, tok, pos in zip(experts, where.token.split(handle.tokens_per_local_expert),
                           where.position.split(handle.tokens_per_local_expert)):
        if not torch.equal(want[e][pos], tok):
            bad.append(f"{name}: expert {e}'s rows at {pos.tolist()} are tokens {tok.tolist()}, "
                       f"the single device's {want[e][pos].tolist()}")
    # every row of every expert is held by some rank (copies split an expert's rows)
    seen = torch.zeros(E, len(choices), dtype=torch.int64)
    for e, pos in zip(experts, where.position.split(handle.tokens_per_local_expert)):
        seen[e, pos] += 1
    mult = 1 if sp or mesh["tp"].size == 1 else mesh["tp"].size
    from shardwise import comm
    comm.all_reduce(seen, mesh["world"])
    covered = torch.stack([seen[e, :len(want[e])].eq(mult).all() for e in range(E)])
    if not bool(covered.all()) or int(seen.sum()) != mult * sum(len(w) for w in want):
        bad.append(f"{name}: rows not covered once each: {seen.sum(1).tolist()}")
    return bad


def _all(seed: int) -> list[str]:
    torch.set_num_threads(1)
    return [b for name in LAYOUTS for b in _check(name, seed)]


def test_positions_are_the_single_devices_order():
    seed = fresh_seed()
    out = run_ranks(4, _all, seed)
    bad = [b for r in out for b in r]
    assert not bad, (seed, bad[:6])
