"""The learning-rate schedule and AdamW knobs: their defaults, their validation and the LR of each step.

Pure arithmetic on `TrainConfig`'s fields, so the CLI can refuse a bad schedule before any rank starts
and a checkpoint can store the schedule it was trained under (`lr_plan`).
"""
from __future__ import annotations

import math

from .errors import ConfigError

LR_SCHEDULES = ("cosine", "linear", "wsd", "constant")
MAX_DEFAULT_WARMUP = 20


def decay_steps(cfg) -> int:
    """The schedule's length: --lr-decay-steps, else --steps."""
    return cfg.steps if cfg.lr_decay_steps is None else cfg.lr_decay_steps


def warmup_steps(cfg) -> int:
    """--warmup-steps as given; by default 10% of the schedule's length, between 1 and 20 (0 for a one-step
    schedule)."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    n = decay_steps(cfg)
    return 0 if n <= 1 else min(MAX_DEFAULT_WARMUP, max(1, n // 10))


def min_lr(cfg) -> float:
    """--min-lr as given, by default lr/10."""
    return cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr


def lr_plan(cfg) -> dict:
    """Everything that fixes the LR of each step: stored in checkpoints, compared on resume."""
    return {"lr_schedule": cfg.lr_schedule, "lr": cfg.lr, "min_lr": min_lr(cfg), "warmup_steps": warmup_steps(cfg),
            "lr_decay_steps": decay_steps(cfg), "wsd_decay_fraction": cfg.wsd_decay_fraction}


def wsd_decay_len(n: int, fraction: float) -> int:
    """Steps of the WSD decay phase: the last `fraction` of the schedule, at least one step."""
    return max(1, round(fraction * n))


def lr_at_plan(step: int, plan: dict) -> float:
    """LR of 0-based `step`: linear warm-up to lr over warmup_steps, then the schedule, which reaches min_lr
    exactly on its last step (lr_decay_steps − 1) and stays there (constant: stays at lr)."""
    lr, lo, warm, n = plan["lr"], plan["min_lr"], plan["warmup_steps"], plan["lr_decay_steps"]
    if step < warm:
        return lr * (step + 1) / warm
    kind = plan["lr_schedule"]
    if kind == "constant":
        return lr
    if kind == "wsd":
        decay = wsd_decay_len(n, plan["wsd_decay_fraction"])
        begin = n - decay  # steps [begin, n) decay linearly; the last of them is min_lr
        if step < begin:
            return lr
        t = min(1.0, (step - begin + 1) / decay)
        return lr + (lo - lr) * t
    span = n - 1 - warm
    t = 1.0 if span <= 0 else min(1.0, (step - warm) / span)
    if kind == "linear":
        return lr + (lo - lr) * t
    return lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * t))


def parse_betas(text) -> tuple[float, float]:
    """`--adam-betas 0.9,0.95` (or a 2-list from TOML) as a pair; ConfigError otherwise."""
    if isinstance(text, (tuple, list)):
        parts = list(text)
    else:
        parts = str(text).split(",")
    try:
        b1, b2 = (float(x) for x in parts)
    except (TypeError, ValueError):
        raise ConfigError(f"--adam-betas {text!r} must be two numbers B1,B2 in [0, 1), e.g. 0.9,0.95") from None
    return b1, b2


def validate_optim(cfg) -> None:
    """Every LR-schedule and AdamW field; one-line ConfigError naming the value and what is valid."""
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"--lr-schedule {cfg.lr_schedule!r} is unknown; valid: {', '.join(LR_SCHEDULES)}")
    if not isinstance(cfg.lr, (int, float)) or not cfg.lr >= 0 or not math.isfinite(cfg.lr):
        raise ConfigError(f"--lr {cfg.lr!r} must be a non-negative number (0 freezes the weights)")
    if cfg.min_lr is not None and not 0 <= cfg.min_lr <= cfg.lr:
        raise ConfigError(f"--min-lr {cfg.min_lr!r} must be in [0, --lr {cfg.lr}]")
    n = cfg.lr_decay_steps
    if n is not None and (not isinstance(n, int) or n <= 0):
        raise ConfigError(f"--lr-decay-steps {n!r} must be a positive integer (the schedule's length in steps)")
    n = decay_steps(cfg)
    w = cfg.warmup_steps
    if w is not None and (not isinstance(w, int) or w < 0):
        raise ConfigError(f"--warmup-steps {w!r} must be a non-negative integer")
    if w is not None and w >= n:
        raise ConfigError(f"--warmup-steps {w} must be below the schedule's length {n} "
                          f"(--lr-decay-steps, default --steps); valid: 0..{n - 1}")
    f = cfg.wsd_decay_fraction
    if not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise ConfigError(f"--wsd-decay-fraction {f!r} must be in (0, 1], e.g. 0.2")
    if cfg.lr_schedule == "wsd" and warmup_steps(cfg) + wsd_decay_len(n, f) > n:
        raise ConfigError(f"--warmup-steps {warmup_steps(cfg)} + the WSD decay's {wsd_decay_len(n, f)} steps "
                          f"(--wsd-decay-fraction {f} of {n}) exceed the schedule's length {n}")
    if not isinstance(cfg.weight_decay, (int, float)) or not cfg.weight_decay >= 0:
        raise ConfigError(f"--weight-decay {cfg.weight_decay!r} must be a non-negative number, e.g. 0.1")
    if not isinstance(cfg.grad_clip, (int, float)) or not cfg.grad_clip >= 0:
        raise ConfigError(f"--grad-clip {cfg.grad_clip!r} must be a non-negative max grad norm (0 = off)")
    b1, b2 = parse_betas(cfg.adam_betas)
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ConfigError(f"--adam-betas {b1},{b2} must both be in [0, 1), e.g. 0.9,0.95")
    if not isinstance(cfg.adam_eps, (int, float)) or not cfg.adam_eps > 0:
        raise ConfigError(f"--adam-eps {cfg.adam_eps!r} must be a positive number, e.g. 1e-8")


def describe_plan(plan: dict) -> str:
    """One phrase for a resume line: `cosine 3e-3→3e-4 over 200 steps (20 warm-up)`."""
    tail = f", decay fraction {plan['wsd_decay_fraction']}" if plan["lr_schedule"] == "wsd" else ""
    return (f"{plan['lr_schedule']} {plan['lr']:g}→{plan['min_lr']:g} over {plan['lr_decay_steps']} steps "
            f"({plan['warmup_steps']} warm-up{tail})")
