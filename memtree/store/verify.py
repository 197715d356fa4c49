"""Check a whole tree on disk and report every problem (``memtree verify DIR``).

:func:`verify_tree` walks a tree like the loader does (same validation of every ``meta.json``,
same checks of every leaf file: regular file, not a link, exact size), but instead of stopping at
the first problem it records each one and goes on, and it compares every leaf's recorded checksum
with the file's bytes, and the root's ``tree_hash`` (format version 2) with the hash of every
``meta.json`` (:mod:`memtree.store.integrity`). It never maps a file,
never unpickles, and never writes. A directory written by tensordict's ``memmap``, which
``load_memmap`` reads too, is checked with the same reader
(:func:`memtree.store.tensordict.check_tensordict_dir`): what that load refuses, verify reports.

Example:
    >>> import os, tempfile, torch
    >>> from memtree import TensorTree, verify_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = TensorTree({"a": torch.arange(4), "b": {"c": torch.ones(2)}}).memmap(d, checksum="crc32")
    >>> verify_tree(d).ok
    True
    >>> leaf = os.path.join(d, "a.memmap")
    >>> st = os.stat(leaf)
    >>> with open(leaf, "r+b") as f:   # bit rot: the bytes change, the modification time does not
    ...     _ = f.write(b"X")
    >>> os.utime(leaf, ns=(st.st_atime_ns, st.st_mtime_ns))
    >>> [(p.kind, p.key) for p in verify_tree(d).problems]
    [('checksum', ('a',))]
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from ..format.dtypes import dtype_name
from ..errors import (
    DtypeError,
    LeafSizeError,
    LimitError,
    MemtreeError,
    MetaFormatError,
    MissingLeafError,
    NotAMemtreeError,
    PickleNotAllowedError,
    StorageError,
    UnsafePathError,
    UnsupportedVersionError,
)
from .files import file_checksum, open_checked
from .integrity import changed_after_meta, tree_hash
from ..format.schema import ChildMeta, LeafMeta, LevelMeta, PickleMeta, starts_with_batch
from ..format.names import META_NAME
from .progress import Progress
from .read import META_FLAGS, open_dir, read_meta
from .tensordict import check_tensordict_dir, is_tensordict_dir
from ..format.names import is_uncommitted_name

__all__ = ["Problem", "VerifyReport", "verify_tree"]

_KINDS: tuple[tuple[type[MemtreeError], str], ...] = (
    (NotAMemtreeError, "not-a-tree"),
    (UnsupportedVersionError, "version"),
    (LimitError, "limit"),
    (MetaFormatError, "meta"),
    (MissingLeafError, "missing"),
    (LeafSizeError, "size"),
    (UnsafePathError, "unsafe"),
    (StorageError, "io"),
    (PickleNotAllowedError, "pickle"),
    (DtypeError, "dtype"),
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a tree.

    Attributes:
        path: the file or directory concerned.
        key: the key path of the leaf or sub-tree (``()`` for the root).
        kind: ``"checksum"`` (the bytes differ from the recorded checksum), ``"stale"`` (they
            differ, and the file was modified after its ``meta.json``: written in place, e.g.
            through a ``mode="r+"`` mapping, so the checksum no longer describes it),
            ``"tree-hash"`` (the root's ``tree_hash`` does not match the ``meta.json`` files),
            ``"size"``, ``"missing"``, ``"unsafe"`` (link, FIFO, directory...),
            ``"meta"`` (a malformed ``meta.json``), ``"version"``, ``"limit"``, ``"structure"``
            (batch sizes that do not nest), ``"not-a-tree"``, ``"not-committed"``, ``"io"``, and
            in tensordict directories ``"pickle"`` (a value only in a pickle sidecar, which
            memtree never runs) or ``"dtype"`` (a nested tensor).
        expected: what the metadata promises (e.g. ``"24 bytes"``, ``"crc32:1a2b3c4d"``), when
            it applies.
        found: what is on disk, when it applies.
        message: a full sentence, as the loader would raise it.
    """

    path: str
    key: tuple[str, ...]
    kind: str
    expected: str | None
    found: str | None
    message: str


