"""Run assembly: the one place that turns flags into the final, validated configuration of a run.

`TrainConfig` holds only what the user asked for and validates its own fields (`shardwise.config`, which
reads no file). Everything that must look outside it lives here: a Hugging Face config.json
(`--model-config`, `--init-from-hf`), a prepared data directory's manifest (the vocabulary follows its
tokenizer), and the check of `--init-from-hf` weights, tokenizer and token ids against each other. The
CLI, train, verify, hf-compare and the planner's `--explain` all call `assemble`; dependencies run one
way: CLI → run → {config, data, hf_config} → partition.
"""
from __future__ import annotations

import dataclasses

from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ..config.args import default_vp, global_batch
from ..config.args import degrees as args_degrees
from ..config.flags import config_fields
from ..data.shards import data_vocab
from ..data.tokenizer import VOCAB_SIZE
from ..hf.config import config_from_hf, init_model_config


def config_from_args(args, torchrun_world: int | None) -> TrainConfig:
    """The assembled run of parsed run flags (`config.args`): the CLI, `simulate` and `plan` read train
    commands through this one function."""
    run, parallel, overrides = config_fields(args)
    degrees = args_degrees(args, torchrun_world)
    parallel = ParallelConfig(**(parallel | degrees | {"vp": default_vp(args)}))
    model = args.model if args.model is not None or args.init_from_hf else "tiny"
    if args.model_config:
        model = read_model_config(args.model_config)
    run |= dict(global_batch=global_batch(args, degrees, torchrun_world),
                final_checkpoint=args.command == "train" and not args.no_checkpoint)
    return assemble(TrainConfig(model=model, parallel=parallel, model_overrides=overrides, **run), torchrun_world)


def read_model_config(path: str) -> ModelConfig:
    """`--model-config config.json` (or a model directory): the shapes of a Hugging Face config."""
    return config_from_hf(path)


def fit_vocab(model, spec: str | None, follows_tokenizer: bool):
    """The model's vocabulary follows --data's tokenizer for the byte-sized presets (tiny, small,
    tiny-moe); a model with its own vocabulary (a preset like llama3-8b, a given config) must cover it."""
    found = data_vocab(spec)
    if found is None:
        return model
    vocab, what = found
    if follows_tokenizer and model.vocab_size == VOCAB_SIZE:
        return dataclasses.replace(model, vocab_size=vocab)
    if vocab > model.vocab_size:
        raise ConfigError(f"--data {what}: the tokenizer has {vocab} ids but model {model.name!r} has "
                          f"vocab_size={model.vocab_size}; use a model whose vocabulary covers it (tiny, small "
                          "and tiny-moe follow the tokenizer)")
    return model


def resolve_model(cfg: TrainConfig) -> ModelConfig:
    """The run's final model: the preset, the given ModelConfig or `--init-from-hf`'s config.json, with the
    flags' overrides, and the vocabulary fitted to `--data`'s tokenizer."""
    if cfg.init_from_hf:
        overrides = cfg.model_flag_overrides()
        fresh_mtp = overrides.get("mtp_layers") if cfg.mtp_init == "fresh" else None
        if fresh_mtp:  # --mtp-init fresh reads no MTP tensor: any depth, whatever num_nextn_predict_layers says
            overrides = {k: v for k, v in overrides.items() if k != "mtp_layers"}
        model = init_model_config(cfg.init_from_hf, cfg.model, overrides)
        if fresh_mtp:
            model = dataclasses.replace(model, mtp_layers=fresh_mtp)
            model.validate()
    else:
        model = cfg.preset_model()
    if cfg.data is not None:
        model = fit_vocab(model, cfg.data, isinstance(cfg.model, str))
    cfg.check_model_overrides(model)
    return model


def assemble(cfg: TrainConfig, world_size: int | None = None) -> TrainConfig:
    """A new config, fully resolved: the model (`resolved_model`), `--dp -1` and every derived degree
    (`TrainConfig.resolved`), validated by everything that needs no process. `cfg` is left as it is (frozen).
    Idempotent: the model is resolved afresh from the flags each time."""
    flags = dataclasses.replace(cfg, resolved_model=None)
    return dataclasses.replace(flags, resolved_model=resolve_model(flags)).resolved(world_size)


def assembled(cfg: TrainConfig) -> TrainConfig:
    """`cfg` itself once assembled (the ranks of a launched run), else `assemble(cfg)` (library callers)."""
    return cfg if cfg.resolved_model is not None else assemble(cfg)


