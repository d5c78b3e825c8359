"""Llama blocks, forward+backward under TP with sequence parallelism: --tp-overlap on/off × fused/unfused projections.

For each tp (2 and 4 by default) the same gloo ranks build four variants of the same seeded blocks
(`ParallelConfig(tp_overlap=..., fused_projections=...)`) and time one forward+backward of the blocks on
the same sequence shard, variants rotated per repetition after a barrier; a repetition's time is the slower rank's.
Beside the step time, each rank measures its *exposed* TP communication: the time spent inside a TP collective call
or waiting on one's handle (the guard in `comm` through which every collective and wait passes). The
overlap can only pay off where each rank has a core for its GEMMs and its collectives' progress threads; with fewer
free cores than that the output says so, and the exposed-communication fraction is the number to read, not the
speed-up.

Megatron-Core runs in the same ranks when it is installed (`pip install megatron-core --no-deps`): the same block
from its ColumnParallelLinear / RowParallelLinear with `sequence_parallel=True` (fused QKV and gate/up, the
sequence-first [s, b, h] shard its SP expects), holding the very weights of shardwise's variants. Its TP comm
overlap proper (`tp_comm_overlap`, TransformerEngine's userbuffers) needs CUDA; on CPU its layers run their built-in
SP overlap only: the backward re-gathers the input under the input-gradient GEMM and reduce-scatters that gradient
under the weight-gradient GEMM. Its exposed time is measured the same way, around the collectives and waits its
layers call. Megatron allocates its SP buffers on `torch.cuda.current_device()`: on a CPU-only torch the ranks
point that at "cpu".

Beside wall time each variant reports the CPU seconds of all its ranks' processes: on a box shared with other jobs the
wall time swings with their load, the CPU time much less (fused against unfused GEMMs is read there).

The last stdout line is one JSON object: medians, exposed fractions, "ratios" (overlap on/off, fused/unfused,
shardwise vs Megatron-Core), config, "absent" with the reason when Megatron-Core is not timed, and per tp the choice
`--tp-overlap-auto` makes for that layout on this host (`results.tpN.tp_overlap_auto`).

    python benchmarks/tp_overlap.py            # tp 2 and 4, dim 512, seq 512
    python benchmarks/tp_overlap.py --smoke    # a few seconds: tiny shapes, tp 2, 2 reps
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from shardwise.comm import Ledger  # noqa: E402
from shardwise.comm import collectives  # noqa: E402
from shardwise.config import ModelConfig, ParallelConfig  # noqa: E402
from shardwise.training.launch import run_local  # noqa: E402
from shardwise.mesh import Mesh  # noqa: E402
from shardwise.models.rope import apply_rope, rope_tables  # noqa: E402
from shardwise.parallelize import build_model  # noqa: E402
from shardwise.planner.tp_overlap import choose_for_run, cpu_host  # noqa: E402
from shardwise.tensor_parallel.fused import region_stored  # noqa: E402

VARIANTS = {"overlap_fused": (True, True), "overlap_unfused": (True, False),
            "plain_fused": (False, True), "plain_unfused": (False, False)}  # name: (tp_overlap, fused)


_GUARD = "guarded" if hasattr(collectives, "guarded") else "_guarded"  # its name before and after comm's split


class ExposedComm:
    """Seconds this rank spends inside TP collective calls and waits (wraps the one function they all go through,
    as `collectives` sees it)."""

    def __init__(self):
        self.seconds = 0.0
        self._inner = getattr(collectives, _GUARD)

    def __enter__(self):
        def timed(axis, what, fn, *args, **kwargs):
            if axis.name != "tp":
                return self._inner(axis, what, fn, *args, **kwargs)
            t0 = time.perf_counter()
            try:
                return self._inner(axis, what, fn, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(collectives, _GUARD, timed)
        return self

    def __exit__(self, *exc):
        setattr(collectives, _GUARD, self._inner)


class _TimedWork:
    """An async collective's handle whose wait() adds to the meter."""

    def __init__(self, work, meter):
        self.work, self.meter = work, meter

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.meter.seconds += time.perf_counter() - t0


