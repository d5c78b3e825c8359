"""Held-out evaluation (`--eval-data SPEC --eval-every N --eval-steps K`): forward only, on every layout.

The eval set is K global batches of the eval data whose windows are taken in order (window i starts at
token i·seq_len; a blend assigns samples to sources by the same closed formula as training), the same K
batches at every evaluation. Each rank runs its share exactly as a training step cuts it (dp rows, cp
cut, microbatches; ZeRO-3 gathers through its forward hooks; pipeline stages walked in order over
p2p), with dropout off, and `eval_loss` is the sum of every counted token's cross-entropy over the
count — a function of the weights alone, equal across layouts. The evaluation's collectives are kept
out of the comm ledger, so a step's communication stays the training step's.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from .. import comm, host
from ..config import ConfigError, TrainConfig
from ..data import IGNORE_INDEX, Loader, open_data
from ..data.shards import PreparedData, data_sources
from ..data.tokenizer import byte_fingerprint


class EvalLoader(Loader):
    """A Loader whose windows are taken in order instead of through the keyed permutation."""

    def _windows(self, j: int, local: np.ndarray, n: int) -> np.ndarray:
        return local % n


def _tokenizer_sha(sources) -> str:
    """What the tokenizer a source was encoded with does (`data.tokenizer.fingerprint`; text files and the embedded
    corpus: the byte tokenizer)."""
    return getattr(sources[0], "tokenizer_fingerprint", None) or byte_fingerprint()


def check_eval_data(cfg: TrainConfig) -> None:
    """Before any rank starts: --eval-data opens, was encoded with --data's tokenizer, and holds the
    --eval-steps global batches. ConfigError otherwise."""
    if cfg.eval_data is None:
        return
    sources, _ = open_data(cfg.eval_data, verify=True)
    if cfg.data is None or os.path.isfile(cfg.data):  # bytes: no need to read the corpus
        train_sha = byte_fingerprint()
    else:
        train_sha = _tokenizer_sha([PreparedData(data_sources(cfg.data)[0][0])])
    if _tokenizer_sha(sources) != train_sha:
        raise ConfigError(f"--eval-data {cfg.eval_data!r} was encoded with another tokenizer (sha256 "
                          f"{_tokenizer_sha(sources)[:12]}…) than --data {cfg.data or '(embedded corpus, bytes)'!r} "
                          f"({train_sha[:12]}…); prepare it with the same --tokenizer")
    gb = cfg.global_batch or cfg.micro_batch * cfg.parallel.dp
    loader = EvalLoader((sources, [1.0] * len(sources)), cfg.seq_len, gb, cfg.seed)
    windows = sum(loader.n_windows_per_source)
    if cfg.eval_steps * gb > windows:
        raise ConfigError(f"--eval-steps {cfg.eval_steps} × global batch {gb} = {cfg.eval_steps * gb} windows of "
                          f"{cfg.seq_len} tokens, but --eval-data {cfg.eval_data!r} holds {windows}; lower "
                          "--eval-steps or give more held-out data")


class Evaluator:
    """The eval loss of a Trainer's current weights on its fixed eval set (collective over every rank)."""

    def __init__(self, trainer, data=None):
        """`data`: a token tensor to evaluate on instead of cfg.eval_data (tests)."""
        cfg = trainer.cfg
        self.trainer, self.steps, self.every = trainer, cfg.eval_steps, cfg.eval_every
        source = open_data(cfg.eval_data) if data is None else data
        self.loader = EvalLoader(source, cfg.seq_len, trainer.global_batch, cfg.seed)
        self.n_tokens = sum(self.loader.count_targets(k) for k in range(self.steps))

    def due(self, step: int, last: int) -> bool:
        """Whether to evaluate after (1-based) `step`: every `eval_every` steps and at the last step."""
        return step == last or (self.every is not None and step % self.every == 0)

    @torch.no_grad()
    def run(self) -> float:
        t = self.trainer
        ledger, was_training = t.mesh.ledger, t.model.training
        moe_counters = [(m.step_dropped, m.step_aux) for m in t.moe]
        enabled, ledger.enabled = ledger.enabled, False
        t.model.eval()
        total = torch.zeros(1, dtype=torch.float64, device=t.mesh.device)
        try:
            for k in range(self.steps):
                xs, ys, side = t.microbatches(self.loader, k)
                if t.executor is None:
                    for mb, (x, y) in enumerate(zip(xs, ys)):
                        with t._autocast():
                            logits = t.model(x, **(side[mb] if side else {}))
                        total += _token_losses(t, logits, y)
                else:
                    total += _pipeline_losses(t, xs, ys, side)
            comm.all_reduce(total, t.mesh["dp_cp"], tag="eval")
            comm.all_reduce(total, t.mesh["pp"], tag="eval")  # only the last stage holds losses
        finally:
            ledger.enabled = enabled
            t.model.train(was_training)
            for m, (dropped, aux) in zip(t.moe, moe_counters):  # the step's routing metrics stay the step's
                m.step_dropped, m.step_aux = dropped, aux
        return host.read(total, "eval loss")[0] / self.n_tokens


def _token_losses(t, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sum of plain cross-entropy (no label smoothing) over the counted targets of one microbatch."""
    return t.model.loss_fn(logits, y, IGNORE_INDEX, 0.0).sum().double()


def _pipeline_losses(t, xs: list, ys: list, side: list[dict] | None) -> torch.Tensor:
    """Forward-only pipeline: every rank walks (microbatch, stage) in the same order; each stage's owner
    runs its chunk and sends the output to the next stage's owner (blocking p2p, so each pair's messages
    are matched in posting order). Returns this rank's sum of last-stage token losses."""
    pp, lay, ex = t.mesh["pp"], t.schedule.layout, t.executor
    total = torch.zeros(1, dtype=torch.float64, device=t.mesh.device)
    last = lay.num_stages - 1
    for mb, (x, y) in enumerate(zip(xs, ys)):
        h = None
        for stage in range(lay.num_stages):
            owner, chunk = lay.owner(stage)
            if owner == pp.rank:
                with t._autocast():
                    h = t.model.chunks[chunk](x if stage == 0 else h, **(side[mb] if side else {}))
                if stage == last:
                    total += _token_losses(t, h, y)
                    break
            if stage == last:
                break
            nxt = lay.owner(stage + 1)[0]
            if nxt == owner:
                continue
            if pp.rank == owner:
                comm.wait_all(comm.p2p([("send", h.to(ex.act_dtype).contiguous(), pp, nxt)]), pp,
                              f"eval: send of stage {stage}'s output")
            elif pp.rank == nxt:
                h = torch.empty(ex.act_shape, dtype=ex.act_dtype, device=t.mesh.device)
                comm.wait_all(comm.p2p([("recv", h, pp, owner)]), pp, f"eval: recv of stage {stage}'s output")
    return total
