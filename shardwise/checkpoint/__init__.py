"""Checkpoints that reshard: saved under one layout, loaded under any other.

Tensors are stored with torch.distributed.checkpoint (DCP) under their *global* names and shapes.
Each rank turns its `ShardSpec`s into boxes of the global tensor (views of its live tensors) and a
pair of small DCP planners writes or reads them, so DCP's resharding handles any layout change:
* only the `valid` rows of padded shards are written, and a slice held by several ranks (TP
  replicas, every dp×cp rank) by exactly one of them — DCP's save-plan check (each tensor covered
  exactly once) therefore also checks the ownership rule;
* AdamW exp_avg / exp_avg_sq (Muon: momentum) are stored like their parameter. A ZeRO-1 shard is a range of the
  flattened local parameters, i.e. a few contiguous boxes (partial row, full rows, partial row),
  so each rank writes and reads its own range with no gather over dp;
* a tied embedding's LM-head copy under PP is not written: it reads `tok_embeddings.weight`'s entries.
Publishing is atomic (tmp-step-N → step-N rename, then `latest`), a JSON manifest of sha256 sums
lets loading skip incomplete or corrupt saves, and nothing is unpickled freely (see SafeReader). The meta names
the optimizer: a checkpoint resumes only under the optimizer whose state it holds.

Modules by idea: `files` (directory layout, naming, manifest checks), `boxes` (local views as global
chunks; the DCP planners and safe reader), `save` (write and publish, sync or async), `load` (newest
intact, reshard, RNG streams).
"""
from .files import FORMAT_VERSION, LATEST, MANIFEST, META, STATE_KEYS, checkpoint_problems, list_checkpoints
from .boxes import flat_boxes
from .load import load_checkpoint, load_global_tensors, newest_intact
from .save import PendingSave, save_checkpoint, wait_for_save

__all__ = ["FORMAT_VERSION", "LATEST", "MANIFEST", "META", "STATE_KEYS", "PendingSave", "checkpoint_problems",
           "flat_boxes", "list_checkpoints", "load_checkpoint", "load_global_tensors", "newest_intact",
           "save_checkpoint", "wait_for_save"]
