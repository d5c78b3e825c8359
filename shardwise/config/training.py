"""Everything one run needs (`TrainConfig`; the degrees live in `parallel.py`), with all the
validation of its own fields that can be done before any process starts. Pure: reading Hugging Face
configs, data manifests and tokenizers is run assembly's job (`shardwise.training.assemble`), which stores the final
model in `TrainConfig.resolved_model`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..rules.partition import ORDERS, check_seq_len, split_layers
from ..rules.schedules import SCHEDULE_NAMES, build_schedule
from ..rules.validation import (
    CP_IMPLS, DSA_STAGES, FP8_RECIPES, RECOMPUTE, REST, ZERO_STAGES, dp_shard_problem, ep_dpcp_problem, fp8_cp_problem,
    heads_tp_problem, hsdp_zero_problem, rest_of_world, sp_tokens_problem, tp_kv_problem, ulysses_problem,
)
from ..rules.validation import fp8_moe_problem, fp8_wire_problem
from .errors import ConfigError
from .schedule import validate_optim
from .model import ModelConfig, get_model_config
from .parallel import AXES, ParallelConfig


def _tp_problem(tp: int, m: ModelConfig) -> str | None:
    """Why `tp` cannot shard model `m`'s heads and FFN (None: it can)."""
    if heads_tp_problem(m.n_heads, tp):
        return f"does not divide n_heads={m.n_heads}"
    kv = tp_kv_problem(tp, m.n_kv_heads)
    if kv:
        return kv
    if m.ffn_dim % tp:
        return f"does not divide ffn_dim={m.ffn_dim}"
    return None


