"""Check a whole tree and report every problem (``memtree verify DIR_OR_URL``).

:func:`verify_tree` walks a tree through the read seam (:class:`~memtree.store.reading.storage.Storage`:
a local directory or any fsspec URL) with the loader's walker (:func:`memtree.store.reading.walk.walk`:
same validation of every ``meta.json``) and checks every leaf file as the loader does (regular
file, not a link, exact size), but instead of stopping at the first problem it records each one
and goes on, and it compares every leaf's recorded checksum (each chunk's, for per-chunk
checksums) with the file's bytes (:func:`memtree.store.primitives.chunk_check.hash_chunks`), and the root's ``tree_hash``
(format version 2) with the hash of every ``meta.json`` (the one computation of
:mod:`memtree.store.reading.integrity`, over what it has read). The same code verifies a local tree
and a remote one. It never maps a file, never unpickles, and never writes. A directory written by tensordict's
``memmap``, which ``load_memmap`` reads too, is checked with the same reader
(:func:`memtree.store.foreign.tensordict.check_tensordict_dir`): what that load refuses, verify reports.

Example:
    >>> import os, tempfile, torch
    >>> from memtree import TensorTree, verify_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = TensorTree({"a": torch.arange(4), "b": {"c": torch.ones(2)}}).memmap(d, checksum="crc32")
    >>> verify_tree(d).ok
    True
    >>> path = os.path.join(d, "a.memmap")
    >>> mtime = os.stat(path).st_mtime_ns
    >>> with open(path, "r+b") as f:  # bit rot: the bytes change, the modification time does not
    ...     _ = f.write(b"X")
    >>> os.utime(path, ns=(mtime, mtime))
    >>> [(p.kind, p.key) for p in verify_tree(d).problems]
    [('checksum', ('a',))]
"""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import (
    check_keywords,
    DtypeError,
    LeafSizeError,
    LimitError,
    MemtreeError,
    MetaFormatError,
    MissingLeafError,
    NotAMemtreeError,
    NotCommittedError,
    PickleNotAllowedError,
    RemoteError,
    StorageError,
    UnsafePathError,
    UnsupportedVersionError,
)
from ..format.names import META_NAME
from ..format.packs import PackRanges, leaf_location
from ..format.schema import LeafMeta, LevelMeta, PickleMeta
from ..format.subclass import SubclassMeta, check_group
from .primitives.chunk_check import differing, hash_chunks, mismatch_words
from .primitives.files import leaf_size_error
from .reading.integrity import changed_after_meta, storage_checksum, stored_tree_hash, tree_hash_mismatch
from .primitives.progress import Progress
from .reading.storage import META_FLAGS, FileInfo, LocalStorage, Storage, is_url, local_path
from .reading.walk import NestingError, WalkedLevel, walk

__all__ = ["Problem", "VerifyReport", "verify_tree"]

#: Leaves checked at a time (each a stat, then its bytes if it records a checksum).
DEFAULT_THREADS = 4