@dataclass
class VerifyReport:
    """The result of :func:`verify_tree`.

    Attributes:
        path: the tree's directory (resolved).
        layout: ``"memtree"``, or ``"tensordict"`` for a directory written by tensordict's
            ``memmap`` (leaves checked for size, at least ``numel × itemsize`` bytes; no checksums).
        leaves: tensor leaves listed by the ``meta.json`` files that could be read.
        checksummed: leaves whose recorded checksum was compared with the file.
        tree_hash: ``"ok"`` (the root's ``tree_hash`` matches every ``meta.json``),
            ``"mismatch"`` (a ``"tree-hash"`` problem), ``"absent"`` (none recorded: a version 1
            tree, written without checksums, or grown since), or ``"unchecked"`` (not compared:
            ``checksums=False``, or a level or pickle file could not be read, already a problem).
        problems: every problem found, in walk order.
    """

    path: str
    layout: str = "memtree"
    leaves: int = 0
    checksummed: int = 0
    tree_hash: str = "absent"
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``memtree verify --json`` prints)."""
        return {
            "path": self.path,
            "layout": self.layout,
            "ok": self.ok,
            "leaves": self.leaves,
            "checksummed": self.checksummed,
            "tree_hash": self.tree_hash,
            "problems": [{**asdict(p), "key": list(p.key)} for p in self.problems],
        }


def _kind(err: MemtreeError) -> str:
    for cls, kind in _KINDS:
        if isinstance(err, cls):
            return kind
    return "error"


class _Walker:
    def __init__(self, report: VerifyReport, checksums: bool, bar: Progress) -> None:
        self.report = report
        self.checksums = checksums
        self.bar = bar
        self.metas: dict[str, LevelMeta] = {}  # every level read, by directory from the root
        self.pickle_sums: dict[str, str] = {}
        self.tree_algorithm: str | None = None  # of the root's tree_hash
        self.complete = True  # every level and pickle file was read

    def add(self, path: str, key: tuple[str, ...], kind: str, message: str,
            expected: str | None = None, found: str | None = None) -> None:
        self.report.problems.append(Problem(path, key, kind, expected, found, message))

    def tensordict_problem(self, path: str, key: tuple[str, ...], err: MemtreeError) -> None:
        self.add(path, key, _kind(err), str(err))

    def tensordict_leaf(self) -> None:
        self.report.leaves += 1
        self.bar.update()

    def level(self, dir_fd: int, where: str, key: tuple[str, ...], depth: int,
              parent_batch: tuple[int, ...], rel: str = "") -> None:
        try:
            meta = read_meta(dir_fd, where, depth=depth, root=depth == 0)
        except MemtreeError as err:
            self.add(os.path.join(where, META_NAME), key, _kind(err), str(err))
            self.complete = False
            return
        self.metas[rel] = meta
        if depth == 0 and meta.tree_hash is not None:
            self.tree_algorithm = meta.tree_hash.partition(":")[0]
        if not starts_with_batch(meta.batch_size, parent_batch):
            self.add(
                os.path.join(where, META_NAME), key, "structure",
                f"batch_size {list(meta.batch_size)} does not start with the parent's "
                f"{list(parent_batch)}",
                f"batch_size starting with {list(parent_batch)}", str(list(meta.batch_size)),
            )
        for entry in meta.entries:
            if isinstance(entry, LeafMeta):
                self.report.leaves += 1
                self.leaf(dir_fd, where, entry, key + (entry.key,))
                self.bar.update()
            elif isinstance(entry, ChildMeta):
                child_where = os.path.join(where, entry.dir)
                try:
                    child_fd = open_dir(entry.dir, child_where, dir_fd)
                except MemtreeError as err:
                    self.add(child_where, key + (entry.key,), _kind(err), str(err))
                    self.complete = False
                    continue
                try:
                    self.level(child_fd, child_where, key + (entry.key,), depth + 1, meta.batch_size,
                               f"{rel}/{entry.dir}" if rel else entry.dir)
                finally:
                    os.close(child_fd)
            elif isinstance(entry, PickleMeta):
                self.pickle_file(dir_fd, where, entry, key + (entry.key,), rel)

    def check_tree_hash(self, root: str) -> None:
        """Compare the root's ``tree_hash`` with the hash of every ``meta.json`` read."""
        root_meta = self.metas.get("")
        if root_meta is None or root_meta.tree_hash is None:
            self.report.tree_hash = "absent" if root_meta is not None else "unchecked"
            return
        if not self.checksums or not self.complete:
            self.report.tree_hash = "unchecked"
            return
        assert self.tree_algorithm is not None
        try:
            found = tree_hash(self.tree_algorithm, self.metas, self.pickle_sums)
        except MemtreeError as err:  # an algorithm this installation lacks
            self.report.tree_hash = "unchecked"
            self.add(os.path.join(root, META_NAME), (), "tree-hash", f"tree_hash not checked: {err}")
            return
        if found == root_meta.tree_hash:
            self.report.tree_hash = "ok"
            return
        self.report.tree_hash = "mismatch"
        self.add(
            os.path.join(root, META_NAME), (), "tree-hash",
            f"{root}: the root meta.json records tree_hash {root_meta.tree_hash}, the tree's "
            f"meta.json files hash to {found}: a key, dtype, shape, value or checksum changed "
            "after the tree was written (or a meta.json was damaged); restore it or re-save the tree",
            root_meta.tree_hash, found,
        )

    def leaf(self, dir_fd: int, where: str, entry: LeafMeta, key: tuple[str, ...]) -> None:
        path = os.path.join(where, entry.file)
        nbytes = entry.nbytes
        expected = f"{entry.file_nbytes:,} bytes ({dtype_name(entry.dtype)} {list(entry.shape)}"
        expected += f", capacity {entry.capacity})" if entry.capacity is not None else ")"
        try:
            fd = open_checked(entry.file, entry.file_nbytes, path, dir_fd=dir_fd)
        except LeafSizeError as err:
            size = os.stat(entry.file, dir_fd=dir_fd, follow_symlinks=False).st_size
            self.add(path, key, "size", str(err), expected, f"{size:,} bytes")
            return
        except MissingLeafError as err:
            self.add(path, key, "missing", str(err), expected, "no file")
            return
        except MemtreeError as err:
            self.add(path, key, _kind(err), str(err), "a regular file", _file_kind(entry.file, dir_fd))
            return
        try:
            if self.checksums and entry.checksum is not None:  # covers the tensor's bytes
                found = file_checksum(fd, nbytes, entry.checksum.partition(":")[0])
                self.report.checksummed += 1
                if found != entry.checksum and changed_after_meta(fd, dir_fd):
                    self.add(
                        path, key, "stale",
                        f"leaf {key!r} at {path}: meta.json records {entry.checksum}, the file "
                        f"has {found}, and the file was modified after its meta.json: it was "
                        "written in place (e.g. through a mode='r+' mapping), so its checksum no "
                        "longer describes it and memtree cannot tell that write from damage; "
                        "re-save the tree to record new checksums",
                        entry.checksum, found,
                    )
                elif found != entry.checksum:
                    self.add(
                        path, key, "checksum",
                        f"leaf {key!r} at {path}: meta.json records {entry.checksum}, the file "
                        f"has {found}; the file changed after it was written",
                        entry.checksum, found,
                    )
        except MemtreeError as err:  # an algorithm this installation lacks
            self.add(path, key, "checksum", f"leaf {key!r} at {path}: not checked: {err}", entry.checksum)
        except OSError as err:
            self.add(path, key, "io", f"reading {path}: {err}")
        finally:
            os.close(fd)

    def pickle_file(self, dir_fd: int, where: str, entry: PickleMeta, key: tuple[str, ...], rel: str) -> None:
        path = os.path.join(where, entry.file)
        name = f"{rel}/{entry.file}" if rel else entry.file
        try:
            fd = os.open(entry.file, META_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            self.add(path, key, "missing", f"pickled leaf file {path} is missing", "a file", "no file")
            self.complete = False
            return
        except OSError as err:
            self.add(path, key, "unsafe", f"cannot open {path} safely: {err}", "a regular file",
                     _file_kind(entry.file, dir_fd))
            self.complete = False
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.add(path, key, "unsafe", f"{path} is not a regular file", "a regular file",
                         _file_kind(entry.file, dir_fd))
            elif self.tree_algorithm is not None and self.checksums:
                self.pickle_sums[name] = file_checksum(fd, st.st_size, self.tree_algorithm)
        except (OSError, MemtreeError) as err:
            self.add(path, key, "io", f"reading {path}: {err}")
        finally:
            os.close(fd)
            self.complete &= name in self.pickle_sums or self.tree_algorithm is None


def _file_kind(name: str, dir_fd: int) -> str:
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError as err:
        return f"unreadable ({err.strerror})"
    for test, label in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return label
    return "a regular file"


def verify_tree(
    prefix: str | os.PathLike[str], *, checksums: bool = True, progress: bool | None = None
) -> VerifyReport:
    """Check every ``meta.json`` and leaf of the tree at ``prefix``; report every problem.

    Args:
        prefix: the tree's directory.
        checksums: compare each leaf's recorded checksum with its file (reads every such
            file once); ``False`` checks structure and sizes only (no leaf data is read).
        progress: a progress bar of the leaves checked (:mod:`memtree.store.progress`): ``None``
            on a terminal outside CI only, ``True``/``False`` forced.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when the tree loads and every checksum
        matches. Leaves saved without a checksum are checked for size only.

    Example:
        >>> import tempfile, torch
        >>> from memtree import TensorTree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = TensorTree({"w": torch.ones(3)}).memmap(d, checksum="sha256")
        >>> r = verify_tree(d)
        >>> r.ok, r.leaves, r.checksummed
        (True, 1, 1)
    """
    root = os.path.realpath(os.fspath(prefix))
    report = VerifyReport(root)
    with Progress(desc="verify", unit="leaf", progress=progress) as bar:
        _verify(root, _Walker(report, checksums, bar))
    return report


def _verify(root: str, walker: _Walker) -> None:
    if is_tensordict_dir(root):  # the reader load_memmap picks for it (store/open.py)
        walker.report.layout = "tensordict"
        check_tensordict_dir(root, walker.tensordict_problem, walker.tensordict_leaf)
        return
    if is_uncommitted_name(os.path.basename(root)):
        walker.add(root, (), "not-committed",
                   f"{root} is the staging directory (or old copy) of an unfinished write")
        return
    try:
        fd = open_dir(root, root, None)
    except MemtreeError as err:
        walker.add(root, (), _kind(err), str(err))
        return
    try:
        walker.level(fd, root, (), 0, ())
    finally:
        os.close(fd)
    walker.check_tree_hash(root)
