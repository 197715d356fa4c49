"""The local cache of remote trees (``load_memmap(url, cache_dir=...)``): entries and downloads.

An **entry** ``<cache_dir>/<entry>/`` is an ordinary committed memtree: the selected levels of
one remote save, their leaves, and their ``meta.json`` files (each leaf records a checksum).
``<entry>`` is the first 32 hex digits of the SHA-256 of the URL, the root ``meta.json`` bytes
(which hold the save's random ``save_id``) and the ``keys=`` selection (:func:`entry_name`).

A **download** (:class:`Download`) builds the entry in a scratch directory
``<cache_dir>/.<entry>.memtree-download-<32 hex>/`` with the entry's final layout, and commits
it with one ``rename`` (never replacing an entry: a concurrent download of the same save that
committed first wins, and this one's scratch is dropped). The scratch directory is held by an
exclusive ``flock`` on its sibling ``<scratch>.lock`` (:class:`~memtree.store.primitives.files.WriterLock`),
taken before the directory exists and dropped after it is renamed away. A process killed
mid-download (even by ``kill -9``) loses its lock; the next download into the same cache
directory and :func:`memtree.recover` on it then remove the scratch directory and its lock
file (:func:`remove_stale_downloads`), and never touch those of a live download.

Example:
    >>> import os, tempfile
    >>> cache = tempfile.mkdtemp()
    >>> with Download(cache, "e" * 32, fsync=False) as d:
    ...     d.write_file("meta.json", b"{}")
    ...     _ = d.commit()
    >>> os.listdir(cache)
    ['eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee']
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
from typing import Any

import orjson

from ...errors import LockError, MemtreeError
from ...format.names import META_NAME, SCRATCH_MARK, scratch_path
from ..primitives import faults
from ..primitives.files import create_leaf, storage_error
from ..primitives.commit import WriterLock, fsync_dir, rename_noreplace, write_small_file
from ..reading.storage import split_rel

__all__ = ["entry_name", "find_entry", "Download", "remove_stale_downloads", "SCRATCH"]

#: A download's scratch directory ``.<entry>.memtree-download-<32 hex>`` or its lock file.
SCRATCH = re.compile(r"(?P<scratch>\..+" + re.escape(SCRATCH_MARK) + r"[0-9a-f]{32})(?P<lock>\.lock)?", re.S)
_WRITE_FLAGS = os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def entry_name(url: str, root_bytes: bytes, selection: Any) -> str:
    """The entry of one save of ``url`` (its root ``meta.json`` bytes) and one selection.

    Example:
        >>> len(entry_name("s3://b/t", b"{}", None))
        32
    """
    h = hashlib.sha256()
    for part in (url.rstrip("/").encode(), root_bytes, orjson.dumps(selection, option=orjson.OPT_SORT_KEYS)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:32]


def find_entry(cache_dir: str, url: str, root_bytes: bytes, selection: Any) -> str | None:
    """A committed entry that holds the selection (the whole tree's serves any selection)."""
    parent = os.path.realpath(cache_dir)
    for sel in [None] if selection is None else [None, selection]:
        d = os.path.join(parent, entry_name(url, root_bytes, sel))
        if os.path.isfile(os.path.join(d, META_NAME)):
            return d
    return None


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_stale_downloads(cache_dir: str | os.PathLike[str]) -> list[str]:
    """Delete the scratch directories (and lock files) of downloads whose process died.

    A scratch directory is deleted only while holding its lock, so a live download (which holds
    it from before its directory exists until after it is renamed away) is never touched.

    Returns:
        One line per thing removed.

    Example:
        >>> import tempfile
        >>> remove_stale_downloads(tempfile.mkdtemp())
        []
    """
    parent = os.fspath(cache_dir)
    try:
        names = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    actions = []
    for scratch in sorted({m.group("scratch") for m in map(SCRATCH.fullmatch, names) if m is not None}):
        path = os.path.join(parent, scratch)
        lock = WriterLock(path + ".lock", path, timeout=0)
        try:
            lock.acquire()
        except (LockError, OSError):  # a live download holds it (or it cannot be taken): leave it
            continue
        try:
            if _is_real_dir(path):
                shutil.rmtree(path, ignore_errors=True)
                actions.append(f"removed the scratch directory of a killed download: {path}")
            else:
                actions.append(f"removed the stale lock file of a killed download: {lock.path}")
        finally:
            lock.release()
    return actions


class Download:
    """A cache entry being built in a locked scratch directory (see the module docstring).

    Use as a context manager: entering removes stale downloads of ``cache_dir`` and creates the
    scratch directory under its lock; :meth:`commit` renames it to the entry; leaving removes
    whatever was not committed and drops the lock.

    Args:
        cache_dir: the cache directory (created if missing).
        name: the entry's name (:func:`entry_name`).
        fsync: fsync every file and directory before the commit, and the cache directory after.
    """

    def __init__(self, cache_dir: str | os.PathLike[str], name: str, *, fsync: bool) -> None:
        self.parent = os.path.realpath(os.fspath(cache_dir))
        self.dest = os.path.join(self.parent, name)
        self.fsync = fsync
        self.scratch = ""
        self.lock: WriterLock | None = None

    def __enter__(self) -> Download:
        try:
            os.makedirs(self.parent, exist_ok=True)
            remove_stale_downloads(self.parent)
            self.scratch = scratch_path(self.parent, os.path.basename(self.dest))
            # a unique name: only a cleaner that found the lock file before it was locked can
            # hold it, and only for a moment
            self.lock = WriterLock(self.scratch + ".lock", self.dest, timeout=1.0)
            self.lock.acquire()
            os.mkdir(self.scratch)
        except OSError as err:
            self.__exit__()
            if isinstance(err, MemtreeError):
                raise
            raise storage_error(err, f"creating a download directory in {self.parent}") from err
        return self

    def __exit__(self, *exc: object) -> None:
        if self.scratch and _is_real_dir(self.scratch):
            shutil.rmtree(self.scratch, ignore_errors=True)
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def path(self, rel: str) -> str:
        """The scratch path of the entry's file or directory ``rel``."""
        return os.path.join(self.scratch, *split_rel(rel))

    def make_dir(self, rel: str) -> None:
        """Create the entry's sub-directory ``rel``."""
        os.mkdir(self.path(rel))

    def create_file(self, rel: str, nbytes: int) -> None:
        """Create the leaf file ``rel`` with ``nbytes`` bytes reserved on disk (a full disk fails
        here, before any byte is downloaded)."""
        create_leaf(self.path(rel), None, nbytes, reserve=True)

    def write(self, rel: str, offset: int, data: memoryview) -> None:
        """``pwrite`` ``data`` into the leaf file ``rel`` at ``offset``."""
        fd = os.open(self.path(rel), _WRITE_FLAGS)
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
        finally:
            os.close(fd)

    def open_read(self, rel: str) -> int:
        """A read-only descriptor of the entry's file ``rel`` (the caller closes it)."""
        return os.open(self.path(rel), os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))

    def write_file(self, rel: str, data: bytes) -> None:
        """Create a small file (a ``meta.json``, a pickle) of the entry."""
        write_small_file(self.path(rel), data, fsync=self.fsync)

    def commit(self) -> str:
        """Rename the scratch directory to the entry, unless another download committed it
        first (then that entry is kept and this one is dropped on exit). Returns the entry."""
        if self.fsync:
            for dirpath, _, files in os.walk(self.scratch, topdown=False):
                for name in files:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                fsync_dir(dirpath)
        faults.point("before_publish")
        try:
            if not rename_noreplace(self.scratch, self.dest):
                if os.path.lexists(self.dest):
                    raise FileExistsError(errno.EEXIST, "exists", self.dest)
                os.rename(self.scratch, self.dest)
        except FileExistsError:
            if not os.path.isfile(os.path.join(self.dest, META_NAME)):
                raise storage_error(
                    OSError(errno.EEXIST, "something that is not a cache entry is in the way"),
                    f"committing the cache entry {self.dest}",
                ) from None
            return self.dest  # another download of the same save committed first
        except OSError as err:
            raise storage_error(err, f"committing the cache entry {self.dest}") from err
        self.scratch = ""
        if self.fsync:
            fsync_dir(self.parent)
        return self.dest