class MegatronComm:
    """Seconds this rank spends inside the collectives Megatron-Core's TP layers call, and in their waits."""

    NAMES = ("dist_all_gather_func", "dist_reduce_scatter_func")

    def __init__(self):
        from megatron.core.tensor_parallel import layers, mappings

        self.seconds, self.modules, self.saved = 0.0, (layers, mappings), []

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
            return _TimedWork(out, self) if out is not None else None
        return call

    def __enter__(self):
        for mod in self.modules:
            for name in self.NAMES:
                self.saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, self._timed(getattr(mod, name)))
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self.saved):
            setattr(mod, name, fn)
        self.saved.clear()


class MegatronSPBlock(nn.Module):
    """The benchmark's block from Megatron-Core's TP linears with sequence parallelism, on [s/tp, b, h] shards.

    Weights are this rank's shards of a shardwise block (fused [q_r; k_r; v_r] and [gate_r; up_r], Megatron's own
    GPT layout), so its output is comparable with the shardwise variants'."""

    def __init__(self, cfg: ModelConfig, block: nn.Module, group, tp: int):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        torch.cuda.current_device = lambda: "cpu"  # Megatron allocates its SP buffers there (CPU-only torch here)
        if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
            parallel_state._set_global_memory_buffer()
        mcfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True, use_cpu_initialization=True,
                                   perform_initialization=False, params_dtype=torch.float32)
        kw = dict(config=mcfg, init_method=nn.init.zeros_, bias=False, tp_group=group)
        a, m = block.attention, block.feed_forward
        self.hd, self.nq, self.nkv = cfg.head_dim, a.wq.weight.shape[0], a.wk.weight.shape[0]
        h, hd = cfg.dim, cfg.head_dim
        self.linear_qkv = ColumnParallelLinear(h, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, gather_output=False, **kw)
        self.linear_proj = RowParallelLinear(cfg.n_heads * hd, h, input_is_parallel=True, skip_bias_add=False, **kw)
        self.linear_fc1 = ColumnParallelLinear(h, 2 * cfg.ffn_dim, gather_output=False, **kw)
        self.linear_fc2 = RowParallelLinear(cfg.ffn_dim, h, input_is_parallel=True, skip_bias_add=False, **kw)
        with torch.no_grad():
            self.linear_qkv.weight.copy_(torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]))
            self.linear_fc1.weight.copy_(torch.cat([m.w1.weight, m.w3.weight]))
            self.linear_proj.weight.copy_(a.wo.weight)
            self.linear_fc2.weight.copy_(m.w2.weight)
        self.attention_norm, self.ffn_norm = block.attention_norm, block.ffn_norm

    def forward(self, x, cos, sin):
        """x [s/tp, b, h] → [s/tp, b, h]."""
        q, k, v = self.linear_qkv(self.attention_norm(x))[0].split([self.nq, self.nkv, self.nkv], dim=-1)
        s, b = q.shape[:2]

        def heads(t):
            return t.transpose(0, 1).reshape(b, s, -1, self.hd)

        q = apply_rope(heads(q), cos, sin).transpose(1, 2)
        k = apply_rope(heads(k), cos, sin).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, heads(v).transpose(1, 2), is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        x = x + self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))[0]
        gate, up = self.linear_fc1(self.ffn_norm(x))[0].chunk(2, dim=-1)
        return x + self.linear_fc2(F.silu(gate) * up)[0]


def megatron_blocks(cfg: ModelConfig, blocks: list[nn.Module], mesh: Mesh) -> tuple[list | None, str | None]:
    """Megatron-Core's version of `blocks` (an unfused shardwise variant's), or None and why not."""
    if importlib.util.find_spec("megatron") is None:
        return None, "megatron-core is not installed (pip install megatron-core --no-deps)"
    try:
        return [MegatronSPBlock(cfg, b, mesh["tp"].group, mesh["tp"].size) for b in blocks], None
    except Exception as e:  # reported, not fatal: shardwise's variants still run
        return None, f"megatron-core unavailable: {type(e).__name__}: {e}"


