"""Activation recompute: trade a second forward for the activations backward would otherwise keep.

* "selective" (Korthikanti et al. 2022): only the attention core — SDPA, or the ring / Ulysses kernel
  under cp — is recomputed, so its saved q·k statistics (and with attention dropout the s×s tensors)
  are not kept; a recomputed ring repeats its sends, as the other ranks' recomputations expect.
* "full": a whole TransformerBlock is recomputed; only its input is kept (under SP its 1/tp shard).
  The recomputed forward repeats the block's TP/SP collectives and MoE all-to-alls (the ledger
  counts them). Under the split-backward schedules (zb, dualpipev) the recomputation runs inside B:
  the recomputed forward builds a throwaway graph, and only the original graph's linear nodes hand
  their (recomputed) inputs to the deferred-W store, once each, so W sees exactly what it would without
  recompute and nothing is registered twice; until W runs the store holds those inputs, not the block.

Both use non-reentrant `torch.utils.checkpoint`. Like Megatron's CheckpointFunction, the RNG
tracker's streams are snapshotted at the forward and restored for the recomputation (then set back),
so every dropout mask replays bit for bit; an MoE block's bookkeeping (load counts for the
loss-free bias, drop and aux-loss metrics) is restored too, so a recomputation is not counted twice, and
its dispatcher reuses the forward's split sizes (asserted equal on the device) instead of reading them again.
A fully recomputed block runs with autocast's weight cache off (`_uncached`), in its forward and its
recomputation: otherwise the cache would hold every block's bf16 weight copies until the forward ends.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from .expert_parallel.dispatch import SplitTape
from .expert_parallel.moe import MoE
from .rules.partition import recomputed_layers

MODES = ("none", "selective", "full")


class _Replay:
    """checkpoint's context_fn: remember the RNG streams at forward, replay them in the recomputation; each MoE
    block's dispatcher records its split sizes at forward and the recomputation reuses them (`SplitTape`: no
    second host read per MoE layer and microbatch)."""

    def __init__(self, tracker, moes):
        self.tracker, self.moes = tracker, moes

    def __call__(self):
        saved = self.tracker.get_states() if self.tracker is not None else None
        tapes = [SplitTape() for _ in self.moes]
        return self._taped(tapes, False), self._recompute(saved, tapes)

    @contextlib.contextmanager
    def _taped(self, tapes, replaying: bool):
        for m, tape in zip(self.moes, tapes):
            tape.replaying, m.dispatcher.tape = replaying, tape
        try:
            yield
        finally:
            for m in self.moes:
                m.dispatcher.tape = None

    @contextlib.contextmanager
    def _recompute(self, saved, tapes):
        now = self.tracker.get_states() if saved is not None else None
        books = [_moe_books(m) for m in self.moes]
        if saved is not None:
            self.tracker.set_states(saved)
        try:
            with self._taped(tapes, True):
                yield
        finally:
            if now is not None:
                self.tracker.set_states(now)
            for m, b in zip(self.moes, books):
                _restore_moe_books(m, b)


def _moe_books(m: MoE) -> tuple:
    return m.aux_loss, m.stats, m.step_dropped, m.step_aux, m.router.pending_counts.clone()


def _restore_moe_books(m: MoE, books: tuple) -> None:
    m.aux_loss, m.stats, m.step_dropped, m.step_aux, counts = books
    m.router.pending_counts.copy_(counts)


def _uncached(fn):
    """Run `fn` with autocast's weight cache off (when autocast is on for its inputs' device). The cache
    keeps the low-precision copy of every weight it casts until the outermost autocast region — a chunk's
    whole forward — ends, though checkpoint saves none of them: every recomputed block's copies would be
    alive at the end of the forward. Without it a copy lives while its op runs, and in the recomputation
    while that block's backward needs it; the cast is the same, so the arithmetic is bit for bit the same.
    It wraps the function checkpoint runs, so the recomputation (which replays the outer autocast state)
    runs uncached too."""
    def run(*args):
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
        if dev is None or not torch.is_autocast_enabled(dev):
            return fn(*args)
        with torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), cache_enabled=False):
            return fn(*args)
    return run


def _checkpointed(fn, replay: _Replay):
    fn = _uncached(fn)

    def run(*args):
        return checkpoint(fn, *args, use_reentrant=False, context_fn=replay, preserve_rng_state=True)
    return run


def apply_recompute(model, mode: str, layers: int | None = None, compiled: bool = False) -> None:
    """Recompute the first `layers` blocks (default all) of every pipeline chunk (or of the model). `compiled`:
    the blocks are compiled (`parallelize.apply_compile`), and checkpoint with our RNG-replay context_fn is not
    traceable, so the selective core's checkpoint runs eagerly."""
    if mode == "none":
        return
    if mode not in MODES:
        raise ValueError(f"recompute {mode!r}; valid: {', '.join(MODES)}")
    chunks = [ch.layer_ids for ch in model.chunks] if model.chunks else [[int(i) for i in model.layers]]
    tracker = model.ctx.rng
    chosen = recomputed_layers(chunks, layers)
    if mode == "selective":  # the attention cores read this from the model's context
        model.ctx.selective = frozenset(chosen)

        def checkpoint_core(core, *qkv):
            return checkpoint(core, *qkv, use_reentrant=False, context_fn=_Replay(tracker, []), preserve_rng_state=True)
        model.ctx.checkpoint_core = torch.compiler.disable(checkpoint_core) if compiled else checkpoint_core
        return
    for i in chosen:
        block = model.layers[str(i)]
        moes = [m for m in block.modules() if isinstance(m, MoE)]
        block.forward = _checkpointed(block.forward, _Replay(tracker, moes))
