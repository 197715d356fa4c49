"""How a lazily opened tree reads each of its leaves (:class:`LeafReader`), as
:class:`~memtree.store.reading.options.ReadOptions` say: opened without following links, checked (a
regular file of exactly its size; with ``verify=True`` its checksum), then mapped, or queued and
read by threads (``mmap=False``, devices), or kept open for
:func:`~memtree.store.reading.read.fill_tree`; an encrypted leaf decrypted, a pickled one unpickled only
when allowed. A leaf mapped read-write (``mode="r+"``) that shares its file with another tree
by a hard link (an incremental save) first gets its own copy (:mod:`memtree.store.reading.unshare`), so
writes into this tree never reach the other one.

:mod:`memtree.store.reading.read` walks the levels (:class:`~memtree.store.reading.read.PendingLevel`) and hands
each leaf entry to the tree's one reader.

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.reading.options import ReadOptions
    >>> from memtree.store.writing.write import write_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> meta = write_tree(d, Level((), {"x": torch.arange(3)})).meta
    >>> fd = os.open(d, os.O_RDONLY)
    >>> LeafReader(ReadOptions()).leaf(fd, d, meta.entries[0], (), ()).tolist()
    [0, 1, 2]
    >>> os.close(fd)
"""

from __future__ import annotations

import fcntl
import os
import pickle
import resource
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ...errors import (
    DecryptionError,
    IntegrityError,
    LeafSizeError,
    MemtreeError,
    MissingLeafError,
    PickleNotAllowedError,
    UnsafePathError,
)
from ...format.chunks import ChunkSums
from ...format.schema import LeafMeta, PickleMeta
from ...format.values import UnloadedPickle
from ..primitives.chunk_check import differing, file_reader, hash_chunks, mismatch_words
from ..primitives.files import FileRange, open_checked, open_leaf, storage_error
from .integrity import changed_after_meta
from .mapped import map_leaf
from .options import ReadOptions
from .storage import META_FLAGS, read_meta

if TYPE_CHECKING:
    from ..primitives.crypto import TreeCipher
    from ..primitives.fill import FillJob
    from .pack_reader import PackReader

__all__ = ["LeafReader", "MAX_PENDING_READS"]

#: Most leaves queued for one threaded read (each holds its file open until then).
MAX_PENDING_READS = 64


