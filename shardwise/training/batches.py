"""This rank's share of a global batch, prepared on the host: its dp rows, the per-microbatch side inputs
the model reads (document ids and positions, the MTP modules' shifted ids and labels) and its cp cut.

Side inputs are computed from the *global* (uncut) sequences, then every cp rank takes its share, so a
layout never changes what a token sees. The `Trainer` copies the result to the device.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..config import TrainConfig
from ..context_parallel.sharding import shard_sequence
from ..data import Loader
from ..mesh import Mesh
from ..models.documents import document_ids, document_positions
from ..models.mtp import depth_counts, shift_inputs
from ..tensor_parallel.layers import check_token_ids


class BatchSlicer:
    def __init__(self, cfg: TrainConfig, mesh: Mesh, global_batch: int, vocab_size: int, eos_id: int):
        self.cfg, self.mesh, self.global_batch = cfg, mesh, global_batch
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.reorder_rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # verify's reference sets it

    def host_batch(self, loader: Loader, step: int, mtp: bool = False):
        """This rank's inputs, targets and per-microbatch side inputs of `loader`'s batch `step`, on the host."""
        per = self.global_batch // self.mesh.dims.dp
        dp_rank = self.mesh["dp"].rank
        x, y = loader.batch_at(step, dp_rank * per, (dp_rank + 1) * per)  # only this rank's windows
        check_token_ids(x, self.vocab_size)  # once per batch, on the host, before the copy to the device
        if self.reorder_rows is not None:
            x, y = self.reorder_rows(x), self.reorder_rows(y)
        side = document_inputs(x, self.eos_id, self.cfg)  # from the global sequences, before any cp cut
        if mtp:
            side = mtp_side_inputs(x, y, side, loader, step, self.cfg, self.mesh["cp"])
        cp = self.mesh["cp"]
        if cp.active:  # targets were shifted over the whole sequence; both are cut the same way
            x = shard_sequence(x, cp.rank, cp.size, self.cfg.parallel.cp_order)
            y = shard_sequence(y, cp.rank, cp.size, self.cfg.parallel.cp_order)
        return x, y, side


def document_inputs(x: torch.Tensor, eos_id: int, cfg: TrainConfig) -> list[dict] | None:
    """Per microbatch, the model's side inputs for --attention-mask document / --reset-positions:
    document ids and positions of the *global* (uncut) sequences; every cp rank takes its share."""
    if cfg.attention_mask == "causal" and not cfg.reset_positions:
        return None
    doc = document_ids(x, eos_id)
    side = [{} for _ in range(-(-x.shape[0] // cfg.micro_batch))]
    if cfg.attention_mask == "document":
        for s, d in zip(side, doc.split(cfg.micro_batch)):
            s["doc_ids"] = d
    if cfg.reset_positions:
        for s, pos in zip(side, document_positions(doc).split(cfg.micro_batch)):
            s["positions"] = pos
    return side


def mtp_side_inputs(x, y, side, loader: Loader, step: int, cfg: TrainConfig, cp) -> list[dict]:
    """Per microbatch, the MTP inputs (models/mtp.py): ids and labels shifted over the whole window on the host,
    then cut for cp like the tokens; the per-depth loss scales λ / (D · n_k) from the global batch's counts."""
    depth = cfg.model_config().mtp_layers
    ids, labels = shift_inputs(x, y, depth)
    if cp.active:
        ids, labels = (shard_sequence(t, cp.rank, cp.size, cfg.parallel.cp_order, dim=2) for t in (ids, labels))
    masked = any(getattr(s, "masked", False) for s in loader.sources)
    counts = depth_counts(loader.global_batch_at(step)[1] if masked else None, loader.global_batch,
                          loader.seq_len, depth)
    scale = torch.tensor([cfg.mtp_loss_weight / (depth * n) if n else 0.0 for n in counts], device=x.device)
    side = side or [{} for _ in range(-(-x.shape[0] // cfg.micro_batch))]
    for mb, s in enumerate(side):
        rows = slice(mb * cfg.micro_batch, (mb + 1) * cfg.micro_batch)
        s.update(mtp_ids=ids[:, rows], mtp_labels=labels[:, rows], mtp_scale=scale)
    return side
