"""Checkpoints that reshard: saved under one layout, loaded under any other.

Tensors are stored with torch.distributed.checkpoint (DCP) under their *global* names and shapes.
Each rank turns its `ShardSpec`s into boxes of the global tensor (views of its live tensors) and a
pair of small DCP planners writes or reads them, so DCP's resharding handles any layout change:
* only the `valid` rows of padded shards are written, and a slice held by several ranks (TP
  replicas, every dp×cp rank) by exactly one of them — DCP's save-plan check (each tensor covered
  exactly once) therefore also checks the ownership rule;
* AdamW exp_avg / exp_avg_sq are stored like their parameter. A ZeRO-1 shard is a range of the
  flattened local parameters, i.e. a few contiguous boxes (partial row, full rows, partial row),
  so each rank writes and reads its own range with no gather over dp;
* a tied embedding's LM-head copy under PP is not written: it reads `tok_embeddings.weight`'s entries.
Publishing is atomic (tmp-step-N → step-N rename, then `latest`), a JSON manifest of sha256 sums
lets loading skip incomplete or corrupt saves, and nothing is unpickled freely (see _SafeReader).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import os
import pickle
import re
import shutil
import threading
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import comm
from .data.shards import sha256_file
from .data_parallel import is_expert
from .pipeline.tied_embedding import is_tied_copy, tied_name
from .tensor_parallel.layers import get_spec

log = logging.getLogger("shardwise.checkpoint")

FORMAT_VERSION = 1
STATE_KEYS = ("exp_avg", "exp_avg_sq")
MANIFEST, META, LATEST = "manifest.json", "meta.json", "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
_OWNER = re.compile(r"^__(\d+)_\d+\.distcp$")
RNG_AXES = ("dp", "pp", "cp", "tp", "ep")


# ---------------------------------------------------------------- boxes: local views -> global chunks
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


def _place(spec, shape, src: torch.Tensor, lo: int, hi: int) -> list[tuple[tuple, torch.Tensor]]:
    """(global offsets, local view) of the valid part of local flat range [lo, hi); `src` holds exactly that range."""
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


def _tp_owned(named, tp) -> set[str]:
    """Names this TP rank writes: it is the lowest TP rank holding that identical slice."""
    mine = {n: (s.dim, s.start, s.valid) for n, p in named for s in (get_spec(p),)}
    every = comm.all_gather_object(mine, tp)
    return {n for n, key in mine.items() if next(r for r, o in enumerate(every) if o.get(n) == key) == tp.rank}


def _persistent_buffers(model):
    """(global name, owner module, tensor) of every persistent buffer: training state (e.g. the MoE expert_bias)."""
    for prefix, mod in model.named_modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), mod, b


def _ensure_state(reducer, step: int | None = None) -> None:
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
                st["step"] = torch.tensor(float(step), dtype=st["step"].dtype, device=st["step"].device)


def _entries(trainer, save: bool) -> dict[str, tuple[tuple, list]]:
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
                   ({} if red.zero else {k: red.optimizer.state[p][k] for k in STATE_KEYS}))
        for kind, t in tensors.items():
            boxes = _place(spec, p.shape, t.detach().view(-1), 0, p.numel()) if mine else []  # a view, never a copy
            add(f"model.{gname[n]}" if kind == "model" else f"optim.{gname[n]}.{kind}", spec, boxes)
    for n, mod, b in _persistent_buffers(trainer.model):
        # Replicated like their module's parameters: the first TP rank of each dp×cp (experts: edp) group writes.
        expert = any(is_expert(q) for q in mod.parameters(recurse=False))
        dp = trainer.mesh["edp"] if expert else trainer.mesh["dp_cp"]
        mine = not save or (trainer.mesh["tp"].rank == 0 and dp.rank == 0)
        spec = get_spec(b)
        add(f"buffer.{n}", spec, _place(spec, b.shape, b.view(-1), 0, b.numel()) if mine else [])
    if red.zero:
        for g in red.flat:
            state = red.optimizer.state[g["shard"]]
            lo_s = g["axis"].rank * g["per"]
            shard = {"model": g["shard"].detach()} if red.zero >= 3 else {}
            for n, p, off, k in g["offsets"]:
                lo, hi = max(off, lo_s), min(off + k, lo_s + g["per"])
                for key, t in (shard | {key: state[key] for key in STATE_KEYS}).items():
                    boxes = (_place(get_spec(p), p.shape, t[lo - lo_s:hi - lo_s], lo - off, hi - off)
                             if lo < hi and n in owned else [])
                    add(f"model.{gname[n]}" if key == "model" else f"optim.{gname[n]}.{key}", get_spec(p), boxes)
    return out


# ---------------------------------------------------------------- DCP planners over boxes
class _BoxSavePlanner(DefaultSavePlanner):
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
                # A compact copy: torch.save of a view would write its whole storage.
                return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        raise KeyError(write_item.index)


class _BoxLoadPlanner(DefaultLoadPlanner):
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


class _SafeReader(dcp.FileSystemReader):
    """DCP's reader, minus free unpickling: tensors already load with weights_only=True; `.metadata` is a
    pickle, checksummed against the manifest before this runs and read with the allow-list above."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def _dcp(fn, mesh=None, **kw):
    """dcp.save / dcp.load / dcp.async_save, in one process (no process group) unless the mesh spans
    several ranks; returns what `fn` returns (async_save: its future)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn({}, no_dist=mesh is None or not mesh["world"].active, **kw)


# ---------------------------------------------------------------- files
def _write_text(path: str, text: str) -> None:
    """Write then rename, so a reader never sees half a file."""
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def _write_json(path: str, obj) -> None:
    _write_text(path, json.dumps(obj, indent=1, default=str))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


# ---------------------------------------------------------------- save
def save_checkpoint(root: str, step: int, trainer, extra_state: dict | None = None, keep: int | None = None,
                    async_save: bool = False) -> str | None:
    """Collective. Save after `step` completed optimizer steps; returns the published directory.

    `extra_state` (JSON-serialisable, rank 0's copy) comes back from `load_checkpoint`; `keep`
    prunes all but the newest `keep` step directories. A save still pending from `async_save=True`
    is finished first. With `async_save=True` the tensors are copied to host memory now and written
    by `torch.distributed.checkpoint.async_save` while training continues; checksums, manifest,
    publish and `latest` follow in the background once every rank's write completed (None is
    returned; `wait_for_save` blocks until it is published).
    """
    wait_for_save(trainer)
    mesh, ckpt = trainer.mesh, trainer.mesh["ckpt"]
    tmp, final = _begin_save(root, step, trainer, extra_state)
    entries = _entries(trainer, True)
    if not async_save:
        _dcp(dcp.save, mesh, storage_writer=dcp.FileSystemWriter(tmp), planner=_BoxSavePlanner(entries))
        _publish(root, tmp, final, step, ckpt, mesh.rank, keep)
        return final
    # Stage: compact host copies of this rank's boxes, so training may overwrite the live tensors.
    staged = {k: (size, [(off, t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True))
                         for off, t in boxes]) for k, (size, boxes) in entries.items()}
    future = _dcp(dcp.async_save, mesh, storage_writer=dcp.FileSystemWriter(tmp), planner=_BoxSavePlanner(staged),
                  process_group=ckpt.group)
    # The publish's gathers run on the checkpoint group off the main thread: keep them out of the
    # ledger, whose per-step counts belong to the training loop.
    quiet = dataclasses.replace(ckpt, ledger=None)
    trainer.pending_save = PendingSave(lambda: (future.result(), _publish(root, tmp, final, step, quiet,
                                                                         mesh.rank, keep)))
    return None


class PendingSave:
    """A checkpoint being written and published by a background thread; `wait` returns its directory."""

    def __init__(self, work):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(work,), name="shardwise-async-save", daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        try:
            self.result = work()[1]
        except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
            self.error = e

    def wait(self) -> str:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"asynchronous checkpoint save failed: {self.error}") from self.error
        return self.result


def wait_for_save(trainer) -> str | None:
    """Block until the trainer's pending asynchronous save is published (before the next save, at the end)."""
    pending, trainer.pending_save = getattr(trainer, "pending_save", None), None
    return pending.wait() if pending is not None else None