class LeafReader:
    """Reads leaves as :class:`~memtree.store.reading.options.ReadOptions` say (device kind decided once)."""

    def __init__(self, options: ReadOptions) -> None:
        self.readonly = options.readonly
        self.mmap = options.mmap
        self.device = options.target
        self.on_cpu = self.device.type == "cpu"
        self.on_meta = self.device.type == "meta"
        self.allow_pickle = options.allow_pickle
        self.verify = options.verify
        self.cipher: TreeCipher | None = None  # an encrypted tree's, set by open_tree
        self.packs: PackReader | None = None  # the tree's packs of small leaves, set by open_tree
        self.pending: list[tuple[FillJob, int]] = []  # leaves to read, and their descriptors
        self.depth = 0  # nested batch() calls
        self.unloads: list[Callable[[], None]] = []  # how to unload each level of the open batch
        #: :func:`~memtree.store.reading.read.open_for_fill`'s open leaves: key path -> (descriptor, entry, path); ``None``:
        #: none kept (a plain load, or too many leaves)
        self.kept: dict[tuple[str, ...], tuple[int, LeafMeta, str]] | None = None
        self.keep_most = 0  # most leaves kept open (a quarter of RLIMIT_NOFILE)
        self.fd_room = FD_ROOM_FROM  # descriptors below this number need no growth of the table

    def leaf(
        self, dir_fd: int, where: str, entry: LeafMeta, parents: tuple[str, ...], dirs: tuple[str, ...]
    ) -> torch.Tensor:
        if self.on_meta:
            if self.kept is not None and entry.chunk_bytes is None:
                self.keep(dir_fd, where, entry, parents)
            return torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        if entry.pack is not None:
            return self.packed_leaf(dir_fd, entry, parents)
        if entry.chunk_bytes is not None:
            return self.sealed_leaf(dir_fd, where, entry, parents, dirs)
        path = os.path.join(where, entry.file)
        mapped = self.mmap and self.on_cpu
        writable = mapped and not self.readonly  # opened read-write before its links are counted
        try:
            fd, st = open_leaf(entry.file, entry.file_nbytes, path, dir_fd=dir_fd, writable=writable)  # maps only nbytes
        except LeafSizeError:
            fd, st = self.open_grown(dir_fd, where, entry, path, writable=writable), None
        check = self.verify and (entry.checksum is not None or entry.chunks is not None)
        if not mapped:  # read, never mapped: into ordinary or device memory
            try:
                tensor = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
            except BaseException:
                os.close(fd)
                raise
            self.queue(fd, dir_fd, tensor, entry, path, parents)
            return tensor
        try:
            if writable:
                if st is None:
                    st = os.fstat(fd)
                if st.st_nlink > 1 and entry.file_nbytes:  # another tree shares it: copy it first
                    from .unshare import own_file

                    shared, fd = fd, -1  # own_file closes it
                    fd, st = own_file(
                        shared, st, entry.file, path, root=_tree_root(where, dirs), dir_fd=dir_fd, dirs=dirs
                    )
            if check:
                self.check_file(fd, entry, path, parents, lambda: changed_after_meta(fd, dir_fd))
            return map_leaf(fd, path, entry.dtype, entry.shape, readonly=self.readonly, st=st)
        except OSError as err:
            if isinstance(err, MemtreeError):
                raise
            raise storage_error(err, f"reading leaf {path}") from err
        finally:
            if fd >= 0:
                os.close(fd)

    def queue(
        self, fd: int, dir_fd: int, dest: torch.Tensor, entry: LeafMeta, path: str, parents: tuple[str, ...]
    ) -> None:
        """Queue reading the open leaf ``fd`` into ``dest`` (cast from ``entry.dtype`` if it
        differs); :meth:`flush` reads and closes ``fd``."""
        checksum: Any = None
        try:
            sums = entry.sums if self.verify else None
            if sums is not None:  # whether the file is newer than its meta.json, known now (dir_fd
                stale = changed_after_meta(fd, dir_fd)  # closes before the read)

                def found_all(found: dict[int, str]) -> None:
                    assert sums is not None
                    self.check(sums, found, entry, path, parents, lambda: stale)

                if entry.chunks is not None:  # checked chunk by chunk as they are read
                    checksum = (entry.chunks, found_all)
                else:
                    checksum = (sums.algorithm, lambda found: found_all({0: found.partition(":")[2]}))
            from ..primitives.fill import FillJob

            cast = entry.dtype if entry.dtype != dest.dtype else None
            job = FillJob(dest, FileRange(fd, entry.offset or 0, entry.nbytes, f"leaf {path}"), cast, checksum)
        except BaseException:
            os.close(fd)
            raise
        self.pending.append((job, fd))
        if self.depth == 0 or len(self.pending) >= MAX_PENDING_READS:
            self.flush()

    def keep(self, dir_fd: int, where: str, entry: LeafMeta, parents: tuple[str, ...]) -> None:
        """Open and check a leaf for :func:`~memtree.store.reading.read.fill_tree`, and keep it open (see :func:`~memtree.store.reading.read.open_for_fill`)."""
        assert self.kept is not None
        if len(self.kept) >= self.keep_most:
            kept, self.kept = self.kept, None  # too many to keep open: keep none
            for fd, _, _ in kept.values():
                os.close(fd)
            return
        if entry.pack is not None:
            assert self.packs is not None
            path = self.packs.path(entry.pack)
            fd = os.dup(self.packs.fd(entry.pack))
        else:
            path = os.path.join(where, entry.file)
            try:
                fd = open_leaf(entry.file, entry.file_nbytes, path, dir_fd=dir_fd)[0]
            except LeafSizeError:
                fd = self.open_grown(dir_fd, where, entry, path)
        self.kept[parents + (entry.key,)] = (fd, entry, path)
        if fd >= self.fd_room:
            self.fd_room = _make_fd_room(fd)

    @contextmanager
    def batch(self, unload: Callable[[], None] | None) -> Iterator[None]:
        """Loading a level (and, when it is the outermost, the levels it loads meanwhile): leaves
        to read are queued and read together, by threads, when the outermost load ends
        (:func:`memtree.store.primitives.fill.fill`). If that fails, no level of the batch stays
        loaded: each level's ``unload`` (:meth:`~memtree.store.reading.read.PendingLevel.unload`)
        is called."""
        outer = self.depth == 0
        self.depth += 1
        if unload is not None:
            self.unloads.append(unload)
        try:
            yield
            if outer:
                self.flush()
        except BaseException:
            if outer:
                self.discard()
                for level_unload in self.unloads:
                    level_unload()
            raise
        finally:
            self.depth -= 1
            if outer:
                self.unloads.clear()

    def flush(self) -> None:
        """Read every queued leaf now (threaded ``preadv``) and close their files."""
        jobs, self.pending = self.pending, []
        if not jobs:
            return
        from ..primitives.fill import fill

        try:
            fill([job for job, _ in jobs])
        finally:
            for _, fd in jobs:
                os.close(fd)

    def discard(self) -> None:
        jobs, self.pending = self.pending, []
        for _, fd in jobs:
            os.close(fd)

    def packed_leaf(self, dir_fd: int, entry: LeafMeta, parents: tuple[str, ...]) -> torch.Tensor:
        """A packed leaf (format version 3): a view of its pack's mapping, or read from its
        range of the pack (:mod:`memtree.store.reading.pack_reader`); its level's ranges were checked."""
        packs = self.packs
        assert packs is not None and entry.pack is not None and entry.offset is not None
        try:
            if not (self.mmap and self.on_cpu):
                tensor = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                self.queue(os.dup(packs.fd(entry.pack)), dir_fd, tensor, entry, packs.path(entry.pack), parents)
                return tensor
            if self.verify and entry.checksum is not None:
                fd = packs.fd(entry.pack, writable=not self.readonly)
                self.check_file(
                    fd, entry, packs.path(entry.pack), parents, lambda: changed_after_meta(fd, dir_fd), entry.offset
                )
            return packs.view(entry, readonly=self.readonly)
        except OSError as err:
            if isinstance(err, MemtreeError):
                raise
            raise storage_error(err, f"reading leaf {parents + (entry.key,)!r} from {packs.path(entry.pack)}") from err

    def sealed_leaf(
        self, dir_fd: int, where: str, entry: LeafMeta, parents: tuple[str, ...], dirs: tuple[str, ...]
    ) -> torch.Tensor:
        """An encrypted leaf, decrypted into memory (:mod:`memtree.store.primitives.crypto`)."""
        path = os.path.join(where, entry.file)
        if self.cipher is None:  # only a damaged tree has an encrypted level below a plain root
            raise DecryptionError(f"leaf {entry.key!r} at {path} is encrypted, but the tree's root is not")
        fd = open_leaf(entry.file, entry.file_nbytes, path, dir_fd=dir_fd)[0]
        try:
            if self.verify and entry.checksum is not None:  # the ciphertext's: checkable without the key
                self.check_file(fd, entry, path, parents, lambda: False)  # never written in place
            tensor = self.cipher.read_leaf(fd, "/".join(dirs + (entry.file,)), entry, path, parents + (entry.key,))
        except OSError as err:
            if isinstance(err, MemtreeError):
                raise
            raise storage_error(err, f"reading leaf {path}") from err
        finally:
            os.close(fd)
        return tensor if self.on_cpu else tensor.to(self.device)

    @staticmethod
    def open_grown(dir_fd: int, where: str, entry: LeafMeta, path: str, *, writable: bool = False) -> int:
        """The leaf's file when the tree grew (``append_``...) after this ``meta.json`` was read.

        The file must then match the level's *current* ``meta.json`` exactly, as the same leaf
        with more rows; the rows the older view covers are unchanged by growth, so the old view
        is mapped. Otherwise the size mismatch is damage: raises ``LeafSizeError``.
        """
        try:
            current = read_meta(dir_fd, where, depth=0, root=False)
        except MemtreeError:
            current = None
        now = next((e for e in current.entries if e.key == entry.key), None) if current else None
        if not (
            isinstance(now, LeafMeta)
            and now != entry
            and (now.file, now.dtype, now.shape[1:]) == (entry.file, entry.dtype, entry.shape[1:])
            and now.file_nbytes > entry.file_nbytes
        ):
            return open_checked(entry.file, entry.file_nbytes, path, dir_fd=dir_fd)  # raises again
        return open_leaf(entry.file, now.file_nbytes, path, dir_fd=dir_fd, writable=writable)[0]

    def check_file(
        self, fd: int, entry: LeafMeta, path: str, parents: tuple[str, ...], stale: Callable[[], bool],
        offset: int = 0,
    ) -> None:
        """Hash the open leaf ``fd`` (its bytes from ``offset``: a packed leaf's in its pack) in its
        recorded chunks and :meth:`check` it."""
        sums = entry.sums
        assert sums is not None
        read = file_reader(fd, path)
        found = hash_chunks(
            lambda at, view: read(offset + at, view), sums, entry.checksum_nbytes, range(sums.count)
        )
        self.check(sums, found, entry, path, parents, stale)

    @staticmethod
    def check(
        recorded: ChunkSums,
        found: dict[int, str],
        entry: LeafMeta,
        path: str,
        parents: tuple[str, ...],
        stale: Callable[[], bool],
    ) -> None:
        """Raise unless ``found`` (hex digests by chunk) are the ``recorded`` checksums."""
        bad = differing(recorded, found)
        if bad:
            key = parents + (entry.key,)
            words = mismatch_words(recorded, found, bad, entry.checksum_nbytes)
            if stale():
                raise IntegrityError(
                    f"leaf {key if len(key) > 1 else key[0]!r} at {path} cannot be verified: its "
                    f"meta.json records checksum {words}, and the "
                    "file was modified after its meta.json (written in place, e.g. through a "
                    "mode='r+' mapping), so the checksum is stale and memtree cannot tell that "
                    "write from damage. Load without verify=True, or re-save the tree to record "
                    "new checksums"
                )
            raise IntegrityError(
                f"leaf {key if len(key) > 1 else key[0]!r} at {path} is damaged: its meta.json "
                f"records checksum {words}. The file changed "
                "after it was written; restore it or re-save the tree (`memtree verify DIR` "
                "lists every damaged leaf)"
            )

    def pickled(self, dir_fd: int, where: str, entry: PickleMeta) -> Any:
        path = os.path.join(where, entry.file)
        if self.on_meta:  # structure only: never open (let alone unpickle) it
            return UnloadedPickle(path)
        if not self.allow_pickle:
            raise PickleNotAllowedError(
                f"non-tensor leaf {entry.key!r} is pickled in {path}; unpickling can run arbitrary "
                "code, so it is loaded only with allow_pickle=True (trusted files only)"
            )
        fd = _open_pickle(dir_fd, path, entry.file)
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                return pickle.load(f)
        finally:
            os.close(fd)