def rank_main(opts: dict) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tp = dist.get_world_size()
    mesh = Mesh.build(ParallelConfig.build(tp, dp=1, tp=tp), torch.device("cpu"), Ledger(enabled=False))
    cfg = ModelConfig(name="bench", dim=opts["dim"], n_layers=opts["layers"], n_heads=opts["n_heads"],
                      n_kv_heads=opts["n_kv_heads"], ffn_dim=opts["ffn"], max_seq_len=opts["seq"])
    cfg.validate()
    blocks = {}
    for name, (overlap, fused) in VARIANTS.items():
        model = build_model(cfg, mesh, opts["seed"], ParallelConfig(tp=tp, sequence_parallel=True, tp_overlap=overlap,
                                                                    fused_projections=fused))
        blocks[name] = list(model.layers.values())
    regions = {id(m.region): m.region for name in ("plain_fused", "overlap_fused") for b in blocks[name]
               for m in b.modules() if getattr(m, "region", None) is not None}
    stored = all(region_stored(r) for r in regions.values())  # the fused variants run on stored fused weights
    mega, absent = megatron_blocks(cfg, blocks["plain_unfused"], mesh)
    gen = torch.Generator().manual_seed(opts["seed"] + 1)
    local = opts["seq"] // tp
    x0 = torch.randn(opts["batch"], opts["seq"], cfg.dim, generator=gen)[:, mesh["tp"].rank * local:][:, :local]
    gy = torch.randn_like(x0)
    cos, sin = rope_tables(cfg.head_dim, opts["seq"], cfg.rope_theta, torch.device("cpu"))

    def step(layers, x):
        for layer in layers:
            x = layer(x, cos, sin)
        x.backward(gy)
        return x

    def mega_step(layers, x):  # Megatron's SP shard is sequence-first: [s/tp, b, h]
        y = x.transpose(0, 1)
        for layer in layers:
            y = layer(y, cos, sin)
        y.backward(gy.transpose(0, 1))
        return y.transpose(0, 1)

    steps = {name: step for name in blocks}
    if mega is not None:
        blocks["megatron"], steps["megatron"] = mega, mega_step
    outs = {}
    for name, layers in blocks.items():  # sanity: every variant computes the same block
        x = x0.clone().requires_grad_(True)
        outs[name] = (steps[name](layers, x).detach(), x.grad.clone())
    base = outs["plain_unfused"]
    diffs = {n: max((o - base[0]).abs().max().item(), (g - base[1]).abs().max().item()) for n, (o, g) in outs.items()}

    times = {n: [] for n in blocks}
    exposed = {n: [] for n in blocks}
    cpus = {n: [] for n in blocks}  # CPU seconds of this rank's process (its GEMMs and gloo's threads)
    names = list(blocks)
    xs = x0.clone().requires_grad_(True)
    for it in range(opts["warmup"] + opts["reps"]):
        for name in names[it % len(names):] + names[:it % len(names)]:
            for layer in blocks[name]:
                layer.zero_grad(set_to_none=True)
            xs.grad = None
            dist.barrier()
            with (MegatronComm() if name == "megatron" else ExposedComm()) as comm_time:
                t0, c0 = time.perf_counter(), time.process_time()
                steps[name](blocks[name], xs)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            if it >= opts["warmup"]:
                times[name].append(dt)
                cpus[name].append(cpu)
                exposed[name].append(comm_time.seconds)
    return {"times": times, "cpus": cpus, "exposed": exposed, "diffs": diffs, "absent": absent, "stored": stored}


