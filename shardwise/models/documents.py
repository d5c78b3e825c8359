"""Packed-window document masking: which document each token belongs to, and its position in it.

Windows are cut from one token stream with documents separated by an end-of-document id, so a
window usually holds the tail of one document, some whole ones and the head of another. With
`--attention-mask document` a token attends only to earlier tokens of its own document, and with
`--reset-positions` RoPE counts positions from each document's first token, so a document packed
after others is computed exactly as if it ran alone.

A token starts a new document right after an EOS (the EOS closes the document it ends). Ids and
positions are computed on the *global* window, before context-parallel sharding, so every cp rank
knows the document of every token of the sequence — its own and the K/V blocks it receives — with
no extra communication.
"""
from __future__ import annotations

import torch

MASKS = ("causal", "document")


def document_ids(tokens: torch.Tensor, eos: int) -> torch.Tensor:
    """[b, s] int32 document index of every token within its window (0 for the first document)."""
    ends = (tokens == eos).to(torch.int32)
    return (ends.cumsum(-1) - ends).to(torch.int32)  # EOS ids before each token, itself excluded


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """[b, s] int64 position of every token within its document (0 at each document's first token)."""
    s = doc.shape[-1]
    idx = torch.arange(s, device=doc.device).expand_as(doc)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[..., 1:] = doc[..., 1:] != doc[..., :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - first


def document_mask(q_doc: torch.Tensor, k_doc: torch.Tensor, q_pos: torch.Tensor | None = None,
                  k_pos: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """Boolean [b, 1, s_q, s_k] mask (True = attend): same document and, if causal, k_pos <= q_pos.

    Positions are the tokens' global positions in the window (never reset ones): causality is
    about order in the window. Without positions the causal part is the plain triangle of equal
    query and key sequences.
    """
    same = q_doc[:, :, None] == k_doc[:, None, :]
    if not causal:
        return same.unsqueeze(1)
    if q_pos is None:
        s_q, s_k = q_doc.shape[-1], k_doc.shape[-1]
        causal = torch.ones(s_q, s_k, dtype=torch.bool, device=q_doc.device).tril_(s_k - s_q)
    else:
        causal = q_pos[:, None] >= k_pos[None, :]
    return (same & causal).unsqueeze(1)