#: A walk that keeps leaves open grows the process's descriptor table in large steps once its
#: descriptors reach this number (see :func:`_make_fd_room`).
FD_ROOM_FROM = 48


def _make_fd_room(fd: int) -> int:
    """Grow the process's descriptor table at once to 16 times ``fd`` (at least 1024, at most
    the soft ``RLIMIT_NOFILE``); returns the descriptor number below which there is room now.

    The kernel doubles the table as descriptors are opened, and each growth waits for an RCU
    grace period: keeping the ~1,300 descriptors of a 924-leaf tree open took 30 to 50 ms in a
    new process (5 growths), one growth to 2048 takes 8 to 14 ms (then nothing: the table never
    shrinks). ``F_DUPFD_CLOEXEC`` takes the lowest free number from the target up, so no
    descriptor of another thread is touched; the copy is closed at once.
    """
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    target = max(1024, 16 * fd)
    if soft != resource.RLIM_INFINITY and soft >= 0:
        target = min(target, soft - 1)
    if target <= fd:
        return 1 << 62  # at the limit: nothing to prepare
    try:
        os.close(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, target))
    except OSError:  # no free number that high: the table grows as usual
        pass
    return target


def _open_pickle(dir_fd: int, path: str, name: str) -> int:
    """Open a pickle file without following links; refuse anything but a regular file."""
    try:
        fd = os.open(name, META_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise MissingLeafError(f"pickled leaf file {path} is missing; the tree is damaged") from None
    except OSError as err:
        raise UnsafePathError(f"cannot open {path} safely: {err}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _tree_root(where: str, dirs: tuple[str, ...]) -> str:
    """The root directory of a tree whose level ``dirs`` (names from the root) lies at ``where``."""
    for _ in dirs:
        where = os.path.dirname(where)
    return where

