"""Loading a tree from a prefix: validate every ``meta.json``, check every leaf, then map it.

Opening a tree (:func:`open_tree`) costs O(metadata of the root): it opens the root directory,
keeps its descriptor, and validates the root ``meta.json``. Each level is then *loaded* when it
is first needed (:meth:`PendingLevel.load`): its leaves are checked and mapped, and its
sub-levels' ``meta.json`` files are validated, relative to the held root descriptor, so every
file comes from the directory that was opened even if the prefix is re-saved meanwhile.
:func:`read_tree` loads every level at once.

What loading does, level by level from the root:

1. open the level's directory (sub-directories relative to their parent's descriptor, never
   following symbolic links) and its ``meta.json`` (regular file, at most 16 MiB, checked with
   ``fstat`` before reading), and validate it with :func:`memtree.format.parse_level`;
2. with ``keys=``, keep only the entries on the path to the requested keys (other sub-trees'
   ``meta.json`` files and leaves are never opened);
3. for each leaf: open it without following links, check it is a regular file of exactly
   ``numel × itemsize`` bytes, and only then map it (or read it, with ``mmap=False``; or skip
   the file entirely, with ``device="meta"``). With ``verify=True``, a leaf whose ``meta.json``
   entry records a checksum is hashed first and refused on a mismatch (``IntegrityError``). Each
   leaf is read by the tree's :class:`~memtree.store.reading.leaf_reader.LeafReader`.

Reading never writes: a damaged tree raises a :class:`~memtree.errors.MemtreeError` naming the
file and leaves every file as it was (with a lazily opened tree, when the damaged level is first
loaded).

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> from memtree.store.reading.read import read_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
    >>> read_tree(d).entries["x"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import dataclasses
import os
import resource
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

import torch

from ...errors import (
    MemtreeKeyError,
    MetaFormatError,
    MissingLeafError,
    NotCommittedError,
    SourceError,
)
from ..primitives.files import FileRange
from .storage import META_FLAGS, LocalStorage, open_dir, read_meta, read_meta_bytes
from ...format.schema import ChildMeta, JsonMeta, LeafMeta, LevelMeta, starts_with_batch
from ...format.subclass import Subclass, SubclassMeta, check_group
from ...format.names import META_NAME
from ...format.level import Level, Value
from .integrity import check_tree_hash as check_stored_tree_hash
from ...format.values import NonTensor, lists_to_tuples
from ...format.names import is_uncommitted_name
from .options import ReadOptions, Selection, select_entries
from .leaf_reader import LeafReader
from .pack_reader import PackReader

__all__ = [
    "read_tree",
    "open_for_fill",
    "fill_tree",
    "release_leaves",
    "open_tree",
    "PendingLevel",
    "load_pending_at",
    "loading_lock",
    "read_meta",
    "read_meta_bytes",
    "walk_levels",
    "held_dirs_budget",
    "open_dir",
    "META_FLAGS",
]


def walk_levels(
    root_fd: int, root: str, visit: Callable[[tuple[str, ...], str, int, LevelMeta], None]
) -> None:
    """Read every level's ``meta.json`` below an open root directory, parents first.

    Calls ``visit(dirs, where, dir_fd, meta)`` for each level: ``dirs`` are the directory names
    from the root, ``where`` its path (for messages), ``dir_fd`` its directory (open during the
    call only). Sub-directories are opened relative to their parent, never following links.
    At most :func:`held_dirs_budget` directories are open at once besides ``root_fd``: a level
    whose parent was not kept open is reached from its nearest open ancestor, so a tree of any
    depth and width is walked within a low descriptor limit.

    Raises:
        MemtreeError: a ``meta.json`` or sub-directory is missing, damaged or hostile.

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"a": Level((), {"b": Level((), {})})}))
        >>> fd, seen = open_dir(d, d, None), []
        >>> walk_levels(fd, d, lambda dirs, where, dir_fd, meta: seen.append(dirs))
        >>> os.close(fd); seen
        [(), ('a',), ('a', 'b')]
    """
    budget = held_dirs_budget()
    held: list[tuple[tuple[str, ...], int]] = [((), root_fd)]  # open ancestors, root first
    todo: list[tuple[tuple[str, ...], str]] = [((), root)]
    try:
        while todo:
            dirs, where = todo.pop()
            while dirs[: len(held[-1][0])] != held[-1][0]:  # not an ancestor of this level
                os.close(held.pop()[1])
            fd = held[-1][1]
            opened: int | None = None
            try:
                for depth in range(len(held[-1][0]), len(dirs)):
                    name = dirs[depth]
                    child = open_dir(name, os.path.join(root, *dirs[: depth + 1]), fd)
                    if opened is not None:
                        os.close(opened)
                    fd = opened = child
                meta = read_meta(fd, where, depth=len(dirs), root=not dirs)
                visit(dirs, where, fd, meta)
            except BaseException:
                if opened is not None:
                    os.close(opened)
                raise
            children = [e.dir for e in meta.entries if isinstance(e, ChildMeta)]
            if opened is not None:
                if children and len(held) <= budget:
                    held.append((dirs, opened))
                else:
                    os.close(opened)
            todo.extend((dirs + (d,), os.path.join(where, d)) for d in reversed(children))
    finally:
        for _, fd in held[1:]:
            os.close(fd)


def check_tree_hash(root_fd: int, root: str, meta: LevelMeta) -> None:
    """Compare the root's ``tree_hash`` with the hash of every ``meta.json`` (and pickle file)
    of the tree open at ``root_fd`` (:func:`memtree.store.reading.integrity.check_tree_hash`); no leaf
    data is read.

    Raises:
        IntegrityError: the hash differs.
        MemtreeError: a level is missing, damaged or hostile.
    """
    with LocalStorage(root, root_fd=root_fd) as storage:
        check_stored_tree_hash(storage, meta)


def read_tree(prefix: str | os.PathLike[str], options: ReadOptions | None = None) -> Level:
    """Load a tree's structure and every selected leaf now (see the module docstring).

    Raises:
        IntegrityError: ``options.verify`` and a leaf's bytes do not match its recorded checksum.
        MemtreeError: the directory is missing, damaged, hostile, or lacks a requested key.
    """
    return open_tree(prefix, options).load_all()


def open_for_fill(prefix: str | os.PathLike[str]) -> PendingLevel:
    """:func:`open_tree` on the ``meta`` device (the structure) that also opens every leaf
    as its level loads, for :func:`fill_tree`: from its held directory, never following a link,
    a regular file of exactly its size (checked as :func:`read_tree` checks it), and keeps it
    open (never mapped). At most a quarter of the process's descriptor limit
    (``RLIMIT_NOFILE``) are kept: a larger tree keeps none (:func:`fill_tree` then says so).
    The caller closes them with :func:`release_leaves`.

    Raises:
        MemtreeError: as :func:`read_tree`: a ``meta.json`` or a leaf is missing, damaged or
            hostile (when its level loads).
    """
    root = open_tree(prefix, ReadOptions.of(mode="r", device="meta"))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    reader = root.source.reader
    reader.keep_most = soft // 4 if soft != resource.RLIM_INFINITY and soft >= 0 else 1 << 62
    reader.kept = {}
    return root


def fill_tree(
    root: PendingLevel,
    targets: Mapping[tuple[str, ...], list[tuple[torch.Tensor, torch.dtype]]],
) -> bool:
    """Read the leaves at the key paths of ``targets`` straight into their live tensors.

    ``root`` comes from :func:`open_for_fill`, its levels loaded: each ``(tensor, stored
    dtype)`` of ``targets[key path]`` is filled from that leaf's kept descriptor, cast when the
    dtypes differ, by threaded ``preadv`` (:func:`memtree.store.primitives.fill.fill`: every range checked
    against its file's size before the first byte is read). Returns ``False``, reading nothing,
    when the tree had too many leaves to keep them open.

    Raises:
        SourceError: a key path is not a tensor leaf of that shape and stored dtype.
        StorageError: a leaf file shrank, or a read failed.

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"a": Level((), {"x": torch.arange(3.0)})}))
        >>> root = open_for_fill(d); _ = root.load_all()
        >>> live = torch.zeros(3)
        >>> fill_tree(root, {("a", "x"): [(live, torch.float32)]}), live.tolist()
        (True, [0.0, 1.0, 2.0])
        >>> release_leaves(root)
    """
    kept = root.source.reader.kept
    if kept is None:
        return False
    from ..primitives.fill import FillJob, fill  # only here and for reads (mmap=False, devices): not on a mapping load

    jobs: list[FillJob] = []
    for key, dests in targets.items():
        found = kept.get(key)
        for dest, stored in dests:
            if found is None or (tuple(dest.shape), stored) != (tuple(found[1].shape), found[1].dtype):
                raise SourceError(
                    f"{root.where}: {'.'.join(key)!r} is not a tensor leaf of {stored}"
                    f"{list(dest.shape)} in this tree"
                )
            fd, entry, path = found
            cast = entry.dtype if entry.dtype != dest.dtype else None
            jobs.append(FillJob(dest, FileRange(fd, entry.offset or 0, entry.nbytes, f"leaf {path}"), cast))
    fill(jobs)
    return True


def release_leaves(root: PendingLevel) -> None:
    """Close the leaves :func:`open_for_fill` kept open."""
    reader = root.source.reader
    kept, reader.kept = reader.kept, None
    for fd, _, _ in (kept or {}).values():
        os.close(fd)


def open_tree(
    prefix: str | os.PathLike[str],
    options: ReadOptions | None = None,
    *,
    written: Mapping[tuple[str, ...], LevelMeta] | None = None,
    reader: LeafReader | None = None,
) -> PendingLevel:
    """Open a tree and validate its root ``meta.json``; its levels load when asked for.

    The root directory's descriptor stays open until every :class:`PendingLevel` of this tree
    is gone, and every later file is opened relative to it.

    ``written`` is for the writer that has just committed ``prefix`` (still holding its lock):
    the metadata it wrote, by directory path from the root, used instead of reading every
    ``meta.json`` back. ``reader`` reads the leaves instead of a
    :class:`~memtree.store.reading.leaf_reader.LeafReader` of ``options`` (a subclass: ``memtree.dist``'s
    reader of a rank's shards).

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"x": torch.arange(3), "sub": Level((), {})}))
        >>> root = open_tree(d)
        >>> [e.key for e in root.meta.entries], type(root.load()["sub"]).__name__
        (['x', 'sub'], 'PendingLevel')

    Raises:
        NotCommittedError: ``prefix`` is a staging directory or an old copy of an unfinished write.
        MemtreeError: the root is missing, damaged, hostile, or lacks a requested key.
    """
    options = options if options is not None else ReadOptions()
    root = os.path.realpath(os.fspath(prefix))
    if is_uncommitted_name(os.path.basename(root)):
        raise NotCommittedError(
            f"{root} is the staging directory (or old copy) of a write that never finished; it "
            "is not a committed tree. memtree.recover() on its parent directory restores or "
            "deletes it"
        )
    source = _Source(root, open_dir(root, root, None), reader if reader is not None else LeafReader(options), written)
    meta = source.meta((), root, source.fd)
    packs = source.reader.packs = PackReader(root, source.fd, meta.packs)
    weakref.finalize(source, packs.close)
    if meta.encryption is not None or options.encryption is not None:  # else no cipher: crypto not imported
        from ..primitives.crypto import open_cipher

        source.reader.cipher, meta = open_cipher(meta, options.encryption, root, structure_only=source.reader.on_meta)
    if options.verify and meta.tree_hash is not None:
        check_tree_hash(source.fd, root, meta)
    return PendingLevel(source, (), root, (), select_entries(meta, options.selection, (), root), options.selection)


_LOCK = threading.RLock()  # loading a pending level (threads share trees)
_SOURCES: weakref.WeakSet[_Source] = weakref.WeakSet()  # opened trees with pending levels

#: How many pending levels, in all, may keep their directory open from their parent's load, so
#: that loading them later opens no directory: at most this many, and at most an eighth of the
#: process's descriptor limit (``RLIMIT_NOFILE``; see :func:`held_dirs_budget`). Beyond it the
#: level held longest lets its directory go (evicted) and re-opens it from the tree's root when
#: it loads (the same directory: every name is resolved from the held root).
MAX_HELD_DIRS = 128
#: Pending levels that hold their directory open, oldest first (changed under ``_LOCK``).
_HELD: OrderedDict[int, weakref.ref[PendingLevel]] = OrderedDict()


def held_dirs_budget() -> int:
    """How many level directories memtree keeps open at most (per purpose), for this process.

    :data:`MAX_HELD_DIRS`, or an eighth of the soft ``RLIMIT_NOFILE`` when that is lower (at least
    one), so that lazily opened trees and tree walks never exhaust a low descriptor limit.

    Example:
        >>> 1 <= held_dirs_budget() <= MAX_HELD_DIRS
        True
    """
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft < 0:
        return MAX_HELD_DIRS
    return max(1, min(MAX_HELD_DIRS, soft // 8))


def _hold_dir(level: PendingLevel, fd: int) -> None:
    """Let ``level`` keep ``fd``, its directory just opened (under ``_LOCK``), evicting the
    levels held longest while the budget is full."""
    budget = held_dirs_budget()
    while _HELD and len(_HELD) >= budget:
        evicted = _HELD.popitem(last=False)[1]()
        if evicted is not None and evicted._fd is not None:
            old, evicted._fd = evicted._fd, None
            os.close(old)
    level._fd = fd
    _HELD[id(level)] = weakref.ref(level)


def _take_dir(level: PendingLevel) -> int | None:
    """The directory ``level`` holds, now the caller's to close (under ``_LOCK``), or None."""
    fd, level._fd = level._fd, None
    if fd is not None:
        _HELD.pop(id(level), None)
    return fd