def check_sources(cfg: TrainConfig) -> None:
    """Once, before any rank starts: the data's manifests, shard checksums and size; under `--init-from-hf`
    the weights' shapes, the tokenizer and the data's ids against the checkpoint; EOS ids for document masks.
    ConfigError on anything wrong."""
    if cfg.init_from_hf and cfg.data is None:
        raise ConfigError(f"--init-from-hf {cfg.init_from_hf} needs --data tokenized with its tokenizer (the built-in "
                          f"corpus is byte-level): shardwise prepare-data FILES --tokenizer {cfg.init_from_hf} --out DIR, "
                          "then --data DIR")
    if cfg.eval_data is not None:  # readable, --data's tokenizer, enough windows
        from .evaluate import check_eval_data

        check_eval_data(cfg)
    if cfg.log_to is not None:  # the optional package imports
        from .observe import check_logger

        check_logger(cfg)
    if cfg.data is None:
        return
    from ..data import Loader, open_data

    sources, weights = open_data(cfg.data, verify=True)
    Loader((sources, weights), cfg.seq_len, 1, cfg.seed)
    if cfg.init_from_hf:
        from ..hf.init import check_init_from_hf

        data_vocab = max(int(s.tokens.max()) + 1 if hasattr(s, "tokens") else s.vocab_size for s in sources)
        manifest = getattr(sources[0], "manifest", None) or {}
        model = cfg.model_config()
        check_init_from_hf(cfg.init_from_hf, model, data_vocab, getattr(sources[0], "tokenizer_sha256", None),
                           data_tokenizer=manifest, allow_tokenizer_mismatch=cfg.allow_tokenizer_mismatch,
                           mtp_init=cfg.mtp_init, init_tokenizer=cfg.init_tokenizer)
        from ..hf.init import not_trained_line

        line = not_trained_line(cfg.init_from_hf)
        if line:
            _say(line)
        if model.mtp_layers and cfg.mtp_init == "fresh":
            _say(f"--mtp-init fresh: the {model.mtp_layers} MTP module(s) start as in training from scratch (--seed "
                 f"{cfg.seed}), not from --init-from-hf {cfg.init_from_hf}; their embedding and head are its own")
    if (cfg.attention_mask == "document" or cfg.reset_positions) and cfg.eos_id is None \
            and sources[0].eos_id is None:
        raise ConfigError(f"--attention-mask {cfg.attention_mask} / --reset-positions find documents by their "
                          f"EOS, but --data {cfg.data!r} was prepared with --no-eos; prepare it with EOS ids")


def checkpoint_root(cfg: TrainConfig) -> str:
    """Where the run's checkpoints live: --checkpoint-dir, else <out>/checkpoints."""
    import os

    return cfg.checkpoint_dir or os.path.join(cfg.out, "checkpoints")


