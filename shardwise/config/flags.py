"""The run flags of train, verify and simulate, declared once: each names the `TrainConfig` field it sets,
and takes its type and default from that field. The CLI builds its parsers from this table and fills a
config from it; `docs/reference.md` is rendered from those parsers (`python -m shardwise.reference`).

A flag's `field` is a path into TrainConfig ("seq_len", "parallel.zero", "model_overrides.moe_experts");
flags with no field are read by the CLI itself (where a run comes from, how it is launched).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass

from ..rules.hf_types import model_types
from ..rules.validation import CP_IMPLS, DSA_STAGES, FP8_RECIPES, RECOMPUTE, ZERO_STAGES
from .schedule import LR_SCHEDULES, parse_betas

GIVEN = "given_flags"
"""Namespace attribute the CLI fills: the dests of the value flags given on the command line or in --config (a
value equal to the default is still given: `--schedule 1f1b` without `--pp` is worth a warning)."""

FROM_FIELD = object()
"""Default marker: the flag's default is its field's default."""


@dataclass(frozen=True)
class Flag:
    name: str
    """The option string, e.g. '--seq-len'."""
    help: str | None
    field: str | None = None
    """Where the value goes in TrainConfig; None: read by the CLI itself."""
    kind: str = "value"
    """'value' (takes an argument), 'switch' (store_true), 'toggle' (--X / --no-X), 'toggle-auto' (a toggle whose
    --X also takes on, off or auto; auto sets the switch --X-auto) or 'negate' (--no-X: the field becomes False)."""
    type: type | None = None
    """Defaults to the field's annotation (its non-None type)."""
    default: object = FROM_FIELD
    choices: tuple | None = None
    metavar: str | None = None
    group: str | None = None
    """Title of the argparse group it is listed under; None: the command's own options."""
    exclusive: str | None = None
    """Flags sharing this tag exclude each other."""
    convert: typing.Callable | None = None
    """Turns the parsed value into the field's (e.g. 'B1,B2' into a tuple)."""

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def _pp_layers(text: str | None) -> tuple[int, ...] | None:
    from .errors import ConfigError

    if not text:
        return None
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise ConfigError(f"--pp-layers {text!r} must be comma-separated integers, e.g. 3,3,2") from None


SAVE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
"""What --save-on-signal takes (SIGINT is Ctrl-C's: it stops at once, without a save)."""


def _signal_name(text: str | None) -> str | None:
    """'TERM', 'sigusr1', 'SIGTERM' → the canonical name; 'none' → None (no handler)."""
    from .errors import ConfigError

    if text is None or text.lower() == "none":
        return None
    name = text.upper() if text.upper().startswith("SIG") else f"SIG{text.upper()}"
    if name not in SAVE_SIGNALS:
        raise ConfigError(f"--save-on-signal {text!r} is not supported; valid: {', '.join(SAVE_SIGNALS)}, none")
    return name


LAYOUT = "layout"
OPTIM = "optimizer and learning-rate schedule"
MOE = "mixture of experts (override the preset)"
MTP = "multi-token prediction (DeepSeek-V3 architecture; docs/mtp.md)"
CHECKPOINTS = "checkpoints"
OBSERVE = "evaluation and observability"

_DEGREES = [Flag(f"--{axis}", f"{what}-parallel degree" + (
    " (-1: the rest of the world size). Omitted degrees are 1, but under torchrun an omitted --dp is the rest of its "
    "world, and train with no layout flag and no torchrun forks dp=2 × tp=2" if axis == "dp" else ""),
                 f"parallel.{axis}", type=int, default=None, group=LAYOUT)
            for axis, what in (("dp", "data"), ("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"),
                               ("ep", "expert"))]
