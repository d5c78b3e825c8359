"""The `shardwise train` command that runs a planned layout, and a layout read back from train flags.

A plan is worth what the trainer can run, so every row carries the exact command: every knob the
planner assumed is spelled out as the train flag of the same name (`--zero`, `--recompute`,
`--[no-]sequence-parallel`, `--dtype`, `--micro-batch`, `--global-batch`, `--schedule`, `--vp`,
`--cp-impl`, ...), so the command depends on none of train's defaults (train's default is a CPU run,
plan's a GPU cluster). One node: a plain `shardwise train` (it starts one process per GPU); several:
the `torchrun` line to run on every node. Models `shardwise train` cannot build (DeepSeek-V3's MLA,
GPT-2) get no command.
"""
from __future__ import annotations

import shlex
from dataclasses import fields, replace
from functools import lru_cache

from shardwise.config import ModelConfig, ParallelConfig, TrainConfig
from shardwise.rules.partition import balanced_counts
from shardwise.rules.validation import REST, layers_pp_problem, rest_of_world
from shardwise.planner.errors import PlanError
from shardwise.planner.hardware import Cluster
from shardwise.planner.layout import Layout, Workload
from shardwise.planner.models import ModelSpec

TORCHRUN_RDZV = "--rdzv-backend c10d --rdzv-endpoint HEAD_NODE_IP:29500 --rdzv-id shardwise"
UNMODELLED = ("--pp-scatter-gather", "--dropout", "--attn-dropout", "--tie-embeddings")
"""Train flags that change what runs in ways a plan row does not describe (refused by --explain)."""


def train_flags(model_flags: list[str], spec: ModelSpec, lay: Layout, wl: Workload) -> list[str]:
    """Every flag `shardwise train` needs to run exactly this layout and workload."""
    out = list(model_flags)
    out += [x for a in ("dp", "tp", "pp", "cp", "ep") for x in (f"--{a}", str(getattr(lay, a)))]
    out += ["--sequence-parallel" if lay.sp else "--no-sequence-parallel", "--zero", str(lay.zero),
            "--recompute", lay.recompute, "--schedule", lay.schedule, "--vp", str(lay.vp), "--cp-impl", lay.cp_impl]
    if lay.hsdp:
        out += ["--dp-shard", str(lay.dp_shard)]
    if lay.recompute_layers is not None and lay.recompute != "none":
        out += ["--recompute-layers", str(lay.recompute_layers)]
    chunks = lay.pp * lay.vp
    if lay.pp > 1 and layers_pp_problem(spec.n_layers, chunks):  # uneven: the split is stated
        out += ["--pp-layers", ",".join(map(str, balanced_counts(spec.n_layers, chunks)))]
    out += ["--seq-len", str(wl.seq_len), "--micro-batch", str(lay.mb), "--global-batch", str(lay.m * lay.mb * lay.dp),
            "--dtype", wl.precision, "--grad-reduce-dtype", wl.grad_reduce]
    if wl.precision == "bf16":
        out.append("--fp32-residual" if wl.fp32_residual else "--no-fp32-residual")
    if wl.optimizer != "adamw":
        out += ["--optimizer", wl.optimizer]
    if wl.fp8:
        out += ["--fp8", wl.fp8] + (["--fp8-all-gather"] if wl.fp8_all_gather else [])
    return out


def train_config(model: str | ModelConfig, spec: ModelSpec, lay: Layout, wl: Workload, steps: int,
                 mtp_layers: int = 0) -> TrainConfig:
    """The TrainConfig of a row's train command (`train_flags`), built directly: `model` a preset name or the
    ModelConfig of --model-config."""
    parallel = ParallelConfig(**{f.name: getattr(lay, f.name) for f in fields(ParallelConfig)})
    chunks = lay.pp * lay.vp
    if lay.pp > 1 and layers_pp_problem(spec.n_layers, chunks):  # uneven: the split is stated
        parallel = replace(parallel, pp_layers=tuple(balanced_counts(spec.n_layers, chunks)))
    return TrainConfig(model=model, parallel=parallel, steps=steps, seq_len=wl.seq_len, micro_batch=lay.mb,
                       global_batch=lay.m * lay.mb * lay.dp, dtype=wl.precision, grad_reduce_dtype=wl.grad_reduce,
                       fp32_residual=wl.fp32_residual and wl.precision == "bf16", optimizer=wl.optimizer,
                       fp8=wl.fp8, fp8_all_gather=wl.fp8_all_gather,
                       model_overrides={"mtp_layers": mtp_layers} if mtp_layers else {})


def train_command(flags: list[str], cluster: Cluster) -> str:
    """The shell line: `shardwise train` on one node (one process per GPU), else torchrun on every node."""
    if cluster.gpus <= cluster.gpus_per_node:
        return f"shardwise train {shlex.join(flags)}"
    return (f"torchrun --nnodes {cluster.gpus // cluster.gpus_per_node} --nproc-per-node {cluster.gpus_per_node} "
            f"{TORCHRUN_RDZV} -m shardwise.cli train {shlex.join(flags)}")


def row_command(model_flags: list[str], spec: ModelSpec, cluster: Cluster, lay: Layout, wl: Workload) -> dict:
    """A plan row's `command` (None when train cannot build the model: `untrainable` says why) and
    `command_refused` (train's own one-line refusal of these flags, None when it accepts them)."""
    if spec.untrainable:
        return {"command": None, "command_refused": None, "untrainable": spec.untrainable}
    flags = train_flags(model_flags, spec, lay, wl)
    return {"command": train_command(flags, cluster), "command_refused": trainer_refusal(flags)}


