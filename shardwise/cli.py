"""`shardwise` command line: train, verify, plan, schedule.

Configuration errors are caught before any rank starts and exit with status 2 and one line.
Without torchrun's environment the command forks the ranks it needs (gloo, CPU); under torchrun
each process joins the job.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .config import ConfigError, ParallelConfig, TrainConfig
from .config.schedule import LR_SCHEDULES, parse_betas
from .run import assemble, check_sources, read_model_config

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default; flags that default to off or to a value derived from others (None)
    say so in their own help instead."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


DEFAULT_LAYOUT = {"dp": 2, "tp": 2}  # `shardwise train` with no layout flags: a small 4-rank job
MAX_LOCAL_RANKS = 64


def _add_layout(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    for axis, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")):
        g.add_argument(f"--{axis}", type=int, default=None, help=f"{what}-parallel degree"
                       + (" (-1: the rest of the world size)" if axis == "dp" else ""))
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
                   help="Megatron sequence parallelism in TP regions (default off)")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage over dp×cp: 0, 1 (AdamW state sharded), 2 (+ gradients), 3 (+ parameters)")
    g.add_argument("--dp-shard", type=int, default=None, metavar="S",
                   help="hybrid sharded DP: ZeRO 2/3 shard over groups of S consecutive dp ranks and all-reduce "
                        "over the dp/S replicas (default S = dp)")
    g.add_argument("--schedule", default="1f1b", help="pipeline schedule: gpipe, 1f1b, interleaved, zb, dualpipev")
    g.add_argument("--vp", type=int, default=None,
                   help="model chunks per pipeline rank (default 2 under --schedule interleaved, else 1)")
    g.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step per dp rank (sets global batch = M × micro-batch × dp)")
    g.add_argument("--pp-layers", default=None, help="layers per stage, comma-separated (pp × vp counts)")
    g.add_argument("--pp-scatter-gather", action="store_true",
                   help="under TP without SP, send 1/tp of each stage activation and all-gather it on arrival")
    g.add_argument("--cp-order", default="balanced", help="context-parallel token order: balanced or contiguous")
    g.add_argument("--cp-impl", default="ring", help="context-parallel attention: ring or ulysses")
    g.add_argument("--recompute", default="none", help="activation recompute: none, selective (attention core), full")
    g.add_argument("--recompute-layers", type=int, default=None,
                   help="full recompute of the first N layers of every stage/chunk (default: all)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (the first step pays the compilation)")


def _add_run(p: argparse.ArgumentParser, steps: int) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="model preset (tiny, small, llama3-8b, ...; default tiny)")
    src.add_argument("--model-config", default=None, metavar="HF_CONFIG.json",
                     help="a Hugging Face config.json (or model directory): llama, mistral, qwen2 or mixtral shapes")
    p.add_argument("--init-from-hf", default=None, metavar="DIR",
                   help="fine-tune a Hugging Face model directory: its config, weights (each rank reads its slices) "
                        "and tokenizer")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps to train to (a resume continues to it)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per microbatch per dp rank")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step over all dp ranks")
    _add_optim(p)
    p.add_argument("--seed", type=int, default=1234, help="model initialisation, data order and dropout")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 (autocast; fp32 master weights)")
    p.add_argument("--fp32-residual", action=argparse.BooleanOptionalAction, default=False,
                   help="under bf16: keep the residual stream fp32 (default off)")
    p.add_argument("--grad-reduce-dtype", default="fp32", help="DP gradient reduction dtype: fp32 or bf16")
    p.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="ZeRO 0/1: reduce gradients after backward instead of overlapping with it")
    p.add_argument("--data", default=None, help="text file, prepare-data directory, or a blend DIR:W,DIR:W "
                   "(default: the embedded pydoc_data corpus)")
    p.add_argument("--out", default=None, help="run directory (default runs/<timestamp>)")
    p.add_argument("--dropout", type=float, default=None, help="residual dropout")
    p.add_argument("--attn-dropout", type=float, default=None, help="attention-probability dropout")
    p.add_argument("--tie-embeddings", action="store_true", default=None)
    moe = p.add_argument_group("mixture of experts (override the preset)")
    for flag, typ, what in (("experts", int, "routed experts per MoE layer (0 = dense)"),
                            ("topk", int, "experts per token"), ("every", int, "every N-th block is MoE"),
                            ("shared-experts", int, "dense experts applied to every token"),
                            ("ffn-dim", int, "inner size of each expert"),
                            ("capacity-factor", float, "cap tokens per expert per rank (default dropless)"),
                            ("aux-loss-coef", float, "Switch load-balancing loss weight"),
                            ("z-loss-coef", float, "router z-loss weight"),
                            ("bias-update-rate", float, "aux-loss-free balancing bias step (DeepSeek-V3)"),
                            ("score", str, "router scores: softmax or sigmoid")):
        moe.add_argument(f"--moe-{flag}", type=typ, default=None, help=what)
    mtp = p.add_argument_group("multi-token prediction (DeepSeek-V3 architecture; docs/mtp.md)")
    mtp.add_argument("--mtp-layers", type=int, default=None, metavar="D",
                     help="MTP modules (default 0; a config.json's num_nextn_predict_layers is not turned on by itself)")
    mtp.add_argument("--mtp-loss-weight", type=float, default=0.1, metavar="LAMBDA",
                     help="weight λ of the mean MTP cross-entropy added to the loss")
    p.add_argument("--collective-timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    p.add_argument("--device", default="auto", help="auto (one NCCL rank per GPU when CUDA is present), cpu or cuda")
    p.add_argument("--gloo-ifname", default=None, metavar="IFACE",
                   help="network interface for gloo groups (default: GLOO_SOCKET_IFNAME, else the one that "
                        "reaches MASTER_ADDR)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-every", type=int, default=None, metavar="N",
                   help="one `key=value` line every N steps (default: every step up to 20 steps, else 10)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--save-every", type=int, default=0,
                    help="checkpoint every N steps and at the last step (0: the last step only)")
    ck.add_argument("--no-checkpoint", action="store_true",
                    help="train: write no checkpoint at all (by default the last step is saved, for hf-export)")
    ck.add_argument("--checkpoint-dir", default=None, help="default <out>/checkpoints")
    ck.add_argument("--keep", type=int, default=None, help="keep the newest K checkpoints")
    ck.add_argument("--resume", action="store_true",
                    help="continue from the checkpoint `latest` names (an older one only if it is damaged)")
    ck.add_argument("--auto-resume", action="store_true",
                    help="resume when the run has a checkpoint, else start fresh (requeued cluster jobs)")
    ck.add_argument("--overwrite", action="store_true",
                    help="start fresh in a non-empty --out, removing its old checkpoints")
    ck.add_argument("--async-save", action="store_true",
                    help="write checkpoints in the background (torch.distributed.checkpoint.async_save)")
    p.add_argument("--fault-inject", default=None, metavar="RANK:STEP:KIND",
                   help="make RANK crash, hang or produce NaN (KIND) at STEP — for testing recovery")
    p.add_argument("--bad-step", default="skip", help="on non-finite loss/grads: skip (logged) or abort")
    p.add_argument("--max-bad-steps", type=int, default=5, help="abort once more steps than this were skipped")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="cross-entropy label smoothing in [0, 1)")
    p.add_argument("--no-report", action="store_true", help="train: do not render the report PNGs at the end")
    p.add_argument("--attention-mask", default="causal",
                   help="causal, or document: attend only within each document of a packed window (EOS-delimited)")
    p.add_argument("--reset-positions", action="store_true", help="restart RoPE positions at each document start")
    ob = p.add_argument_group("evaluation and observability")
    ob.add_argument("--eval-data", default=None, metavar="SPEC",
                    help="held-out data like --data (same tokenizer): forward-only eval_loss in metrics.jsonl")
    ob.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default: at the end)")
    ob.add_argument("--eval-steps", type=int, default=10, help="global batches per evaluation, taken in order")
    ob.add_argument("--profile-steps", default=None, metavar="A:B",
                    help="torch.profiler Chrome traces of steps A..B per rank under <out>/profile/")
    ob.add_argument("--log-to", default=None, metavar="{wandb,mlflow}",
                    help="also log metrics to W&B (offline unless configured) or MLflow (optional extras)")


def _add_optim(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and learning-rate schedule")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--lr-schedule", default="cosine", help=f"{', '.join(LR_SCHEDULES)}. After the warm-up: cosine or linear decay to --min-lr on the schedule's last step; wsd "
                        "(constant, then a linear decay over the last --wsd-decay-fraction); constant")
    g.add_argument("--min-lr", type=float, default=None, help="LR at the schedule's end (default --lr / 10)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps, honoured exactly (default 10%% of the schedule, 1..20)")
    g.add_argument("--lr-decay-steps", type=int, default=None,
                   help="the schedule's length (default --steps; on resume, the checkpoint's); later steps stay "
                        "at --min-lr")
    g.add_argument("--wsd-decay-fraction", type=float, default=0.2, help="wsd: fraction of the schedule that decays")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on norms)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    g.add_argument("--adam-betas", default="0.9,0.95", metavar="B1,B2", help="AdamW betas")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model on a parallel layout", formatter_class=HelpFormatter)
    _add_layout(t)
    _add_run(t, steps=200)
    v = sub.add_parser("verify", help="check a layout against the single-device model", formatter_class=HelpFormatter)
    _add_layout(v)
    _add_run(v, steps=3)
    for p in (t, v):
        p.add_argument("--config", default=None, metavar="FILE.toml",
                       help="TOML file whose keys are these flags' names; flags given on the command line win")
        p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    parser._sw_runs = {"train": t, "verify": v}
    for mod in ("shardwise.pipeline.cli", "shardwise.planner.cli", "shardwise.checkpoint_cli", "shardwise.report",
                "shardwise.hf_cli", "shardwise.data.cli", "shardwise.generate", "shardwise.simulate.cli"):
        try:
            __import__(mod, fromlist=["add_parser"]).add_parser(sub)
        except ImportError:
            pass
    return parser


def config_from_args(args, torchrun_world: int | None) -> TrainConfig:
    given = {a: getattr(args, a) for a in ("dp", "tp", "pp", "cp", "ep") if getattr(args, a) is not None}
    if not given and args.command == "train" and torchrun_world is None:
        given = dict(DEFAULT_LAYOUT)
    degrees = {a: given.get(a, 1) for a in ("dp", "tp", "pp", "cp", "ep")}
    if torchrun_world is not None and "dp" not in given:
        degrees["dp"] = -1
    try:
        pp_layers = [int(c) for c in args.pp_layers.split(",")] if args.pp_layers else None
    except ValueError:
        raise ConfigError(f"--pp-layers {args.pp_layers!r} must be comma-separated integers, e.g. 3,3,2") from None
    parallel = ParallelConfig(**degrees, sequence_parallel=args.sequence_parallel, zero=args.zero,
                              dp_shard=args.dp_shard, schedule=args.schedule, vp=_vp(args), pp_layers=pp_layers,
                              pp_scatter_gather=args.pp_scatter_gather, cp_order=args.cp_order,
                              cp_impl=args.cp_impl, recompute=args.recompute,
                              recompute_layers=args.recompute_layers, compile=args.compile)
    if args.microbatches is not None:
        if args.microbatches <= 0 or (args.global_batch is not None):
            raise ConfigError(f"--microbatches {args.microbatches} must be positive and not combined with "
                              "--global-batch")
        dp = degrees["dp"]
        if dp == -1:  # under torchrun: the rest of the world (resolve_world reports a bad split)
            dp = max(1, torchrun_world // (degrees["pp"] * degrees["cp"] * degrees["tp"]))
        args.global_batch = args.microbatches * args.micro_batch * dp
    model = args.model if args.model is not None or args.init_from_hf else "tiny"
    if args.model_config:
        model = read_model_config(args.model_config)
    cfg = TrainConfig(model=model, init_from_hf=args.init_from_hf, parallel=parallel, steps=args.steps, seq_len=args.seq_len,
                      micro_batch=args.micro_batch, global_batch=args.global_batch, seed=args.seed,
                      dtype=args.dtype, data=args.data, out=args.out, dropout=args.dropout,
                      attn_dropout=args.attn_dropout, tie_embeddings=args.tie_embeddings,
                      timeout_s=args.collective_timeout, progress=not args.no_progress, log_every=args.log_every,
                      fault_inject=args.fault_inject, bad_step=args.bad_step, max_bad_steps=args.max_bad_steps,
                      save_every=args.save_every, checkpoint_dir=args.checkpoint_dir, keep=args.keep,
                      resume=args.resume, async_save=args.async_save, fp32_residual=args.fp32_residual,
                      grad_reduce_dtype=args.grad_reduce_dtype, label_smoothing=args.label_smoothing,
                      report=not args.no_report, attention_mask=args.attention_mask,
                      reset_positions=args.reset_positions,
                      overlap_grad_reduce=not args.no_overlap_grad_reduce,
                      final_checkpoint=args.command == "train" and not args.no_checkpoint,
                      lr=args.lr, lr_schedule=args.lr_schedule, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
                      lr_decay_steps=args.lr_decay_steps, wsd_decay_fraction=args.wsd_decay_fraction,
                      weight_decay=args.weight_decay, grad_clip=args.grad_clip, adam_betas=parse_betas(args.adam_betas),
                      adam_eps=args.adam_eps,
                      eval_data=args.eval_data, eval_every=args.eval_every, eval_steps=args.eval_steps,
                      profile_steps=args.profile_steps, log_to=args.log_to,
                      mtp_loss_weight=args.mtp_loss_weight,
                      model_overrides={k: v for k, v in vars(args).items()
                                       if (k.startswith("moe_") or k == "mtp_layers") and v is not None})
    return assemble(cfg, torchrun_world)


def _vp(args) -> int:
    """--vp, by default 2 chunks per rank under --schedule interleaved (which needs at least 2), else 1."""
    if args.vp is not None:
        return args.vp
    return 2 if args.schedule == "interleaved" and (args.pp or 1) > 1 else 1


def _run(kind: str, cfg: TrainConfig, device=None):
    if kind == "train":
        from .train import train_main

        return train_main(cfg, device)
    from .verify import verify_main

    return verify_main(cfg, device)


def _check_tp_within_node(cfg: TrainConfig) -> None:
    """TP is innermost, so a TP group is `tp` consecutive ranks: it stays on one node (NVLink) exactly
    when the processes per node are a multiple of tp. On GPUs anything else is refused."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    tp = cfg.parallel.tp
    if local and local % tp:
        msg = (f"--tp {tp} does not fit the {local} processes per node: TP groups would span nodes; "
               f"use a tp that divides {local}")
        import torch

        if torch.cuda.is_available():
            raise ConfigError(msg)
        print(f"shardwise: warning: {msg}", file=sys.stderr)


