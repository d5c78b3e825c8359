"""MoE training end to end: auxiliary-loss-free balancing lowers the max/mean expert load."""
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
