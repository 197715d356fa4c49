"""Distributed checkpoints: memtree storage for ``torch.distributed.checkpoint`` (DCP), no pickle.

``dcp.save(state, storage_writer=memtree.dcp.Writer(path))`` writes a directory that is a plain
memtree (``memtree.load_memmap(path)`` opens it in any single process: one full ``.memmap`` file
per tensor, non-tensor values inline in ``meta.json``) plus a ``dcp.json`` file holding DCP's
metadata as JSON: global shapes, dtypes and which chunk of each tensor every rank saved.
``dcp.load(state, storage_reader=memtree.dcp.Reader(path))`` loads it back with any number of
ranks and any sharding: DCP's planner reshards (saved by 2 ranks, loaded by 1 or 3).

How a save works (``docs/format.md``, "Distributed checkpoints"):

1. the coordinator (``prepare_global_plan``) takes the destination's writer lock, creates a
   staging directory next to it and, in it, every leaf file at its full size; each rank's plan
   carries the staging path and the file of each of its tensors;
2. every rank (``write_data``) writes its chunks with ``pwrite`` into those shared files, at the
   byte offsets of the chunk inside the full tensor (chunks never overlap: DCP checks it);
3. the coordinator (``finish``), once every rank succeeded, writes each level's ``meta.json``,
   then ``dcp.json``, then the root ``meta.json``, and renames the staging directory onto the
   destination like any memtree write. A save that fails on any rank commits nothing.

Nothing is pickled: DCP's own file storage unpickles ``.metadata`` and ``torch.load``s non-tensor
values with ``weights_only=False`` (torch 2.13). Here metadata is ``dcp.json``, non-tensor values
are JSON (refused if JSON would change them), and :class:`Reader` never opens any other file.
With DCP's default planners the JSON path is used too; :class:`SavePlanner`/:class:`LoadPlanner`
make it explicit. DCP raises ``CheckpointException``, a ``BaseException``; :func:`save` and
:func:`load` turn it into :class:`~memtree.errors.DistributedCheckpointError`.

Example:
    >>> import tempfile, torch, memtree, memtree.dcp
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7}
    >>> _ = memtree.dcp.save(state, d)
    >>> memtree.load_memmap(d)["model", "w"].sum().item(), memtree.load_memmap(d)["step"]
    (15.0, 7)
    >>> target = {"model": {"w": torch.zeros(2, 3)}, "step": 0}
    >>> memtree.dcp.load(target, d)
    >>> target["step"], target["model"]["w"][1].tolist()
    (7, [3.0, 4.0, 5.0])
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import stat
import uuid
import warnings
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from typing import Any

import orjson
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..format.dtypes import dtype_from_name, dtype_name, itemsize
from ..errors import (
    DistributedCheckpointError,
    InvalidKeyError,
    LimitError,
    MemtreeError,
    MetaFormatError,
    NonTensorValueError,
    NotAMemtreeError,
    UnsafePathError,
)
from ..store.files import WriterLock, allocate_fd, byte_view, fsync_dir, storage_error, write_small_file
from ..format.schema import ChildMeta, Entry, JsonMeta, LeafMeta, LevelMeta, dump_level
from ..format.names import META_NAME, encode_level
from ..format.level import Level
from ..store.mapped import to_storable
from ..format.values import NonTensor, json_problem
from ..store.read import read_tree
from ..format.names import lock_path, staging_path
from ..store.recovery import recover_locked
from ..store.write import LOCK_TIMEOUT, destination_state, publish

__all__ = ["Writer", "Reader", "SavePlanner", "LoadPlanner", "save", "load", "DCP_NAME"]

#: The JSON file next to the root ``meta.json`` that holds DCP's metadata.
DCP_NAME = "dcp.json"
DCP_FORMAT = "memtree-dcp"
DCP_VERSION = 1
MAX_DCP_BYTES = 256 * 1024 * 1024
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_OPEN_RW = os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


# ---------------------------------------------------------------------------------------------
# planners: non-tensor values as JSON


def _json_bytes(value: Any, fqn: str) -> bytes:
    problem = json_problem(value)
    if problem is not None:
        raise NonTensorValueError(
            f"non-tensor value {fqn!r}: {problem}. memtree's DCP storage keeps non-tensor values "
            "as JSON and never pickles: store it as a tensor, or convert it (e.g. a tuple to a list)"
        )
    return orjson.dumps(value)


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, but non-tensor values become JSON bytes instead of pickles.

    Example:
        >>> planner = SavePlanner()   # dcp.save(state, storage_writer=Writer(d), planner=planner)
    """

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        """JSON bytes for a non-tensor value (refused if JSON would change it); tensors as is."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(_json_bytes(object, write_item.index.fqn))
        return object


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read as JSON, never unpickled.

    Example:
        >>> planner = LoadPlanner()   # dcp.load(state, storage_reader=Reader(d), planner=planner)
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode a JSON value and put it where the state dict expects it."""
        try:
            obj = orjson.loads(value.getvalue())
        except orjson.JSONDecodeError as err:
            raise MetaFormatError(f"non-tensor value {read_item.dest_index.fqn!r} is not JSON ({err})") from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _object_bytes(planner: Any, item: WriteItem) -> bytes:
    """A non-tensor value's JSON bytes, without ever letting a stock planner ``torch.save`` it."""
    if isinstance(planner, DefaultSavePlanner) and type(planner).transform_object is DefaultSavePlanner.transform_object:
        return _json_bytes(planner.lookup_object(item.index), item.index.fqn)
    data = planner.resolve_data(item)
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    try:
        orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        raise NonTensorValueError(
            f"the save planner turned {item.index.fqn!r} into bytes that are not JSON (a pickle?); "
            "memtree's DCP storage stores only JSON: use memtree.dcp.SavePlanner"
        ) from None
    return bytes(raw)