def free_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run(tp: int, opts: dict) -> dict:
    per_rank = run_local(rank_main, tp, opts, timeout_s=600.0)
    out = {"medians_s": {}, "cpu_medians_s": {}, "exposed_fraction": {}, "max_abs_diff": {},
           "absent": per_rank[0]["absent"],
           "fused_stored": all(r["stored"] for r in per_rank)}
    for name in per_rank[0]["times"]:
        steps = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank))]
        frac = [e / t for r in per_rank for e, t in zip(r["exposed"][name], r["times"][name])]
        out["medians_s"][name] = statistics.median(steps)
        # CPU seconds of every rank together: the work done, which a box shared with other jobs does not inflate
        out["cpu_medians_s"][name] = statistics.median([sum(cs) for cs in zip(*(r["cpus"][name] for r in per_rank))])
        out["exposed_fraction"][name] = statistics.median(frac)
        out["max_abs_diff"][name] = max(r["diffs"][name] for r in per_rank)
    m = out["medians_s"]
    e = out["exposed_fraction"]
    out["ratios"] = {"overlap_vs_plain": m["overlap_fused"] / m["plain_fused"],
                     "fused_vs_unfused": m["plain_fused"] / m["plain_unfused"],
                     "fused_vs_unfused_cpu": out["cpu_medians_s"]["plain_fused"] / out["cpu_medians_s"]["plain_unfused"],
                     "overlap_fused_vs_plain_unfused": m["overlap_fused"] / m["plain_unfused"],
                     "exposed_overlap_vs_plain": (e["overlap_fused"] / e["plain_fused"]) if e["plain_fused"] else None}
    c = out["cpu_medians_s"]
    for name in ("plain_fused", "overlap_fused"):  # Megatron's layout is fused: compare like with like
        out["ratios"][f"{name}_vs_megatron"] = m[name] / m["megatron"] if "megatron" in m else None
        out["ratios"][f"{name}_vs_megatron_cpu"] = c[name] / c["megatron"] if "megatron" in c else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--n-kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, tp 2, 2 reps: checks the benchmark runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tp, args.dim, args.n_heads, args.n_kv_heads, args.ffn = [2], 64, 4, 2, 96
        args.layers, args.seq, args.reps, args.warmup = 1, 32, 2, 1
    opts = vars(args)
    cores = free_cores()
    results, notes = {}, []
    model = ModelConfig(name="bench", dim=args.dim, n_layers=args.layers, n_heads=args.n_heads,
                        n_kv_heads=args.n_kv_heads, ffn_dim=args.ffn, max_seq_len=args.seq)
    for tp in args.tp:
        results[f"tp{tp}"] = r = run(tp, opts)
        # what --tp-overlap-auto picks for this layout on this host, beside what the overlap measured
        r["tp_overlap_auto"] = choose_for_run(model, tp, True, 1, args.batch, args.seq, 4, cpu_host(cores, tp))[1]
        # each rank needs a core for its GEMMs and one for gloo's progress to hide anything
        if cores < 2 * tp:
            notes.append(f"tp{tp}: {cores} free cores for {tp} ranks plus their communication threads: the overlap "
                         "cannot run beside the GEMMs here; read the exposed-communication fraction, not the speed-up")
        print(f"tp={tp} (SP) dim={args.dim} seq={args.seq} layers={args.layers}, {cores} free cores")
        for name in r["medians_s"]:
            print(f"  {name:16s} median {r['medians_s'][name] * 1e3:8.2f} ms  CPU {r['cpu_medians_s'][name] * 1e3:8.2f} ms"
                  f"  exposed TP comm "
                  f"{r['exposed_fraction'][name] * 100:5.1f}%  max diff {r['max_abs_diff'][name]:.1e}")
        for k, v in r["ratios"].items():
            if v is not None:
                print(f"  {k}: {v:.3f}")
        print(f"  --tp-overlap-auto: {r['tp_overlap_auto']}")
    ratios = {f"tp{tp}_{k}": v for tp in args.tp for k, v in results[f"tp{tp}"]["ratios"].items()}
    split = [tp for tp in args.tp if tp > 1]  # Megatron-Core refuses sequence parallelism at tp=1
    first = results[f"tp{split[0]}"]["ratios"] if split else {}
    ratios["vs_megatron"] = first.get("plain_fused_vs_megatron")  # shardwise's fused block / Megatron's, first tp > 1
    ratios["vs_megatron_cpu"] = first.get("plain_fused_vs_megatron_cpu")  # the same in CPU seconds
    why = next((results[f"tp{tp}"]["absent"] for tp in split if results[f"tp{tp}"]["absent"]), None)
    absent = {"megatron": why} if why else {}
    if why:
        notes.append(f"no Megatron-Core timing: {why}")
    else:
        notes.append("Megatron-Core: sequence_parallel=True with its built-in backward overlap; tp_comm_overlap "
                     "(TransformerEngine userbuffers) needs CUDA and is not available on CPU")
    medians = {f"tp{tp}_{name}": t for tp in args.tp for name, t in results[f"tp{tp}"]["medians_s"].items()}
    for note in notes:
        print(note)
    config = {k: opts[k] for k in ("tp", "dim", "n_heads", "n_kv_heads", "ffn", "layers", "batch", "seq", "reps",
                                   "warmup")} | {"free_cores": cores, "threads_per_rank": 1,
                                                 "torch": torch.__version__, "smoke": args.smoke}
    print(json.dumps({"medians_s": medians, "ratios": ratios, "absent": absent, "results": results, "notes": notes,
                      "config": config}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
