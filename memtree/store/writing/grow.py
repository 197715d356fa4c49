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

**No loaded tree ever sees its rows change.** Rows are written in place only past every length
the file ever had, which no process can have mapped. Two cases cannot keep that promise in
place, and write a *new generation* of the leaf file instead (a new file under the same name,
published with the commit, holding a copy of the kept rows; the old file lives on, unchanged,
for the processes that map it):

* a shrink (``resize_`` to a smaller length): the dropped rows stay mapped by whoever loaded the
  longer tree, and a later growth would write over them. So every leaf gets a new generation
  holding the kept rows (``copy_file_range``: copied inside the kernel, a clone on filesystems
  with reflinks) with the old capacity; the rows past the new length are zeros (a sparse file);
* a leaf file with another hard link (``st_nlink > 1``, e.g. a ``cp -al`` snapshot of the
  tree): writing into it would change the other name's bytes, perhaps outside the tree.

A commit replaces every ``meta.json`` at once, without copying data: a one-level tree's
``meta.json`` is replaced by a rename; a nested tree, or any tree with a new generation, is
staged (new ``meta.json`` files, the new generations, and *hard links* to the other files in
``.<name>.memtree-tmp-<hex>``) and exchanged with the tree in one
``renameat2(RENAME_EXCHANGE)``, as a write is published. A load sees the tree before or after a
commit, never a mix of levels. Existing rows are never rewritten and files never truncated, so
processes that loaded the tree before keep a consistent view of the old length. Capacity
doubles, so appending one row at a time costs amortised O(1) per row: one small commit of the
``meta.json`` files, and a file growth once per doubling.

Limits:

* one writer at a time (the lock); a handle whose tree changed on disk since it was loaded (or
  that was loaded with ``keys=``, or is a view) is refused with
  :class:`~memtree.errors.NotGrowableError`: load the tree again;
* files that no ``meta.json`` names are not kept when a tree is staged (as with any write);
* a load that runs while the tree grows may fail (its directory replaced under it, or a file
  grown in step 2 before that commit): retry it. A lazily opened tree whose levels were not
  loaded yet when the tree was staged raises ``MissingLeafError`` on first use (as after a
  re-save); trees opened by this process are loaded first;
* a crash in the microseconds between step 2's ``ftruncate`` and its commit leaves files longer
  than their ``meta.json`` says, which the loader refuses (``LeafSizeError``); the data is
  intact and truncating each file to the size its ``meta.json`` expects repairs it. An
  exception there truncates the files back itself.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from math import prod
from typing import Any

import torch

from ...format.dtypes import itemsize
from ...errors import (
    InvalidArgumentError,
    LeafSizeError,
    MemtreeError,
    MemtreeKeyError,
    MissingLeafError,
    NotGrowableError,
    ReadOnlyError,
    ShapeMismatchError,
)
from ..primitives.files import (
    check_free_space,
    copy_range,
    new_file,
    open_leaf,
    storage_error,
    write_fd,
)
from ..primitives.commit import LOCK_TIMEOUT, WriterLock, fsync_dir, publish, write_small_file
from ...format.packs import is_pack_name, unpacked_name
from ...format.schema import ChildMeta, LeafMeta, LevelMeta, PickleMeta, SubclassMeta, dump_level
from ...format.names import META_NAME, lock_path, meta_tmp_name, staging_path
from ...format.level import Level, fmt_key
from ..reading.mapped import MemoryMappedTensor, map_leaf, to_storable
from ...format.values import NonTensor
from ..reading.read import held_dirs_budget, load_pending_at, open_dir, read_meta, walk_levels
from .recovery import GROWTH_JOURNAL, recover_locked
from ..reading.unshare import own_file

__all__ = ["GROWTH_FACTOR", "check_growable", "extend_level", "resize_level"]

#: A leaf that runs out of rows gets at least this many times its capacity.
GROWTH_FACTOR = 2
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

    New rows are zeros; a smaller length copies the kept rows into a new generation of each
    leaf file, leaving the old files to the processes that map them (see the module
    docstring). Used by :meth:`TensorTree.resize_`.

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
            if is_pack_name(os.path.basename(prefix)):  # a packed leaf: its pack is at the root
                return os.path.dirname(prefix)
            for _ in range(len(path) + 1):
                prefix = os.path.dirname(prefix)
            return prefix
        if isinstance(value, Level):
            found = _find_prefix(value, path + (key,))
            if found is not None:
                return found
    return None