def _deliver_bytes(planner: Any, item: ReadItem, data: bytes) -> None:
    """Hand a JSON value to the load planner without ever letting a stock planner unpickle it."""
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        LoadPlanner.load_bytes(planner, item, io.BytesIO(data))  # type: ignore[arg-type]
    else:
        planner.load_bytes(item, io.BytesIO(data))  # a custom planner receives JSON text


# ---------------------------------------------------------------------------------------------
# layout: tensors and values -> tree paths -> files


@dataclass
class _Layout:
    """Where every FQN lives in the tree, computed by the coordinator from all ranks' plans."""

    paths: dict[str, tuple[str, ...]] = field(default_factory=dict)  # fqn -> tree key path
    files: dict[str, str] = field(default_factory=dict)  # tensor fqn -> file, relative to the root
    dirs: dict[tuple[str, ...], str] = field(default_factory=dict)  # tree path -> directory
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    order: dict[tuple[str, ...], list[str]] = field(default_factory=dict)  # level -> keys


@dataclass(frozen=True)
class _RankStorage:
    """What one rank needs to write its part: the staging directory and its tensors' files."""

    staging: str
    files: dict[str, str]


def _tree_path(fqn: str, mappings: Any) -> tuple[str, ...]:
    if isinstance(mappings, dict) and fqn in mappings:
        return tuple(str(p) for p in mappings[fqn])
    return (fqn,)