def _after_fork_in_child() -> None:  # a fork while another thread held the lock must not deadlock
    global _LOCK
    _LOCK = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def loading_lock() -> AbstractContextManager[bool]:
    """The re-entrant lock held while a pending level loads (callers that publish the loaded
    entries, like the tree layer, hold it too, so that a level is loaded and published once).

    Example:
        >>> with loading_lock():
        ...     pass
    """
    return _LOCK


def load_pending_at(prefix: str | os.PathLike[str]) -> None:
    """Load every still-pending level of the trees this process opened from ``prefix``.

    :func:`memtree.store.writing.write.write_tree` calls it (under the destination's writer lock) before it
    replaces ``prefix``: an opened tree's levels load on first
    use, relative to the old directory, which the save deletes. Loaded levels map their files,
    and mappings keep the old data readable after the deletion, as with an eager load. (Trees
    opened by *other* processes cannot be helped: their unloaded levels raise a clear
    :class:`~memtree.errors.MissingLeafError` once the old directory is gone.)

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
        >>> root = open_tree(d)
        >>> load_pending_at(d)
        >>> _ = write_tree(d, Level((), {"x": torch.zeros(3)}))
        >>> root.load()["x"].tolist()
        [0, 1, 2]
    """
    if not _SOURCES:
        return
    try:
        st = os.stat(prefix)
    except OSError:
        return
    for source in list(_SOURCES):
        try:
            same = os.path.samestat(os.fstat(source.fd), st)
        except OSError:
            continue
        if same:
            source.load_everything()


