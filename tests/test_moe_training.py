"""MoE training end to end: auxiliary-loss-free balancing lowers the max/mean expert load; the router's routing tape
(verify's replay hook) records margins and forces choices."""
import json
import subprocess
import sys


def test_bias_balancing_lowers_max_over_mean_load(tmp_path):
    r = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--model", "tiny-moe", "--dp", "2", "--ep",
                        "2", "--moe-aux-loss-coef", "0", "--moe-bias-update-rate", "0.01", "--steps", "60",
                        "--seq-len", "64", "--no-progress", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    load = [row["moe_max_over_mean_load"] for row in rows]
    assert sum(load[-15:]) / 15 < 0.8 * sum(load[:15]) / 15, load
    assert all(sum(row["moe_tokens_per_expert"]) == 8 * 64 * 2 * 4 for row in rows)  # b·s·k per MoE layer × 4 layers
    ledger = json.loads((tmp_path / "comm.json").read_text())["per_step"][-1]["axes"]["ep"]
    assert ledger["all_to_all:dispatch"]["count"] == 4 and ledger["all_to_all:counts"]["count"] == 4


def test_routing_tape_records_margins_and_forces_choices():
    """verify's routing replay hook: a forced choice replaces the top-k but keeps the router's own gates and counts
    it; the recorded margin is the k-th minus the (k+1)-th selection score, and under group-limited routing no
    larger than the kept-versus-dropped group gap."""
    import torch

    from shardwise.expert_parallel.router import Router, RoutingTape

    torch.manual_seed(0)
    router = Router(16, 8, 2, score="sigmoid", n_group=4, topk_group=2)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 16)
    own = router(x)
    router.tape = RoutingTape()
    forced = torch.tensor([[7, 6]] * 5)
    router.tape.forced = [forced]
    routing = router(x)
    (indices, margin), = router.tape.calls
    assert torch.equal(indices, own.indices) and torch.equal(routing.indices, forced)
    scores = (x @ router.weight.T).sigmoid()
    gates = scores.gather(1, forced)
    assert torch.allclose(routing.weights, gates / gates.sum(-1, keepdim=True))
    assert routing.counts.tolist() == [0, 0, 0, 0, 0, 0, 5, 5]
    groups = scores.view(5, 4, 2).sum(-1)  # group score: the sum of its top-2 (both) experts
    kept = groups.topk(2, dim=-1)[1]
    candidates = scores.view(5, 4, 2).gather(1, kept[:, :, None].expand(5, 2, 2)).reshape(5, 4).sort(-1, True)[0]
    group_gap = groups.sort(-1, descending=True)[0]
    expected = torch.minimum(candidates[:, 1] - candidates[:, 2], group_gap[:, 1] - group_gap[:, 2])
    assert torch.allclose(margin, expected)