def _plan_layout(plans: list[SavePlan]) -> _Layout:
    lay = _Layout()
    kinds: dict[tuple[str, ...], str] = {}  # tree path -> "tensor" | "json" | "tree"
    for plan in plans:
        for item in plan.items:
            fqn = item.index.fqn
            if fqn in lay.paths:
                continue
            path = _tree_path(fqn, plan.planner_data)
            for depth in range(len(path)):
                sub, kind = path[: depth + 1], "tree" if depth + 1 < len(path) else (
                    "json" if item.type == WriteItemType.BYTE_IO else "tensor")
                if kinds.setdefault(sub, kind) != kind or (kind != "tree" and sub in lay.order):
                    raise InvalidKeyError(
                        f"state dict key {fqn!r} maps to the tree path {path!r}, which collides with "
                        "another key's; memtree needs a tree (rename one of them)"
                    )
                if sub[-1] not in lay.order.get(sub[:-1], []):
                    lay.order.setdefault(sub[:-1], []).append(sub[-1])
            lay.paths[fqn] = path
            if item.tensor_data is not None:
                dtype_name(item.tensor_data.properties.dtype)  # DtypeError for unsupported dtypes
                lay.tensors[fqn] = (item.tensor_data.properties.dtype, tuple(item.tensor_data.size))
    by_path = {path: fqn for fqn, path in lay.paths.items()}
    lay.dirs[()] = ""
    for level in sorted(lay.order, key=len):  # parents before children
        keys = lay.order[level]
        names = encode_level([(k, "" if kinds[level + (k,)] == "tree" else ".memmap") for k in keys])
        for key, name in zip(keys, names):
            sub = level + (key,)
            if not level and name.lower() == DCP_NAME:
                raise InvalidKeyError(
                    f"the top-level key {key!r} would be stored as {name!r}, the name of the "
                    "checkpoint's metadata file; rename it"
                )
            rel = f"{lay.dirs[level]}/{name}" if lay.dirs[level] else name
            if kinds[sub] == "tree":
                lay.dirs[sub] = rel
            elif kinds[sub] == "tensor":
                lay.files[by_path[sub]] = rel
    return lay


def _runs(full: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], isize: int) -> tuple[list[int], int]:
    """Byte offsets in the full tensor's file of the contiguous runs of a chunk, and their length."""
    if not full:
        return [0], isize
    k = len(full) - 1
    while k > 0 and sizes[k] == full[k]:
        k -= 1
    strides = [prod(full[d + 1 :]) for d in range(len(full))]
    grid = torch.tensor([offsets[k] * strides[k]], dtype=torch.int64)
    for d in range(k - 1, -1, -1):  # outer dims: every index combination, in row-major order
        grid = ((offsets[d] + torch.arange(sizes[d], dtype=torch.int64)) * strides[d])[:, None] + grid[None, :]
        grid = grid.reshape(-1)
    return (grid * isize).tolist(), sizes[k] * strides[k] * isize


def _write_chunk(path: str, tensor: torch.Tensor, full: tuple[int, ...], offsets: tuple[int, ...], fsync: bool) -> int:
    data = byte_view(tensor)
    if not len(data):
        return 0
    starts, run = _runs(full, offsets, tuple(tensor.shape), tensor.element_size())
    fd = os.open(path, _OPEN_RW)
    try:
        for j, start in enumerate(starts):
            view = data[j * run : (j + 1) * run]
            while view:
                n = os.pwrite(fd, view, start + run - len(view))
                view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