def _torchrun() -> bool:
    from .launch import under_torchrun

    return under_torchrun()


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "func"):
        return args.func(args)
    torchrun_world = int(os.environ["WORLD_SIZE"]) if _torchrun() else None
    try:
        if args.config:
            from .config_file import apply_config_file

            args = apply_config_file(parser, parser._sw_runs[args.command], args.config, argv)
        cfg = config_from_args(args, torchrun_world)
        if torchrun_world is not None:
            _check_tp_within_node(cfg)
        if args.print_config:
            from .config_file import render_config

            print(render_config(parser._sw_runs[args.command], args, cfg))
            return 0
        if args.command == "verify":
            from .verify import check_verifiable

            check_verifiable(cfg)
        if args.command == "train":
            done = _prepare_run_dir(args, cfg)
            if done is not None:
                if torchrun_world is None or int(os.environ["RANK"]) == 0:
                    print(f"shardwise train: {done}", file=sys.stderr)
                return 0
        check_sources(cfg)  # once, before any rank: manifests, shard checksums, --init-from-hf
        world = cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.cp * cfg.parallel.tp
        import torch

        from .launch import plan_launch

        launch = plan_launch(world, args.device, torch.cuda.device_count() if args.device != "cpu" else 0,
                             torchrun_world is not None)
        if torchrun_world is not None or args.gloo_ifname:
            from .launch import configure_gloo

            configure_gloo(args.gloo_ifname)
        if torchrun_world is None and world > MAX_LOCAL_RANKS:
            raise ConfigError(f"the layout needs {world} ranks; the local launcher starts at most "
                              f"{MAX_LOCAL_RANKS} (use torchrun for more)")
    except ConfigError as e:
        print(f"shardwise {args.command}: error: {e}", file=sys.stderr)
        return 2
    p = cfg.parallel
    if p.pp > 1 and cfg.grad_accum < p.pp and (torchrun_world is None or int(os.environ["RANK"]) == 0):
        print(f"shardwise {args.command}: warning: {cfg.grad_accum} microbatch(es) per step for {p.pp} pipeline "
              f"stages: most stages idle most of the step; set --microbatches {p.pp} or more", file=sys.stderr)
    from .launch import RankError, run_local

    try:
        if torchrun_world is not None:
            from .launch import init_distributed

            result = _run(args.command, cfg, init_distributed(cfg.timeout_s, launch.device, cfg.out))
            rank0 = int(os.environ["RANK"]) == 0
        elif world == 1:
            import torch

            device = torch.device("cuda", 0) if launch.device == "cuda" else None
            result, rank0 = _run(args.command, cfg, device), True
        else:
            result, rank0 = run_local(_rank_run, world, args.command, cfg, timeout_s=cfg.timeout_s,
                                      backend=launch.backend, run_dir=cfg.out)[0], True
    except RankError as e:
        print(f"shardwise {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if torchrun_world is None or int(os.environ["RANK"]) == 0:
            start = "\n" if sys.stderr.isatty() else ""  # on its own line, not after a progress bar or ^C
            print(f"{start}shardwise {args.command}: {_interrupted_line(cfg)}", file=sys.stderr)
        return 130
    if not rank0:
        return 0
    if args.command == "verify":
        losses = result.pop("losses")
        print(f"losses: {' '.join(f'{x:.6f}' for x in losses)}", file=sys.stderr)
        print(json.dumps(result))
        return 0 if result["passed"] else 1
    from .report import summary_lines

    print("\n".join(summary_lines(result)))
    return 0


def _prepare_run_dir(args, cfg: TrainConfig) -> str | None:
    """Before any rank: the run directory (newest run for a bare --resume), fresh vs resume, and protection of
    a non-empty --out. Returns the line to print when the checkpoint already reaches --steps."""
    from .run import check_run_dir
    from .run_dir import default_out_dir, newest_run_with_checkpoints

    if cfg.out is None:
        if (cfg.resume or args.auto_resume) and cfg.checkpoint_dir is None:
            cfg.out = newest_run_with_checkpoints()
            if cfg.out is None and cfg.resume:
                raise ConfigError("--resume found no run with checkpoints under runs/; pass --out RUN_DIR "
                                  "or --checkpoint-dir DIR")
        cfg.out = cfg.out or default_out_dir()
    return check_run_dir(cfg, auto_resume=args.auto_resume, overwrite=args.overwrite)


def _rank_run(kind: str, cfg: TrainConfig, device=None):
    """A local rank: Ctrl-C is the parent's to handle (it stops every rank and prints one line), so a rank
    ignores SIGINT and is terminated by the launcher instead of printing its own traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _run(kind, cfg, device)


def _interrupted_line(cfg: TrainConfig) -> str:
    """`interrupted at step N; last checkpoint step-M; continue with --resume`, from the run directory."""
    step = 0
    try:
        with open(os.path.join(cfg.out, "metrics.jsonl")) as f:
            for line in f:
                if line.strip():
                    step = json.loads(line)["step"]
    except (OSError, ValueError, KeyError):
        pass
    from .run import checkpoint_root

    try:
        with open(os.path.join(checkpoint_root(cfg), "latest")) as f:
            last = f.read().strip()
    except OSError:
        last = None
    if last is None:
        return f"interrupted at step {step}; no checkpoint written (use --save-every N to resume later)"
    return f"interrupted at step {step}; last checkpoint {last}; continue with --resume"


if __name__ == "__main__":
    sys.exit(main())
