"""Incremental saves: hard-link the unchanged leaves of a write from a previous committed tree.

:func:`memtree.store.writing.write.write_tree` with ``WriteOptions(link_from=old)`` asks a
:class:`LinkSource` for each tensor leaf. The trust model (``docs/format.md``, "Incremental
saves"):

* the old tree is read like any tree: every ``meta.json`` validated, sub-directories opened
  relative to the root's descriptor (held for the whole write) without following links, so a
  symlink or a renamed directory can never lead a link outside the old tree;
* a leaf is a candidate only if its key path exists there with the same dtype and shape, no
  capacity, and a recorded checksum of the write's algorithm equal to the new bytes' checksum
  (per-chunk checksums: every chunk's, in the old leaf's chunks; a quick filter: equal
  checksums do not prove equal bytes);
* the old file is opened without following links and must be a regular file of the exact size,
  with fewer than :data:`MAX_LINKS` links, and **no process may have it open for writing**
  (a tree loaded with ``mode="r+"`` maps its leaves read-write): a read lease proves it
  (:mod:`memtree.store.primitives.lease`), held until the link is made, and the link is undone if a writer
  opened the file meanwhile. Where leases cannot prove it (a network filesystem, overlayfs, a
  file of another owner...), nothing is linked;
* the decision is made on the **bytes**: the old file is read and compared with the new data,
  so two different contents that share a checksum (crc32, crc32c and xxh3 collisions can be made
  on purpose) are never linked, nor is a file damaged or written in place since its checksum
  was recorded. Only ``verify=False`` with ``sha256`` checksums trusts the recorded checksum
  instead of reading the old file (for a file not modified after its ``meta.json``): a
  non-cryptographic checksum is never trusted alone;
* the link is made by name relative to the held directory, then the new name is checked to be
  the very file that was checked (device and inode): a file swapped in between is unlinked again;
* anything that fails (another filesystem, permissions, ``EMLINK``, the old tree removed
  meanwhile) makes the writer write the leaf instead.

A file linked this way is never written in place afterwards through memtree: a writer that
opens it read-write sees the second link and gives its tree its own copy first
(:mod:`memtree.store.reading.unshare`).

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> d = tempfile.mkdtemp()
    >>> from memtree.store.reading.options import WriteOptions
    >>> _ = write_tree(d + "/old", Level((), {"w": torch.ones(2)}), WriteOptions.of(checksum="crc32"))
    >>> with LinkSource.open(d + "/old", "crc32", d, True) as links:
    ...     links.candidate(("w",), torch.ones(2)) is not None
    True
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ...errors import MemtreeError
from ...format.chunks import ChunkSums
from ...format.names import META_NAME
from ...format.schema import ChildMeta, LeafMeta, LevelMeta
from ..primitives.files import FileRange, _unlink_quiet, equal_bytes, open_leaf
from ..primitives.lease import Lease, lease_refusal, read_lease
from ..reading.options import ReadOptions
from ..reading.read import open_dir, open_tree, walk_levels
from .packing import PackJob

__all__ = ["MAX_LINKS", "TRUSTED_CHECKSUMS", "LinkSource", "WriteStats", "check_link_source"]

#: A file with this many hard links already is written, not linked again (ext4 allows 65,000;
#: leaving room keeps other tools working on it).
MAX_LINKS = 60_000
#: Checksums that no one can match on purpose with other bytes: only these are trusted in place
#: of the bytes (``verify=False``).
TRUSTED_CHECKSUMS = frozenset({"sha256"})


@dataclass
class WriteStats:
    """What a :func:`write_tree` did, for callers that measure it (pass ``stats=WriteStats()``).

    Attributes:
        files_written: leaf files written (data copied).
        bytes_written: their bytes.
        files_linked: leaf files hard-linked from ``link_from`` instead.
        bytes_linked: their bytes (no data written).
        link_fallbacks: leaves whose checksum matched ``link_from`` but that were written
            anyway: the old file failed a check (size, bytes, link count, open for writing by
            some process) or the link failed.
        link_error: why ``link_from`` could not be used at all (unreadable, another
            filesystem...), else None: every leaf is then written.

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.reading.options import WriteOptions
        >>> from memtree.store.writing.write import write_tree
        >>> d = tempfile.mkdtemp()
        >>> _ = write_tree(d + "/1", Level((), {"w": torch.ones(4)}))
        >>> stats = WriteStats()
        >>> _ = write_tree(d + "/2", Level((), {"w": torch.ones(4)}), WriteOptions.of(link_from=d + "/1"), stats=stats)
        >>> stats.files_linked, stats.bytes_linked, stats.files_written
        (1, 16, 0)
    """

    files_written: int = 0
    bytes_written: int = 0
    files_linked: int = 0
    bytes_linked: int = 0
    link_fallbacks: int = 0
    link_error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, nbytes: int, *, linked: bool, fallback: bool = False) -> None:
        """Count one leaf file (thread-safe)."""
        with self._lock:
            if linked:
                self.files_linked += 1
                self.bytes_linked += nbytes
            else:
                self.files_written += 1
                self.bytes_written += nbytes
            self.link_fallbacks += fallback


def check_link_source(link_from: str) -> None:
    """Check that ``link_from`` (a public ``memmap(..., link_from=...)``) is a committed tree.

    A :class:`LinkSource` that cannot be read links nothing and the write goes on (a
    checkpoint's previous step may be deleted while a save runs); a path given by the caller
    that names no tree is a mistake to report, not an incremental save to skip silently.

    Raises:
        NotAMemtreeError, NotCommittedError, MetaFormatError: ``link_from`` does not exist, is not
            a memtree directory, is the staging directory of an unfinished write, or its root
            ``meta.json`` is damaged; the message starts with ``link_from=``.

    Example:
        >>> check_link_source("/nonexistent/step1")
        Traceback (most recent call last):
        ...
        memtree.errors.NotAMemtreeError: link_from='/nonexistent/step1' is not a committed tree to link from: ...
    """
    import torch

    try:
        open_tree(link_from, ReadOptions(device=torch.device("meta")))
    except MemtreeError as err:
        raise type(err)(
            f"link_from={link_from!r} is not a committed tree to link from: {err}. Pass the "
            "directory of a tree written before (the previous checkpoint), or link_from=None"
        ) from None


@dataclass(frozen=True)
class _Old:
    dirs: tuple[str, ...]
    meta: LeafMeta
    meta_mtime_ns: int


class LinkSource:
    """The leaves of a committed tree that a write may hard-link (see the module docstring)."""

    def __init__(self, root: str, root_fd: int, algorithm: str, verify: bool) -> None:
        self.root = root
        self.root_fd = root_fd
        self.algorithm = algorithm
        #: Trust the recorded checksum instead of comparing bytes (``verify=False``, sha256 only).
        self.trust_checksums = not verify and algorithm in TRUSTED_CHECKSUMS
        self.leaves: dict[tuple[str, ...], _Old] = {}
        #: packed leaves (format version 3) by key path, their packs' sizes, leaves per pack
        self.packed: dict[tuple[str, ...], LeafMeta] = {}
        self.packs: dict[str, int] = {}
        self.pack_members: dict[str, int] = {}
        self.root_mtime_ns = 0  # of the root meta.json, written after every pack
        self.error: str | None = None

    @classmethod
    @contextmanager
    def open(
        cls, link_from: str | None, algorithm: str | None, staging: str, verify: bool
    ) -> Iterator[LinkSource | None]:
        """The link source of a write into ``staging`` (``None`` without ``link_from``).

        A ``link_from`` that cannot be read as a tree, lies on another filesystem than
        ``staging``, or on a filesystem where no lease can prove that its files have no writer
        (:func:`~memtree.store.primitives.lease.lease_refusal`), gives a source with no leaves and its
        reason in :attr:`error`: nothing is linked, everything is written.
        """
        if link_from is None or algorithm is None:
            yield None
            return
        try:
            fd = open_dir(link_from, link_from, None)
        except MemtreeError as err:
            source = cls(link_from, -1, algorithm, verify)
            source.error = str(err)
            yield source
            return
        source = cls(link_from, fd, algorithm, verify)
        try:
            refusal = lease_refusal(fd)
            if os.fstat(fd).st_dev != os.stat(staging).st_dev:
                source.error = f"{link_from} is on another filesystem than the destination"
            elif refusal is not None:
                source.error = (
                    f"memtree cannot prove that no process writes into the files of {link_from} "
                    f"(a tree loaded with mode='r+' maps them read-write): {refusal}"
                )
            else:
                source._index()
            yield source
        finally:
            os.close(fd)

    def _index(self) -> None:
        keys: dict[tuple[str, ...], tuple[str, ...]] = {(): ()}  # dirs -> key path

        def visit(dirs: tuple[str, ...], where: str, dir_fd: int, meta: LevelMeta) -> None:
            path = keys[dirs]
            mtime = os.stat(META_NAME, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
            if not dirs:
                self.packs = {p.file: p.nbytes for p in meta.packs}
                self.root_mtime_ns = mtime
            for e in meta.entries:
                if isinstance(e, ChildMeta):
                    keys[dirs + (e.dir,)] = path + (e.key,)
                elif isinstance(e, LeafMeta) and e.pack is not None:  # (a packed leaf is one chunk)
                    self.pack_members[e.pack] = self.pack_members.get(e.pack, 0) + 1
                    if e.checksum is not None and e.checksum.partition(":")[0] == self.algorithm:
                        self.packed[path + (e.key,)] = e
                elif isinstance(e, LeafMeta) and e.capacity is None:
                    sums = e.sums
                    if sums is not None and sums.algorithm == self.algorithm:
                        self.leaves[path + (e.key,)] = _Old(dirs, e, mtime)

        try:
            walk_levels(self.root_fd, self.root, visit)
        except (MemtreeError, OSError) as err:
            self.leaves.clear()
            self.packed.clear()
            self.error = f"{self.root} cannot be read as a tree: {err}"

    def candidate(self, key: tuple[str, ...], tensor: torch.Tensor) -> LeafMeta | None:
        """The old leaf at ``key`` if it could be linked for ``tensor`` (same dtype and shape)."""
        old = self.leaves.get(key)
        if old is None or old.meta.dtype != tensor.dtype or old.meta.shape != tuple(tensor.shape):
            return None
        return old.meta

    def link(
        self,
        key: tuple[str, ...],
        checksum: ChunkSums,
        target: str,
        data: torch.Tensor | FileRange,
        *,
        fsync: bool = False,
    ) -> bool | None:
        """Hard-link the old leaf at ``key`` to the new path ``target`` if it holds ``data``.

        ``checksum`` is the checksum of ``data`` (a contiguous CPU tensor, or a
        :class:`~memtree.store.primitives.files.FileRange` of its bytes) in the old leaf's chunks
        (one chunk for a leaf that records one ``checksum``): the recorded ones must equal it
        before anything is opened. ``fsync``: also flush the old file's data (the old
        tree may have been written without ``fsync``; the new one promises durability).

        Returns:
            True when linked; None when the recorded checksum differs (the leaf changed);
            False when it matched but the old file failed a check (its bytes, its size, its
            links, a writer) or the link failed.
        """
        old = self.leaves[key]
        if old.meta.sums != checksum:
            return None
        return self._link_file(old, target, data, fsync)

    def link_pack(
        self,
        job: PackJob,
        sums: dict[tuple[str, ...], str],
        target: str,
        data: torch.Tensor,
        *,
        fsync: bool = False,
    ) -> bool | None:
        """Hard-link the old tree's pack to ``target`` if it is this pack, byte for byte.

        A candidate is an old pack that holds exactly the members of ``job`` (the same key
        paths, and no other leaf), each at the same offset, of the same size and with a recorded
        checksum equal to the new one in ``sums``, and has the new pack's size; the file is then
        checked as :meth:`link` checks a leaf's (its bytes compared with ``data``, the pack's
        bytes; no writer; the link verified).

        Returns:
            True when linked; None when no old pack matches (a leaf changed, moved or went);
            False when one matched but the file failed a check or the link failed.
        """
        name = None
        for m in job.members:
            old = self.packed.get(m.key)
            if old is None or old.offset != m.offset or old.nbytes != m.nbytes or old.checksum != sums.get(m.key):
                return None
            if name is None:
                name = old.pack
            elif old.pack != name:
                return None
        if name is None or self.packs.get(name) != job.nbytes or self.pack_members.get(name) != len(job.members):
            return None
        whole = _Old((), LeafMeta(name, name, "uint8", (job.nbytes,)), self.root_mtime_ns)  # the pack as one file
        return self._link_file(whole, target, data, fsync)

    def _link_file(self, old: _Old, target: str, data: torch.Tensor | FileRange, fsync: bool) -> bool:
        """Link the old file of ``old`` to ``target`` if it holds ``data`` and no process writes
        it (see the module docstring)."""
        name = old.meta.file
        where = os.path.join(self.root, *old.dirs, name)
        dir_fd = self.root_fd
        opened: list[int] = []
        try:
            for dir_name in old.dirs:
                dir_fd = open_dir(dir_name, where, dir_fd)
                opened.append(dir_fd)
            fd, st = open_leaf(name, old.meta.file_nbytes, where, dir_fd=dir_fd)
        except (MemtreeError, OSError):
            for held in opened:
                os.close(held)
            return False
        try:
            if st.st_nlink >= MAX_LINKS:
                return False
            with read_lease(fd) as lease:  # no writer now, and none until the link is made
                if lease is None or not self._holds(fd, st, old, data, lease):
                    return False
                try:
                    os.link(name, target, src_dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    return False
                try:
                    made = os.lstat(target)
                except OSError:
                    made = None
                if made is None or (made.st_dev, made.st_ino) != (st.st_dev, st.st_ino) or not lease.intact():
                    _unlink_quiet(target)  # another file swapped in, or a writer opened it meanwhile
                    return False
            if fsync:
                os.fsync(fd)  # an error here fails the write, as a failed fsync of a written leaf does
            return True
        finally:
            os.close(fd)
            for held in opened:
                os.close(held)

    def _holds(self, fd: int, st: os.stat_result, old: _Old, data: torch.Tensor | FileRange, lease: Lease) -> bool:
        """The old file holds ``data``: its bytes are compared (stopping if a writer opens it),
        or, trusting a sha256 checksum (``verify=False``), it was not modified after its
        ``meta.json``."""
        if self.trust_checksums:
            return st.st_mtime_ns <= old.meta_mtime_ns
        try:
            return equal_bytes(fd, old.meta.nbytes, data, lease.intact)
        except OSError:
            return False