# ---------------------------------------------------------------------------------------------
# the writer


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that saves a checkpoint as a memtree directory (see the module doc).

    Args:
        path: the checkpoint directory (on a filesystem every rank shares).
        existsok: replace an existing memtree at ``path`` (atomically, at the commit).
        fsync: fsync every file and directory before the commit (DCP's ``sync_files``).
        num_threads: tensors written concurrently by each rank (0: in the calling thread).

    The coordinator holds the destination's writer lock from ``prepare_global_plan`` to
    ``finish``. When ``dcp.save`` fails, call :meth:`abort` on the coordinator's writer (or save
    again with it) to remove the staging directory and release the lock; :func:`save` does this
    for you. ``dcp.save(..., use_collectives=False)`` is not supported: ranks must agree on one
    layout.

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=Writer(d), planner=SavePlanner(), no_dist=True)
    """

    def __init__(self, path: str | os.PathLike[str], *, existsok: bool = True, fsync: bool = True,
                 num_threads: int = 0) -> None:
        super().__init__()
        self.path = os.path.realpath(os.fspath(path))
        self.existsok = existsok
        self.fsync = fsync
        self.num_threads = num_threads
        self.is_coordinator = False
        self._staging: str | None = None
        self._state = "absent"
        self._layout: _Layout | None = None
        self._lock: WriterLock | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save (to ``checkpoint_id`` if given); leftovers of a failed one are removed."""
        self.abort()
        if checkpoint_id is not None:
            self.path = os.path.realpath(os.fspath(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Record whether this rank is the coordinator."""
        if kwargs.get("use_collectives") is False:
            raise DistributedCheckpointError(
                "memtree.dcp.Writer needs dcp.save(..., use_collectives=True): the coordinator lays "
                "out the files every rank writes into"
            )
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint's path, recorded in ``dcp.json``."""
        return StorageMeta(checkpoint_id=self.path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing rank-local to plan: the coordinator lays out the files for everyone."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: lock the destination, create the staging tree and every leaf file."""
        self.abort()
        layout = _plan_layout(plans)
        parent, name = os.path.split(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
            lock = WriterLock(lock_path(parent, name), self.path, timeout=LOCK_TIMEOUT)
            lock.acquire()
            self._lock = lock
            recover_locked(parent, name, lock)
            self._state = destination_state(self.path, self.existsok)
            staging = staging_path(parent, name)
            lock.write_journal({"staging": os.path.basename(staging)}, fsync=False)
            os.mkdir(staging, 0o700)
            self._staging = staging
            for rel in sorted(layout.dirs.values(), key=lambda r: r.count("/")):
                if rel:
                    os.mkdir(os.path.join(staging, rel))
            for fqn, rel in layout.files.items():
                dtype, shape = layout.tensors[fqn]
                fd = os.open(os.path.join(staging, rel), _NEW, 0o644)
                try:
                    allocate_fd(fd, prod(shape) * itemsize(dtype), reserve=True)
                finally:
                    os.close(fd)
        except BaseException as err:
            self.abort()
            if isinstance(err, OSError) and not isinstance(err, MemtreeError):
                raise storage_error(err, f"preparing the checkpoint {self.path}") from err
            raise
        self._layout = layout
        out = []
        for plan in plans:
            mine = {i.index.fqn: layout.files[i.index.fqn] for i in plan.items if i.index.fqn in layout.files}
            out.append(dataclasses.replace(plan, storage_data=_RankStorage(staging, mine)))
        return out

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        """Write this rank's chunks into the shared leaf files; non-tensor values go to the coordinator."""
        storage: _RankStorage = plan.storage_data

        def one(item: WriteItem) -> WriteResult:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = _object_bytes(planner, item)
                return WriteResult(index=item.index, size_in_bytes=len(data), storage_data=data)
            assert item.tensor_data is not None
            tensor = to_storable(planner.resolve_data(item), f"tensor {fqn!r}")
            if tuple(tensor.shape) != tuple(item.tensor_data.chunk.sizes):
                raise MetaFormatError(
                    f"tensor {fqn!r}: the planner resolved a chunk of shape {list(tensor.shape)}, "
                    f"expected {list(item.tensor_data.chunk.sizes)}"
                )
            try:
                n = _write_chunk(os.path.join(storage.staging, storage.files[fqn]), tensor,
                                 tuple(item.tensor_data.size), tuple(item.tensor_data.chunk.offsets), self.fsync)
            except OSError as err:
                raise storage_error(err, f"writing tensor {fqn!r} of the checkpoint {self.path}") from err
            return WriteResult(index=item.index, size_in_bytes=n, storage_data=None)

        if self.num_threads > 0 and len(plan.items) > 1:
            with ThreadPoolExecutor(self.num_threads, thread_name_prefix="memtree-dcp") as pool:
                results = list(pool.map(one, plan.items))
        else:
            results = [one(item) for item in plan.items]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write every ``meta.json`` and ``dcp.json``, then commit by rename."""
        if self._staging is None or self._layout is None or self._lock is None:
            raise DistributedCheckpointError("finish() was called before prepare_global_plan()")
        layout, staging = self._layout, self._staging
        values = {
            r.index.fqn: orjson.loads(r.storage_data)
            for rank in results for r in rank if isinstance(r.storage_data, (bytes, bytearray))
        }
        try:
            levels = _level_metas(layout, values)
            for path in sorted(levels, key=len, reverse=True):  # deepest first
                if path:
                    directory = os.path.join(staging, layout.dirs[path])
                    write_small_file(os.path.join(directory, META_NAME), dump_level(levels[path]), fsync=self.fsync)
                    if self.fsync:
                        fsync_dir(directory)
            write_small_file(os.path.join(staging, DCP_NAME), _dump_dcp(metadata, layout), fsync=self.fsync)
            root = dataclasses.replace(levels[()], save_id=uuid.uuid4().hex)
            os.chmod(staging, 0o755)
            write_small_file(os.path.join(staging, META_NAME), dump_level(root), fsync=self.fsync)
            if self.fsync:
                fsync_dir(staging)
            publish(staging, self.path, self._state, self.fsync, self._lock)
            self._staging = None
        except BaseException as err:
            self.abort()
            if isinstance(err, OSError) and not isinstance(err, MemtreeError):
                raise storage_error(err, f"committing the checkpoint {self.path}") from err
            raise
        self.abort()  # releases the lock

    def abort(self) -> None:
        """Remove the staging directory of an unfinished save and release the lock (coordinator)."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._layout = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """memtree never claims a checkpoint id by itself: pass ``storage_writer=Writer(...)``."""
        return False


def _level_metas(layout: _Layout, values: dict[str, Any]) -> dict[tuple[str, ...], LevelMeta]:
    by_path = {path: fqn for fqn, path in layout.paths.items()}
    out: dict[tuple[str, ...], LevelMeta] = {}
    for level, keys in layout.order.items():
        entries: list[Entry] = []
        for key in keys:
            sub = level + (key,)
            if sub in layout.dirs:
                entries.append(ChildMeta(key, layout.dirs[sub].rsplit("/", 1)[-1]))
            elif by_path[sub] in layout.files:
                dtype, shape = layout.tensors[by_path[sub]]
                entries.append(LeafMeta(key, layout.files[by_path[sub]].rsplit("/", 1)[-1], dtype, shape))
            else:
                entries.append(JsonMeta(key, values[by_path[sub]]))
        out[level] = LevelMeta((), tuple(entries))
    out.setdefault((), LevelMeta((), ()))
    return out


# ---------------------------------------------------------------------------------------------
# dcp.json


def _dump_dcp(metadata: Metadata, layout: _Layout) -> bytes:
    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = list(layout.paths.get(fqn, (fqn,)))
        if isinstance(md, TensorStorageMetadata):
            items[fqn] = {
                "kind": "tensor",
                "path": path,
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        else:
            items[fqn] = {"kind": "bytes", "path": path}
    planner_data = metadata.planner_data
    mappings = (
        {k: list(v) for k, v in planner_data.items()}
        if isinstance(planner_data, dict) and all(isinstance(v, tuple) for v in planner_data.values())
        else None
    )
    sm = metadata.storage_meta
    return orjson.dumps({
        "format": DCP_FORMAT,
        "version": DCP_VERSION,
        "dcp_version": metadata.version,
        "items": items,
        "mappings": mappings,
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
    })


class _Json:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, pointer: str, problem: str) -> MetaFormatError:
        return MetaFormatError(f"{self.where}: {pointer} {problem}; the checkpoint is damaged or not memtree's")

    def obj(self, v: Any, p: str, required: set[str], optional: AbstractSet[str] = frozenset()) -> dict[str, Any]:
        if type(v) is not dict:
            raise self.fail(p, "must be a JSON object")
        if required - v.keys() or v.keys() - required - optional:
            raise self.fail(p, f"must have the fields {sorted(required)} (optional {sorted(optional)})")
        return v

    def ints(self, v: Any, p: str) -> tuple[int, ...]:
        if type(v) is not list or len(v) > 64 or not all(type(x) is int and x >= 0 for x in v):
            raise self.fail(p, "must be a list of at most 64 ints >= 0")
        return tuple(v)

    def strs(self, v: Any, p: str, *, ints_ok: bool = False) -> list[Any]:
        ok = (str, int) if ints_ok else (str,)
        if type(v) is not list or not v or not all(type(x) in ok for x in v):
            raise self.fail(p, "must be a non-empty list of strings")
        return v


def _parse_dcp(data: bytes, where: str) -> tuple[Metadata, dict[str, tuple[str, ...]]]:
    c = _Json(where)
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raise c.fail("content", f"is not valid UTF-8 JSON ({err})") from None
    doc = c.obj(doc, "top level", {"format", "version", "dcp_version", "items", "mappings", "storage_meta"})
    if doc["format"] != DCP_FORMAT or doc["version"] != DCP_VERSION:
        raise c.fail("format/version", f"must be {DCP_FORMAT!r} version {DCP_VERSION}")
    if type(doc["items"]) is not dict:
        raise c.fail("items", "must be a JSON object")
    state: dict[str, Any] = {}
    paths: dict[str, tuple[str, ...]] = {}
    for fqn, raw in doc["items"].items():
        p = f"items[{fqn!r}]"
        kind = raw.get("kind") if type(raw) is dict else None
        if kind == "tensor":
            raw = c.obj(raw, p, {"kind", "path", "dtype", "size", "chunks"})
            dtype = dtype_from_name(raw["dtype"]) if type(raw["dtype"]) is str else None
            if dtype is None:
                raise c.fail(f"{p}.dtype", f"names no dtype memtree can read: {raw['dtype']!r:.40}")
            size = c.ints(raw["size"], f"{p}.size")
            if type(raw["chunks"]) is not list:
                raise c.fail(f"{p}.chunks", "must be a list")
            chunks = []
            for i, ch in enumerate(raw["chunks"]):
                ch = c.obj(ch, f"{p}.chunks[{i}]", {"offsets", "sizes"})
                off, sz = c.ints(ch["offsets"], f"{p}.chunks[{i}].offsets"), c.ints(ch["sizes"], f"{p}.chunks[{i}].sizes")
                if len(off) != len(size) or len(sz) != len(size) or any(o + s > n for o, s, n in zip(off, sz, size)):
                    raise c.fail(f"{p}.chunks[{i}]", f"does not fit in the tensor's size {list(size)}")
                chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
            state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks)
        elif kind == "bytes":
            raw = c.obj(raw, p, {"kind", "path"})
            state[fqn] = BytesStorageMetadata()
        else:
            raise c.fail(f"{p}.kind", "must be 'tensor' or 'bytes'")
        paths[fqn] = tuple(c.strs(raw["path"], f"{p}.path"))
    mappings = doc["mappings"]
    planner_data = None
    if mappings is not None:
        if type(mappings) is not dict:
            raise c.fail("mappings", "must be a JSON object or null")
        planner_data = {k: tuple(c.strs(v, f"mappings[{k!r}]", ints_ok=True)) for k, v in mappings.items()}
    sm_raw = doc["storage_meta"]
    storage_meta = None
    if sm_raw is not None:
        sm_raw = c.obj(sm_raw, "storage_meta", {"checkpoint_id", "save_id", "modules"})
        if not all(type(sm_raw[k]) in (str, type(None)) for k in ("checkpoint_id", "save_id")):
            raise c.fail("storage_meta", "checkpoint_id and save_id must be strings or null")
        if type(sm_raw["modules"]) is not list or not all(type(m) is str for m in sm_raw["modules"]):
            raise c.fail("storage_meta.modules", "must be a list of strings")
        storage_meta = StorageMeta(sm_raw["checkpoint_id"], sm_raw["save_id"], None, sm_raw["modules"])
    version = doc["dcp_version"] if type(doc["dcp_version"]) is str else None
    return Metadata(state, planner_data, None, storage_meta, version), paths


# ---------------------------------------------------------------------------------------------
# the reader


class Reader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`Writer`; it never unpickles.

    It reads only ``dcp.json`` and the memtree (validated by the normal loader, leaves mapped
    read-only); any ``.metadata`` or ``*.distcp`` file in the directory is ignored.

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=Writer(d), no_dist=True)
        >>> target = {"w": torch.zeros(2)}
        >>> dcp.load(target, storage_reader=Reader(d), planner=LoadPlanner(), no_dist=True)
        >>> target["w"].tolist()
        [1.0, 1.0]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.path.realpath(os.fspath(path))
        self._paths: dict[str, tuple[str, ...]] = {}
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load (from ``checkpoint_id`` if given)."""
        if checkpoint_id is not None:
            self.path = os.path.realpath(os.fspath(checkpoint_id))
        self._paths, self._metadata = {}, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Parse ``dcp.json`` (size-limited, never pickle) into DCP's ``Metadata``."""
        where = os.path.join(self.path, DCP_NAME)
        try:
            fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise NotAMemtreeError(
                f"{where} is missing: {self.path} is not a distributed checkpoint written by memtree.dcp.Writer"
            ) from None
        except OSError as err:
            raise UnsafePathError(f"cannot open {where} safely: {err}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(f"{where} is not a regular file")
            if st.st_size > MAX_DCP_BYTES:
                raise LimitError(f"{where} has {st.st_size:,} bytes, more than the {MAX_DCP_BYTES:,} allowed")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(MAX_DCP_BYTES + 1)
        finally:
            os.close(fd)
        self._metadata, self._paths = _parse_dcp(data, where)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the metadata (``read_metadata`` may have run on another instance)."""
        if self._metadata is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to add: every rank reads the shared directory."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to add: every rank reads the shared directory."""
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
        """Copy each requested region out of the mapped leaves; JSON values to the planner."""
        assert self._metadata is not None
        wanted = sorted({self._paths[item.storage_index.fqn] for item in plan.items})
        tree = read_tree(self.path, keys=wanted, mode="r") if wanted else Level(())
        for item in plan.items:
            fqn = item.storage_index.fqn
            value = _lookup(tree, self._paths[fqn])
            md = self._metadata.state_dict_metadata[fqn]
            if item.type == LoadItemType.BYTE_IO:
                if not isinstance(value, NonTensor):
                    raise MetaFormatError(f"{self.path}: {fqn!r} is a non-tensor value in {DCP_NAME} but not in meta.json")
                _deliver_bytes(planner, item, orjson.dumps(value.data))
                continue
            if not isinstance(value, torch.Tensor) or not isinstance(md, TensorStorageMetadata) or (
                value.dtype != md.properties.dtype or value.shape != md.size
            ):
                raise MetaFormatError(
                    f"{self.path}: tensor {fqn!r} in meta.json does not match {DCP_NAME} "
                    f"(dtype/shape {getattr(value, 'dtype', None)}/{list(getattr(value, 'shape', []))} vs "
                    f"{getattr(getattr(md, 'properties', None), 'dtype', None)}/{list(getattr(md, 'size', []))})"
                )
            src = value
            chunk = item.storage_index.offset or torch.Size([0] * value.dim())
            for d, (c0, o, n) in enumerate(zip(chunk, item.storage_offsets, item.lengths)):
                src = src.narrow(d, c0 + o, n)
            dest = planner.resolve_tensor(item).detach()
            if dest.shape != src.shape:
                raise MetaFormatError(
                    f"tensor {fqn!r}: the load plan asks for a region of shape {list(src.shape)} "
                    f"into a destination of shape {list(dest.shape)}"
                )
            with torch._C.DisableTorchFunctionSubclass():
                dest.copy_(src.as_subclass(torch.Tensor))
            planner.commit_tensor(item, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a directory holding a memtree ``dcp.json``."""
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), DCP_NAME))


def _lookup(tree: Level, path: tuple[str, ...]) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, Level) or key not in node.entries:
            raise MetaFormatError(f"{DCP_NAME} names the tree path {path!r}, which meta.json does not hold")
        node = node.entries[key]
    return node


# ---------------------------------------------------------------------------------------------
# the API boundary: CheckpointException (a BaseException) -> DistributedCheckpointError


def _convert(err: CheckpointException, what: str) -> DistributedCheckpointError:
    failures = {rank: pair[0] if isinstance(pair, tuple) else pair for rank, pair in err.failures.items()}
    lines = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(failures.items()))
    return DistributedCheckpointError(f"{what} failed on {len(failures)} rank(s): {lines}", failures)


def save(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None,
         existsok: bool = True, fsync: bool = True, num_threads: int = 0) -> Metadata:
    """``dcp.save`` with memtree's :class:`Writer` and :class:`SavePlanner` (call it on every rank).

    Args:
        state_dict: the state to save (tensors, DTensors, JSON values), as for ``dcp.save``.
        path: the checkpoint directory, on a filesystem every rank shares.
        process_group: the group to save with (default: the default group, or a single process
            when ``torch.distributed`` is not initialised).
        existsok, fsync, num_threads: see :class:`Writer`.

    Returns:
        DCP's ``Metadata`` of the saved checkpoint.

    Raises:
        DistributedCheckpointError: the save failed on some rank (``failures`` maps each rank to
            its exception); nothing was committed.

    Example:
        >>> import tempfile, torch
        >>> _ = save({"w": torch.ones(3)}, tempfile.mkdtemp() + "/ckpt")
    """
    writer = Writer(path, existsok=existsok, fsync=fsync, num_threads=num_threads)
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            metadata: Metadata = dcp.save(state_dict, storage_writer=writer, planner=SavePlanner(),
                                          process_group=process_group, no_dist=no_dist)
            return metadata
    except CheckpointException as err:
        raise _convert(err, f"saving the checkpoint {writer.path}") from None
    except torch.distributed.DistError as err:  # a collective failed (a rank died, a timeout)
        raise DistributedCheckpointError(
            f"saving the checkpoint {writer.path} failed in a collective ({type(err).__name__}: "
            f"{err}); nothing was committed"
        ) from err
    finally:
        writer.abort()


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None) -> None:
    """``dcp.load`` with memtree's :class:`Reader` and :class:`LoadPlanner`: fills ``state_dict`` in place.

    The tensors of ``state_dict`` (plain or ``DTensor``, any sharding, any number of ranks) say
    what to load; DCP's planner reshards.

    Raises:
        DistributedCheckpointError: the load failed on some rank.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> _ = save({"w": torch.arange(3.0)}, d)
        >>> target = {"w": torch.zeros(3)}
        >>> load(target, d)
        >>> target["w"].tolist()
        [0.0, 1.0, 2.0]
    """
    reader = Reader(path)
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=LoadPlanner(),
                     process_group=process_group, no_dist=no_dist)
    except CheckpointException as err:
        raise _convert(err, f"loading the checkpoint {reader.path}") from None
    except torch.distributed.DistError as err:
        raise DistributedCheckpointError(
            f"loading the checkpoint {reader.path} failed in a collective ({type(err).__name__}: {err})"
        ) from err
