"""Host reads per training step, counted by `shardwise.host` and held to a budget.

One 2-rank fork trains four layouts with `train_main` and reads `host_syncs_per_step` from summary.json:
dense (dp2, ZeRO-1) and pp2 read the loss and the clipped grad norm together, once; cp2 with document
masks adds the document plan, once per microbatch; MoE (ep2) adds the split sizes, once per MoE layer
and microbatch — under full recompute too (the recomputation reuses its forward's). Before, the loss, the norm and each MoE metric were read separately, and the step timer
waited for the step's end.
"""
from __future__ import annotations

import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.training.step_timer import StepTimer

from _dist import fresh_seed, run_ranks


def _train(root: str, seed: int):
    from shardwise.training.loop import train_main

    runs = {"dense": (dict(dp=2, zero=1), {}), "pp": (dict(pp=2), {}),
            "cp_doc": (dict(cp=2), dict(attention_mask="document")),
            "moe": (dict(dp=2, ep=2), dict(model="tiny-moe", global_batch=8)),
            "moe_full": (dict(dp=2, ep=2, recompute="full"), dict(model="tiny-moe", global_batch=8))}
    out = {}
    for name, (par, kw) in runs.items():
        cfg = TrainConfig(**({"model": "tiny", "global_batch": 4} | kw), parallel=ParallelConfig(**par), steps=3,
                          seq_len=32, micro_batch=2, seed=seed, progress=False, report=False, out=f"{root}/{name}")
        cfg = cfg.resolved()
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
    # full recompute: the recomputed forward reuses each microbatch's split sizes (no second read per layer)
    assert out["moe_full"][:2] == out["moe"][:2], (out["moe_full"], out["moe"], seed)


def test_recompute_that_routes_differently_fails_loudly():
    """The split sizes a full-recompute replay reuses are checked against what it routes: a recomputation that
    would route differently (here: the selection bias changed between forward and backward) raises."""
    import pytest

    from shardwise.config import get_model_config
    from shardwise.parallelize import plain_model
    from shardwise.recompute import apply_recompute

    torch.manual_seed(0)
    model = plain_model(get_model_config("tiny-moe", n_layers=1))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.chunks = None  # one unpipelined chunk (what build_model sets without PP)
    apply_recompute(model, "full")
    moe = model.layers["0"].feed_forward
    moe.router.expert_bias.zero_()
    model(torch.randint(0, 64, (2, 16))).sum().backward()  # same routing: replays without a read
    out = model(torch.randint(0, 64, (2, 16))).sum()
    moe.router.expert_bias[0] = 1e3  # every token now picks expert 0 first
    with pytest.raises(RuntimeError, match="MoE recompute routed differently from its forward"):
        out.backward()


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


def test_grouped_gemm_runs_in_the_autocast_dtype_with_device_offsets(monkeypatch):
    """Under bf16 autocast the experts' grouped GEMM gets bf16 rows and weights (on sm90 only bf16 runs
    fused; fp32 falls back to a host copy of the offsets and a per-expert loop) and offsets computed on
    the device from the dispatcher's counts, never `torch.tensor(list, device=...)`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardwise.expert_parallel.experts import GroupedExperts, grouped_mm_available
    from shardwise.mesh import Axis
    from shardwise.simulate.world import StandIns

    experts = GroupedExperts(4, 16, 32, Axis("ep"), grouped_mm=True)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.1)
    seen, real = [], torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append((a.dtype, b.dtype, offs.tolist()))
        return real(a, b, offs=offs, **kw)

    def no_list_copy(*a, **kw):
        raise AssertionError("offsets copied from a host list")

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    rows, counts = torch.randn(10, 16), [3, 0, 5, 2]
    device_counts = torch.tensor(counts)
    with monkeypatch.context() as m, torch.autocast("cpu", dtype=torch.bfloat16):
        m.setattr(torch, "tensor", no_list_copy)
        out = experts(rows, counts, device_counts)
    assert out.dtype == torch.float32 and len(seen) == 3
    assert all(a == b == torch.bfloat16 and offs == [3, 3, 8, 10] for a, b, offs in seen), seen
    loop = GroupedExperts(4, 16, 32, Axis("ep"), grouped_mm=False)
    loop.load_state_dict(experts.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loop(rows, counts)
    assert torch.allclose(out, want.float(), atol=2e-2, rtol=2e-2)
    x, w = torch.empty(8, 16), torch.empty(4, 32, 16)
    assert grouped_mm_available(x, w)  # fp32 runs fused on CPU
    with FakeTensorMode(), StandIns(answers=None):  # simulation: its stand-in says the fake kernel's bf16 only
        x, w = torch.empty(8, 16), torch.empty(4, 32, 16)
        assert not grouped_mm_available(x, w)
        assert grouped_mm_available(x.bfloat16(), w.bfloat16())


def test_a_host_read_is_counted_and_answerable_without_its_data():
    """`host.read` counts by call site; a TorchFunctionMode may answer it (as the simulator's stand-ins do)
    without touching the tensor, and the count is the same either way."""
    from torch.overrides import TorchFunctionMode

    from shardwise import host

    class Answer(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is host.values:
                return f"answered {args[1]}"
            return func(*args, **(kwargs or {}))

    host.reset()
    assert host.read(torch.tensor([1, 2]), "real") == [1, 2] and host.read(torch.tensor(3.0), "real") == 3.0
    with Answer():
        assert host.read(torch.empty(2, device="meta"), "stand-in") == "answered stand-in"
    assert host.counts() == {"real": 2, "stand-in": 1} and host.count() == 3
