"""Pipeline parallelism on CPU gloo ranks: shardwise's executor vs. torch.distributed.pipelining.

The same stages (shardwise's own model chunks, built from the same seeded global weights) and the
same microbatches (the Trainer's loader, step 0) run through three pairs of schedules:

  shardwise schedule            torch.distributed.pipelining peer           stages per rank
  ----------------------------  ------------------------------------------  ---------------
  1f1b                          Schedule1F1B                                1
  interleaved (vp=2)            ScheduleInterleaved1F1B                     2 (loop layout)
  zb (ZB-H1: 1F1B + split W)    ScheduleInterleavedZeroBubble, 1 stage/rank 1
  dualpipev (--dualpipev)       ScheduleDualPipeV                           2 (V layout)

ScheduleInterleavedZeroBubble with one stage per rank is ZB1P at v=1, i.e. ZB-H1: the F/B order of
1F1B with rank r holding back r weight-gradient passes, the same action lists shardwise's `zb`
builds. torch splits dI and dW with two autograd calls over a retained graph
(stage_backward_input / stage_backward_weight); shardwise keeps (input, grad_output) of every
linear in its WeightGradStore during B and runs the dW matmuls in W.

Both sides compute the loss as shardwise's Trainer does: the per-token cross-entropy summed and
divided by the step's token count, per microbatch, so gradients are not rescaled
(`scale_grads=False` for torch). The torch stage module wraps a shardwise StageChunk and registers
the chunk's own modules, so the forward code is identical; only the pipeline machinery differs.
Every model is its own copy (the zb model has the deferred-W linears, the torch models do not).

Timing: after a warm-up, every repetition runs each pair back to back (who goes first alternates,
the pairs' order rotates), each run after a barrier; a run's time is the slower rank's wall time of
one forward+backward of the whole step (shardwise: `executor.run`; torch: `schedule.step`), no
optimizer. Medians, ratios of medians and paired per-repetition ratios (the same background load
on both sides: trust these more on a shared machine) are printed.

Bubbles (shardwise), medians over the timed repetitions of:
  measured             1 - busy / (p * makespan) from the executor's per-action events;
  simulated            `simulate(schedule, mean F, mean B, mean W)` with that repetition's mean cost per
                       kind over all ranks (what `shardwise train` writes to summary.json);
  analytic             the textbook formula (None for zb / dualpipev);
  simulated_per_stage  the same dependencies with each rank's own mean cost per kind (the last
                       stage's LM head + loss make it the slow one);
  replayed             every action at its own measured duration, zero communication time;
  late_receive         idle time before actions whose cross-rank input was sent before the rank was
                       free, i.e. spent only in the executor's receive path.
measured - replayed is what the executor and the transport add; simulated_per_stage - simulated is
stage imbalance, which a mean-cost simulation cannot see.


The last stdout line is one JSON object: medians_s, ratios, bubbles, paired_ratios, cpu_paired_ratios
(CPU seconds of all ranks, paired), page_faults (minor page faults per step, median, per rank: memory
freshly mapped), breakdown (`--breakdown`: per rank, per category), loss_diff,
max_grad_diff, config.

    python benchmarks/pp_peers.py                 # pp=2, m=8, dim 256, 8 layers, seq 128, mb 2
    python benchmarks/pp_peers.py --dualpipev     # + shardwise dualpipev vs ScheduleDualPipeV
    python benchmarks/pp_peers.py --pp 4 --reps 6 # 4 ranks on 2 cores: ranks share cores, bubbles are not meaningful
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from shardwise.data import load_tokens  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402
from shardwise.rules.schedule_check import analytic_bubble, measured_bubble, simulate  # noqa: E402
from shardwise.data import IGNORE_INDEX  # noqa: E402
from shardwise.training.trainer import Trainer, make_mesh  # noqa: E402

PAIRS = {  # key -> (shardwise schedule, vp, torch schedule class name)
    "1f1b": ("1f1b", 1, "Schedule1F1B"),
    "interleaved": ("interleaved", 2, "ScheduleInterleaved1F1B"),
    "zb": ("zb", 1, "ScheduleInterleavedZeroBubble"),
    "dualpipev": ("dualpipev", 2, "ScheduleDualPipeV"),
}
SMOKE = {"m": 4, "mb": 1, "dim": 64, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 128, "seq": 32, "reps": 1,
         "warmup": 0, "dualpipev": True, "breakdown": True}


class TorchStageModule(nn.Module):
    """A shardwise StageChunk as a torch pipelining submodule: same forward, its own parameters registered."""

    def __init__(self, chunk):
        super().__init__()
        model = chunk._model[0]
        self._chunk = [chunk]  # not registered: the chunk holds the whole (pruned) model
        self.layers = nn.ModuleList(model.layers[str(i)] for i in chunk.layer_ids)
        self.tok_embeddings = model.tok_embeddings if chunk.first else None
        self.norm = model.norm if chunk.last else None
        self.output = model.output if chunk.last else None

    def forward(self, x):
        return self._chunk[0](x)


def make_cfg(opts: dict, schedule: str, vp: int) -> TrainConfig:
    m = ModelConfig(name="bench", dim=opts["dim"], n_layers=opts["layers"], n_heads=opts["heads"],
                    n_kv_heads=opts["kv_heads"], ffn_dim=opts["ffn"], max_seq_len=opts["seq"])
    cfg = TrainConfig(model=m, parallel=ParallelConfig(pp=opts["pp"], schedule=schedule, vp=vp),
                      seq_len=opts["seq"], micro_batch=opts["mb"], global_batch=opts["mb"] * opts["m"],
                      seed=opts["seed"], progress=False, timeout_s=120.0)
    cfg.resolve_world(opts["pp"])
    return cfg


class ShardwiseRunner:
    def __init__(self, opts, mesh, tokens, schedule, vp):
        self.trainer = Trainer(make_cfg(opts, schedule, vp), mesh, tokens)
        self.model = self.trainer.model

    def step(self, xs, ys, n_tokens) -> float:
        return float(self.trainer.executor.run(xs, ys, n_tokens))


class TorchRunner:
    def __init__(self, opts, mesh, tokens, schedule, vp, cls_name):
        import torch.distributed.pipelining as pipelining

        # The plain-linear model of the same stage layout (the zb peer must not use the deferred-W linears).
        plain = {"zb": "1f1b", "dualpipev": "dualpipev"}.get(schedule, schedule)
        tr = self.trainer = Trainer(make_cfg(opts, plain, vp), mesh, tokens)
        if tr.model.grad_store is not None:
            for m in tr.model.modules():
                if hasattr(m, "grad_store"):
                    m.grad_store = None
        self.model, lay = tr.model, tr.schedule.layout
        pp = mesh["pp"]
        self.stages = [pipelining.PipelineStage(TorchStageModule(ch), lay.stage_of(pp.rank, c), lay.num_stages,
                                                mesh.device, group=pp.group)
                       for c, ch in enumerate(tr.model.chunks)]
        self.has_first = any(s.is_first for s in self.stages)
        self.has_last = any(s.is_last for s in self.stages)
        self.n_tokens = 1
        loss_model = tr.model

        def loss_fn(logits, y):
            return loss_model.loss_fn(logits, y, IGNORE_INDEX).sum() / self.n_tokens

        cls = getattr(pipelining, cls_name)
        stages = self.stages[0] if cls_name == "Schedule1F1B" else self.stages
        self.sched = cls(stages, n_microbatches=opts["m"], loss_fn=loss_fn, scale_grads=False)

    def step(self, x, y, n_tokens) -> float:
        self.n_tokens = n_tokens
        losses: list = []
        args = (x,) if self.has_first else ()
        kw = dict(target=y, losses=losses) if self.has_last else {}
        self.sched.step(*args, **kw, return_outputs=False)
        return float(sum(loss.detach() for loss in losses)) if losses else 0.0


class Breakdown:
    """Per-category wall and thread-CPU seconds of one run on this rank (`--breakdown`): the chunks' forward, the
    loss, the autograd backward (with the gradient hooks inside it), posting p2p, waiting on p2p; `other` is the
    rest of the step (the executor's or torch's own Python). Wrappers are the same on both sides."""

    CATS = ("forward", "loss", "backward", "p2p_post", "p2p_wait")

    def __init__(self):
        self.acc: dict[str, list[float]] = {}
        self.depth = 0

    def wrap(self, cat: str, fn):
        def timed(*a, **k):
            if self.depth:  # the outermost category owns nested time (a loss inside a forward, etc.)
                return fn(*a, **k)
            self.depth += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                e = self.acc.setdefault(cat, [0.0, 0.0])
                e[0] += time.perf_counter() - t0
                e[1] += time.thread_time() - c0
                self.depth -= 1
        return timed

    def install(self) -> None:
        import torch.distributed.pipelining.schedules as ts

        import shardwise.comm as comm
        import shardwise.pipeline.runtime as runtime
        from shardwise.models.llama import Transformer
        from shardwise.pipeline.stage import StageChunk

        comm.p2p = self.wrap("p2p_post", comm.p2p)
        comm.wait, comm.wait_all = self.wrap("p2p_wait", comm.wait), self.wrap("p2p_wait", comm.wait_all)
        ts._batch_p2p, ts._wait_batch_p2p = self.wrap("p2p_post", ts._batch_p2p), self.wrap("p2p_wait", ts._wait_batch_p2p)
        StageChunk.forward = self.wrap("forward", StageChunk.forward)
        Transformer.loss_fn = self.wrap("loss", Transformer.loss_fn)
        engine, wrap = torch.autograd.Variable._execution_engine, self.wrap

        class Engine:  # torch.autograd.backward (torch's stages) and the executor's run_backward both land here
            run_backward = staticmethod(wrap("backward", engine.run_backward))

            def __getattr__(self, name):
                return getattr(engine, name)

        runtime._ENGINE = torch.autograd.Variable._execution_engine = Engine()

    def take(self, wall: float, cpu: float) -> dict:
        row = {c: tuple(self.acc.get(c, (0.0, 0.0))) for c in self.CATS}
        row["other"] = (wall - sum(v[0] for v in row.values()), cpu - sum(v[1] for v in row.values()))
        self.acc = {}
        return row


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rank_main(opts: dict) -> dict:
    warnings.filterwarnings("ignore")
    breakdown = Breakdown() if opts["breakdown"] else None
    if breakdown is not None:
        breakdown.install()
    torch.manual_seed(0)
    cfg0 = make_cfg(opts, "1f1b", 1)
    mesh = make_mesh(cfg0, torch.device("cpu"))
    pp = mesh["pp"]
    tokens = load_tokens(None)
    keys = [k for k in PAIRS if (k != "dualpipev" or opts["dualpipev"]) and (not opts["only"] or k in opts["only"])]
    runners, names = {}, []
    for k in keys:
        sched, vp, cls_name = PAIRS[k]
        runners[f"shardwise_{k}"] = ShardwiseRunner(opts, mesh, tokens, sched, vp)
        runners[f"torch_{k}"] = TorchRunner(opts, mesh, tokens, sched, vp, cls_name)
        names += [f"shardwise_{k}", f"torch_{k}"]

    x, y = runners[names[0]].trainer.loader.global_batch_at(0)  # the same global batch for everyone
    n_tokens = int((y != IGNORE_INDEX).sum())
    xs, ys = list(x.split(opts["mb"])), list(y.split(opts["mb"]))

    def run(name) -> float:
        r = runners[name]
        # The reducer's hooks count each step's backward passes: a step that is never reduced is dropped
        # through the reducer (model.zero_grad would leave its count at the previous step's rounds).
        r.trainer.reducer.zero_grad()
        if isinstance(r, ShardwiseRunner):
            return r.step(xs, ys, n_tokens)
        return r.step(x, y, n_tokens)

    # Correctness: the pp-summed loss and every local gradient of each pair.
    check = {}
    for k in keys:
        out = {}
        for side in ("shardwise", "torch"):
            loss = torch.tensor([run(f"{side}_{k}")])
            dist.all_reduce(loss, group=pp.group)
            out[side] = (float(loss), _grads(runners[f"{side}_{k}"].model))
        gs, gt = out["shardwise"][1], out["torch"][1]
        missing = sorted(set(gs) ^ set(gt))
        gdiff = max(((gs[n] - gt[n]).abs().max().item() for n in gs if n in gt), default=float("nan"))
        check[k] = {"loss_shardwise": out["shardwise"][0], "loss_torch": out["torch"][0],
                    "loss_diff": abs(out["shardwise"][0] - out["torch"][0]), "max_grad_diff": gdiff,
                    "grads_missing": missing}

    times: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}  # this rank's CPU seconds per run (gloo's threads too)
    parts: dict[str, list[dict]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}  # this rank's minor page faults per run (fresh memory)
    events: dict[str, list] = {n: [] for n in names if isinstance(runners[n], ShardwiseRunner)}
    groups = [[n for n in names if n.endswith(f"_{k}")] for k in keys]  # the implementations compared
    for it in range(opts["warmup"] + opts["reps"]):
        # A pair runs back to back (so a paired ratio sees one background load), who goes first
        # alternates within the pair, and the pairs' order rotates.
        order = []
        for g in groups[it % len(groups):] + groups[:it % len(groups)]:
            order += g[it % len(g):] + g[:it % len(g)]
        for name in order:
            dist.barrier(group=pp.group)
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            run(name)
            dt, dc, dp = time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0
            if it >= opts["warmup"]:
                times[name].append(dt)
                cpus[name].append(dp)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                if breakdown is not None:
                    parts[name].append(breakdown.take(dt, dc))
                if name in events:
                    events[name].append(list(runners[name].trainer.executor.clock.events()))

    prof = None
    if opts["profile"]:
        prof = profile_tables(names, run, opts)
    peaks = {n: runners[n].trainer.executor.peak_inflight for n in events}
    return {"times": times, "cpus": cpus, "faults": faults, "parts": parts, "events": events, "check": check, "peaks": peaks, "profile": prof,
            "rank": pp.rank}


def profile_tables(names, run, opts) -> dict:
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in names:
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(3):
                dist.barrier()
                run(name)
        out[name] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=opts["profile_rows"])
    return out


# ---------------------------------------------------------------- driver
def replay(schedule, durations: list[list[float]], comm: float = 0.0) -> float:
    """Bubble of `schedule` when every action takes its own measured duration (zero comm by default).

    Same dependency rules as shardwise.rules.schedule_check (F(k) after F(k-1); B(k) after F(k) and
    B(k+1); W after B), but `durations[r][i]` is the time rank r's i-th action really took, so stage
    imbalance (the last stage's LM head and loss) and per-microbatch jitter are kept; what is left
    between this and the measured bubble is communication latency plus executor overhead.
    """
    lay, last = schedule.layout, schedule.num_stages - 1
    done: dict[tuple, tuple[float, int]] = {}
    clock, nxt = [0.0] * schedule.p, [0] * schedule.p
    busy = sum(map(sum, durations))
    left = busy and sum(len(a) for a in schedule.actions)
    while left:
        moved = False
        for r, ops in enumerate(schedule.actions):
            while nxt[r] < len(ops):
                a = ops[nxt[r]]
                k = lay.stage_of(r, a.chunk)
                deps = {"F": [("F", k - 1, a.microbatch)] if k else [],
                        "B": [("F", k, a.microbatch)] + ([("B", k + 1, a.microbatch)] if k < last else []),
                        "W": [("B", k, a.microbatch)]}[a.kind]
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d][0] + (comm if done[d][1] != r else 0.0) for d in deps])
                clock[r] = start + durations[r][nxt[r]]
                done[(a.kind, k, a.microbatch)] = (clock[r], r)
                nxt[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError(f"replay of {schedule.name} is stuck")
    makespan = max(clock)
    return 1.0 - busy / (schedule.p * makespan) if makespan > 0 else 0.0


def late_receive_gaps(schedule, events: list[list[dict]]) -> tuple[float, int]:
    """Idle time before actions whose cross-rank input had been produced before the rank was free.

    The data was ready, so the gap is the executor's receive path alone (post the irecv, gloo's
    rendezvous round trip through the sender, wait). Returns (total seconds over ranks, count).
    """
    lay, last = schedule.layout, schedule.num_stages - 1
    end = {(e["kind"], lay.stage_of(r, e["chunk"]), e["microbatch"]): (e["end"], r)
           for r, evs in enumerate(events) for e in evs}
    total, n = 0.0, 0
    for r, evs in enumerate(events):
        for prev, e in zip(evs, evs[1:]):
            k = lay.stage_of(r, e["chunk"])
            dep = (end[("F", k - 1, e["microbatch"])] if e["kind"] == "F" and k > 0 else
                   end[("B", k + 1, e["microbatch"])] if e["kind"] == "B" and k < last else None)
            if dep is not None and dep[1] != r and dep[0] <= prev["end"]:
                total += max(0.0, e["start"] - prev["end"])
                n += 1
    return total, n


def bubble_report(opts, per_rank, name, key) -> dict:
    from shardwise.rules.schedules import build_schedule

    sched_name, vp, _ = PAIRS[key]
    sched = build_schedule(sched_name, opts["pp"], opts["m"], vp)
    rows = []
    for rep in range(opts["reps"]):
        ev = [r["events"][name][rep] for r in per_rank]
        dur = [[e["end"] - e["start"] for e in evs] for evs in ev]
        costs = {k: [d for evs, ds in zip(ev, dur) for e, d in zip(evs, ds) if e["kind"] == k] for k in "FBW"}
        mean = {k: sum(v) / len(v) for k, v in costs.items() if v}
        per_rank_mean = []  # every action at its own rank's mean cost of its kind
        for evs, ds in zip(ev, dur):
            by = {k: statistics.fmean([d for e, d in zip(evs, ds) if e["kind"] == k] or [0.0]) for k in "FBW"}
            per_rank_mean.append([by[e["kind"]] for e in evs])
        late, n_late = late_receive_gaps(sched, ev)
        makespan = max(e["end"] for evs in ev for e in evs) - min(e["start"] for evs in ev for e in evs)
        rows.append({"measured": measured_bubble(ev),
                     "simulated": simulate(sched, mean["F"], mean["B"], mean.get("W", 0.0)).bubble_fraction,
                     "simulated_per_stage": replay(sched, per_rank_mean), "replayed": replay(sched, dur),
                     "late_recv_share": late / (sched.p * makespan), "late_recv_n": n_late,
                     "late_recv_s": late, "mean": mean})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "mean"}
    out = {"measured": med["measured"], "simulated": med["simulated"],
           "analytic": analytic_bubble(sched.name, sched.p, sched.m, sched.v),
           "simulated_per_stage": med["simulated_per_stage"], "replayed": med["replayed"]}
    for k in ("simulated", "simulated_per_stage", "replayed"):
        out[f"measured_vs_{k}_rel"] = (med["measured"] - med[k]) / med[k] if med[k] else None
    out["late_receive"] = {"share_of_rank_time": med["late_recv_share"], "per_step_s": med["late_recv_s"],
                           "count": med["late_recv_n"]}
    out["mean_action_s"] = {k: statistics.median(r["mean"][k] for r in rows) for k in rows[0]["mean"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    ap.add_argument("--m", type=int, default=8, help="microbatches per step")
    ap.add_argument("--mb", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=12, help="timed repetitions per implementation")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dualpipev", action="store_true", help="also run shardwise dualpipev vs ScheduleDualPipeV")
    ap.add_argument("--only", type=lambda v: v.split(","), default=None,
                    help=f"comma-separated subset of {','.join(PAIRS)}")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table per implementation (rank 0)")
    ap.add_argument("--profile-rows", type=int, default=15)
    ap.add_argument("--breakdown", action="store_true",
                    help="per rank and implementation: forward, loss, backward, p2p post, p2p wait, other (wall, CPU)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, one repetition, every pair: the test of the script")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    opts = vars(args)
    if args.layers % (2 * args.pp):
        ap.error(f"--layers {args.layers} must be divisible by 2 x pp = {2 * args.pp} (interleaved vp=2)")
    if args.m % args.pp:
        ap.error(f"--m {args.m} must be a multiple of pp={args.pp} (interleaved)")

    t_start = time.perf_counter()
    per_rank = run_local(rank_main, args.pp, opts, timeout_s=300.0)
    wall = time.perf_counter() - t_start
    keys = list(per_rank[0]["check"])
    names = list(per_rank[0]["times"])
    print(f"model dim={args.dim} layers={args.layers} heads={args.heads}/{args.kv_heads} ffn={args.ffn} "
          f"seq={args.seq}; pp={args.pp} gloo ranks x 1 thread, m={args.m} microbatches of {args.mb}; "
          f"{args.warmup} warm-up + {args.reps} reps; torch {torch.__version__}")
    print("correctness (pp-summed loss; worst local gradient over ranks):")
    loss_diff, grad_diff = {}, {}
    for k in keys:
        c = per_rank[0]["check"][k]
        gd = max(r["check"][k]["max_grad_diff"] for r in per_rank)
        missing = sorted({n for r in per_rank for n in r["check"][k]["grads_missing"]})
        loss_diff[k], grad_diff[k] = c["loss_diff"], gd
        flag = "" if c["loss_diff"] < 1e-5 and gd < 1e-5 and not missing else "  <-- MISMATCH"
        print(f"  {k:12s} loss shardwise {c['loss_shardwise']:.6f} torch {c['loss_torch']:.6f} "
              f"diff {c['loss_diff']:.1e}  max|dgrad| {gd:.1e}{flag}"
              + (f"  grads only on one side: {missing}" if missing else ""))
    steps = {n: [max(ts) for ts in zip(*(r["times"][n] for r in per_rank))] for n in names}
    medians = {n: statistics.median(v) for n, v in steps.items()}
    print("step time (forward+backward of the whole step, slower rank):")
    for n in names:
        q = statistics.quantiles(steps[n], n=4) if len(steps[n]) > 1 else [steps[n][0]] * 3
        print(f"  {n:22s} median {medians[n] * 1e3:8.1f} ms  (min {min(steps[n]) * 1e3:.1f}, "
              f"p25 {q[0] * 1e3:.1f}, p75 {q[2] * 1e3:.1f})")

    def paired_ratio(a, b):  # same repetition, same background load
        return statistics.median(x / y for x, y in zip(steps[a], steps[b]))

    ratios = {f"vs_torch_{k}": medians[f"shardwise_{k}"] / medians[f"torch_{k}"] for k in keys}
    paired = {f"vs_torch_{k}": paired_ratio(f"shardwise_{k}", f"torch_{k}") for k in keys}
    # CPU seconds of all ranks per run: what the machine's other load moves least.
    cpu = {n: [sum(c) for c in zip(*(r["cpus"][n] for r in per_rank))] for n in names}
    cpu_paired = {f"vs_torch_{k}": statistics.median(a / b for a, b in zip(cpu[f"shardwise_{k}"], cpu[f"torch_{k}"]))
                  for k in keys}
    for k in keys:
        r, pr = ratios[f"vs_torch_{k}"], paired[f"vs_torch_{k}"]
        print(f"  shardwise/torch {k:12s} ratio of medians {r:.3f}, paired {pr:.3f} "
              f"({'faster' if pr < 1 else 'slower'}); CPU seconds of all ranks, paired {cpu_paired[f'vs_torch_{k}']:.3f}")
    faults = {n: [statistics.median(r["faults"][n]) for r in per_rank] for n in names}
    print("minor page faults per step, median, rank 0 / 1 / ...: " + "; ".join(
        f"{n} {' / '.join(f'{f:.0f}' for f in faults[n])}" for n in names))
    breakdown = {}
    if opts["breakdown"]:
        print("breakdown per rank, median ms per step, wall / thread CPU (other: the schedule's own Python and the "
              "rest of the step):")
        for n in names:
            breakdown[n] = []
            for rank, r in enumerate(per_rank):
                med = {c: [statistics.median(row[c][0] for row in r["parts"][n]),
                           statistics.median(row[c][1] for row in r["parts"][n])] for c in r["parts"][n][0]}
                breakdown[n].append(med)
                print(f"  {n:22s} rank {rank}: " + "  ".join(f"{c} {w * 1e3:.1f}/{c_ * 1e3:.1f}"
                                                            for c, (w, c_) in med.items()))
    bubbles = {}
    print("shardwise bubble, median over reps. simulated: that rep's mean F/B/W over all ranks (as `shardwise\n"
          "  train`); per-stage: each rank's own mean F/B/W; replayed: every action at its measured duration;\n"
          "  late recv: idle while receiving data that was already sent (share of p x makespan):")
    for n in names:
        if n not in per_rank[0]["events"]:
            continue
        k = n.split("_", 1)[1]
        b = bubble_report(opts, per_rank, n, k)
        b["peak_inflight_per_stage"] = [r["peaks"][n] for r in per_rank]
        if n.startswith("shardwise"):
            bubbles[k] = b
        else:
            bubbles[n] = b
        an = "  n/a" if b["analytic"] is None else f"{b['analytic']:.3f}"
        lr = b["late_receive"]
        print(f"  {n:22s} measured {b['measured']:.3f}  simulated {b['simulated']:.3f} "
              f"({b['measured_vs_simulated_rel']:+.0%})  analytic {an}  per-stage {b['simulated_per_stage']:.3f} "
              f"({b['measured_vs_simulated_per_stage_rel']:+.0%})  replayed {b['replayed']:.3f} "
              f"({b['measured_vs_replayed_rel']:+.0%})  late recv {lr['share_of_rank_time']:.3f} "
              f"({lr['count']:.0f} x, {lr['per_step_s'] * 1e3:.1f} ms)")
    print("  mean action s: " + "; ".join(
        f"{k} " + " ".join(f"{kk}={v * 1e3:.1f}ms" for kk, v in b["mean_action_s"].items())
        for k, b in bubbles.items()))
    if per_rank[0]["profile"]:
        for n, table in per_rank[0]["profile"].items():
            print(f"\n=== profile: {n} (rank 0, 3 steps) ===\n{table}")
    print(f"total wall {wall:.1f} s")
    config = {"pp": args.pp, "m": args.m, "micro_batch": args.mb, "dim": args.dim, "n_layers": args.layers,
              "n_heads": args.heads, "n_kv_heads": args.kv_heads, "ffn_dim": args.ffn, "seq": args.seq,
              "reps": args.reps, "warmup": args.warmup, "threads_per_rank": 1, "torch": torch.__version__,
              "mapping": {k: f"shardwise {PAIRS[k][0]} (vp={PAIRS[k][1]}) vs torch {PAIRS[k][2]}" for k in keys}}
    print(json.dumps({"medians_s": medians, "ratios": ratios, "bubbles": bubbles, "paired_ratios": paired,
                      "cpu_paired_ratios": cpu_paired, "page_faults": faults, "breakdown": breakdown,
                      "loss_diff": loss_diff, "max_grad_diff": grad_diff, "config": config}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