_MOE = [Flag(f"--moe-{flag}", what, f"model_overrides.moe_{flag.replace('-', '_')}", type=typ, default=None, group=MOE)
        for flag, typ, what in (("experts", int, "routed experts per MoE layer (0 = dense)"),
                                ("topk", int, "experts per token"), ("every", int, "every N-th block is MoE"),
                                ("shared-experts", int, "dense experts applied to every token"),
                                ("ffn-dim", int, "inner size of each expert"),
                                ("capacity-factor", float, "cap tokens per expert per rank (default dropless)"),
                                ("aux-loss-coef", float, "Switch load-balancing loss weight"),
                                ("z-loss-coef", float, "router z-loss weight"),
                                ("bias-update-rate", float, "aux-loss-free balancing bias step (DeepSeek-V3)"),
                                ("score", str, "router scores: softmax or sigmoid"))]

RUN_FLAGS: tuple[Flag, ...] = (
    *_DEGREES,
    Flag("--sequence-parallel", "Megatron sequence parallelism in TP regions (default off)",
         "parallel.sequence_parallel", kind="toggle", group=LAYOUT),
    Flag("--tp-overlap", "under --sequence-parallel, split each TP all-gather and reduce-scatter into tp chunks "
         "that travel while the GEMMs of the previous chunks run (default off); `--tp-overlap auto`: as "
         "--tp-overlap-auto; `on`/`off` as bare --tp-overlap / --no-tp-overlap", "parallel.tp_overlap",
         kind="toggle-auto", group=LAYOUT),
    Flag("--tp-overlap-auto", "let the planner's exposed-communication term set --tp-overlap for this layout and host "
         "(off without SP, and on a CPU host with 2 or fewer cores per rank); the choice and why are printed at start",
         "tp_overlap_auto", kind="switch", group=LAYOUT),
    Flag("--fused-projections", "q/k/v (MLA: the down-projections) and w1/w3 (shared experts too) stored back to "
         "back in one buffer per rank, one GEMM each; checkpoints and HF files unchanged; equal to the separate "
         "GEMMs up to rounding (default off)",
         "parallel.fused_projections", kind="toggle", group=LAYOUT),
    Flag("--zero", "ZeRO stage over dp×cp: 0, 1 (AdamW state sharded), 2 (+ gradients), 3 (+ parameters)",
         "parallel.zero", group=LAYOUT),
    Flag("--dp-shard", "hybrid sharded DP: ZeRO 2/3 shard over groups of S consecutive dp ranks and all-reduce "
         "over the dp/S replicas (default S = dp)", "parallel.dp_shard", metavar="S", group=LAYOUT),
    Flag("--schedule", "pipeline schedule: gpipe, 1f1b, interleaved, zb, dualpipev", "parallel.schedule", group=LAYOUT),
    Flag("--vp", "model chunks per pipeline rank (default 2 under --schedule interleaved, else 1)", "parallel.vp",
         default=None, group=LAYOUT),
    Flag("--microbatches", "microbatches per step per dp rank (sets global batch = M × micro-batch × dp; verify under "
         "pp with no batch flag: pp, 2 × pp under dualpipev)",
         type=int, default=None, group=LAYOUT),
    Flag("--pp-layers", "layers per stage, comma-separated (pp × vp counts)", "parallel.pp_layers", type=str,
         group=LAYOUT, convert=_pp_layers),
    Flag("--pp-scatter-gather", "under TP without SP, send 1/tp of each stage activation and all-gather it on arrival",
         "parallel.pp_scatter_gather", kind="switch", group=LAYOUT),
    Flag("--cp-order", "context-parallel token order: balanced or contiguous", "parallel.cp_order", group=LAYOUT),
    Flag("--expert-placement", "which ep rank holds which expert: contiguous (default) or balanced (permuted for an "
         "even load from --expert-routing's histogram; the math is unchanged)", "parallel.expert_placement",
         choices=("contiguous", "balanced"), group=LAYOUT),
    Flag("--expert-routing", "the tokens-per-expert histogram a balanced placement reads: a run directory (its "
         "routing.jsonl) or that file", "parallel.expert_routing", type=str, group=LAYOUT, metavar="RUN_DIR"),
    Flag("--expert-replicas", "under --expert-placement balanced, the ep hottest experts held by R ranks each "
         "(their gradients summed; tokens split between the copies)", "parallel.expert_replicas", group=LAYOUT,
         metavar="R"),
    Flag("--cp-impl", "context-parallel attention: ring or ulysses", "parallel.cp_impl", group=LAYOUT),
    Flag("--recompute", "activation recompute: none, selective (attention core), full", "parallel.recompute",
         group=LAYOUT),
    Flag("--recompute-layers", "full recompute of the first N layers of every stage/chunk (default: all)",
         "parallel.recompute_layers", group=LAYOUT),
    Flag("--compile", "torch.compile each transformer block (the first step pays the compilation)", "parallel.compile",
         kind="switch", group=LAYOUT),
    Flag("--model", "model preset (tiny, small, llama3-8b, ...; default tiny)", type=str, default=None,
         exclusive="source"),
    Flag("--model-config", "a Hugging Face config.json (or model directory) of model_type "
         f"{', '.join(model_types())}",
         type=str, default=None, metavar="HF_CONFIG.json", exclusive="source"),
    Flag("--init-from-hf", "fine-tune a Hugging Face model directory: its config, weights (each rank reads its slices) "
         "and tokenizer", "init_from_hf", metavar="DIR"),
    Flag("--init-tokenizer", "the tokenizer of an --init-from-hf directory that holds no tokenizer.json (byte, a "
         "tokenizer.json or a folder holding one): --data must have been prepared with it", "init_tokenizer",
         metavar="SPEC"),
    Flag("--allow-tokenizer-mismatch", "fine-tune even when the data's tokenizer differs from --init-from-hf's",
         "allow_tokenizer_mismatch", kind="switch"),
    Flag("--steps", "optimizer steps to train to (a resume continues to it)", "steps"),
    Flag("--seq-len", "tokens per sequence", "seq_len"),
    Flag("--micro-batch", "sequences per microbatch per dp rank", "micro_batch"),
    Flag("--global-batch", "sequences per step over all dp ranks", "global_batch"),
    Flag("--lr", "peak learning rate", "lr", group=OPTIM),
    Flag("--lr-schedule", f"{', '.join(LR_SCHEDULES)}. After the warm-up: cosine or linear decay to --min-lr on the "
         "schedule's last step; wsd (constant, then a linear decay over the last --wsd-decay-fraction); constant",
         "lr_schedule", group=OPTIM),
    Flag("--min-lr", "LR at the schedule's end (default --lr / 10)", "min_lr", group=OPTIM),
    Flag("--warmup-steps", "linear warm-up steps, honoured exactly (default 10%% of the schedule, 1..20)",
         "warmup_steps", group=OPTIM),
    Flag("--lr-decay-steps", "the schedule's length (default --steps; on resume, the checkpoint's); later steps stay "
         "at --min-lr", "lr_decay_steps", group=OPTIM),
    Flag("--wsd-decay-fraction", "wsd: fraction of the schedule that decays", "wsd_decay_fraction", group=OPTIM),
    Flag("--weight-decay", "AdamW weight decay (not on norms)", "weight_decay", group=OPTIM),
    Flag("--grad-clip", "max global gradient norm (0: no clipping)", "grad_clip", group=OPTIM),
    Flag("--adam-betas", "AdamW betas", "adam_betas", type=str, default="0.9,0.95", metavar="B1,B2", group=OPTIM,
         convert=parse_betas),
    Flag("--adam-eps", "AdamW epsilon", "adam_eps", group=OPTIM),
    Flag("--optimizer", "adamw, or muon: Newton–Schulz-orthogonalised momentum on the hidden matrices, AdamW (with "
         "the --adam-* flags) on embeddings, LM head, norms, biases and routers", "optimizer",
         choices=("adamw", "muon"), group=OPTIM),
    Flag("--muon-momentum", "Muon: Nesterov momentum", "muon_momentum", group=OPTIM),
    Flag("--muon-ns-steps", "Muon: Newton–Schulz iterations", "muon_ns_steps", group=OPTIM),
    Flag("--muon-ns-fp32", "Muon: Newton–Schulz in fp32 on CUDA too (default bf16 there; fp32 on CPU)",
         "muon_ns_fp32", kind="switch", group=OPTIM),
    Flag("--muon-qk-clip", "Muon: MuonClip threshold τ: after each step, scale down the query and key weights of "
         "every head whose largest attention logit of the step exceeded τ (Kimi K2's per-head rule; 0: off)",
         "muon_qk_clip", metavar="TAU", group=OPTIM),
    Flag("--seed", "model initialisation, data order and dropout", "seed"),
    Flag("--dtype", "fp32 or bf16 (autocast; fp32 master weights)", "dtype"),
    Flag("--fp8", "FP8 GEMMs for the linears of attention, MLPs and experts (dynamic scales; docs/fp8.md)", "fp8",
         type=str, default=None, choices=FP8_RECIPES, metavar="RECIPE"),
    Flag("--fp8-all-gather", "with --fp8: ZeRO-3 parameter all-gathers and the SP all-gather of activations travel "
         "in FP8 with their scales (half the bf16 bytes)", "fp8_all_gather", kind="switch"),
    Flag("--dsa-stage", "DeepSeek Sparse Attention indexer objective: none (transformers'), dense-warmup (dense "
         "attention, all but the indexers frozen, KL to the main attention) or sparse (KL over the top-k keys, indexer "
         "inputs detached)", "dsa_stage", choices=DSA_STAGES),
    Flag("--dsa-kl-weight", "weight of the indexer's KL term (a mean over the step's queries)", "dsa_kl_weight"),
    Flag("--fp32-residual", "under bf16: keep the residual stream fp32 (default off)", "fp32_residual", kind="toggle"),
    Flag("--grad-reduce-dtype", "DP gradient reduction dtype: fp32 or bf16", "grad_reduce_dtype"),
    Flag("--no-overlap-grad-reduce", "ZeRO 0/1: reduce gradients after backward instead of overlapping with it",
         "overlap_grad_reduce", kind="negate"),
    Flag("--data", "text file, prepare-data directory, or a blend DIR:W,DIR:W (default: the embedded pydoc_data "
         "corpus)", "data"),
    Flag("--out", "run directory (default runs/<timestamp>)", "out"),
    Flag("--dropout", "residual dropout", "dropout"),
    Flag("--attn-dropout", "attention-probability dropout", "attn_dropout"),
    Flag("--tie-embeddings", None, "tie_embeddings", kind="switch", default=None),
    *_MOE,
    Flag("--mtp-layers", "MTP modules (default 0; a config.json's num_nextn_predict_layers is not turned on by itself)",
         "model_overrides.mtp_layers", type=int, default=None, metavar="D", group=MTP),
    Flag("--mtp-loss-weight", "weight λ of the mean MTP cross-entropy added to the loss", "mtp_loss_weight",
         metavar="LAMBDA", group=MTP),
    Flag("--mtp-init", "how MTP modules start under --init-from-hf: from the checkpoint's, or freshly initialised",
         "mtp_init", choices=("checkpoint", "fresh"), group=MTP),
    Flag("--collective-timeout", "seconds before a stuck collective fails", "timeout_s"),
    Flag("--device", "auto (one NCCL rank per GPU when CUDA is present), cpu or cuda", type=str, default="auto"),
    Flag("--gloo-ifname", "network interface for gloo groups (default: GLOO_SOCKET_IFNAME, else the one that reaches "
         "MASTER_ADDR)", type=str, default=None, metavar="IFACE"),
    Flag("--no-progress", "no progress bar", "progress", kind="negate"),
    Flag("--save-every", "checkpoint every N steps and at the last step (0: the last step only)", "save_every",
         group=CHECKPOINTS),
    Flag("--no-checkpoint", "train: write no checkpoint at all (by default the last step is saved, for hf-export)",
         kind="switch", group=CHECKPOINTS),
    Flag("--checkpoint-dir", "default <out>/checkpoints", "checkpoint_dir", group=CHECKPOINTS),
    Flag("--keep", "keep the newest K checkpoints", "keep", group=CHECKPOINTS),
    Flag("--resume", "continue from the checkpoint `latest` names (an older one only if it is damaged)", "resume",
         kind="switch", group=CHECKPOINTS),
    Flag("--auto-resume", "resume when the run has a checkpoint, else start fresh (requeued cluster jobs)",
         kind="switch", group=CHECKPOINTS),
    Flag("--overwrite", "start fresh in a non-empty --out, removing its old checkpoints", kind="switch",
         group=CHECKPOINTS),
    Flag("--save-on-signal", "on this signal to the launcher, any rank or the job (a scheduler's preemption notice): "
         "finish the step, save a checkpoint, exit 143 (none: die at once)", "save_on_signal", type=str,
         default="SIGTERM", metavar="SIG", group=CHECKPOINTS, convert=_signal_name),
    Flag("--async-save", "write checkpoints in the background (torch.distributed.checkpoint.async_save)",
         "async_save", kind="switch", group=CHECKPOINTS),
    Flag("--fault-inject", "make RANK crash, hang, produce NaN, be SIGKILLed or lose its node (KIND: crash, hang, "
         "nan, kill, node; gone: its node lost for good) at STEP, in PHASE (start, forward, backward, optimizer, "
         "mem-ckpt) — for testing recovery",
         "fault_inject", metavar="RANK:STEP:KIND[:PHASE]"),
    Flag("--mem-ckpt-every", "copy each rank's training state every N steps into host memory on its node and on a "
         "peer node, for recovery without a disk read (docs/fault-tolerance.md; 0: off)", "mem_ckpt_every",
         metavar="N", group=CHECKPOINTS),
    Flag("--max-restarts", "built-in launcher: restart the worker group up to N times after a lost rank, resuming from "
         "the newest memory copy or checkpoint (torchrun: its own --max-restarts)", "max_restarts", metavar="N",
         group=CHECKPOINTS),
    Flag("--ranks-per-node", "built-in launcher: how many consecutive ranks stand for one node (default: all)",
         "ranks_per_node", metavar="N", group=CHECKPOINTS),
    Flag("--min-dp", "elastic data parallelism: when a lost node does not come back, go on with the surviving whole DP "
         "replicas (at least D) and the same global batch (0: off)", "min_dp", metavar="D", group=CHECKPOINTS),
    Flag("--debug", "show the full traceback of an environmental failure (full disk, read-only directory) instead "
         "of its one line", "debug", kind="switch"),
    Flag("--bad-step", "on non-finite loss/grads: skip (logged) or abort", "bad_step"),
    Flag("--max-bad-steps", "abort once more steps than this were skipped", "max_bad_steps"),
    Flag("--label-smoothing", "cross-entropy label smoothing in [0, 1)", "label_smoothing"),
    Flag("--no-report", "train: do not render the report PNGs at the end", "report", kind="negate"),
    Flag("--attention-mask", "causal, or document: attend only within each document of a packed window "
         "(EOS-delimited)", "attention_mask"),
    Flag("--reset-positions", "restart RoPE positions at each document start", "reset_positions", kind="switch"),
    Flag("--eval-data", "held-out data like --data (same tokenizer): forward-only eval_loss in metrics.jsonl",
         "eval_data", metavar="SPEC", group=OBSERVE),
    Flag("--eval-every", "evaluate every N steps (default: at the end)", "eval_every", group=OBSERVE),
    Flag("--eval-steps", "global batches per evaluation, taken in order", "eval_steps", group=OBSERVE),
    Flag("--profile-steps", "torch.profiler Chrome traces of steps A..B per rank under <out>/profile/",
         "profile_steps", metavar="A:B", group=OBSERVE),
    Flag("--log-to", "also log metrics to W&B (offline unless configured) or MLflow (optional extras)", "log_to",
         metavar="{wandb,mlflow}", group=OBSERVE),
    Flag("--log-every", "print one key=value line every N steps; default 10, every step for runs of <= 20 steps",
         "log_every", group=OBSERVE),
)
"""Every run flag, in --help order."""