def _begin_save(root: str, step: int, trainer, extra_state: dict | None) -> tuple[str, str]:
    """Collective. A fresh tmp-step-N holding this rank's RNG states and rank 0's metadata, as of now."""
    mesh, ckpt = trainer.mesh, trainer.mesh["ckpt"]
    rank0 = mesh.rank == 0
    tmp, final = os.path.join(root, f"tmp-step-{step}"), os.path.join(root, f"step-{step}")
    if rank0:
        os.makedirs(root, exist_ok=True)
        for d in os.listdir(root):  # saves are collective and sequential: any tmp dir is from a save that died
            if d.startswith("tmp-step-"):
                shutil.rmtree(os.path.join(root, d))
        os.makedirs(tmp)
    comm.barrier(ckpt)
    _ensure_state(trainer.reducer)
    state = next(iter(trainer.reducer.optimizer.state.values()))
    tracker = trainer.model.rng_tracker
    _write_json(os.path.join(tmp, f"rank{mesh.rank}.json"), {
        "rank": mesh.rank, "coords": mesh.coords, "torch_cpu_rng": _b64(torch.get_rng_state()),
        "tracker_rng": {k: _b64(g.get_state()) for k, g in tracker.generators.items()}})
    if rank0:
        layout = trainer.cfg.parallel.as_dict() | {"world": ckpt.size}
        _write_json(os.path.join(tmp, META), {
            "format": FORMAT_VERSION, "step": step, "optimizer_step": int(state["step"]), "layout": layout,
            "model": vars(trainer.model_cfg), "extra_state": extra_state or {},
            "bad_steps": getattr(trainer, "bad_steps", 0)})
    return tmp, final