@dataclass
class _Leaf:
    """One leaf file to grow: where, its meta before and after, its open descriptors."""

    rel: str
    path: str
    key: tuple[str, ...]
    old: LeafMeta
    new: LeafMeta
    rows: torch.Tensor | None
    dirty_until: int  # rows past the length up to here may hold old data (the old capacity)
    target: str = ""  # the file the rows go to: the leaf's file, or its new generation
    identity: tuple[int, int] = (0, 0)  # the target's (st_dev, st_ino), checked at each open
    fd: int = -1  # the target, kept open when the tree has few leaves
    new_generation: bool = False  # the rows go to a new file in the staging directory
    #: the leaf's file after the growth (a packed leaf moves out of its pack into a file of its
    #: own, in the same commit: its ``path`` is its pack's); "": ``path``
    new_path: str = ""
    source_offset: int = 0  # where its rows start in ``path`` (a packed leaf: in its pack)
    source_nbytes: int = 0  # ``path``'s exact size (a pack's; 0: the old entry's file size)

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
                "written with memmap(prefix)/memmap_like(prefix) or loaded with load_memmap "
                "(not encrypted trees, nor mmap=False loads: those are in memory)"
            )
        self.dest = os.path.realpath(prefix)
        self.fsync = fsync
        self.leaves: list[_Leaf] = []
        self.metas: dict[str, LevelMeta] = {}
        self.save_id: str | None = None
        self.mappings: dict[str, tuple[int, int]] = {}
        self.staging: str | None = None  # holds the new generations until the commit
        self.fresh_paths: set[str] = set()  # leaves with a new generation: map them again
        self.identities: dict[str, tuple[int, int]] = {}  # each leaf file's (st_dev, st_ino), as checked
        self.keep_open = True  # the leaves' files stay open from their check to the commit

    def run(self, length: int, rows: Level | None) -> Level:
        parent, name = os.path.split(self.dest)
        with WriterLock(lock_path(parent, name), self.dest, timeout=LOCK_TIMEOUT) as lock:
            recover_locked(parent, name, lock)
            self._read_metas()
            self._plan(self.current, rows, "", (), length)
            old_length = self.current.batch_size[0]
            if length == old_length:
                return self.current
            self.keep_open = len(self.leaves) <= held_dirs_budget()
            try:
                for leaf in self.leaves:
                    self._check_file(leaf, shrink=length < old_length)
                self._check_space(old_length, length, rows is None)
                self._grow_capacity(lock)
                if any(leaf.new_generation for leaf in self.leaves):
                    self._new_generations(lock, min(old_length, length))
                self._write_rows(old_length, length, rows is not None)
                final = {rel: self._final(rel, meta, length) for rel, meta in self.metas.items()}
                self._commit(final, lock, staging=self.staging)
            except OSError as err:
                if isinstance(err, MemtreeError):
                    raise
                raise storage_error(err, f"growing {self.dest}") from err
            finally:
                for leaf in self.leaves:
                    if leaf.fd >= 0:
                        os.close(leaf.fd)
                        leaf.fd = -1
                if self.staging is not None:  # not published: the new generations are garbage
                    shutil.rmtree(self.staging, ignore_errors=True)
            made: dict[str, tuple[int, int]] = {}
            self.fresh_paths = {leaf.new_path for leaf in self.leaves if leaf.new_generation}
            self.identities = {leaf.new_path: leaf.identity for leaf in self.leaves}
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

        def visit(dirs: tuple[str, ...], where: str, fd: int, meta: LevelMeta) -> None:
            self.metas["/".join(dirs)] = meta

        fd = open_dir(self.dest, self.dest, None)
        try:
            walk_levels(fd, self.dest, visit)
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
                f"level {fmt_key(path) if path else 'root'} has batch_size {list(level.batch_size)} "
                f"here and {list(meta.batch_size)} on disk"
            )
        on_disk = {e.key for e in meta.entries}
        if set(level.entries) != on_disk:
            raise self._changed(
                f"keys {sorted(on_disk - set(level.entries))[:5]} are on disk only and keys "
                f"{sorted(set(level.entries) - on_disk)[:5]} in memory only, at "
                f"{fmt_key(path) if path else 'the root'}"
            )
        if rows is not None and set(rows.entries) != on_disk:
            missing, extra = sorted(on_disk - set(rows.entries)), sorted(set(rows.entries) - on_disk)
            where = fmt_key(path) if path else "the root"
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
            elif isinstance(entry, SubclassMeta):
                raise NotGrowableError(
                    f"cannot grow: {fmt_key(key)} is a tensor subclass ({entry.subclass.type}), whose "
                    "inner tensors have no rows to append; write the grown tree anew with memmap()"
                )
            elif isinstance(entry, ChildMeta):
                if not isinstance(value, Level):
                    raise self._changed(f"{fmt_key(key)} is a sub-tree on disk")
                if new is not None and not isinstance(new, Level):
                    raise ShapeMismatchError(f"rows to append: {fmt_key(key)} must be a sub-tree")
                self._plan(value, new, f"{rel}/{entry.dir}" if rel else entry.dir, key, length)
            elif not isinstance(value, NonTensor):
                raise self._changed(f"{fmt_key(key)} is a non-tensor leaf on disk")
            elif new is not None and not (isinstance(new, NonTensor) and new == value):
                shown = new.data if isinstance(new, NonTensor) else type(new).__name__
                raise NotGrowableError(
                    f"cannot append: non-tensor leaf {fmt_key(key)} is {value.data!r:.60} in the "
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
        path = os.path.join(self.dest, entry.pack if entry.pack is not None else os.path.join(rel, entry.file))
        if not isinstance(value, MemoryMappedTensor) or value.filename != path:
            raise self._changed(f"leaf {fmt_key(key)} is not mapped from {path}")
        if value.readonly:
            raise ReadOnlyError(
                f"cannot grow the tree at {self.dest}: it was loaded with mode='r'; load it with "
                "mode='r+' to append to it"
            )
        with torch._C.DisableTorchFunctionSubclass():  # plain attribute reads: fast
            shape, dtype = tuple(value.shape), value.dtype
            start = int(value.storage_offset()) * value.element_size()
            whole = start == (entry.offset or 0) and value.is_contiguous()
        if shape != entry.shape or dtype != entry.dtype or not whole:
            raise self._changed(
                f"leaf {fmt_key(key)} is {str(value.dtype)[6:]}{list(value.shape)} here and "
                f"{str(entry.dtype)[6:]}{list(entry.shape)} on disk"
            )
        if rows is not None:
            expected = (length - entry.shape[0],) + entry.shape[1:]
            if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != expected:
                found = list(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
                raise ShapeMismatchError(
                    f"rows to append: leaf {fmt_key(key)} must have shape {list(expected)} "
                    f"(rows of {list(entry.shape[1:])}), got {found}"
                )
        old_capacity = entry.shape[0] if entry.capacity is None else entry.capacity
        capacity = old_capacity if length <= old_capacity else max(length, GROWTH_FACTOR * old_capacity)
        new = replace(
            entry,
            shape=(length,) + entry.shape[1:],
            capacity=capacity if capacity > length else None,
            checksum=None,  # the content changes; a checksum would be stale
            chunks=None,
        )
        leaf = _Leaf(rel, path, key, entry, new, rows, old_capacity)
        if entry.pack is not None:  # it moves out of its pack, into a file of its own (a new generation)
            new = replace(new, file=unpacked_name(self.metas[rel], entry.key), pack=None, offset=None)
            leaf.new, leaf.source_offset = new, entry.offset or 0
            leaf.source_nbytes = next(p.nbytes for p in self.metas[""].packs if p.file == entry.pack)
        leaf.new_path = os.path.join(self.dest, rel, new.file)
        self.leaves.append(leaf)

    def _check_file(self, leaf: _Leaf, *, shrink: bool) -> None:
        """Check the leaf's file (never through a link); decide whether it gets a new generation.

        It does on a shrink (the dropped rows stay mapped by earlier readers, and would be
        written over by a later growth) and when the file has another hard link (its bytes
        are shared with a name that may lie outside the tree, or with another tree by an
        incremental save). The link count read here stays right for the whole growth: the tree
        being grown maps the file read-write, and the linker of incremental saves never links a
        file open for writing (:mod:`memtree.store.primitives.lease`). A tree with many leaves (more
        than :func:`~memtree.store.reading.read.held_dirs_budget`) has each file opened when used and
        closed at once, so it grows with a few descriptors; a smaller one keeps them open.
        """
        nbytes = leaf.source_nbytes or leaf.old.file_nbytes
        try:
            fd, st = open_leaf(leaf.path, nbytes, leaf.path, writable=True)
        except MissingLeafError:
            raise self._changed(f"leaf file {leaf.path} is missing") from None
        except LeafSizeError:
            raise self._changed(f"leaf file {leaf.path} does not have the {nbytes:,} bytes its meta.json says") from None
        leaf.target, leaf.identity = leaf.path, (st.st_dev, st.st_ino)
        leaf.new_generation = shrink or st.st_nlink > 1 or leaf.old.pack is not None
        self._keep(leaf, fd)

    def _keep(self, leaf: _Leaf, fd: int) -> None:
        """Keep ``fd`` (the leaf's target) open for the next steps, or close it now."""
        if self.keep_open:
            leaf.fd = fd
        else:
            os.close(fd)

    @contextmanager
    def _opened(self, leaf: _Leaf) -> Iterator[int]:
        """The leaf's target open read-write: the very file checked (or created) before."""
        if leaf.fd >= 0:
            yield leaf.fd
            return
        try:
            fd, st = open_leaf(leaf.target, 0, leaf.target, strict_size=False, writable=True)
        except MissingLeafError:
            raise self._changed(f"leaf file {leaf.target} was removed during the growth") from None
        try:
            if (st.st_dev, st.st_ino) != leaf.identity:
                raise self._changed(f"leaf file {leaf.target} was replaced during the growth")
            yield fd
        finally:
            os.close(fd)

    def _check_space(self, old_length: int, length: int, zeros: bool) -> None:
        """Refuse up front when the copies and the zero rows of a resize do not fit the disk.

        Rows of ``extend_`` are written with ``pwrite``, which raises ``ENOSPC`` cleanly; zero
        rows are sparse, and a later write through a mapping into an unbackable sparse file
        would kill the process with SIGBUS.
        """
        needed = 0
        for leaf in self.leaves:
            if leaf.new_generation:
                needed += min(old_length, length) * leaf.row_bytes
            if zeros and length > old_length:
                needed += (length - old_length) * leaf.row_bytes
        if needed:
            check_free_space(os.path.dirname(self.dest), needed, f"{'resizing' if zeros else 'growing'} {self.dest}")

    # -- steps 2 to 4 ----------------------------------------------------------------------------
    def _grow_capacity(self, lock: WriterLock) -> None:
        """Step 2: ftruncate up the files that need more rows, and commit their capacity."""
        grown = [
            leaf for leaf in self.leaves
            if leaf.new.file_nbytes > leaf.old.file_nbytes and not leaf.new_generation
        ]
        if not grown:
            return
        by_file = {(leaf.rel, leaf.old.file): leaf.new.capacity or leaf.new.shape[0] for leaf in grown}
        metas = {
            rel: replace(meta, entries=tuple(
                replace(e, capacity=by_file[(rel, e.file)], checksum=None, chunks=None)
                if isinstance(e, LeafMeta) and (rel, e.file) in by_file else e
                for e in meta.entries
            ))
            for rel, meta in self.metas.items()
        }


        def grow_files() -> None:
            for leaf in grown:
                with self._opened(leaf) as fd:
                    os.ftruncate(fd, leaf.new.file_nbytes)  # up only: mappers never SIGBUS
                    if self.fsync:
                        os.fsync(fd)

        try:
            self._commit(metas, lock, before=grow_files)
        except BaseException:
            if self._root_save_id() != self.save_id:  # not committed: nobody maps past the old size
                for leaf in grown:
                    try:
                        with self._opened(leaf) as fd:
                            if os.fstat(fd).st_size > leaf.old.file_nbytes:
                                os.ftruncate(fd, leaf.old.file_nbytes)
                    except (OSError, MemtreeError):
                        pass
            raise
        for leaf in grown:
            leaf.old = replace(leaf.old, capacity=leaf.new.capacity or leaf.new.shape[0], checksum=None, chunks=None)

    def _new_generations(self, lock: WriterLock, kept: int) -> None:
        """Create the staging directory of the final commit, with each new generation in it.

        A new generation is a new file (the leaf's name, in the staging directory) of the new
        capacity, holding a copy of the first ``kept`` rows; the rest is sparse zeros.
        """
        self.staging = self._new_staging(lock)
        for leaf in self.leaves:
            if not leaf.new_generation:
                continue
            path = os.path.join(self.staging, leaf.rel, leaf.new.file)
            with self._opened(leaf) as source:
                fd = new_file(path)
                try:
                    os.ftruncate(fd, leaf.new.file_nbytes)
                    copy_range(source, leaf.source_offset, fd, 0, kept * leaf.row_bytes)
                    st = os.fstat(fd)
                except BaseException:
                    os.close(fd)
                    raise
            if leaf.fd >= 0:
                os.close(leaf.fd)  # the old file: done with it
                leaf.fd = -1
            leaf.target, leaf.identity = path, (st.st_dev, st.st_ino)
            self._keep(leaf, fd)
            leaf.dirty_until = kept  # the new file holds zeros past the copied rows

    def _write_rows(self, start: int, stop: int, appended: bool) -> None:
        """Step 3: write each leaf's appended rows, or zero the new rows of a resize that an
        interrupted growth may have written (never committed); fsync them when asked."""
        for leaf in self.leaves:
            data = None
            if appended and leaf.rows is not None and leaf.rows.numel():
                data = to_storable(leaf.rows.to(leaf.old.dtype), fmt_key(leaf.key))
            zeros = 0 if appended else max(0, min(stop, leaf.dirty_until) - start) * leaf.row_bytes
            if data is None and not zeros and not (self.fsync and leaf.new_generation):
                continue
            with self._opened(leaf) as fd:
                if data is not None:
                    write_fd(fd, data, start * leaf.row_bytes)
                offset = start * leaf.row_bytes
                end = offset + zeros
                while offset < end:
                    offset += os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), end - offset)], offset)
                if self.fsync:
                    os.fsync(fd)

    def _final(self, rel: str, meta: LevelMeta, length: int) -> LevelMeta:
        new = {leaf.old.key: leaf.new for leaf in self.leaves if leaf.rel == rel}
        out = replace(
            meta,
            batch_size=(length,) + meta.batch_size[1:],
            entries=tuple(new.get(e.key, e) if isinstance(e, LeafMeta) else e for e in meta.entries),
        )
        if not rel and out.packs:  # every leaf grew, so none is packed any more: the packs go
            out = replace(out, packs=())
        return out

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
        self,
        metas: dict[str, LevelMeta],
        lock: WriterLock,
        before: Callable[[], None] | None = None,
        staging: str | None = None,
    ) -> None:
        """Replace every ``meta.json`` by ``metas`` at once (``before`` runs right before).

        A one-level tree has one ``meta.json``: it is replaced by a rename. A nested tree, or
        one with new generations (already in ``staging``), is staged (new ``meta.json`` files,
        hard links to the other leaves) and exchanged with the tree.
        """
        if staging is None:
            self.save_id = os.urandom(16).hex()
        assert self.save_id is not None, "_new_staging() journaled it"
        metas[""] = replace(metas[""], save_id=self.save_id, tree_hash=None)  # leaves change: no hash
        if staging is None and len(metas) == 1:
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
            fresh = set()  # the files already in a staging directory made for new generations
            if staging is None:
                staging = self._new_staging(lock)
            else:
                fresh = {(leaf.rel, leaf.new.file) for leaf in self.leaves if leaf.new_generation}
            try:
                self._stage(staging, metas, fresh)
                load_pending_at(self.dest)  # this process's lazily opened trees: map them now
                if before is not None:
                    before()
                publish(staging, self.dest, "tree", self.fsync, lock)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            finally:
                self.staging = None  # published (its name now holds the old tree, removed) or removed
        self.metas = metas

    def _new_staging(self, lock: WriterLock) -> str:
        """A new staging directory with the tree's sub-directories, journaled with a new save id."""
        parent, name = os.path.split(self.dest)
        staging = staging_path(parent, name)
        self.save_id = os.urandom(16).hex()
        lock.write_journal({"staging": os.path.basename(staging), GROWTH_JOURNAL: self.save_id}, fsync=False)
        os.mkdir(staging, 0o700)
        try:
            for rel in sorted(self.metas, key=lambda r: r.count("/") + bool(r)):  # parents first
                if rel:
                    os.mkdir(os.path.join(staging, rel))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return staging

    def _stage(self, staging: str, metas: dict[str, LevelMeta], fresh: set[tuple[str, str]]) -> None:
        """Fill ``staging`` with ``metas`` and hard links to every leaf and pickle file but the
        ``fresh`` ones (``(rel, file)``: new generations already there)."""
        for rel in metas:
            for entry in metas[rel].entries:
                if isinstance(entry, (LeafMeta, PickleMeta)) and entry.file and (rel, entry.file) not in fresh:
                    os.link(
                        os.path.join(self.dest, rel, entry.file),
                        os.path.join(staging, rel, entry.file),
                        follow_symlinks=False,
                    )
        for pack in metas[""].packs:  # (a capacity commit before packed leaves move out)
            os.link(os.path.join(self.dest, pack.file), os.path.join(staging, pack.file), follow_symlinks=False)
        for rel in sorted(metas, key=lambda r: -(r.count("/") + bool(r))):  # root last
            directory = os.path.join(staging, rel)
            write_small_file(os.path.join(directory, META_NAME), dump_level(metas[rel]), fsync=self.fsync)
            if self.fsync:
                fsync_dir(directory)
        os.chmod(staging, 0o755)

    # -- step 5 ------------------------------------------------------------------------------------
    def _remap(self, level: Level, rel: str, length: int, made: dict[str, tuple[int, int]]) -> Level:
        out = Level((length,) + tuple(level.batch_size[1:]), {}, level.type)
        for entry in self.metas[rel].entries:
            value = level.entries[entry.key]
            if isinstance(entry, LeafMeta):
                assert isinstance(value, torch.Tensor)
                path = os.path.join(self.dest, rel, entry.file)
                storage = _storage(value)
                mapped = getattr(value, "_file", None)
                if (
                    self.mappings.get(path) == storage
                    and storage[1] == entry.file_nbytes
                    and path not in self.fresh_paths
                    and mapped is not None
                    and mapped.file_id == self.identities.get(path)
                ):
                    # still the mapping of the whole file made by the last growth (the file the
                    # path names: not given its own copy by another load meanwhile): view more rows
                    tensor = value.as_strided(entry.shape, value.stride(), 0)
                else:
                    tensor = _map_rows(path, entry, self.dest)
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


def _map_rows(path: str, entry: LeafMeta, root: str) -> MemoryMappedTensor:
    """Map a leaf's whole file (all its capacity) and return its first ``shape[0]`` rows.

    Mapping the capacity lets the tensor travel to other processes as a reference to a file of
    exactly its storage's size (see :mod:`memtree.store.reading.mapped`). A file another name shares
    (a hard link made meanwhile by someone else) gets its own copy first
    (:mod:`memtree.store.reading.unshare`; the caller holds the tree's writer lock).
    """
    rows = entry.capacity if entry.capacity is not None else entry.shape[0]
    fd, st = open_leaf(path, entry.file_nbytes, path, writable=True)
    try:
        if st.st_nlink > 1 and entry.file_nbytes:
            shared, fd = fd, -1  # own_file closes it
            fd, st = own_file(shared, st, path, path, root=root)
        full = map_leaf(fd, path, entry.dtype, (rows,) + entry.shape[1:], readonly=False, st=st)
    finally:
        if fd >= 0:
            os.close(fd)
    out = full[: entry.shape[0]]
    assert isinstance(out, MemoryMappedTensor)
    return out
