"""Writing a DCP checkpoint as a memtree: planners (JSON, no pickle), the layout, the ``Writer``.

See :mod:`memtree.dcp` for how a save works.

Example:
    >>> import tempfile, torch
    >>> from memtree.dcp import save
    >>> _ = save({"w": torch.ones(2)}, tempfile.mkdtemp() + "/ckpt")
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import prod
from typing import Any

import orjson
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..format.dtypes import dtype_name, itemsize
from ..errors import DistributedCheckpointError, InvalidKeyError, MemtreeError, MetaFormatError
from ..store.primitives.files import allocate_fd, storage_error
from ..store.primitives.memory import byte_view
from ..store.primitives.commit import LOCK_TIMEOUT, WriterLock, destination_state, fsync_dir, publish, write_small_file
from ..format.schema import ChildMeta, Entry, JsonMeta, LeafMeta, LevelMeta, dump_level
from ..format.names import META_NAME, encode_level
from ..store.reading.mapped import to_storable
from ..format.names import lock_path, staging_path
from ..store.writing.recovery import recover_locked
from .planners import object_bytes
from ..format.dcp_json import DCP_NAME, dump_dcp

__all__ = ["Writer"]

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_OPEN_RW = os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


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
        >>> from memtree.dcp import SavePlanner
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
                data, tuples = object_bytes(planner, item)
                return WriteResult(index=item.index, size_in_bytes=len(data), storage_data=(data, tuples))
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
        values = {  # fqn -> (JSON value, paths of its tuples)
            r.index.fqn: (orjson.loads(r.storage_data[0]), r.storage_data[1])
            for rank in results for r in rank if isinstance(r.storage_data, tuple)
        }
        try:
            levels = _level_metas(layout, values)
            for path in sorted(levels, key=len, reverse=True):  # deepest first
                if path:
                    directory = os.path.join(staging, layout.dirs[path])
                    write_small_file(os.path.join(directory, META_NAME), dump_level(levels[path]), fsync=self.fsync)
                    if self.fsync:
                        fsync_dir(directory)
            write_small_file(os.path.join(staging, DCP_NAME), dump_dcp(metadata, layout.paths), fsync=self.fsync)
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
                entries.append(LeafMeta(key, layout.files[by_path[sub]].rsplit("/", 1)[-1], dtype_name(dtype), shape))
            else:
                value, tuples = values[by_path[sub]]
                entries.append(JsonMeta(key, value, tuples=tuple(map(tuple, tuples)) or None))
        out[level] = LevelMeta((), tuple(entries))
    out.setdefault((), LevelMeta((), ()))
    return out