def _publish(root: str, tmp: str, final: str, step: int, ckpt, rank: int, keep: int | None) -> str:
    """Collective over `ckpt`, once every rank's DCP write finished: checksums, manifest, rename, `latest`."""
    rank0 = rank == 0
    # Each rank hashes what it wrote (DCP names data files __<rank>_<n>.distcp); rank 0 merges the
    # small per-rank dicts, so no rank reads the whole checkpoint while the others wait.
    mine = [f for f in os.listdir(tmp) if (m := _OWNER.match(f)) and int(m.group(1)) == rank]
    mine += [f"rank{rank}.json"] + ([META, ".metadata"] if rank0 else [])
    sums = {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "sha256": sha256_file(os.path.join(tmp, f))} for f in mine}
    merged = comm.all_gather_object(sums, ckpt)
    if rank0:
        files = {f: v for part in merged for f, v in part.items()}
        unowned = sorted(set(os.listdir(tmp)) - set(files) - {f for f in os.listdir(tmp) if f.endswith(".tmp")})
        if unowned:
            raise RuntimeError(f"checkpoint {tmp}: files no rank hashed: {unowned}")
        _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT_VERSION, "step": step, "files": files})
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)  # saved this step before (a resume): the older steps still stand
        os.replace(tmp, final)
        _write_text(os.path.join(root, LATEST), f"step-{step}\n")
        _fsync_dir(root)
        if keep:
            for old_step, path in list_checkpoints(root)[keep:]:
                shutil.rmtree(path)
    comm.barrier(ckpt)
    return final


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Published step directories under `root`, newest first (validity not checked)."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := STEP_DIR.match(d))]
    return sorted(found, reverse=True)


