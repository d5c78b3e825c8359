"""Boxes: each rank's live tensors (and ZeRO ranges of them) as chunks of the global tensors, and the two
small DCP planners and the safe reader that write and read them."""
from __future__ import annotations

import math
import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .. import comm
from ..data_parallel import is_expert
from ..pipeline.tied_embedding import is_tied_copy, tied_name
from ..tensor_parallel.layers import get_spec
from .files import MUON_STATE_KEYS, STATE_KEYS


def flat_boxes(shape, lo: int, hi: int) -> list[tuple[tuple, tuple, int]]:
    """Elements [lo, hi) of a row-major tensor as boxes (start index, sizes, flat start), each contiguous."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) * len(shape), (hi - lo,) * len(shape), lo)]
    inner = math.prod(shape[1:])
    r0, a = divmod(lo, inner)
    r1, b = divmod(hi, inner)

    def row(r, x, y):
        return [((r, *i), (1, *s), r * inner + f) for i, s, f in flat_boxes(shape[1:], x, y)]

    if r0 == r1:
        return row(r0, a, b)
    out = []
    if a:
        out += row(r0, a, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:]), r0 * inner))
    if b:
        out += row(r1, 0, b)
    return out


def _place(spec, shape, src: torch.Tensor, lo: int, hi: int, save: bool = False) -> list[tuple[tuple, torch.Tensor]]:
    """(global offsets, local view) of the valid part of local flat range [lo, hi); `src` holds exactly that range."""
    if getattr(spec, "rows", None):  # placed experts: slot j is logical expert rows[j]
        return _place_rows(spec, shape, src, lo, hi, save)
    valid = list(shape)
    if spec.dim is not None:
        valid[spec.dim] = spec.valid  # padding rows sit past `valid` along the split dim
    out = []
    for idx, sizes, start in flat_boxes(shape, lo, hi):
        view = src[start - lo:start - lo + math.prod(sizes)].view(sizes)
        keep = [min(i + s, v) - i for i, s, v in zip(idx, sizes, valid)]
        if min(keep, default=1) <= 0:
            continue
        for d, k in enumerate(keep):
            view = view.narrow(d, 0, k)
        offsets = tuple(i + (spec.start if d == spec.dim else 0) for d, i in enumerate(idx))
        out.append((offsets, view))
    return out


def _place_rows(spec, shape, src: torch.Tensor, lo: int, hi: int, save: bool) -> list[tuple[tuple, torch.Tensor]]:
    """`_place` for an `ExpertShard`: each local slot's part at its logical expert's row, so a checkpoint holds logical
    expert ids whatever the placement; a save writes only each expert's first copy (replicas hold equal values)."""
    inner = math.prod(shape[1:])
    out = []
    for j, (row, first) in enumerate(zip(spec.rows, spec.primary)):
        a, b = max(lo, j * inner), min(hi, (j + 1) * inner)
        if a >= b or (save and not first):
            continue
        for idx, sizes, start in flat_boxes(shape, a, b):
            view = src[start - lo:start - lo + math.prod(sizes)].view(sizes)
            out.append(((row + idx[0] - j, *idx[1:]), view))
    return out


def _tp_owned(named, tp) -> set[str]:
    """Names this TP rank writes: it is the lowest TP rank holding that identical slice."""
    mine = {n: (s.dim, s.start, s.valid) for n, p in named for s in (get_spec(p),)}
    every = comm.all_gather_object(mine, tp)
    return {n for n, key in mine.items() if next(r for r, o in enumerate(every) if o.get(n) == key) == tp.rank}


def persistent_buffers(model):
    """(global name, owner module, tensor) of every persistent buffer: training state (e.g. the MoE expert_bias)."""
    for prefix, mod in model.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), mod, b