@dataclass(frozen=True)
class TrainConfig:
    """Everything one `shardwise train` / `shardwise verify` run needs. Frozen: resolution (`resolved`, run
    assembly) returns a new config, so what a rank runs is what was validated; derive others with
    `dataclasses.replace`."""

    model: str | ModelConfig = "tiny"
    """A preset name, or a ModelConfig for custom shapes (tests, HF configs)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    steps: int = 200
    seq_len: int = 128
    micro_batch: int = 4
    """Sequences per microbatch per data-parallel rank."""
    tp_overlap_auto: bool = False
    """--tp-overlap-auto: the CLI sets parallel.tp_overlap for this layout and host before the ranks start, by the
    planner's rule (planner/tp_overlap.py `choose`), and prints the choice and why."""
    global_batch: int | None = None
    """Sequences per optimizer step over all dp ranks; default micro_batch × dp (no accumulation)."""
    lr: float = 3e-3
    """Peak learning rate (reached at the end of the warm-up)."""
    lr_schedule: str = "cosine"
    """After the warm-up: cosine, linear (both decay to min_lr on the schedule's last step), wsd (constant, then a
    linear decay over the last wsd_decay_fraction of the schedule) or constant."""
    min_lr: float | None = None
    """LR at the end of the schedule; None = lr/10. Never above lr."""
    warmup_steps: int | None = None
    """Linear warm-up steps, honoured exactly; None = 10% of the schedule's length, between 1 and 20."""
    lr_decay_steps: int | None = None
    """The schedule's length; None = steps (on resume: the length stored in the checkpoint, so extending a run
    with a larger --steps does not move the LR). Steps past it run at min_lr."""
    wsd_decay_fraction: float = 0.2
    """wsd: the fraction of the schedule's length spent decaying to min_lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    grad_clip: float = 1.0
    """Global grad-norm clip (0 disables)."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    optimizer: str = "adamw"
    """adamw, or muon: orthogonalised momentum on the hidden matrices, AdamW on the rest (docs/optimizers.md)."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum coefficient."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations that orthogonalise each matrix's momentum."""
    muon_ns_fp32: bool = False
    """Run the Newton–Schulz iteration in fp32 on CUDA too (it runs in bf16 there by default, fp32 on CPU)."""
    muon_qk_clip: float = 0.0
    """MuonClip's τ: after each step, scale the query and key weights of every head whose largest attention logit
    of the step exceeded τ so it would have been τ (0: off)."""
    seed: int = 1234
    dtype: str = "fp32"
    """fp32 or bf16 (bf16 autocast for matmuls; master weights and optimizer state stay fp32)."""
    fp32_residual: bool = False
    """Under bf16: keep the residual stream (and so the SP/PP/EP payloads) fp32; default bf16, as Megatron."""
    fp8: str | None = None
    """FP8 GEMMs for the linears of attention, MLPs and experts: tensorwise, rowwise, blockwise or mxfp8 (docs/fp8.md);
    None: off."""
    fp8_all_gather: bool = False
    """With fp8: ZeRO-3 parameter all-gathers and the SP all-gather of activations travel in FP8 with their scales."""
    dsa_stage: str = "none"
    """DeepSeek Sparse Attention's indexer objective (docs/sparse-attention.md): none (transformers': the indexer
    untrained), dense-warmup (dense attention, every parameter but the indexers' frozen, KL to the main attention) or
    sparse (top-k attention, KL over the selected keys on detached indexer inputs)."""
    dsa_kl_weight: float = 1.0
    """Weight of the indexer's KL term (a mean over the step's queries) under --dsa-stage dense-warmup or sparse."""
    grad_reduce_dtype: str = "fp32"
    """Dtype of the DP gradient reduction: fp32, or bf16 (bucket cast for the collective, accumulated in fp32)."""
    overlap_grad_reduce: bool = True
    """Start each gradient bucket's dp×cp reduction from backward (ZeRO 0/1; ZeRO 2/3 always do)."""
    data: str | None = None
    """A text file, a `shardwise prepare-data` directory, or a blend of them `a:0.7,b:0.3`; default:
    CPython's pydoc_data.topics (embedded, no download)."""
    out: str | None = None
    """Run directory for metrics.jsonl, comm.json, summary.json; default runs/<timestamp>."""
    dropout: float | None = None
    attn_dropout: float | None = None
    tie_embeddings: bool | None = None
    model_overrides: dict = field(default_factory=dict)
    """ModelConfig fields to override on the preset (e.g. moe_experts from --moe-experts)."""
    timeout_s: float = 300.0
    """Collective timeout: a rank stuck longer than this in a collective fails instead of hanging."""
    progress: bool = True
    log_every: int | None = None
    """Print one `key=value` line every N steps (and each evaluation's); None = every step for runs of at most
    20 steps, else every 10."""
    save_every: int = 0
    """Write a checkpoint every N steps and at the last step; 0 = only the last step when final_checkpoint."""
    final_checkpoint: bool = False
    """Checkpoint the last step even without save_every (the CLI's default; --no-checkpoint turns it off)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; default <out>/checkpoints."""
    keep: int | None = None
    """Keep only the newest K checkpoints."""
    resume: bool = False
    """Continue from the newest intact checkpoint (any layout: it reshards)."""
    async_save: bool = False
    """Write checkpoints with torch.distributed.checkpoint.async_save while training continues; each is
    published (manifest, rename, `latest`) only once every rank's write completed."""
    save_on_signal: str | None = None
    """SIGTERM, SIGUSR1 or SIGUSR2: on it, every rank finishes its step, one checkpoint is saved and the run stops
    (`training.preemption`); None: no handler (the library default; the CLI's is SIGTERM)."""
    fault_inject: str | None = None
    """RANK:STEP:KIND[:PHASE] — make global rank RANK crash, hang, produce a NaN loss, be SIGKILLed (kill) or lose its
    whole node (node) at STEP, in PHASE (start, forward, backward, optimizer, mem-ckpt; default start) (tests)."""
    mem_ckpt_every: int = 0
    """Every N steps each rank copies its training state into host memory: its own node's and a peer node's
    (`shardwise.resilience`); a restarted worker group resumes from it. 0: off."""
    max_restarts: int = 0
    """The built-in launcher restarts the worker group this many times after a lost rank (torchrun: its own flag)."""
    ranks_per_node: int | None = None
    """Built-in launcher: consecutive ranks that stand for one node (their memory copies are lost together);
    default: every rank on one node. Under torchrun a node is an agent (LOCAL_WORLD_SIZE)."""
    min_dp: int = 0
    """Elastic data parallelism: when a lost node does not come back, continue on the surviving whole DP replicas
    (at least this many) with the same global batch (`shardwise.resilience.elastic`); 0: off (wait for the node)."""
    debug: bool = False
    """Environmental failures (a checkpoint the filesystem refused) keep their traceback instead of one line."""
    bad_step: str = "skip"
    """Non-finite loss or gradients: 'skip' the step (logged), or 'abort' the run at once."""
    max_bad_steps: int = 5
    """With bad_step='skip': abort once more than this many steps were skipped."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing ε in [0, 1): the target is (1-ε)·one-hot + ε/V."""
    mtp_loss_weight: float = 0.1
    """λ of multi-token prediction (`--mtp-loss-weight`, with --mtp-layers D > 0): the loss adds λ times the mean
    of the D depths' cross-entropies (DeepSeek-V3 used 0.3, then 0.1)."""
    mtp_init: str = "checkpoint"
    """Under --init-from-hf: MTP modules start from the checkpoint's ('checkpoint') or freshly initialised ('fresh')."""
    report: bool = True
    """Render the report PNGs (loss, tokens/s, comm per axis, timeline) into the run directory at the end."""
    attention_mask: str = "causal"
    """'causal', or 'document': a token attends only within its own document of the packed window."""
    reset_positions: bool = False
    """Restart RoPE positions at 0 at each document start (documents begin right after an EOS)."""
    eos_id: int | None = None
    """End-of-document id that delimits documents for the two knobs above; None = the byte tokenizer's (256)."""
    init_from_hf: str | None = None
    """Hugging Face model directory to fine-tune: its config.json is the model (`model` must be None, shape
    flags must agree), every rank reads its slices of the weights, its tokenizer.json is checked and recorded."""
    init_tokenizer: str | None = None
    """The tokenizer of an --init-from-hf directory without tokenizer.json: prepared --data is checked against it."""
    allow_tokenizer_mismatch: bool = False
    """Fine-tune even when the data's tokenizer differs from the --init-from-hf checkpoint's."""
    eval_data: str | None = None
    """Held-out data (same forms as `data`, same tokenizer): evaluated forward-only on `eval_steps` fixed global
    batches taken in order, so eval_loss depends on the weights alone."""
    eval_every: int | None = None
    """Evaluate every N steps (and at the last step); None = only at the last step."""
    eval_steps: int = 10
    """Global batches of eval_data per evaluation."""
    profile_steps: str | None = None
    """A:B — torch.profiler traces of steps A..B (1-based, inclusive) per rank under <out>/profile/."""
    log_to: str | None = None
    """Also log metrics to 'wandb' or 'mlflow' (optional extras; offline/local unless configured)."""
    resolved_model: ModelConfig | None = None
    """The final model, set by run assembly (`shardwise.training.assemble.assemble`) once the HF config and the data's
    vocabulary are applied; None until then."""

    def residual_dtype(self) -> str:
        """'bf16' when the residual stream runs in bf16, else 'fp32'."""
        if self.grad_reduce_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--grad-reduce-dtype {self.grad_reduce_dtype!r}; valid: fp32, bf16")
        return "bf16" if self.dtype == "bf16" and not self.fp32_residual else "fp32"

    def fault(self) -> tuple[int, int, str, str] | None:
        """(rank, 1-based step, kind, phase) of --fault-inject, or None."""
        if not self.fault_inject:
            return None
        parts = self.fault_inject.split(":")
        kinds = ("crash", "hang", "nan", "kill", "node", "gone")
        phases = ("start", "forward", "backward", "optimizer", "mem-ckpt")
        if len(parts) == 3:
            parts.append("start")
        if (len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in kinds
                or parts[3] not in phases):
            raise ConfigError(f"--fault-inject {self.fault_inject!r} must be RANK:STEP:KIND[:PHASE] with KIND in "
                              f"{', '.join(kinds)} and PHASE in {', '.join(phases)}, e.g. 1:3:crash")
        return int(parts[0]), int(parts[1]), parts[2], parts[3]

    def profile_range(self) -> tuple[int, int] | None:
        """--profile-steps A:B as (A, B), 1-based and inclusive; None when off."""
        if self.profile_steps is None:
            return None
        a, _, b = str(self.profile_steps).partition(":")
        if not (a.isdigit() and b.isdigit()) or not 1 <= int(a) <= int(b):
            raise ConfigError(f"--profile-steps {self.profile_steps!r} must be A:B with 1 <= A <= B (steps, "
                              "inclusive), e.g. 3:5")
        return int(a), int(b)

    def _validate_observability(self) -> None:
        if self.eval_every is not None and (not isinstance(self.eval_every, int) or self.eval_every <= 0):
            raise ConfigError(f"--eval-every {self.eval_every!r} must be a positive integer (steps between "
                              "evaluations)")
        if not isinstance(self.eval_steps, int) or self.eval_steps <= 0:
            raise ConfigError(f"--eval-steps {self.eval_steps!r} must be a positive integer (global batches)")
        if self.eval_every is not None and self.eval_data is None:
            raise ConfigError(f"--eval-every {self.eval_every} needs --eval-data (held-out text file or "
                              "prepare-data directory)")
        rng = self.profile_range()
        if rng is not None and rng[1] > self.steps:
            raise ConfigError(f"--profile-steps {self.profile_steps} ends after the last step {self.steps}")
        if self.log_to not in (None, "wandb", "mlflow"):
            raise ConfigError(f"--log-to {self.log_to!r} is unknown; valid: wandb, mlflow")

    def model_config(self) -> ModelConfig:
        """The run's final model. After run assembly (`shardwise.training.assemble.assemble`) that is `resolved_model`; a
        config that names only a preset or a ModelConfig resolves here, purely (no file is read)."""
        if self.resolved_model is not None:
            return self.resolved_model
        if self.init_from_hf or self.data is not None:
            raise ConfigError("a run with --init-from-hf or --data is assembled by shardwise.training.assemble.assemble(cfg), which "
                              "reads the checkpoint's config.json and the data's tokenizer")
        cfg = self.preset_model()
        self.check_model_overrides(cfg)
        return cfg

    def preset_model(self) -> ModelConfig:
        """`model` (a preset name or a ModelConfig) with the flags' overrides applied and validated."""
        overrides = self.model_flag_overrides()
        if isinstance(self.model, ModelConfig):
            cfg = self.model.with_overrides(**{k: v for k, v in overrides.items() if v is not None})
            cfg.validate()
            return cfg
        return get_model_config(self.model, **overrides)

    def model_flag_overrides(self) -> dict:
        """ModelConfig fields set by flags (None = not given)."""
        return dict(dropout=self.dropout, attn_dropout=self.attn_dropout, tie_embeddings=self.tie_embeddings,
                    **self.model_overrides)

    def check_model_overrides(self, cfg: ModelConfig) -> None:
        stray = sorted(k for k in self.model_overrides if k.startswith("moe_") and k != "moe_experts")
        if stray and not cfg.moe_experts:
            raise ConfigError(f"--{stray[0].replace('_', '-')} given, but model {cfg.name!r} has no experts; "
                              "add --moe-experts E or use an MoE preset such as tiny-moe")

    def resolved(self, world_size: int | None = None) -> "TrainConfig":
        """A new config with every derived degree filled — dp=-1 the rest of `world_size`, dualpipev's 2 chunks
        per rank — validated by everything that needs no process."""
        self.residual_dtype()
        p = self.parallel
        for a in AXES:
            v = getattr(p, a)
            if not isinstance(v, int) or (v <= 0 and not (a == "dp" and v == REST)):
                raise ConfigError(f"--{a} {v!r} must be a positive integer" + (" or -1 (the rest)" if a == "dp" else ""))
        if p.dp == REST:
            if world_size is None:
                raise ConfigError("--dp -1 needs a known world size (run under torchrun)")
            dp = rest_of_world(world_size, p.pp, p.cp, p.tp)
            if dp is None:
                raise ConfigError(f"world size {world_size} is not divisible by pp={p.pp} × cp={p.cp} × tp={p.tp} = "
                                  f"{p.pp * p.cp * p.tp}")
            p = replace(p, dp=dp)
        if p.pp > 1 and p.schedule == "dualpipev":  # the V: always two chunks per rank
            p = replace(p, vp=2)
        world = p.world_size
        if world_size is not None and world != world_size:
            raise ConfigError(
                f"dp={p.dp} × pp={p.pp} × cp={p.cp} × tp={p.tp} = {world} does not equal the world size {world_size}"
            )
        cfg = replace(self, parallel=p)
        cfg.validate(world)
        return cfg

    def resolve_world(self, world_size: int | None = None) -> int:
        """The world size of the resolved config (`resolved`: validates everything that needs no process)."""
        return self.resolved(world_size).parallel.world_size

    @staticmethod
    def _validate_recompute(p: ParallelConfig, m: ModelConfig) -> None:
        if p.recompute not in RECOMPUTE:
            raise ConfigError(f"--recompute {p.recompute!r} is not supported; valid: {', '.join(RECOMPUTE)}")
        if p.recompute_layers is None:
            return
        stages = p.pp * (p.vp if p.pp > 1 else 1)
        fewest = min(p.pp_layers) if p.pp_layers else m.n_layers // stages
        if not isinstance(p.recompute_layers, int) or not 1 <= p.recompute_layers <= fewest:
            raise ConfigError(f"--recompute-layers {p.recompute_layers!r} must be in [1, {fewest}] "
                              f"(the layers of the smallest stage/chunk)")

    @staticmethod
    def _validate_compile(p: ParallelConfig) -> None:
        if not p.compile:
            return
        try:  # torch only when asked: the planner imports this module without torch
            from torch._dynamo.eval_frame import check_if_dynamo_supported

            check_if_dynamo_supported()
        except Exception as e:  # noqa: BLE001 - any reason torch.compile cannot run here
            raise ConfigError(f"--compile: torch.compile is unavailable here ({str(e).strip() or type(e).__name__}); "
                              "run without --compile") from None

    @staticmethod
    def _validate_dp_shard(p: ParallelConfig) -> None:
        valid = ", ".join(str(s) for s in range(1, p.dp + 1) if p.dp % s == 0)
        if dp_shard_problem(p.dp, p.dp_shard):
            raise ConfigError(f"--dp-shard {p.dp_shard!r} must be a divisor of dp={p.dp}; valid: {valid}")
        if hsdp_zero_problem(p.hsdp, p.zero):
            raise ConfigError(f"--dp-shard {p.dp_shard} shards nothing at --zero {p.zero} (ZeRO 0/1 keep gradients "
                              "and parameters whole); use --zero 2 or 3, or drop --dp-shard")

    def _validate_optimizer(self) -> None:
        if self.optimizer not in ("adamw", "muon"):
            raise ConfigError(f"--optimizer {self.optimizer!r} is unknown; valid: adamw, muon")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"--muon-momentum {self.muon_momentum} must be in [0, 1), e.g. 0.95")
        if not (isinstance(self.muon_ns_steps, int) and self.muon_ns_steps >= 1):
            raise ConfigError(f"--muon-ns-steps {self.muon_ns_steps!r} must be a positive integer, e.g. 5")
        if not (isinstance(self.muon_qk_clip, (int, float)) and self.muon_qk_clip >= 0):
            raise ConfigError(f"--muon-qk-clip {self.muon_qk_clip!r} must be a logit threshold > 0 (e.g. 100), or 0 for off")
        if self.muon_qk_clip and self.optimizer != "muon":
            raise ConfigError(f"--muon-qk-clip {self.muon_qk_clip} clips after Muon's step: add --optimizer muon")

    def validate(self, world: int) -> None:
        p = self.parallel
        m = self.model_config()
        if self.async_save and not (self.save_every or self.final_checkpoint):
            raise ConfigError("--async-save needs --save-every N or the final checkpoint (drop --no-checkpoint)")
        self._validate_recompute(p, m)
        self._validate_compile(p)
        self._validate_optimizer()
        if self.muon_qk_clip and m.qk_norm and not m.is_mla:
            raise ConfigError(f"--muon-qk-clip: model {m.name!r} normalises each head's q and k (qk_norm), which "
                              "undoes a scaling of Wq and Wk; run it without --muon-qk-clip")
        if p.zero not in ZERO_STAGES:
            raise ConfigError(f"--zero {p.zero} is not supported; valid: 0, 1, 2 or 3")
        if p.zero == 3 and p.dp * p.cp == 1:
            raise ConfigError("--zero 3 shards parameters over dp×cp, which is 1 here: nothing to shard; "
                              "use --zero 0, or --dp/--cp > 1")
        self._validate_dp_shard(p)
        if p.sequence_parallel and p.tp == 1:
            raise ConfigError("--sequence-parallel needs --tp > 1 (it shards the TP regions' sequence)")
        if p.tp_overlap and not p.sequence_parallel:
            raise ConfigError("--tp-overlap needs --sequence-parallel (it chunks the SP all-gathers and "
                              "reduce-scatters)")
        problem = _tp_problem(p.tp, m)
        if problem:
            valid = ", ".join(str(t) for t in range(1, m.n_heads + 1) if not _tp_problem(t, m))
            raise ConfigError(f"--tp {p.tp} {problem} of model {m.name!r}; valid: {valid}")
        for name in ("steps", "seq_len", "micro_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} {v!r} must be a positive integer")
        validate_optim(self)
        if self.seq_len > m.max_seq_len:
            raise ConfigError(f"--seq-len {self.seq_len} exceeds max_seq_len={m.max_seq_len} of model {m.name!r}")
        if p.cp > 1:
            self._validate_context(m)
        if p.sequence_parallel and sp_tokens_problem(self.seq_len, p.cp, p.tp):
            raise ConfigError(f"--seq-len {self.seq_len} / cp {p.cp} = {self.seq_len // p.cp} tokens per rank is not "
                              f"divisible by tp={p.tp} (needed by --sequence-parallel)")
        gb = self.global_batch
        if gb is not None:
            if not isinstance(gb, int) or gb <= 0:
                raise ConfigError(f"--global-batch {gb!r} must be a positive integer")
            if gb % (self.micro_batch * p.dp):
                raise ConfigError(
                    f"--global-batch {gb} must be a multiple of micro-batch {self.micro_batch} × dp {p.dp}"
                    f" = {self.micro_batch * p.dp}"
                )
        if self.dtype not in ("fp32", "bf16"):
            raise ConfigError(f"--dtype {self.dtype!r} is not supported; valid: fp32, bf16")
        if p.ep > 1 or m.moe_experts:
            self._validate_experts(m)
        if p.pp > 1:
            self._validate_pipeline(m)
        elif p.vp != 1 or p.pp_layers is not None or p.pp_scatter_gather:
            raise ConfigError("--vp / --pp-layers / --pp-scatter-gather need --pp > 1")
        if self.log_every is not None and (not isinstance(self.log_every, int) or self.log_every < 1):
            raise ConfigError(f"--log-every {self.log_every!r} must be a positive integer")
        if not isinstance(self.save_every, int) or self.save_every < 0:
            raise ConfigError(f"--save-every {self.save_every!r} must be a non-negative integer")
        if self.keep is not None and (not isinstance(self.keep, int) or self.keep < 1):
            raise ConfigError(f"--keep {self.keep!r} must be a positive integer")
        fault = self.fault()
        if fault is not None and fault[0] >= world:
            raise ConfigError(f"--fault-inject rank {fault[0]} does not exist (world size {world})")
        if fault is not None and fault[3] == "mem-ckpt" and not self.mem_ckpt_every:
            raise ConfigError(f"--fault-inject {self.fault_inject}: phase mem-ckpt needs --mem-ckpt-every N")
        for name in ("mem_ckpt_every", "max_restarts"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} {v!r} must be a non-negative integer")
        if not isinstance(self.min_dp, int) or not 0 <= self.min_dp <= p.dp:
            raise ConfigError(f"--min-dp {self.min_dp!r} must be an integer from 0 (off) to --dp {p.dp}")
        rpn = self.ranks_per_node
        if rpn is not None and (not isinstance(rpn, int) or rpn < 1 or world % rpn):
            raise ConfigError(f"--ranks-per-node {rpn!r} must divide the world size {world}")
        if self.bad_step not in ("skip", "abort"):
            raise ConfigError(f"--bad-step {self.bad_step!r} is not supported; valid: skip, abort")
        if not isinstance(self.max_bad_steps, int) or self.max_bad_steps < 0:
            raise ConfigError(f"--max-bad-steps {self.max_bad_steps!r} must be a non-negative integer")
        if self.timeout_s <= 0:
            raise ConfigError(f"--collective-timeout {self.timeout_s} must be positive (seconds)")
        if not (isinstance(self.mtp_loss_weight, (int, float)) and 0.0 <= self.mtp_loss_weight < float("inf")):
            raise ConfigError(f"--mtp-loss-weight {self.mtp_loss_weight} must be a finite number >= 0, e.g. 0.1")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"--label-smoothing {self.label_smoothing} must be in [0, 1), e.g. 0.1")
        if self.attention_mask not in ("causal", "document"):
            raise ConfigError(f"--attention-mask {self.attention_mask!r} is unknown; valid: causal, document")
        self._validate_observability()
        if self.fp8 is not None:
            self._validate_fp8(p, m)
        elif self.fp8_all_gather:
            raise ConfigError("--fp8-all-gather needs --fp8 RECIPE (tensorwise, rowwise, blockwise or mxfp8)")
        self._validate_dsa(m)
        if self.eos_id is not None and (not isinstance(self.eos_id, int) or not 0 <= self.eos_id < m.vocab_size):
            raise ConfigError(f"eos id {self.eos_id!r} must be a token id in [0, {m.vocab_size})")

    def _validate_dsa(self, m: ModelConfig) -> None:
        if self.dsa_stage not in DSA_STAGES:
            raise ConfigError(f"--dsa-stage {self.dsa_stage!r} is unknown; valid: {', '.join(DSA_STAGES)}")
        if self.dsa_stage == "none":
            return
        if not m.is_dsa:
            raise ConfigError(f"--dsa-stage {self.dsa_stage} needs a DeepSeek Sparse Attention model (e.g. --model "
                              f"deepseek-v3.2 or glm-5); model {m.name!r} has no indexer")
        if not (isinstance(self.dsa_kl_weight, (int, float)) and 0.0 < self.dsa_kl_weight < float("inf")):
            raise ConfigError(f"--dsa-kl-weight {self.dsa_kl_weight} must be a finite number > 0, e.g. 1.0")
        if self.dsa_stage == "dense-warmup" and m.moe_experts and m.moe_bias_update_rate:
            raise ConfigError(f"--dsa-stage dense-warmup freezes the main model, but its routers' biases would still "
                              f"move (moe_bias_update_rate={m.moe_bias_update_rate}); add --moe-bias-update-rate 0")

    def _validate_fp8(self, p: ParallelConfig, m: ModelConfig) -> None:
        if self.fp8 not in FP8_RECIPES:
            raise ConfigError(f"--fp8 {self.fp8!r} is unknown; valid: {', '.join(FP8_RECIPES)}")
        if p.tp_overlap and self.fp8_all_gather:
            raise ConfigError(f"--fp8-all-gather with --tp-overlap: the overlapped chunks gather in high precision "
                              f"(--fp8 {self.fp8} runs with --tp-overlap); drop one of them")
        problem = fp8_cp_problem(self.fp8, self.seq_len, p.cp, p.cp_order == "balanced")
        if problem:
            raise ConfigError(f"--fp8 {self.fp8} with --cp {p.cp} and --seq-len {self.seq_len} {problem}")
        problem = m.moe_experts and fp8_moe_problem(self.fp8, p.tp if p.sequence_parallel else 1, p.cp, p.dp, p.ep,
                                                    self.micro_batch, self.seq_len, bool(m.moe_shared_experts),
                                                    m.moe_capacity_factor is not None, p.cp_order == "balanced")
        if problem:
            raise ConfigError(f"--fp8 {self.fp8} on MoE model {m.name!r} {problem}")
        problem = self.fp8_all_gather and fp8_wire_problem(self.fp8, p.zero == 3, p.sequence_parallel and p.tp > 1)
        if problem:
            raise ConfigError(f"--fp8-all-gather with --fp8 {self.fp8} {problem}")

    def _validate_experts(self, m: ModelConfig) -> None:
        p = self.parallel
        if p.ep > 1 and not m.moe_experts:
            raise ConfigError(f"--ep {p.ep} needs an MoE model (e.g. --model tiny-moe or --moe-experts E)")
        if ep_dpcp_problem(p.dp, p.cp, p.ep):
            raise ConfigError(f"--ep {p.ep} must divide dp × cp = {p.dp} × {p.cp} = {p.dp * p.cp} "
                              "(expert parallelism is drawn from the data-parallel ranks)")
        if m.moe_experts % p.ep:
            valid = ", ".join(str(e) for e in range(1, m.moe_experts + 1) if not m.moe_experts % e)
            raise ConfigError(f"--ep {p.ep} does not divide moe_experts={m.moe_experts} of model {m.name!r}; "
                              f"valid: {valid}")
        self._validate_placement(m)
        if m.moe_experts and m.moe_aux_loss_scope == "model" and m.moe_aux_loss_coef and p.pp > 1:
            raise ConfigError(f"--pp {p.pp} with model {m.name!r}'s aux loss pooled over all layers "
                              "(moe_aux_loss_scope='model', Hugging Face's): the pool needs every layer on one stage; "
                              "use --pp 1 or --moe-aux-loss-coef 0")

    def _validate_placement(self, m: ModelConfig) -> None:
        p = self.parallel
        if p.expert_placement not in ("contiguous", "balanced"):
            raise ConfigError(f"--expert-placement {p.expert_placement!r} is unknown; valid: contiguous, balanced")
        if p.expert_placement == "balanced" and not p.expert_routing:
            raise ConfigError("--expert-placement balanced needs --expert-routing RUN_DIR (a recorded routing.jsonl)")
        if p.expert_replicas != 1 and p.expert_placement != "balanced":
            raise ConfigError(f"--expert-replicas {p.expert_replicas} needs --expert-placement balanced")
        if not 1 <= p.expert_replicas <= p.ep:
            raise ConfigError(f"--expert-replicas {p.expert_replicas} must be in 1..ep={p.ep}")
        if p.expert_replicas > 1 and self.fp8:
            raise ConfigError(f"--expert-replicas {p.expert_replicas} does not run with --fp8 {self.fp8} yet (FP8 "
                              "expert GEMMs do not sum the copies' gradients); drop one of them")

    def _validate_context(self, m: ModelConfig) -> None:
        p = self.parallel
        if p.cp_order not in ORDERS:
            raise ConfigError(f"--cp-order {p.cp_order!r} is unknown; valid: {', '.join(ORDERS)}")
        if p.cp_impl not in CP_IMPLS:
            raise ConfigError(f"--cp-impl {p.cp_impl!r} is unknown; valid: {', '.join(CP_IMPLS)}")
        try:
            check_seq_len(self.seq_len, p.cp, p.cp_order)
        except ValueError as e:
            raise ConfigError(f"--seq-len: {e}") from None
        if m.attn_dropout > 0:
            raise ConfigError("--attn-dropout > 0 is not supported with --cp > 1 (ring attention has no dropout)")
        problem = ulysses_problem(m.n_heads, m.n_kv_heads, p.tp, p.cp) if p.cp_impl == "ulysses" else None
        if problem:
            raise ConfigError(f"--cp-impl {problem}")

    def _validate_pipeline(self, m: ModelConfig) -> None:
        p = self.parallel
        if p.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"--schedule {p.schedule!r} is unknown; valid: {', '.join(SCHEDULE_NAMES)}")
        if p.schedule not in ("interleaved", "dualpipev") and p.vp != 1:
            raise ConfigError(f"--vp {p.vp} needs --schedule interleaved (schedule {p.schedule} runs one chunk per rank)")
        if p.pp_scatter_gather and (p.tp == 1 or p.sequence_parallel):
            raise ConfigError("--pp-scatter-gather needs --tp > 1 without --sequence-parallel (under SP each TP "
                              "rank already sends only its own sequence shard)")
        try:
            build_schedule(p.schedule, p.pp, self.grad_accum, p.vp)
        except ValueError as e:
            raise ConfigError(f"{e} (microbatches = global batch / (micro-batch × dp) = {self.grad_accum}; "
                              f"set --microbatches)") from None
        try:
            split_layers(m.n_layers, p.pp * p.vp, p.pp_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def grad_accum(self) -> int:
        gb = self.global_batch or self.micro_batch * self.parallel.dp
        return gb // (self.micro_batch * self.parallel.dp)