STEPS = {"train": 200, "verify": 3, "simulate": 2}
"""--steps' default per command (train's is TrainConfig.steps)."""


def _field(path: str) -> dataclasses.Field:
    from .parallel import ParallelConfig
    from .training import TrainConfig

    owner, name = (ParallelConfig, path.split(".", 1)[1]) if path.startswith("parallel.") else (TrainConfig, path)
    return next(f for f in dataclasses.fields(owner) if f.name == name)


_TYPES = {"int": int, "float": float, "str": str}


class ToggleOrAuto(argparse.Action):
    """--X (on), --no-X (off) and --X on|off|auto, where auto sets the switch --X-auto instead (`--tp-overlap auto`:
    the planner decides)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__([*option_strings, "--no-" + option_strings[0][2:]], dest, nargs="?", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value (got {values!r})")
            setattr(namespace, self.dest, False)
        elif values in (None, "on", "off"):
            setattr(namespace, self.dest, values != "off")
        elif values == "auto":
            setattr(namespace, self.dest + "_auto", True)
        else:
            parser.error(f"{option_string} {values!r} is unknown; valid: on, off, auto (or bare {option_string})")


def flag_type(flag: Flag):
    """The argparse type: the flag's own, else the field annotation's non-None part (None for switches)."""
    if flag.type is not None or flag.kind != "value":
        return flag.type
    parts = [p.strip() for p in str(_field(flag.field).type).split("|") if p.strip() != "None"]
    return _TYPES.get(parts[0]) if len(parts) == 1 else None


def flag_default(flag: Flag, command: str):
    if flag.name == "--steps":
        return STEPS[command]
    if flag.default is not FROM_FIELD:
        return flag.default
    if flag.kind == "negate" or flag.field is None:
        return False if flag.kind != "value" else None
    f = _field(flag.field)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def config_fields(args) -> tuple[dict, dict, dict]:
    """(TrainConfig fields, ParallelConfig fields, model overrides) the parsed `args` set through RUN_FLAGS;
    model overrides only where given. The CLI decides the degrees, vp and the model source itself."""
    run, parallel, overrides = {}, {}, {}
    for flag in RUN_FLAGS:
        if flag.field is None:
            continue
        value = getattr(args, flag.dest)
        if flag.kind == "negate":
            value = not value
        if flag.convert is not None:
            value = flag.convert(value)
        owner, _, name = flag.field.rpartition(".")
        if owner == "model_overrides":
            if value is not None:
                overrides[name] = value
        else:
            (parallel if owner == "parallel" else run)[name] = value
    return run, parallel, overrides


@dataclass(frozen=True)
class PlanFlag:
    """A train flag as `shardwise plan` takes it. Its name, type and kind are train's (`RUN_FLAGS`); plan states its
    own default and help, since it models a GPU cluster where train runs here, and searches a range where train
    takes one value (`--micro-batch`, `--vp`, `--schedule`)."""

    name: str
    help: str
    """Plan's help; `{...}` fields are filled with the planner's names (presets, schedules) by `plan_argument`."""
    default: object = None
    also: tuple[str, ...] = ()
    """Plan's other spellings of the flag."""
    dest: str | None = None
    choices: tuple | None = None
    metavar: str | None = None
    kind: str | None = None
    """Where plan's argparse kind differs from train's ('switch': a plain on-switch)."""


