"""Host reads per training step, counted by `shardwise.host` and held to a budget.

One 2-rank fork trains four layouts with `train_main` and reads `host_syncs_per_step` from summary.json:
dense (dp2, ZeRO-1) and pp2 read the loss and the clipped grad norm together, once; cp2 with document
masks adds the document plan, once per microbatch; MoE (ep2) adds the split sizes, once per MoE layer
and microbatch. Before, the loss, the norm and each MoE metric were read separately, and the step timer
waited for the step's end.
"""
from __future__ import annotations

import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.train import StepTimer

from _dist import fresh_seed, run_ranks


def _train(root: str, seed: int):
    from shardwise.train import train_main

    runs = {"dense": (dict(dp=2, zero=1), {}), "pp": (dict(pp=2), {}),
            "cp_doc": (dict(cp=2), dict(attention_mask="document")),
            "moe": (dict(dp=2, ep=2), dict(model="tiny-moe", global_batch=8))}
    out = {}
    for name, (par, kw) in runs.items():
        cfg = TrainConfig(**({"model": "tiny", "global_batch": 4} | kw), parallel=ParallelConfig(**par), steps=3,
                          seq_len=32, micro_batch=2, seed=seed, progress=False, report=False, out=f"{root}/{name}")
        cfg.resolve_world()
        s = train_main(cfg)
        if s:
            mc = cfg.model_config()
            out[name] = (s["host_syncs_per_step"], s["host_syncs_by_site"], cfg.grad_accum,
                         sum(mc.is_moe_layer(i) for i in range(mc.n_layers)))
    return out


def test_host_syncs_per_step_within_budget(tmp_path):
    seed = fresh_seed()
    out = run_ranks(2, _train, str(tmp_path), seed)[0]
    for name in ("dense", "pp"):
        syncs, sites, _, _ = out[name]
        assert syncs <= 2 and sites == {"loss+norm": 1}, (name, out[name], seed)
    syncs, sites, m, _ = out["cp_doc"]
    assert syncs <= 1 + m and sites == {"loss+norm": 1, "cp document plan": m}, (out["cp_doc"], seed)
    syncs, sites, m, layers = out["moe"]
    assert m == 2 and layers > 1, out["moe"]
    assert syncs <= layers * m + 2 and sites == {"loss+norm": 1, "moe split sizes": layers * m}, (out["moe"], seed)


class _Event:
    def __init__(self, log):
        self.log, self.t = log, None

    def record(self):
        self.t = len(self.log) * 10.0
        self.log.append("record")

    def synchronize(self):
        self.log.append("sync")

    def elapsed_time(self, end):
        return end.t - self.t


def test_step_timer_reads_device_events_a_step_late(monkeypatch):
    log = []
    timer = StepTimer(torch.device("meta"))  # any non-CPU device takes the event path
    monkeypatch.setattr(timer, "_event", lambda: _Event(log))
    recs = [{}, {}]
    for rec in recs:
        timer.start()
        timer.stop(rec)
        assert rec["step_time_s"] is None
    assert log.count("sync") == 1 and recs[0]["step_time_s"] == 0.01  # step 1's end read at step 2's stop
    timer.flush()
    assert recs[1]["step_time_s"] == 0.01 and log.count("sync") == 2