def check_run_dir(cfg: TrainConfig, auto_resume: bool = False,
                  overwrite: bool = False) -> tuple[TrainConfig, str | None]:
    """Once, before any rank: decide fresh vs resume and protect what the user already has.

    `--resume` continues from the first intact checkpoint in resume order; with none (none at all, or every one
    damaged) it is a ConfigError naming each and why it was rejected. `--auto-resume` resumes likewise, else
    starts fresh in the run's own directory, saying so in one line when it found only damaged checkpoints. A
    fresh run into a non-empty `--out` (or a checkpoint directory holding checkpoints) needs `--overwrite`,
    which removes the old checkpoints, so they never mix with the new run's. On resume the schedule's length
    defaults to the one stored in the checkpoint. Returns the config with those decisions (`resume`,
    `lr_decay_steps`) and a line to print (and exit 0) when the checkpoint is already at --steps: nothing is
    touched."""
    import os

    from ..config.schedule import validate_optim

    if overwrite and (cfg.resume or auto_resume):
        raise ConfigError(f"--overwrite replaces the run in {cfg.out}; --{'resume' if cfg.resume else 'auto-resume'} "
                          "continues it: choose one")
    from ..paths import check_writable
    from .preflight import LOCK, check_lock

    root = checkpoint_root(cfg)
    check_writable(cfg.out, "--out")
    if cfg.checkpoint_dir:
        check_writable(root, "--checkpoint-dir")
    lead = os.environ.get("RANK", "0") == "0"  # under torchrun rank 0 holds the lock for the job
    if lead:
        check_lock(cfg.out)
    if cfg.resume or auto_resume:
        path, meta, rejected = first_intact_checkpoint(root)
        why = "; ".join(f"{os.path.basename(p)}: {r}" for p, r in rejected)
        if path is None and not auto_resume:
            if not rejected:
                raise ConfigError(f"--resume: no checkpoint under {root}; run without --resume to start fresh "
                                  "(or --auto-resume: resume when one exists)")
            raise ConfigError(f"--resume: no intact checkpoint under {root} ({why}); start fresh with --overwrite")
        cfg = dataclasses.replace(cfg, resume=path is not None)
        if path is None:
            if rejected:
                _say(f"--auto-resume: no intact checkpoint under {root} ({why}); starting fresh")
            return _start(cfg, root, lead)  # a requeued job's own directory: nothing in it to protect from itself
        _check_resumed(cfg, path, meta)
        if meta["step"] >= cfg.steps:
            return cfg, (f"{path} is already at step {meta['step']} (--steps {cfg.steps}): nothing to train; "
                         "raise --steps to continue")
        stored = meta.get("extra_state", {}).get("lr_plan")
        if cfg.lr_decay_steps is None and stored:
            cfg = dataclasses.replace(cfg, lr_decay_steps=stored["lr_decay_steps"])
            validate_optim(cfg)
        return _start(cfg, root, lead)
    busy = [d for d in dict.fromkeys((cfg.out, root)) if os.path.isdir(d) and set(os.listdir(d)) - {LOCK}]
    if busy and not overwrite:
        raise ConfigError(f"--out {busy[0]} is not empty (an earlier run?); continue it with --resume or "
                          "--auto-resume, choose another --out, or pass --overwrite to replace it")
    if overwrite:
        remove_checkpoints(root)
    return _start(cfg, root, lead)


def _start(cfg: TrainConfig, root: str, lead: bool) -> tuple[TrainConfig, None]:
    """A run that will write: room for its checkpoints, then --out held for it (the launching process)."""
    from .preflight import check_free_space, take_lock

    if cfg.save_every or cfg.final_checkpoint:
        check_free_space(root, cfg.resolved_model or cfg.model_config(), cfg.optimizer)
    if lead:
        take_lock(cfg.out)
    return cfg, None


def _check_resumed(cfg: TrainConfig, path: str, meta: dict) -> None:
    """The resumed checkpoint was made by this model and tokenizer (the first difference, in one line)."""
    from .preflight import check_resumed_model

    tokenizer = None
    if cfg.data is not None:
        from ..hf.export import tokenizer_record

        try:
            tokenizer = tokenizer_record(cfg.data, cfg.init_from_hf)
        except (OSError, ValueError, KeyError):
            tokenizer = None  # unreadable data is check_sources' to report
    check_resumed_model(path, meta, cfg.resolved_model or cfg.model_config(), tokenizer)


def first_intact_checkpoint(root: str) -> tuple[str | None, dict | None, list[tuple[str, str]]]:
    """The checkpoint a resume loads (the first in resume order whose manifest, meta.json and files are all there
    at their sizes) with its meta.json, and the (path, reason) of each one rejected before it.

    No checksums here: this runs in one process before the ranks (and in every process under torchrun), where
    reading a 671B model's terabytes would take hours. The ranks checksum every file between them when they
    load (`checkpoint.load.newest_intact`) and fall back past one that fails, saying so in one line."""
    import json
    import os

    from ..checkpoint.files import META, checkpoint_problems, resume_order

    rejected = []
    for _, path in resume_order(root):  # the one `latest` names, unless it is damaged
        try:
            with open(os.path.join(path, META)) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            rejected.append((path, f"unreadable {META} ({e.__class__.__name__})"))
            continue
        problems = checkpoint_problems(path, checksum=False)
        if problems:
            rejected.append((path, "; ".join(problems)))
            continue
        return path, meta, rejected
    return None, None, rejected


def remove_checkpoints(root: str) -> None:
    """--overwrite: the old run's checkpoints and `latest` (TensorBoard events go when the new run starts)."""
    import contextlib
    import os
    import shutil

    from ..checkpoint.files import LATEST

    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name == LATEST or name.startswith(("step-", "tmp-step-")):
            full = os.path.join(root, name)  # under torchrun every process does this: tolerate the others
            if os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(full)


def _say(line: str) -> None:
    """One line from the launching process (under torchrun: rank 0's only)."""
    import os
    import sys

    if os.environ.get("RANK", "0") == "0":
        print(f"shardwise train: {line}", file=sys.stderr)
