"""Wire bytes of one collective: what one rank puts on links under ring algorithms, for its payload and group.

The comm layer records these in the byte ledger and the planner predicts with them, so a measured ledger and a
planned one agree op by op. Payload (`bytes`) is what this rank contributes: the input of an all-reduce,
reduce-scatter or all-to-all, the local shard of an all-gather, the tensor of a send (a receive and a
broadcast's non-source ranks contribute none). Each fraction is taken of the exact integer product, so a value
is rounded once.
"""
from __future__ import annotations


def all_reduce(nbytes: int, n: int) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, each sending (n−1)/n of the tensor."""
    return 2 * (n - 1) * nbytes / n


def reduce_scatter(nbytes: int, n: int) -> float:
    """Every part of the input but this rank's own 1/n."""
    return (n - 1) * nbytes / n


def all_gather(shard_bytes: int, n: int) -> int:
    """The local shard, passed on to each of the n−1 others."""
    return (n - 1) * shard_bytes


def all_to_all(nbytes: int, n: int) -> float:
    """Equal splits: every part but the one this rank keeps."""
    return (n - 1) * nbytes / n


def all_to_all_v(row_bytes: int, in_splits: list[int], rank: int) -> int:
    """Variable splits (`in_splits[j]` rows to rank j): the rows addressed to other ranks."""
    return row_bytes * (sum(in_splits) - in_splits[rank])


def broadcast(nbytes: int, source: bool) -> int:
    """The source sends the tensor once; the others are booked nothing."""
    return nbytes if source else 0


def send(nbytes: int) -> int:
    return nbytes


def recv(nbytes: int) -> int:
    """Receives are counted but book nothing: their bytes are the sender's."""
    return 0


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Wire bytes of ledger op `op` (its `:tag` ignored) of payload `nbytes` in a group of `n`, all-to-alls with
    equal splits: the planner's form, which books every op by name."""
    base = op.split(":")[0]
    if base == "all_reduce":
        return all_reduce(nbytes, n)
    if base == "reduce_scatter":
        return reduce_scatter(nbytes, n)
    if base == "all_gather":
        return float(all_gather(nbytes, n))
    if base == "all_to_all":
        return all_to_all(nbytes, n)
    if base == "send":
        return float(send(nbytes))
    if base == "recv":
        return float(recv(nbytes))
    raise ValueError(f"unknown op {op!r}")


FP8_WIRE_TAG = "fp8"
"""Ledger tag of an FP8 all-gather (`all_gather:fp8`, `--fp8-all-gather`)."""


def fp8_all_gather(numel: int, scale_blocks: int) -> tuple[int, int]:
    """(all-gather payload, amax all-reduce payload) of one FP8 all-gather of a `numel`-element local shard whose
    tensor has `scale_blocks` scale blocks: one byte per element (the shard cast with the whole tensor's scales), and
    one fp32 amax per scale block, max-reduced over the gather's axis (and the axes the scale spans) before the
    cast. The one place the planner counts an FP8 gather's bytes."""
    return numel, 4 * scale_blocks