# ---------------------------------------------------------------- verify and load
def checkpoint_problems(path: str, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with checkpoint `path`; this rank checks every `world`-th file of the manifest."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return [f"no {MANIFEST} (incomplete save)"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"unreadable {MANIFEST}: {e}"]
    if META not in files or ".metadata" not in files:
        return [f"{MANIFEST} lists no {META} or .metadata"]
    out = []
    for name in sorted(files)[rank::world]:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            out.append(f"{name} is missing")
        elif os.path.getsize(full) != files[name]["bytes"]:
            out.append(f"{name} has {os.path.getsize(full)} bytes, manifest says {files[name]['bytes']} (truncated?)")
        elif sha256_file(full) != files[name]["sha256"]:
            out.append(f"{name} fails its sha256 checksum")
    return out


def newest_intact(root: str, world_axis=None) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest intact checkpoint under `root` (or `root` itself) and the (path, reason) of each skipped one.

    Collective over `world_axis` when given: ranks split the checksumming and agree on the answer.
    """
    size, rank = (world_axis.size, world_axis.rank) if world_axis is not None else (1, 0)
    single = os.path.isfile(os.path.join(root, MANIFEST)) or STEP_DIR.match(os.path.basename(os.path.normpath(root)))
    cands = [root] if single else [path for _, path in list_checkpoints(root)]
    if world_axis is not None:
        cands = comm.all_gather_object(cands, world_axis)[0]  # one listing for all ranks
    skipped = []
    for path in cands:
        probs = checkpoint_problems(path, rank, size)
        if world_axis is not None:
            probs = sorted({p for ps in comm.all_gather_object(probs, world_axis) for p in ps})
        if not probs:
            return path, skipped
        reason = "; ".join(probs)
        if rank == 0:
            log.warning("skipping checkpoint %s: %s", path, reason)
        skipped.append((path, reason))
    return None, skipped


def load_checkpoint(root: str, trainer) -> dict | None:
    """Collective. Load the newest intact checkpoint under `root` into `trainer`, resharding as needed.

    Restores parameters, AdamW state and step count, `trainer.step`, and — when the layout is the
    one saved — every rank's RNG streams (another layout cannot replay them, so the tracker streams
    are reseeded from (seed, step) instead). Returns {"step", "path", "layout", "extra_state",
    "skipped"}, or None when no intact checkpoint exists.
    """
    mesh = trainer.mesh
    path, skipped = newest_intact(root, mesh["world"] if mesh["world"].active else None)
    if path is None:
        if skipped and mesh.rank == 0:
            log.warning("no intact checkpoint under %s; starting from scratch", root)
        return None
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format {meta.get('format')}, this shardwise reads {FORMAT_VERSION}")
    _ensure_state(trainer.reducer, meta["optimizer_step"])
    _dcp(dcp.load, mesh, storage_reader=_SafeReader(path), planner=_BoxLoadPlanner(_entries(trainer, False), path))
    step = meta["step"]
    tracker = trainer.model.rng_tracker
    same = all(meta["layout"].get(a) == getattr(mesh.dims, a) for a in RNG_AXES)
    rank_file = os.path.join(path, f"rank{mesh.rank}.json")
    if same and os.path.isfile(rank_file):
        with open(rank_file) as f:
            rng = json.load(f)
        torch.set_rng_state(_unb64(rng["torch_cpu_rng"]))
        for k, g in tracker.generators.items():
            g.set_state(_unb64(rng["tracker_rng"][k]))
    else:
        for g in tracker.generators.values():
            g.manual_seed((g.initial_seed() + 1_000_003 * step) % 2**63)
        if mesh.rank == 0:
            log.info("checkpoint %s was saved under %s: RNG streams reseeded from (seed, step)", path, meta["layout"])
    trainer.step = step
    trainer.bad_steps = meta.get("bad_steps", 0)
    return {"step": step, "path": path, "layout": meta["layout"], "extra_state": meta["extra_state"],
            "skipped": skipped}


def load_global_tensors(path: str, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Full-shaped tensors of every key under `prefix` (prefix stripped), read in this process alone."""
    reader = _SafeReader(path)
    saved = reader.read_metadata().state_dict_metadata
    full = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for k, md in saved.items() if k.startswith(prefix)}
    entries = {k: (tuple(t.shape), [((0,) * t.ndim, t)]) for k, t in full.items()}
    _dcp(dcp.load, storage_reader=reader, planner=_BoxLoadPlanner(entries, path))
    return {k[len(prefix):]: t for k, t in full.items()}
