"""Cutting the model into pipeline stages.

There are p·v stages (v chunks per rank). Stage k holds a contiguous run of layers; stage 0 also
holds the embedding, the last stage the final norm, LM head and loss. A rank keeps only the modules
of its own chunks and drops the rest, and parameter names stay global (`layers.7.attention.wq`),
so checkpoints and parity checks need no renaming. Which layers a stage holds is `partition.split_layers`
(torch-free, shared with config validation and the planner).
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.llama import Transformer


class StageChunk(nn.Module):
    """One stage's view of the (pruned) model: embedding?, its layers, head? — no parameters of its own."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool):
        super().__init__()
        self._model = [model]  # a list, so the chunk does not register the model's parameters twice
        self.layer_ids, self.first, self.last = list(layers), first, last

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, **mtp) -> torch.Tensor:
        """Tokens → hidden (first stage), hidden → hidden, or hidden → logits (last stage).

        `doc_ids` / `positions` are the microbatch's side inputs (document masking, reset RoPE
        positions): every stage gets them from the global batch, since later stages see no tokens.
        """
        model = self._model[0]
        local_len = x.shape[1] * (model.ctx.tp_axis.size if model.ctx.sequence_parallel and not self.first else 1)
        cos, sin = model.rope(local_len, x.device, positions)
        h = model.tok_embeddings(x) if self.first else x
        for i in self.layer_ids:
            h = model.layers[str(i)](h, cos, sin, doc_ids)
        return model.head(h, cos, sin, doc_ids, **mtp) if self.last else h


def prune_to_stages(model: Transformer, rank: int, layout, stage_layers: list[range]) -> list[StageChunk]:
    """Delete every module this pipeline rank does not own; return its chunks in local-chunk order."""
    n_stages = layout.num_stages
    chunks = []
    keep: set[int] = set()
    for c in range(layout.v):
        stage = layout.stage_of(rank, c)
        chunks.append(StageChunk(model, stage_layers[stage], stage == 0, stage == n_stages - 1))
        keep.update(stage_layers[stage])
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    if not any(ch.first for ch in chunks):
        model.tok_embeddings = None
    if not any(ch.last for ch in chunks):
        model.norm = None
        model.output = None
        model.mtp = None
    return chunks