def ensure_state(reducer, step: int | None = None) -> None:
    """Create AdamW state AdamW would create lazily (zeros), so it can be saved or loaded into; set its step."""
    opt = reducer.optimizer
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:  # fused/capturable AdamW keeps its step on the parameter's device, the others on the host
                on_device = group.get("fused") or group.get("capturable")
                st.update(step=torch.zeros((), device=p.device if on_device else "cpu"),
                          exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            if step is not None:
                st["step"] = torch.full((), step, dtype=st["step"].dtype, device=st["step"].device)


def _optimizer_state(reducer, t: torch.Tensor, muon: bool) -> dict[str, torch.Tensor]:
    """{state key: tensor} the optimizer that steps `t` (a parameter or a ZeRO shard) keeps for it."""
    if muon:
        return {k: reducer.muon.state[t][k] for k in MUON_STATE_KEYS}
    return {k: reducer.optimizer.state[t][k] for k in STATE_KEYS}


def state_entries(trainer, save: bool) -> dict[str, tuple[tuple, list]]:
    """{global key: (global shape, boxes)}: on save only the boxes this rank owns, on load all it holds."""
    red = trainer.reducer
    owned = _tp_owned(red.named, trainer.mesh["tp"]) if save else {n for n, _ in red.named}
    if save:  # a tied LM head's copy (PP) is stored once, by the embedding's stage
        owned -= {n for n, p in red.named if is_tied_copy(n, p)}
    gname = {n: tied_name(n, p) for n, p in red.named}  # the copy reads the embedding's entries
    out: dict[str, tuple[tuple, list]] = {}

    def add(key, spec, boxes):
        out[key] = (tuple(spec.global_shape), boxes)

    for i, (n, p) in enumerate(red.named):
        spec = get_spec(p)
        # Params (and zero=0 state) are identical on every dp×cp rank (experts: every edp rank):
        # spread the writes over them.
        dp = trainer.mesh["edp"] if is_expert(p) else trainer.mesh["dp_cp"]
        mine = n in owned and (not save or i % dp.size == dp.rank)
        tensors = (({} if red.zero >= 3 else {"model": p}) |  # ZeRO-3: parameters exist only as shards (below)
                   ({} if red.zero else _optimizer_state(red, p, red.muon is not None and red.is_muon(n, p))))
        for kind, t in tensors.items():
            boxes = _place(spec, p.shape, t.detach().view(-1), 0, p.numel(), save) if mine else []  # a view, not a copy
            add(f"model.{gname[n]}" if kind == "model" else f"optim.{gname[n]}.{kind}", spec, boxes)
    for n, mod, b in persistent_buffers(trainer.model):
        # Replicated like their module's parameters: the first TP rank of each dp×cp (experts: edp) group writes.
        expert = any(is_expert(q) for q in mod.parameters(recurse=False))
        dp = trainer.mesh["edp"] if expert else trainer.mesh["dp_cp"]
        mine = not save or (trainer.mesh["tp"].rank == 0 and dp.rank == 0)
        spec = get_spec(b)
        add(f"buffer.{n}", spec, _place(spec, b.shape, b.view(-1), 0, b.numel()) if mine else [])
    if red.zero:
        for g in red.flat:
            state = _optimizer_state(red, g["shard"], g["muon"])
            lo_s = g["axis"].rank * g["per"]
            # hybrid sharding: the dp/S replicas of a dense shard hold equal copies; the first writes it
            copy = save and not g["expert"] and trainer.mesh["dp_replicate"].rank > 0
            shard = {"model": g["shard"].detach()} if red.zero >= 3 else {}
            for n, p, off, k in g["offsets"]:
                lo, hi = max(off, lo_s), min(off + k, lo_s + g["per"])
                for key, t in (shard | state).items():
                    boxes = (_place(get_spec(p), p.shape, t[lo - lo_s:hi - lo_s], lo - off, hi - off, save)
                             if lo < hi and n in owned and not copy else [])
                    add(f"model.{gname[n]}" if key == "model" else f"optim.{gname[n]}.{key}", get_spec(p), boxes)
    return out


# ---------------------------------------------------------------- DCP planners over boxes
class BoxSavePlanner(DefaultSavePlanner):
    """Writes each owned box as a chunk of its global tensor; the default global plan validates coverage."""

    def __init__(self, entries):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries = entries

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([
            WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(off), t.size()),
                                                  TensorProperties.create_from_tensor(t), torch.Size(size)))
            for fqn, (size, boxes) in self.entries.items() for off, t in boxes])
        return self.plan

    def create_global_plan(self, all_plans):
        """DCP would silently drop exact duplicates; a duplicate means the ownership rule broke, so refuse it."""
        seen, dups = set(), set()
        for plan in all_plans:
            for item in plan.items:
                key = (item.index.fqn, tuple(item.index.offset))
                (dups if key in seen else seen).add(key)
        if dups:
            raise ValueError(f"checkpoint: {len(dups)} chunks written by several ranks, e.g. {sorted(dups)[:3]}")
        return super().create_global_plan(all_plans)

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        for off, t in self.entries[write_item.index.fqn][1]:
            if torch.Size(off) == write_item.index.offset:
                if t.device.type == "cpu" and t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes:
                    return t.detach()  # already compact on the host (an async save's staging buffer)
                # A compact copy: torch.save of a view would write its whole storage.
                return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        raise KeyError(write_item.index)


class BoxLoadPlanner(DefaultLoadPlanner):
    """Reads into each box (a view of a live tensor) whatever saved chunks overlap it."""

    def __init__(self, entries, path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.entries, self.path = entries, path

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        saved = self.metadata.state_dict_metadata
        for fqn, (size, boxes) in self.entries.items():
            if fqn not in saved:
                raise KeyError(f"checkpoint {self.path} has no tensor {fqn!r}: was it saved from another model?")
            if tuple(saved[fqn].size) != tuple(size):
                raise ValueError(f"checkpoint {self.path}: {fqn} has shape {tuple(saved[fqn].size)}, "
                                 f"the model needs {tuple(size)}")
            items += create_read_items_for_chunk_list(
                fqn, saved[fqn], [ChunkStorageMetadata(torch.Size(off), t.size()) for off, t in boxes])
        return LoadPlan(items)

    def load_bytes(self, read_item, value) -> None:  # the default would torch.load(weights_only=False)
        raise ValueError(f"checkpoint {self.path}: unexpected pickled object {read_item.dest_index.fqn!r}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        t = self.entries[read_item.dest_index.fqn][1][read_item.dest_index.index][1]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t


_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
                 ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its metadata; admit only DCP metadata classes, torch.Size, dtypes and paths."""

    def find_class(self, module, name):
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        obj = getattr(torch, name, None) if module == "torch" else None
        if isinstance(obj, torch.dtype):
            return obj
        if module == "torch.distributed.checkpoint.metadata":  # only the classes defined there
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, minus free unpickling: tensors already load with weights_only=True; `.metadata` is a
    pickle, checksummed against the manifest before this runs and read with the allow-list above."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def run_dcp(fn, mesh=None, **kw):
    """dcp.save / dcp.load / dcp.async_save, in one process (no process group) unless the mesh spans
    several ranks — then on the mesh's `ckpt` group (gloo, long timeout: a slow filesystem must not trip
    the training group's watchdog, and DCP's plan exchange never touches the accelerator's
    communicator); returns what `fn` returns (async_save: its future)."""
    alone = mesh is None or not mesh["world"].active
    if not alone:
        kw["process_group"] = mesh["ckpt"].group
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn({}, no_dist=alone, **kw)