PLAN_FLAGS: tuple[PlanFlag, ...] = (
    PlanFlag("--model", "model preset: {presets}"),
    PlanFlag("--model-config", "Hugging Face config.json of model_type {model_types} ({shapes_only}: planned for its "
             "shapes, with no command: train cannot build it)", metavar="PATH"),
    PlanFlag("--mtp-layers", "DeepSeek-V3 multi-token prediction modules on the last stage (train's --mtp-layers; "
             "default 0)", default=0),
    PlanFlag("--seq-len", "tokens per sequence (default 4096)", default=4096),
    PlanFlag("--global-batch", "sequences per optimizer step (default {global_batch}; with --explain m=..., m·mb·dp)"),
    PlanFlag("--micro-batch", "sequences per microbatch (default: search 1, 2, 4, 8; explain 1)"),
    PlanFlag("--dtype", "train's --dtype: activation precision (default bf16; weights and AdamW state stay fp32)",
             default="bf16", also=("--precision",), dest="precision"),
    PlanFlag("--fp32-residual", "under bf16, keep the residual stream fp32 (train's flag; default off)", default=False),
    PlanFlag("--grad-reduce-dtype", "dtype of the dp×cp / edp gradient reduction (train's flag; default fp32)",
             default="fp32"),
    PlanFlag("--optimizer", "adamw, or muon on the hidden matrices: its gathers and one momentum buffer (default adamw)",
             default="adamw"),
    PlanFlag("--zero", "ZeRO stage over dp×cp (default 1)", default=1, choices=ZERO_STAGES),
    PlanFlag("--dp-shard", "ZeRO 2/3 hybrid sharding over S dp ranks only (0: none; default: try dp and the largest S "
             "whose shard group stays inside a node)"),
    PlanFlag("--recompute", "activation recompute (default selective)", default="selective", choices=RECOMPUTE),
    PlanFlag("--sequence-parallel", "Megatron sequence parallelism on layouts with tp > 1 (default on)", default=True),
    PlanFlag("--schedule", "pipeline schedule(s) to search, comma-separated from {schedules} (default 1f1b,interleaved)",
             default="1f1b,interleaved", also=("--schedules",), dest="schedules"),
    PlanFlag("--vp", "interleaved: model chunks per pipeline rank (default: search 2..--max-vp)"),
    PlanFlag("--cp-impl", "context-parallel attention (default ring)", default="ring", choices=CP_IMPLS),
    PlanFlag("--tp-overlap", "model train's --tp-overlap: SP collectives in tp chunks under the GEMMs (default off)",
             default=False, kind="switch"),
    PlanFlag("--expert-placement", "train's MoE expert placement: contiguous (default), or balanced — plan the busiest "
             "ep rank once the experts of --routing's layers (or of --moe-skew's stated load) are placed for an even "
             "load", default="contiguous", choices=("contiguous", "balanced")),
    PlanFlag("--fp8", "train's --fp8 RECIPE: the FP8 linears' GEMMs at the GPU's FP8 peak, their amax all-reduces; "
             "MFU against the FP8 peak, the bf16-equivalent beside it (default off)"),
    PlanFlag("--fp8-all-gather", "train's --fp8-all-gather: ZeRO-3 and SP all-gathers in FP8 with their scales",
             default=False, kind="switch"),
)
"""The train flags `shardwise plan` takes, with plan's own defaults (its other flags are its own: GPUs, search)."""


def plan_argument(name: str, choices=None, **facts) -> tuple[list[str], dict]:
    """(option strings, argparse keywords) of train flag `name` on plan's parser: train's type, kind and metavar,
    plan's default and help (`facts` fill its `{...}` fields); `choices` where the planner names them (precisions)."""
    use = next(f for f in PLAN_FLAGS if f.name == name)
    flag = next(f for f in RUN_FLAGS if f.name == name)
    kw = dict(default=use.default, help=use.help.format(**facts) if facts else use.help)
    if use.dest is not None:
        kw["dest"] = use.dest
    kind = use.kind or flag.kind
    if kind == "toggle":
        kw["action"] = argparse.BooleanOptionalAction
    elif kind == "switch":
        kw["action"] = "store_true"
    else:
        kw |= {k: v for k, v in dict(type=flag_type(flag), choices=choices or use.choices or flag.choices,
                                     metavar=use.metavar or flag.metavar).items() if v is not None}
    if kw["default"] is None:
        del kw["default"]
    return [name, *use.also], kw