class _Refuse(Exception):
    pass


def _raise(message: str):
    raise _Refuse(message)


@lru_cache(maxsize=1)
def _train_parser():
    """train's own parser, raising instead of exiting: a printed command and an --explain command are read
    exactly as `shardwise train` reads them."""
    from shardwise.config.args import train_parser

    sub = train_parser()
    sub.error = _raise
    return sub


def _train_args(tokens: list[str]):
    from shardwise.config.args import unknown_flags_message

    sub = _train_parser()
    args, extras = sub.parse_known_args(tokens)
    if extras:
        _raise(unknown_flags_message(sub, extras))
    args.command = "train"
    return args


def trainer_refusal(flags: list[str]) -> str | None:
    """What `shardwise train` says about these flags before starting any rank (None: it accepts them), from
    its own parser and validation — so a plan never silently prints a command the trainer refuses."""
    from shardwise.training.assemble import config_from_args
    from shardwise.config import ConfigError

    try:
        config_from_args(_train_args(flags), None)
    except (_Refuse, ConfigError) as e:
        return str(e)
    return None


def parse_train_flags(text: str, gpus: int, global_batch: int | None, model: str | None,
                      n_layers: int, mtp_layers: int = 0) -> tuple[Layout, dict]:
    """(Layout, Workload fields) of a train command's flags, e.g. '--dp 2 --tp 2 --pp 2 --schedule 1f1b' or a
    whole printed command. Flags not given take train's defaults; --dp left out fills the rest of the GPUs,
    as under torchrun. Parsed by train's own argument parser, so the names and meanings are train's."""
    tokens = shlex.split(text)
    if "train" in tokens:  # a whole command: `shardwise train ...` or `torchrun ... -m shardwise.cli train ...`
        tokens = tokens[tokens.index("train") + 1:]
    try:
        args = _train_args(tokens)
    except _Refuse as e:
        raise PlanError(f"--explain {text!r}: {e} (train's flags; see shardwise train --help)") from None
    unmodelled = [t for t in tokens if t.split("=")[0] in UNMODELLED or t.startswith("--moe-")]
    if unmodelled:
        raise PlanError(f"--explain: {unmodelled[0]} is not modelled by the planner (it plans the preset's model, "
                        "full pipeline sends and balanced stage splits)")
    given_model = args.model_config or args.model  # train's --model defaults to None (tiny)
    if given_model is not None and given_model != model:
        raise PlanError(f"--explain: the command's model {given_model!r} is not the plan's {model!r}")
    if (args.mtp_layers or 0) != mtp_layers:
        raise PlanError(f"--explain: the command's --mtp-layers {args.mtp_layers or 0} is not the plan's {mtp_layers}; "
                        f"pass --mtp-layers {args.mtp_layers or 0} to plan")
    deg = {a: 1 if getattr(args, a) is None else getattr(args, a) for a in ("tp", "pp", "cp", "ep")}
    for name, v in [*deg.items(), ("dp", args.dp), ("micro-batch", args.micro_batch)]:
        if v is not None and v < 1 and not (name == "dp" and v == REST):
            raise PlanError(f"--explain: --{name} {v} must be a positive integer" + (" (or -1)" if name == "dp" else ""))
    dp = args.dp
    if dp is None or dp == REST:
        dp = rest_of_world(gpus, deg["pp"], deg["cp"], deg["tp"])
        if dp is None:
            raise PlanError(f"--explain: tp×pp×cp = {deg['tp'] * deg['pp'] * deg['cp']} does not divide --gpus {gpus}")
    per_step = args.micro_batch * dp
    if args.microbatches is not None:
        m = args.microbatches
    else:
        gb = args.global_batch or global_batch or per_step  # train's default: no accumulation
        if gb % per_step:
            raise PlanError(f"--explain: global batch {gb} is not divisible by micro-batch {args.micro_batch} × dp {dp}")
        m = gb // per_step
    pp = deg["pp"]
    schedule = args.schedule if pp > 1 else "1f1b"
    vp = 2 if schedule == "dualpipev" else (args.vp or (2 if schedule == "interleaved" else 1) if pp > 1 else 1)
    if args.pp_layers and args.pp_layers != ",".join(map(str, balanced_counts(n_layers, pp * vp))):
        raise PlanError(f"--explain: --pp-layers {args.pp_layers} is not the planner's balanced split "
                        f"{','.join(map(str, balanced_counts(n_layers, pp * vp)))}")
    lay = Layout(dp=dp, **deg, vp=vp, schedule=schedule, mb=args.micro_batch, m=m, zero=args.zero,
                 recompute=args.recompute, sequence_parallel=bool(args.sequence_parallel), cp_impl=args.cp_impl,
                 recompute_layers=args.recompute_layers if args.recompute != "none" else None,
                 dp_shard=args.dp_shard if args.dp_shard not in (None, dp) else None,
                 tp_overlap=bool(args.tp_overlap and args.sequence_parallel))
    seq_given = any(t == "--seq-len" or t.startswith("--seq-len=") for t in tokens)
    wl = dict(seq_len=args.seq_len if seq_given else None, precision=args.dtype,
              fp32_residual=bool(args.fp32_residual), grad_reduce=args.grad_reduce_dtype, optimizer=args.optimizer)
    return lay, {k: v for k, v in wl.items() if v is not None}