class _Source:
    """An opened tree: the root directory's descriptor (closed with the last reference)."""

    def __init__(
        self, root: str, fd: int, reader: LeafReader, written: Mapping[tuple[str, ...], LevelMeta] | None
    ) -> None:
        self.root = root
        self.fd = fd
        self.reader = reader
        self.written = written or {}
        self.pending: weakref.WeakSet[PendingLevel] = weakref.WeakSet()
        weakref.finalize(self, os.close, fd)
        _SOURCES.add(self)

    def load_everything(self) -> None:
        """Load (and keep) every pending level of this tree, and the levels below them."""
        with _LOCK:
            todo = list(self.pending)
            while todo:
                todo.extend(v for v in todo.pop().load().values() if isinstance(v, PendingLevel))

    def meta(self, dirs: tuple[str, ...], where: str, dir_fd: int) -> LevelMeta:
        """The validated ``meta.json`` of the level ``dirs`` (open as ``dir_fd``)."""
        meta = self.written.get(dirs) or read_meta(dir_fd, where, depth=len(dirs), root=not dirs)
        if dirs and self.reader.cipher is not None:  # an encrypted tree: every level authenticated
            return self.reader.cipher.reveal(meta, "/".join(dirs), where)
        return meta

    def open_level(self, dirs: tuple[str, ...]) -> int:
        """A new descriptor of the level ``dirs`` below the root (never following links)."""
        if not dirs:
            return os.dup(self.fd)
        fd, where = self.fd, self.root
        for name in dirs:
            where = os.path.join(where, name)
            try:
                child = open_dir(name, where, fd)
            finally:
                if fd != self.fd:
                    os.close(fd)
            fd = child
        return fd

    def removed(self) -> bool:
        """True when the opened root directory has been deleted (e.g. replaced by a re-save)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True


@dataclasses.dataclass(eq=False)
class PendingLevel:
    """A level whose ``meta.json`` is validated and whose entries are not loaded yet.

    Attributes:
        dirs: the directory names from the root to this level.
        where: the level's directory (for messages).
        keys: the key path from the root.
        meta: the validated ``meta.json``, with only the selected entries.
        selection: the ``keys=`` selection below this level (``None``: everything).
        subclass: a tensor subclass's group (its entry's record), else ``None``.
    """

    source: _Source
    dirs: tuple[str, ...]
    where: str
    keys: tuple[str, ...]
    meta: LevelMeta
    selection: Selection | None
    subclass: Subclass | None = None
    #: The level's directory, kept open from its parent's load (see :data:`MAX_HELD_DIRS`).
    _fd: int | None = dataclasses.field(default=None, repr=False)
    _loaded: dict[str, Value | PendingLevel] | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.source.pending.add(self)

    def __del__(self) -> None:  # never loaded: let its held directory go
        if self._fd is not None:
            try:
                with _LOCK:
                    fd = _take_dir(self)
                    if fd is not None:
                        os.close(fd)
            except (OSError, TypeError, AttributeError):  # module globals torn down at exit
                pass

    @property
    def batch_size(self) -> tuple[int, ...]:
        """The level's batch size."""
        return self.meta.batch_size

    @property
    def type(self) -> str:
        """The level's stored container type (``"TensorTree"`` or a registered class name)."""
        return self.meta.type

    def load(self) -> dict[str, Value | PendingLevel]:
        """This level's entries: leaves checked and mapped (or read), sub-levels pending.

        Loaded once: later calls return the same entries.

        Raises:
            MemtreeError: a leaf or a sub-level's ``meta.json`` is missing, damaged or hostile;
                :class:`~memtree.errors.MissingLeafError` also when the tree was deleted or
                replaced since it was opened.
        """
        with _LOCK:
            if self._loaded is None:
                with self.source.reader.batch(self.unload):
                    self._loaded = self._open_and_load()
            return self._loaded

    def unload(self) -> None:
        """Forget the loaded entries: the read of a batch of levels failed (see
        :meth:`~memtree.store.reading.leaf_reader.LeafReader.batch`), so none of them stays loaded."""
        self._loaded = None

    def _open_and_load(self) -> dict[str, Value | PendingLevel]:
        try:
            fd = _take_dir(self)  # no longer held: loading the sub-levels cannot evict it
            if fd is None:
                fd = self.source.open_level(self.dirs)
            try:
                return self._load(fd)
            finally:
                os.close(fd)
        except MissingLeafError as err:
            if self.source.removed():
                raise MissingLeafError(
                    f"the tree at {self.source.root} was deleted or replaced (re-saved) after it "
                    f"was opened, before {self.where} was loaded; levels load when first used, so "
                    "load the tree again (load_memmap(..., lazy=False) loads every leaf at once)"
                ) from err
            raise

    def _load(self, fd: int) -> dict[str, Value | PendingLevel]:
        reader, sel = self.source.reader, self.selection
        if reader.packs is not None:  # every packed leaf inside its pack, none overlapping
            reader.packs.accept(self.meta, self.dirs, os.path.join(self.where, META_NAME))
        out: dict[str, Value | PendingLevel] = {}
        for entry in self.meta.entries:
            sub = sel.get(entry.key) if sel is not None else None
            if isinstance(entry, LeafMeta):
                if sub is not None:
                    raise MemtreeKeyError(
                        f"key {self.keys + (entry.key,)!r} is a tensor leaf at {self.where}; it "
                        f"has no sub-key {next(iter(sub))!r}"
                    )
                out[entry.key] = reader.leaf(fd, self.where, entry, self.keys, self.dirs)
            elif isinstance(entry, ChildMeta):
                path = self.keys + (entry.key,)
                where = os.path.join(self.where, entry.dir)
                dirs = self.dirs + (entry.dir,)
                child_fd = open_dir(entry.dir, where, fd)
                try:
                    meta = self.source.meta(dirs, where, child_fd)
                    self._check_nesting(entry, meta, where)
                    meta = select_entries(meta, sub, path, where)
                except BaseException:
                    os.close(child_fd)
                    raise
                subclass = entry.subclass if isinstance(entry, SubclassMeta) else None
                child = PendingLevel(self.source, dirs, where, path, meta, sub, subclass)
                _hold_dir(child, child_fd)
                # a subclass is one leaf: its inner tensors load with its level
                out[entry.key] = child if subclass is None else child._level_of_all()
            elif isinstance(entry, JsonMeta):
                out[entry.key] = NonTensor(lists_to_tuples(entry.value, entry.tuples))
            else:
                out[entry.key] = NonTensor(reader.pickled(fd, self.where, entry))
        return out

    def _check_nesting(self, entry: ChildMeta, meta: LevelMeta, where: str) -> None:
        """A sub-level's batch size starts with this level's; a subclass group follows its rules."""
        meta_path = os.path.join(where, META_NAME)
        if isinstance(entry, SubclassMeta):
            problem = check_group(entry, meta, meta_path)
            if problem is not None:
                raise MetaFormatError(f"{problem}; the tree is damaged")
        elif not starts_with_batch(meta.batch_size, self.meta.batch_size):
            raise MetaFormatError(
                f"{meta_path}: batch_size {list(meta.batch_size)} does not start with the parent's "
                f"{list(self.meta.batch_size)}; the tree is damaged"
            )

    def load_all(self) -> Level:
        """This level and every level below it, loaded now."""
        with _LOCK, self.source.reader.batch(None):  # every leaf below read by one threaded fill
            return self._level_of_all()

    def _level_of_all(self) -> Level:
        entries = {
            k: v._level_of_all() if isinstance(v, PendingLevel) else v for k, v in self.load().items()
        }
        return Level(self.meta.batch_size, entries, self.meta.type, subclass=self.subclass)
