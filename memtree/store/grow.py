"""Growing a memory-mapped tree along its first batch dim: ``append_``, ``extend_``, ``resize_``.

A tree written to (or loaded from) a prefix can grow in place, for datasets and replay buffers
filled over time. What :meth:`TensorTree.extend_` (and ``append_``, ``resize_``) does, under the
destination's writer lock ``.<name>.memtree.lock`` (the lock a write takes):

1. read every ``meta.json`` and check that the tree in memory is the whole tree on disk,
   unchanged (same keys, shapes, files), and that the new rows fit it;
2. if a leaf's file is too small for the new length, grow its *capacity* to
   ``max(length, 2 × capacity)`` rows: ``ftruncate`` every such file up (a file that grows never
   hurts a process that maps it) and commit ``meta.json`` files that record the new
   ``"capacity"`` (``docs/format.md``, "Growable leaves") with the old shapes;
3. write the new rows with ``pwrite`` after the last row (``resize_``: zero them), a region no
   reader maps;
4. commit ``meta.json`` files with the new length;
5. replace the tree's leaves by views of the grown files (its sub-tree objects stay the same).

A commit replaces every ``meta.json`` at once, without copying data: a one-level tree's
``meta.json`` is replaced by a rename; a nested tree is staged (new ``meta.json`` files and
*hard links* to the leaf files in ``.<name>.memtree-tmp-<hex>``) and exchanged with the tree in
one ``renameat2(RENAME_EXCHANGE)``, as a write is published. A load sees the tree before or
after a commit, never a mix of levels. Existing rows are never rewritten and files never
truncated, so processes that loaded the tree before keep a consistent view of the old length.
Capacity doubles, so appending one row at a time costs amortised O(1) per row: one small commit
of the ``meta.json`` files, and a file growth once per doubling.

Limits:

* one writer at a time (the lock); a handle whose tree changed on disk since it was loaded (or
  that was loaded with ``keys=``, or is a view) is refused with
  :class:`~memtree.errors.NotGrowableError`: load the tree again;
* files that no ``meta.json`` names are not kept when a nested tree grows (as with any write);
* a load that runs while the tree grows may fail (its directory replaced under it, or a file
  grown in step 2 before that commit): retry it;
* a crash in the microseconds between step 2's ``ftruncate`` and its commit leaves files longer
  than their ``meta.json`` says, which the loader refuses (``LeafSizeError``); the data is
  intact and truncating each file to the size its ``meta.json`` expects repairs it. An
  exception there truncates the files back itself.

``resize_`` to a smaller length keeps the files (and their capacity); the rows past the new
length are zeroed when the tree grows over them again.

Example:
    >>> import tempfile, torch, memtree
    >>> d = tempfile.mkdtemp() + "/buffer"
    >>> buf = memtree.TensorTree({"obs": torch.zeros(0, 3)}, batch_size=[0]).memmap(d)
    >>> for i in range(5):
    ...     _ = buf.append_({"obs": torch.full((3,), float(i))})
    >>> len(buf), memtree.load_memmap(d)["obs"][:, 0].tolist()
    (5, [0.0, 1.0, 2.0, 3.0, 4.0])
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from math import prod
from typing import Any

import torch

from ..format.dtypes import itemsize
from ..errors import (
    InvalidArgumentError,
    MemtreeError,
    MemtreeKeyError,
    NotGrowableError,
    ReadOnlyError,
    ShapeMismatchError,
)
from .files import (
    WriterLock,
    check_free_space,
    fsync_dir,
    open_checked,
    storage_error,
    write_fd,
    write_small_file,
)
from ..format.schema import ChildMeta, LeafMeta, LevelMeta, PickleMeta, dump_level
from ..format.names import META_NAME, lock_path, meta_tmp_name, staging_path
from ..format.level import Level
from .mapped import MemoryMappedTensor, map_leaf, to_storable
from ..format.values import NonTensor
from .read import open_dir, read_meta
from .recovery import GROWTH_JOURNAL, recover_locked
from .write import LOCK_TIMEOUT, publish

__all__ = ["GROWTH_FACTOR", "check_growable", "extend_level", "resize_level"]

#: A leaf that runs out of rows gets at least this many times its capacity.
GROWTH_FACTOR = 2
_WRITE_FLAGS = os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_ZEROS = bytes(4 * 1024 * 1024)
_LAST_COMMIT_MAX = 64


@dataclass
class _Commit:
    """What this process's last growth of a tree committed, to skip work in the next one.

    While the root ``meta.json`` is still the file that growth wrote (same inode, size and
    times), the ``meta.json`` files are ``metas`` (not read again), and a leaf still mapped by
    the mapping that growth made (``mappings``: path -> storage address and size) is grown by
    a view of that mapping instead of a new one.
    """

    root_stat: tuple[int, ...]
    metas: dict[str, LevelMeta]
    mappings: dict[str, tuple[int, int]]


_LAST_COMMIT: dict[str, _Commit] = {}


def _stat_key(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    with torch._C.DisableTorchFunctionSubclass():
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()


def extend_level(current: Level, rows: Level, *, fsync: bool = False) -> Level:
    """Append ``rows`` to the memory-mapped tree ``current`` on disk; return its new leaves.

    Used by :meth:`TensorTree.append_`/:meth:`TensorTree.extend_`, which check the rows' batch
    size and adopt the result.

    Args:
        current: the tree as mapped from its prefix, with at least one batch dim.
        rows: a level of batch size ``[k] + current.batch_size[1:]`` with the tree's keys.
        fsync: make the growth durable across power loss (fsync files and directories).

    Raises:
        NotGrowableError: ``current`` is not the whole tree mapped from a prefix, or it changed
            on disk, or a non-tensor leaf of ``rows`` differs from the tree's.
        MemtreeKeyError, ShapeMismatchError: ``rows`` does not fit the tree.
        ReadOnlyError: the tree was loaded with ``mode="r"``.
    """
    check_growable(current)
    return _Growth(current, fsync).run(current.batch_size[0] + rows.batch_size[0], rows)


def resize_level(current: Level, length: int, *, fsync: bool = False) -> Level:
    """Set a memory-mapped tree's first batch dim to ``length``; return its new leaves.

    New rows are zeros; a smaller length keeps the files (see the module docstring). Used by
    :meth:`TensorTree.resize_`.

    Raises:
        NotGrowableError, ReadOnlyError: as :func:`extend_level`.
        InsufficientSpaceError: the filesystem cannot hold the new rows.
    """
    check_growable(current)
    if type(length) is not int or length < 0:
        raise InvalidArgumentError(f"resize_ needs an int length >= 0, got {length!r}")
    return _Growth(current, fsync).run(length, None)


def check_growable(level: Level) -> None:
    """Raise ``NotGrowableError`` if ``level`` has no first batch dim to grow along."""
    if not level.batch_size:
        raise NotGrowableError(
            "the tree has batch_size []: it has no first batch dim to grow along; give it one "
            "(batch_size=[n]) before writing it"
        )


def _find_prefix(level: Level, path: tuple[str, ...] = ()) -> str | None:
    for key, value in level.entries.items():
        if isinstance(value, MemoryMappedTensor) and value.filename is not None:
            prefix = value.filename
            for _ in range(len(path) + 1):
                prefix = os.path.dirname(prefix)
            return prefix
        if isinstance(value, Level):
            found = _find_prefix(value, path + (key,))
            if found is not None:
                return found
    return None


def _label(path: tuple[str, ...]) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


@dataclass
class _Leaf:
    """One leaf file to grow: where, its meta before and after, its open descriptor."""

    rel: str
    path: str
    key: tuple[str, ...]
    old: LeafMeta
    new: LeafMeta
    rows: torch.Tensor | None
    dirty_until: int  # rows past the length up to here may hold old data (the old capacity)
    fd: int = -1

    @property
    def row_bytes(self) -> int:
        return prod(self.old.shape[1:]) * itemsize(self.old.dtype)


class _Growth:
    """One ``extend_``/``resize_`` of one tree (the steps of the module docstring)."""

    def __init__(self, current: Level, fsync: bool) -> None:
        self.current = current
        prefix = _find_prefix(self.current)
        if prefix is None:
            raise NotGrowableError(
                "the tree has no leaf mapped from a file: append_/extend_/resize_ grow trees "
                "written with memmap(prefix)/memmap_like(prefix) or loaded with load_memmap"
            )
        self.dest = os.path.realpath(prefix)
        self.fsync = fsync
        self.leaves: list[_Leaf] = []
        self.metas: dict[str, LevelMeta] = {}
        self.save_id: str | None = None
        self.mappings: dict[str, tuple[int, int]] = {}

    def run(self, length: int, rows: Level | None) -> Level:
        parent, name = os.path.split(self.dest)
        with WriterLock(lock_path(parent, name), self.dest, timeout=LOCK_TIMEOUT) as lock:
            recover_locked(parent, name, lock)
            self._read_metas()
            self._plan(self.current, rows, "", (), length)
            old_length = self.current.batch_size[0]
            if length == old_length:
                return self.current
            if rows is None and length > old_length:
                needed = sum((length - old_length) * leaf.row_bytes for leaf in self.leaves)
                check_free_space(os.path.dirname(self.dest), needed, f"resizing {self.dest}")
            try:
                for leaf in self.leaves:
                    leaf.fd = self._open(leaf)
                self._grow_capacity(lock)
                if rows is not None:
                    self._write_rows(old_length)
                elif length > old_length:
                    self._zero_rows(old_length, length)
                if self.fsync:
                    for leaf in self.leaves:
                        os.fsync(leaf.fd)
                self._commit({rel: self._final(rel, meta, length) for rel, meta in self.metas.items()}, lock)
            except OSError as err:
                if isinstance(err, MemtreeError):
                    raise
                raise storage_error(err, f"growing {self.dest}") from err
            finally:
                for leaf in self.leaves:
                    if leaf.fd >= 0:
                        os.close(leaf.fd)
            made: dict[str, tuple[int, int]] = {}
            out = self._remap(self.current, "", length, made)
            root_stat = _stat_key(os.path.join(self.dest, META_NAME))
            if root_stat is not None:
                _LAST_COMMIT.pop(self.dest, None)
                _LAST_COMMIT[self.dest] = _Commit(root_stat, self.metas, made)
                while len(_LAST_COMMIT) > _LAST_COMMIT_MAX:
                    del _LAST_COMMIT[next(iter(_LAST_COMMIT))]
            return out

    # -- step 1: read and check ----------------------------------------------------------------
    def _read_metas(self) -> None:
        """Read every level's ``meta.json`` (none when this process committed them, unchanged)."""
        last = _LAST_COMMIT.get(self.dest)
        if last is not None and _stat_key(os.path.join(self.dest, META_NAME)) == last.root_stat:
            self.metas = dict(last.metas)
            self.mappings = last.mappings
            return

        def walk(fd: int, where: str, rel: str, depth: int) -> None:
            meta = read_meta(fd, where, depth=depth, root=depth == 0)
            self.metas[rel] = meta
            for entry in meta.entries:
                if isinstance(entry, ChildMeta):
                    child_where = os.path.join(where, entry.dir)
                    child = open_dir(entry.dir, child_where, fd)
                    try:
                        walk(child, child_where, f"{rel}/{entry.dir}" if rel else entry.dir, depth + 1)
                    finally:
                        os.close(child)

        fd = open_dir(self.dest, self.dest, None)
        try:
            walk(fd, self.dest, "", 0)
        finally:
            os.close(fd)

    def _changed(self, what: str) -> NotGrowableError:
        return NotGrowableError(
            f"cannot grow the tree at {self.dest}: {what}. This tree in memory is not the whole "
            "tree on disk as it is now (it was loaded with keys=, is a view or a copy, or the "
            "tree changed on disk since); load it again with load_memmap and grow that"
        )

    def _plan(self, level: Level, rows: Level | None, rel: str, path: tuple[str, ...], length: int) -> None:
        meta = self.metas[rel]
        if tuple(level.batch_size) != meta.batch_size:
            raise self._changed(
                f"level {_label(path) if path else 'root'} has batch_size {list(level.batch_size)} "
                f"here and {list(meta.batch_size)} on disk"
            )
        on_disk = {e.key for e in meta.entries}
        if set(level.entries) != on_disk:
            raise self._changed(
                f"keys {sorted(on_disk - set(level.entries))[:5]} are on disk only and keys "
                f"{sorted(set(level.entries) - on_disk)[:5]} in memory only, at "
                f"{_label(path) if path else 'the root'}"
            )
        if rows is not None and set(rows.entries) != on_disk:
            missing, extra = sorted(on_disk - set(rows.entries)), sorted(set(rows.entries) - on_disk)
            where = _label(path) if path else "the root"
            raise MemtreeKeyError(
                f"rows to append must have exactly the tree's keys at {where}: missing "
                f"{missing[:5]}, unexpected {extra[:5]}"
            )
        for entry in meta.entries:
            key = path + (entry.key,)
            value = level.entries[entry.key]
            new = rows.entries[entry.key] if rows is not None else None
            if isinstance(entry, LeafMeta):
                self._plan_leaf(entry, value, new, rel, key, length)
            elif isinstance(entry, ChildMeta):
                if not isinstance(value, Level):
                    raise self._changed(f"{_label(key)} is a sub-tree on disk")
                if new is not None and not isinstance(new, Level):
                    raise ShapeMismatchError(f"rows to append: {_label(key)} must be a sub-tree")
                self._plan(value, new, f"{rel}/{entry.dir}" if rel else entry.dir, key, length)
            elif not isinstance(value, NonTensor):
                raise self._changed(f"{_label(key)} is a non-tensor leaf on disk")
            elif new is not None and not (isinstance(new, NonTensor) and new == value):
                shown = new.data if isinstance(new, NonTensor) else type(new).__name__
                raise NotGrowableError(
                    f"cannot append: non-tensor leaf {_label(key)} is {value.data!r:.60} in the "
                    f"tree and {shown!r:.60} in the new rows; a non-tensor leaf holds one value "
                    "for the whole tree"
                )

    def _plan_leaf(
        self,
        entry: LeafMeta,
        value: Any,
        rows: Any,
        rel: str,
        key: tuple[str, ...],
        length: int,
    ) -> None:
        path = os.path.join(self.dest, rel, entry.file)
        if not isinstance(value, MemoryMappedTensor) or value.filename != path:
            raise self._changed(f"leaf {_label(key)} is not mapped from {path}")
        if value.readonly:
            raise ReadOnlyError(
                f"cannot grow the tree at {self.dest}: it was loaded with mode='r'; load it with "
                "mode='r+' to append to it"
            )
        with torch._C.DisableTorchFunctionSubclass():  # plain attribute reads: fast
            shape, dtype = tuple(value.shape), value.dtype
            whole = value.storage_offset() == 0 and value.is_contiguous()
        if shape != entry.shape or dtype != entry.dtype or not whole:
            raise self._changed(
                f"leaf {_label(key)} is {str(value.dtype)[6:]}{list(value.shape)} here and "
                f"{str(entry.dtype)[6:]}{list(entry.shape)} on disk"
            )
        if rows is not None:
            expected = (length - entry.shape[0],) + entry.shape[1:]
            if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != expected:
                found = list(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
                raise ShapeMismatchError(
                    f"rows to append: leaf {_label(key)} must have shape {list(expected)} "
                    f"(rows of {list(entry.shape[1:])}), got {found}"
                )
        old_capacity = entry.shape[0] if entry.capacity is None else entry.capacity
        capacity = old_capacity if length <= old_capacity else max(length, GROWTH_FACTOR * old_capacity)
        new = replace(
            entry,
            shape=(length,) + entry.shape[1:],
            capacity=capacity if capacity > length else None,
            checksum=None,  # the content changes; a checksum would be stale
        )
        self.leaves.append(_Leaf(rel, path, key, entry, new, rows, old_capacity))

    def _open(self, leaf: _Leaf) -> int:
        try:
            fd = os.open(leaf.path, _WRITE_FLAGS)
        except FileNotFoundError:
            raise self._changed(f"leaf file {leaf.path} is missing") from None
        size = os.fstat(fd).st_size
        if size != leaf.old.file_nbytes:
            os.close(fd)
            raise self._changed(
                f"leaf file {leaf.path} has {size:,} bytes, its meta.json says {leaf.old.file_nbytes:,}"
            )
        return fd

    # -- steps 2 to 4 ----------------------------------------------------------------------------
    def _grow_capacity(self, lock: WriterLock) -> None:
        """Step 2: ftruncate up the files that need more rows, and commit their capacity."""
        grown = [leaf for leaf in self.leaves if leaf.new.file_nbytes > leaf.old.file_nbytes]
        if not grown:
            return
        by_file = {(leaf.rel, leaf.old.file): leaf.new.capacity or leaf.new.shape[0] for leaf in grown}
        metas = {
            rel: replace(meta, entries=tuple(
                replace(e, capacity=by_file[(rel, e.file)], checksum=None)
                if isinstance(e, LeafMeta) and (rel, e.file) in by_file else e
                for e in meta.entries
            ))
            for rel, meta in self.metas.items()
        }


        def grow_files() -> None:
            for leaf in grown:
                os.ftruncate(leaf.fd, leaf.new.file_nbytes)  # up only: mappers never SIGBUS
                if self.fsync:
                    os.fsync(leaf.fd)

        try:
            self._commit(metas, lock, before=grow_files)
        except BaseException:
            if self._root_save_id() != self.save_id:  # not committed: nobody maps past the old size
                for leaf in grown:
                    try:
                        os.ftruncate(leaf.fd, leaf.old.file_nbytes)
                    except OSError:
                        pass
            raise
        for leaf in grown:
            leaf.old = replace(leaf.old, capacity=leaf.new.capacity or leaf.new.shape[0], checksum=None)

    def _write_rows(self, start: int) -> None:
        for leaf in self.leaves:
            if leaf.rows is not None and leaf.rows.numel():
                data = to_storable(leaf.rows.to(leaf.old.dtype), _label(leaf.key))
                write_fd(leaf.fd, data, start * leaf.row_bytes)

    def _zero_rows(self, start: int, stop: int) -> None:
        """Zero the new rows a shrink left behind (rows past the old capacity are zeros)."""
        for leaf in self.leaves:
            offset, end = start * leaf.row_bytes, min(stop, leaf.dirty_until) * leaf.row_bytes
            while offset < end:
                offset += os.pwrite(leaf.fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - offset)], offset)

    def _final(self, rel: str, meta: LevelMeta, length: int) -> LevelMeta:
        new = {leaf.old.file: leaf.new for leaf in self.leaves if leaf.rel == rel}
        return replace(
            meta,
            batch_size=(length,) + meta.batch_size[1:],
            entries=tuple(new.get(e.file, e) if isinstance(e, LeafMeta) else e for e in meta.entries),
        )

    def _root_save_id(self) -> str | None:
        try:
            fd = open_dir(self.dest, self.dest, None)
            try:
                return read_meta(fd, self.dest, depth=0, root=True).save_id
            finally:
                os.close(fd)
        except (MemtreeError, OSError):
            return None

    def _commit(
        self, metas: dict[str, LevelMeta], lock: WriterLock, before: Callable[[], None] | None = None
    ) -> None:
        """Replace every ``meta.json`` by ``metas`` at once (``before`` runs right before).

        A one-level tree has one ``meta.json``: it is replaced by a rename. A nested tree is
        staged (new ``meta.json`` files, hard links to the leaves) and exchanged with the tree.
        """
        self.save_id = os.urandom(16).hex()
        metas[""] = replace(metas[""], save_id=self.save_id)
        if len(metas) == 1:
            tmp = meta_tmp_name()
            lock.write_journal({"meta_tmp": tmp, GROWTH_JOURNAL: self.save_id}, fsync=False)
            path = os.path.join(self.dest, tmp)
            write_small_file(path, dump_level(metas[""]), fsync=self.fsync)
            try:
                if before is not None:
                    before()
                os.rename(path, os.path.join(self.dest, META_NAME))
            except BaseException:
                _unlink_quiet(path)
                raise
            if self.fsync:
                fsync_dir(self.dest)
        else:
            staging = self._stage(metas, lock)
            try:
                if before is not None:
                    before()
                publish(staging, self.dest, "tree", self.fsync, lock)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        self.metas = metas

    def _stage(self, metas: dict[str, LevelMeta], lock: WriterLock) -> str:
        """A staging directory with ``metas`` and hard links to every leaf and pickle file."""
        parent, name = os.path.split(self.dest)
        staging = staging_path(parent, name)
        assert self.save_id is not None, "_stage() runs inside _commit()"
        lock.write_journal({"staging": os.path.basename(staging), GROWTH_JOURNAL: self.save_id}, fsync=False)
        os.mkdir(staging, 0o700)
        try:
            for rel in sorted(metas, key=lambda r: r.count("/") + bool(r)):  # parents first
                if rel:
                    os.mkdir(os.path.join(staging, rel))
                for entry in metas[rel].entries:
                    if isinstance(entry, (LeafMeta, PickleMeta)):
                        os.link(
                            os.path.join(self.dest, rel, entry.file),
                            os.path.join(staging, rel, entry.file),
                            follow_symlinks=False,
                        )
            for rel in sorted(metas, key=lambda r: -(r.count("/") + bool(r))):  # root last
                directory = os.path.join(staging, rel)
                write_small_file(os.path.join(directory, META_NAME), dump_level(metas[rel]), fsync=self.fsync)
                if self.fsync:
                    fsync_dir(directory)
            os.chmod(staging, 0o755)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    # -- step 5 ------------------------------------------------------------------------------------
    def _remap(self, level: Level, rel: str, length: int, made: dict[str, tuple[int, int]]) -> Level:
        out = Level((length,) + tuple(level.batch_size[1:]), {}, level.type)
        for entry in self.metas[rel].entries:
            value = level.entries[entry.key]
            if isinstance(entry, LeafMeta):
                assert isinstance(value, torch.Tensor)
                path = os.path.join(self.dest, rel, entry.file)
                storage = _storage(value)
                if self.mappings.get(path) == storage and storage[1] == entry.file_nbytes:
                    # still the mapping of the whole file made by the last growth: view more rows
                    tensor = value.as_strided(entry.shape, value.stride(), 0)
                else:
                    tensor = _map_rows(path, entry)
                made[path] = _storage(tensor)
                out.entries[entry.key] = tensor
            elif isinstance(entry, ChildMeta):
                assert isinstance(value, Level)
                child_rel = f"{rel}/{entry.dir}" if rel else entry.dir
                out.entries[entry.key] = self._remap(value, child_rel, length, made)
            else:
                out.entries[entry.key] = value
        return out




def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _map_rows(path: str, entry: LeafMeta) -> MemoryMappedTensor:
    """Map a leaf's whole file (all its capacity) and return its first ``shape[0]`` rows.

    Mapping the capacity lets the tensor travel to other processes as a reference to a file of
    exactly its storage's size (see :mod:`memtree.store.mapped`).
    """
    rows = entry.capacity if entry.capacity is not None else entry.shape[0]
    fd = open_checked(path, entry.file_nbytes, path)
    try:
        full = map_leaf(fd, path, entry.dtype, (rows,) + entry.shape[1:], readonly=False)
    finally:
        os.close(fd)
    out = full[: entry.shape[0]]
    assert isinstance(out, MemoryMappedTensor)
    return out