_KINDS: tuple[tuple[type[MemtreeError], str], ...] = (
    (NotCommittedError, "not-committed"),
    (NotAMemtreeError, "not-a-tree"),
    (NestingError, "structure"),
    (UnsupportedVersionError, "version"),
    (LimitError, "limit"),
    (MetaFormatError, "meta"),
    (MissingLeafError, "missing"),
    (LeafSizeError, "size"),
    (UnsafePathError, "unsafe"),
    (StorageError, "io"),
    (RemoteError, "io"),
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
            through a ``mode="r+"`` mapping, so the checksum no longer describes it; only while
            the ``meta.json`` files are intact: ``tree_hash`` ``"ok"`` or ``"absent"``),
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
        path: the tree's directory (resolved) or URL.
        layout: ``"memtree"``, or ``"tensordict"`` for a directory written by tensordict's
            ``memmap`` (leaves checked for size, at least ``numel × itemsize`` bytes; no checksums).
        leaves: tensor leaves listed by the ``meta.json`` files that could be read.
        checksummed: leaves whose recorded checksum was compared with the file.
        tree_hash: ``"ok"`` (the root's ``tree_hash`` matches every ``meta.json``),
            ``"mismatch"`` (a ``"tree-hash"`` problem), ``"absent"`` (none recorded: a version 1
            tree, written without checksums, or grown since), or ``"unchecked"`` (not compared:
            ``checksums=False``, a level or pickle file could not be read, already a problem, or
            an encrypted tree's sealed names).
        problems: every problem found: those of the ``meta.json`` files, then those of the
            leaf files, each in walk order (breadth first).
        encrypted: the tree is encrypted (``memmap(..., encryption=key)``). Without the key, a
            leaf's checksum is compared with its ciphertext: a damaged file is found, but
            nothing is decrypted or authenticated (``load_memmap(path, encryption=key,
            verify=True)`` does both).
        sealed: the tree was written with ``encrypt_names=True``: its levels' entries are
            sealed, so no key, sub-level or leaf below the root is listed or checked without the
            key (``leaves`` is 0).
    """

    path: str
    layout: str = "memtree"
    leaves: int = 0
    checksummed: int = 0
    tree_hash: str = "absent"
    problems: list[Problem] = field(default_factory=list)
    encrypted: bool = False
    sealed: bool = False

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
            "encrypted": self.encrypted,
            "sealed": self.sealed,
            "problems": [{**asdict(p), "key": list(p.key)} for p in self.problems],
        }


def _kind(err: MemtreeError) -> str:
    for cls, kind in _KINDS:
        if isinstance(err, cls):
            return kind
    return "error"


class _Walker:
    def __init__(self, report: VerifyReport, checksums: bool) -> None:
        self.report = report
        self.checksums = checksums
        self.lock = threading.Lock()
        self.bar: Progress | None = None  # set once the walk has counted the work
        self.tree_algorithm: str | None = None  # of the root's tree_hash
        self.pickle_sums: dict[str, str] = {}  # for the tree hash, by path from the root
        self.complete = True  # every level and pickle file was read
        self.packs: dict[str, FileInfo] = {}  # the packs found whole (format version 3), by name

    def add(self, path: str, key: tuple[str, ...], kind: str, message: str,
            expected: str | None = None, found: str | None = None) -> None:
        self.report.problems.append(Problem(path, key, kind, expected, found, message))

    def tensordict_problem(self, path: str, key: tuple[str, ...], err: MemtreeError) -> None:
        self.add(path, key, _kind(err), str(err))

    def tensordict_leaf(self) -> None:
        self.report.leaves += 1

    def level_problem(self, where: str, key: tuple[str, ...], err: MemtreeError) -> None:
        self.complete = False
        if not isinstance(err, NestingError):  # those are reported with their sizes by jobs()
            self.add(where, key, _kind(err), str(err))

    def check_tree_hash(self, storage: Storage, levels: list[WalkedLevel]) -> None:
        """Compare the root's ``tree_hash`` with the hash of every ``meta.json`` read."""
        root = next((lvl.meta for lvl in levels if not lvl.dirs), None)
        if root is None or root.tree_hash is None:
            self.report.tree_hash = "absent" if root is not None else "unchecked"
            return
        if not self.checksums or not self.complete or root.sealed is not None:
            self.report.tree_hash = "unchecked"  # (sealed names: the hash covers what only the key reveals)
            return
        meta_path = storage.describe(META_NAME)
        try:
            found = stored_tree_hash(storage, root, levels=levels, pickle_sums=self.pickle_sums)
        except MemtreeError as err:  # an algorithm this installation lacks
            self.report.tree_hash = "unchecked"
            self.add(meta_path, (), "tree-hash", f"tree_hash not checked: {err}")
            return
        if found == root.tree_hash:
            self.report.tree_hash = "ok"
            return
        self.report.tree_hash = "mismatch"
        self.add(
            meta_path, (), "tree-hash",
            tree_hash_mismatch(storage.describe(""), root.tree_hash, found, fix="restore it or re-save the tree"),
            root.tree_hash, found,
        )

    def check_packs(self, storage: Storage, root: LevelMeta) -> None:
        """Check each pack of the root as the loader does (a regular file of its exact size);
        the packs found whole go to :attr:`packs` (their leaves are then checked)."""
        for pack in root.packs:
            path = storage.describe(pack.file)
            expected = f"{pack.nbytes:,} bytes (a pack of small leaves)"
            try:
                info = storage.stat(pack.file)
            except MissingLeafError as err:
                self.add(path, (), "missing", str(err), expected, "no file")
                continue
            except UnsafePathError as err:
                self.add(path, (), "unsafe", str(err), "a regular file", _file_kind(storage, pack.file))
                continue
            except MemtreeError as err:
                self.add(path, (), _kind(err), str(err))
                continue
            if info.size != pack.nbytes:
                self.add(path, (), "size", str(leaf_size_error(path, info.size, pack.nbytes)), expected,
                         f"{info.size:,} bytes")
                continue
            self.packs[pack.file] = info

    def jobs(self, storage: Storage, levels: list[WalkedLevel]) -> list[tuple[WalkedLevel, LeafMeta | PickleMeta]]:
        """The files to check, in walk order; nesting problems, and packed leaves outside their
        pack or overlapping, recorded on the way (those leaves are not checked further)."""
        metas: dict[tuple[str, ...], LevelMeta] = {lvl.dirs: lvl.meta for lvl in levels}
        root = metas.get(())
        ranges = PackRanges({p.file: p.nbytes for p in root.packs} if root is not None else {})
        groups = {lvl.dirs + (e.dir,): e for lvl in levels for e in lvl.meta.entries if isinstance(e, SubclassMeta)}
        out: list[tuple[WalkedLevel, LeafMeta | PickleMeta]] = []
        for lvl in levels:
            try:
                ranges.add_level(lvl.meta, storage.describe(lvl.file(META_NAME)))
                packed_ok = True
            except MetaFormatError as err:
                self.add(storage.describe(lvl.file(META_NAME)), lvl.keys, "meta", str(err))
                packed_ok = False
            parent = metas.get(lvl.dirs[:-1]) if lvl.dirs else None
            group = groups.get(lvl.dirs)
            problem = check_group(group, lvl.meta, storage.describe(lvl.file(META_NAME))) if group else None
            if problem is not None:  # a tensor subclass's group: its own rules, not the batch rule
                self.add(storage.describe(lvl.file(META_NAME)), lvl.keys, "structure", problem)
            elif group is None and parent is not None and lvl.meta.batch_size[: len(parent.batch_size)] != parent.batch_size:
                self.add(
                    storage.describe(lvl.file(META_NAME)), lvl.keys, "structure",
                    f"batch_size {list(lvl.meta.batch_size)} does not start with the parent's "
                    f"{list(parent.batch_size)}",
                    f"batch_size starting with {list(parent.batch_size)}", str(list(lvl.meta.batch_size)),
                )
            for entry in lvl.meta.entries:
                if isinstance(entry, LeafMeta) and entry.pack is not None:
                    if packed_ok and entry.pack in self.packs:  # (a damaged pack is reported once)
                        out.append((lvl, entry))
                elif isinstance(entry, (LeafMeta, PickleMeta)):
                    out.append((lvl, entry))
        return out

    def check(self, storage: Storage, job: tuple[WalkedLevel, LeafMeta | PickleMeta]) -> list[Problem]:
        """The problems of one file (run in a worker thread: returns them, records nothing)."""
        lvl, entry = job
        rel, offset = leaf_location(lvl.rel, entry) if isinstance(entry, LeafMeta) else (lvl.file(entry.file), 0)
        path = storage.describe(rel)
        key = lvl.keys + (entry.key,)
        found: list[Problem] = []

        def problem(kind: str, message: str, expected: str | None = None, got: str | None = None) -> list[Problem]:
            found.append(Problem(path, key, kind, expected, got, message))
            return found

        if isinstance(entry, PickleMeta):

            def unread(kind: str, message: str, expected: str | None = None, got: str | None = None) -> list[Problem]:
                self.complete = False  # the tree hash covers its bytes: it cannot be checked
                return problem(kind, message, expected, got)

            try:
                info = storage.stat(rel)
            except MissingLeafError:
                return unread("missing", f"pickled leaf file {path} is missing", "a file", "no file")
            except UnsafePathError as err:
                return unread("unsafe", str(err), "a regular file", _file_kind(storage, rel))
            except MemtreeError as err:
                return unread(_kind(err), str(err))
            if self.checksums and self.tree_algorithm is not None:  # the tree hash covers its bytes
                try:
                    digest = storage_checksum(storage, rel, self.tree_algorithm, info=info, advance=self.advance)
                except (OSError, MemtreeError) as err:
                    return unread("io", f"reading {path}: {err}")
                with self.lock:
                    self.pickle_sums[rel] = digest
            return found
        if entry.pack is not None:  # its pack was found whole and its range checked (jobs())
            info = self.packs[entry.pack]
        else:
            expected = f"{entry.file_nbytes:,} bytes ({entry.dtype_name} {list(entry.shape)}"
            expected += f", capacity {entry.capacity})" if entry.capacity is not None else ")"
            try:
                info = storage.stat(rel)
            except MissingLeafError as err:
                return problem("missing", str(err), expected, "no file")
            except UnsafePathError as err:
                return problem("unsafe", str(err), "a regular file", _file_kind(storage, rel))
            except MemtreeError as err:
                return problem(_kind(err), str(err))
            if info.size != entry.file_nbytes:
                size_error = leaf_size_error(path, info.size, entry.file_nbytes)
                return problem("size", str(size_error), expected, f"{info.size:,} bytes")
        sums = entry.sums  # a checksum covers the tensor's bytes; an encrypted leaf's, its ciphertext
        if not self.checksums or sums is None:
            return found
        try:
            digests = hash_chunks(
                lambda at, view: storage.read_into(rel, offset + at, view, info), sums, entry.checksum_nbytes,
                range(sums.count), advance=self.advance,
            )
        except MemtreeError as err:
            return problem(_kind(err), str(err))
        except OSError as err:
            return problem("io", f"reading {path}: {err}")
        with self.lock:
            self.report.checksummed += 1
        bad = differing(sums, digests)
        if not bad:
            return found
        words = mismatch_words(sums, digests, bad, entry.checksum_nbytes)
        stale = entry.chunk_bytes is None and _written_in_place(storage, lvl, rel)
        got = f"{sums.algorithm}:{digests[bad[0]]}"
        found.append(_mismatch(path, key, words, sums.digest(bad[0]), got, stale=stale))
        return found

    def advance(self, n: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(n)


_STALE = (
    ", and the file was modified after its meta.json: it was written in place (e.g. through a "
    "mode='r+' mapping), so its checksum no longer describes it and memtree cannot tell that write "
    "from damage; re-save the tree to record new checksums"
)
_DAMAGED = "; the file changed after it was written"


def _mismatch(path: str, key: tuple[str, ...], words: str, recorded: str, got: str, *, stale: bool) -> Problem:
    """A leaf whose bytes differ from its recorded checksum (``words``: what differs, from
    :func:`mismatch_words`): ``"stale"`` when it was written in place after its ``meta.json``
    (and the tree's ``meta.json`` files are intact), else damage."""
    message = f"leaf {key!r} at {path}: meta.json records {words}"
    if stale:
        return Problem(path, key, "stale", recorded, got, message + _STALE)
    return Problem(path, key, "checksum", recorded, got, message + _DAMAGED)


def _as_damage(p: Problem) -> Problem:
    """A "stale" problem reported as damage (the ``meta.json`` files changed too)."""
    return replace(p, kind="checksum", message=p.message.removesuffix(_STALE) + _DAMAGED)


#: The tree hash results that leave the ``meta.json`` files trusted: only then can a leaf be
#: merely stale (a ``meta.json`` edited since the save makes its leaves' mismatches damage,
#: whatever the files' times say).
_META_INTACT = frozenset({"ok", "absent"})


def _written_in_place(storage: Storage, lvl: WalkedLevel, rel: str) -> bool:
    """A local leaf file newer than its level's ``meta.json`` (:func:`changed_after_meta`); a
    remote storage keeps no such times, so there a mismatch is always reported as damage."""
    if not isinstance(storage, LocalStorage):
        return False
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        dir_fd = os.open(storage.describe(lvl.rel), flags | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fd = os.open(storage.describe(rel), flags)  # a pack lies at the root, not in its leaf's level
        try:
            return changed_after_meta(fd, dir_fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.close(dir_fd)


def _file_kind(storage: Storage, rel: str) -> str | None:
    """What a local file that is not a regular one is (``None`` for a remote storage)."""
    if not isinstance(storage, LocalStorage):
        return None
    try:
        mode = os.stat(storage.describe(rel), follow_symlinks=False).st_mode
    except OSError as err:
        return f"unreadable ({err.strerror})"
    for test, label in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return label
    return "a regular file"


@check_keywords
def verify_tree(
    prefix: str | os.PathLike[str],
    *,
    checksums: bool = True,
    progress: bool | None = None,
    num_threads: int = DEFAULT_THREADS,
    storage_options: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> VerifyReport:
    """Check every ``meta.json`` and leaf of the tree at ``prefix``; report every problem.

    Args:
        prefix: the tree's directory, or its URL (``https://``, ``s3://``, any fsspec URL: the
            optional ``memtree[remote]`` extra), read as ``load_memmap`` reads it.
        checksums: compare each leaf's recorded checksum with its file (reads every such
            file once: for a URL, downloads it); ``False`` checks structure and sizes only (no
            leaf data is read).
        progress: a progress bar (:mod:`memtree.store.primitives.progress`) of the bytes hashed, or of the
            leaves checked with ``checksums=False``: ``None`` on a terminal outside CI only,
            ``True``/``False`` forced.
        num_threads: files checked at a time.
        storage_options: URLs only: passed to fsspec (credentials, endpoint...).
        timeout: URLs only: seconds one request may take (default: the remote reader's).

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
    if num_threads < 1:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"num_threads must be >= 1, got {num_threads}")
    prefix = local_path(prefix)  # file:///path is the local path
    remote = is_url(prefix)
    if not remote and (storage_options is not None or timeout is not None):
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"storage_options and timeout are for URLs only, got the path {prefix!r}")
    root = str(prefix).rstrip("/") if remote else os.path.realpath(os.fspath(prefix))
    report = VerifyReport(root)
    walker = _Walker(report, checksums)
    if not remote and not _written_by_memtree(root):  # (torch is imported only for tensordict's)
        from .foreign.tensordict import check_tensordict_dir, is_tensordict_dir

        if is_tensordict_dir(root):  # the reader load_memmap picks for it (store/open.py)
            report.layout = "tensordict"
            with Progress(desc="verify", unit="leaf", progress=progress) as bar:

                def leaf() -> None:
                    walker.tensordict_leaf()
                    bar.update()

                check_tensordict_dir(root, walker.tensordict_problem, leaf)
            return report
    try:
        storage = _open_storage(root, remote, storage_options, timeout)
    except MemtreeError as err:
        walker.add(root, (), _kind(err), str(err))
        return report
    try:
        _verify(storage, walker, progress, num_threads)
    finally:
        storage.close()
    return report


def _written_by_memtree(root: str) -> bool:
    """A hint, never a check: ``root/meta.json`` starts as memtree writes it (the checks are the
    walk's, which opens the file again as the loader does)."""
    try:
        fd = os.open(os.path.join(root, META_NAME), META_FLAGS)  # a FIFO or link: never blocks
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, 19, 0) == b'{"format":"memtree"'
    except OSError:
        return False
    finally:
        os.close(fd)


def _open_storage(root: str, remote: bool, storage_options: dict[str, Any] | None,
                  timeout: float | None) -> Storage:
    if not remote:
        return LocalStorage(root)
    from .urls.fsspec_storage import DEFAULT_TIMEOUT, FsspecStorage

    return FsspecStorage(root, storage_options=storage_options,
                         timeout=DEFAULT_TIMEOUT if timeout is None else timeout)


def _verify(storage: Storage, walker: _Walker, progress: bool | None, num_threads: int) -> None:
    with ThreadPoolExecutor(num_threads) as pool:
        levels = list(walk(storage, pool=pool, on_error=walker.level_problem))
        root = next((lvl.meta for lvl in levels if not lvl.dirs), None)
        if root is not None and root.tree_hash is not None:
            walker.tree_algorithm = root.tree_hash.partition(":")[0]
        if root is not None:
            walker.check_packs(storage, root)
            walker.report.encrypted = root.encryption is not None
            walker.report.sealed = root.sealed is not None
        jobs = walker.jobs(storage, levels)
        leaves = [e for _, e in jobs if isinstance(e, LeafMeta)]
        walker.report.leaves = sum(isinstance(e, LeafMeta) for lvl in levels for e in lvl.meta.entries)
        hashed = [e for e in leaves if walker.checksums and (e.checksum is not None or e.chunks is not None)]
        by_bytes = bool(hashed)
        total = sum(e.nbytes for e in hashed) if by_bytes else len(jobs)
        with Progress(total=total, desc="verify", unit="B" if by_bytes else "leaf", progress=progress) as bar:
            walker.bar = bar if by_bytes else None
            for found in pool.map(lambda job: walker.check(storage, job), jobs):
                walker.report.problems.extend(found)
                if not by_bytes:
                    bar.update()
        walker.bar = None
    walker.check_tree_hash(storage, levels)
    if walker.report.tree_hash not in _META_INTACT:  # meta.json files changed too: no leaf is merely stale
        walker.report.problems = [
            _as_damage(p) if p.kind == "stale" else p
            for p in walker.report.problems
        ]
