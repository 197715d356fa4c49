"""The primitives of a commit (``docs/format.md``, "How a write is committed").

``renameat2`` exchange and no-replace renames, directory ``fsync``, small new files (a
``meta.json``), :class:`WriterLock`: the per-destination writer lock, whose file holds the
journal of a writer that died (``memtree.store.writing.recovery`` replays it), and the two steps every
directory commit takes under that lock: :func:`destination_state` (what may be replaced) and
:func:`publish` (the rename of a complete staging directory onto the destination, and the
removal of the old copy). :func:`memtree.store.writing.staged.staged_commit` runs them in order.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> write_small_file(os.path.join(d, "a"), b"x", fsync=False)
    >>> rename_noreplace(os.path.join(d, "a"), os.path.join(d, "b")), sorted(os.listdir(d))
    (True, ['b'])
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import stat
import threading
import time
from typing import Any

import orjson

from ...errors import DestinationExistsError, LockError, UnsafePathError
from ...format.names import META_NAME, old_path
from ...format.schema import FORMAT
from .faults import point
from .files import RW_FLAGS, libc_function, new_file, storage_error

__all__ = [
    "exchange",
    "rename_noreplace",
    "fsync_dir",
    "make_dirs",
    "write_small_file",
    "WriterLock",
    "lock_holder",
    "JOURNAL_BYTES",
    "LOCK_TIMEOUT",
    "destination_state",
    "publish",
    "wait_for_removals",
]


# -- directories and the commit rename ----------------------------------------------------------
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


_renameat2 = libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)


def _rename2(a: str, b: str, flags: int) -> bool:
    if _renameat2 is None:  # pragma: no cover
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``).

    Returns:
        False when the platform or filesystem does not support the exchange (the caller then
        falls back to two renames); True when the paths were swapped.
    """
    return _rename2(a, b, _RENAME_EXCHANGE)


def rename_noreplace(src: str, dst: str) -> bool:
    """Rename ``src`` to ``dst`` only if ``dst`` does not exist (``RENAME_NOREPLACE``).

    Returns:
        False when the platform or filesystem does not support the flag (the caller falls back
        to a checked ``os.rename``); True when renamed.

    Raises:
        FileExistsError: ``dst`` exists (nothing was renamed).
    """
    return _rename2(src, dst, _RENAME_NOREPLACE)


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str, *, fsync: bool) -> list[str]:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates fsynced into its parent
    (with ``fsync``) before the next one, so that a later commit inside is reachable after a
    power loss.

    Returns:
        The directories it created, outermost first.

    Raises:
        OSError: as ``os.mkdir`` (``FileExistsError`` when ``path`` or a parent is not a directory).

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> [os.path.relpath(p, d) for p in make_dirs(os.path.join(d, "a", "b"), fsync=True)]
        ['a', 'a/b']
    """
    missing = []
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    for new in reversed(missing):
        try:
            os.mkdir(new)
        except FileExistsError:
            if not os.path.isdir(new):
                raise
        if fsync:
            fsync_dir(os.path.dirname(new))
    return missing[::-1]


def write_small_file(path: str, data: bytes, *, fsync: bool) -> None:
    """Create a new small file (e.g. a ``meta.json``) holding ``data``."""
    fd = new_file(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


# -- the writer lock ----------------------------------------------------------------------------
#: Seconds a writer waits for another writer of the same destination before raising LockError.
LOCK_TIMEOUT = 1.0
_LOCK_FLAGS = RW_FLAGS | os.O_CREAT
#: The lock file's journal is padded to this size and written with one ``pwrite``.
JOURNAL_BYTES = 1024


#: The lock files this process holds, and the thread that took each (see :func:`lock_holder`).
_HELD: dict[str, int] = {}


def lock_holder(path: str) -> int | None:
    """The thread of this process (``threading.get_ident()``) holding the :class:`WriterLock` on
    ``path``, or None. Work that the holder does under its lock (loading the levels of a tree it
    is about to replace) must not take the lock again: it would wait for itself.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), ".t.memtree.lock")
        >>> with WriterLock(path, "t", timeout=0):
        ...     lock_holder(path) == threading.get_ident()
        True
        >>> lock_holder(path) is None
        True
    """
    return _HELD.get(path)


class WriterLock:
    """An exclusive ``flock`` on a lock file: one writer at a time per destination.

    The lock file exists only while a writer holds it: :meth:`release` unlinks it before
    unlocking. A waiter that then gets the lock on the unlinked inode notices (the path no longer
    names its inode) and starts over, so two writers can never both hold the lock. The OS drops
    the lock when its holder dies (even by ``kill -9``); a lock file left by a dead writer is
    reused by the next one and removed when that one releases it.

    The file also holds a small *journal* (:meth:`read_journal`/:meth:`write_journal`): the names
    of the staging directory and old copy of the write in progress, so that the next writer can
    clean up after a crash without listing the parent directory.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), ".t.memtree.lock")
        >>> with WriterLock(path, "t", timeout=0) as lock:
        ...     lock.write_journal({"staging": "x"}, fsync=False)
        ...     lock.read_journal()
        {'staging': 'x'}
        >>> os.path.exists(path)
        False
    """

    def __init__(self, path: str, what: str, *, timeout: float) -> None:
        """Prepare a lock on ``path`` (taken by :meth:`acquire` or ``with``).

        Args:
            path: the lock file.
            what: the locked destination, for messages.
            timeout: seconds to keep retrying while another writer holds the lock (0: once).
        """
        self.path = path
        self.what = what
        self.timeout = timeout
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, retrying for ``timeout`` seconds.

        Raises:
            LockError: another writer still holds it after ``timeout`` seconds.
            UnsafePathError: the lock file is not a regular file with a single name (a link, a
                FIFO, a hard link to another file): it is never written.
            StorageError: the lock file cannot be created (permissions, read-only filesystem).
        """
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise LockError(
                        f"another writer is writing {self.what} (it holds {self.path}); wait for "
                        "it to finish and retry. A crashed writer never blocks: the OS releases "
                        "its lock when it dies"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            except OSError as err:
                os.close(fd)
                raise storage_error(err, f"locking {self.path}") from err
            try:
                st = os.stat(self.path, follow_symlinks=False)
                fst = os.fstat(fd)
            except FileNotFoundError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
                self.fd = fd
                _HELD[self.path] = threading.get_ident()
                return
            os.close(fd)  # the previous holder unlinked this inode: start over

    def _open(self) -> int:
        """Open (or create) the lock file: a regular file with no other name, never a link.

        The journal is written into this file, so a name that leads elsewhere (a symbolic link,
        a FIFO, or a hard link sharing its bytes with a file that may lie outside the tree) is
        refused rather than written.
        """
        try:
            fd = os.open(self.path, _LOCK_FLAGS, 0o644)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV):
                raise self._unsafe("a symbolic link, a directory, a socket or a device") from None
            raise storage_error(err, f"creating the lock file {self.path} of {self.what}") from err
        try:
            st = os.fstat(fd)
        except OSError as err:
            os.close(fd)
            raise storage_error(err, f"checking the lock file {self.path}") from err
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            raise self._unsafe(
                f"a {stat.filemode(st.st_mode)} file" if not stat.S_ISREG(st.st_mode)
                else f"a file with {st.st_nlink} hard links (another name shares its bytes)"
            )
        return fd

    def _unsafe(self, what: str) -> UnsafePathError:
        return UnsafePathError(
            f"the lock file {self.path} of {self.what} is {what}; memtree writes its journal into "
            "its lock file, so it refuses to use this one. memtree never makes such a file: "
            "remove it (it holds no data of the tree) and retry"
        )

    def release(self) -> None:
        """Remove the lock file and drop the lock (unlink first, so no one can lock a stale inode)."""
        if self.fd is None:
            return
        _HELD.pop(self.path, None)
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def read_journal(self) -> dict[str, Any]:
        """The journal left by the previous holder (``{}`` when empty or unreadable)."""
        assert self.fd is not None, "read_journal() needs the lock"
        try:
            data = os.pread(self.fd, JOURNAL_BYTES, 0)
            record = json.loads(data.decode("utf-8", "surrogateescape")) if data.strip() else {}
        except (OSError, ValueError, RecursionError):
            return {}
        return record if type(record) is dict else {}

    def write_journal(self, record: dict[str, str], *, fsync: bool) -> None:
        """Replace the journal with ``record`` in one ``pwrite`` (fsynced when asked).

        JSON whose strings are written as the bytes they stand for: a name that is not UTF-8
        (``os.fsdecode``'s lone surrogates) comes back from :meth:`read_journal` unchanged.
        """
        assert self.fd is not None, "write_journal() needs the lock"
        data = json.dumps(record, ensure_ascii=False).encode("utf-8", "surrogateescape")
        if len(data) > JOURNAL_BYTES:
            raise ValueError(f"journal record too large ({len(data)} bytes)")
        os.pwrite(self.fd, data.ljust(JOURNAL_BYTES), 0)
        if fsync:
            os.fsync(self.fd)

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- the commit steps ---------------------------------------------------------------------------
def destination_state(dest: str, existsok: bool) -> str:
    """``"absent"``, ``"empty"`` (an empty directory) or ``"tree"``; raise if it must not be replaced.

    Constant cost: it looks at one entry of the directory and at its ``meta.json``.
    """
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return "absent"
    if not stat.S_ISDIR(st.st_mode):
        raise DestinationExistsError(
            f"{dest} exists and is not a directory; choose another prefix or remove it"
        )
    with os.scandir(dest) as it:
        if next(it, None) is None:
            return "empty"
    if not existsok:
        raise DestinationExistsError(
            f"{dest} already exists; pass existsok=True to replace it, or choose another prefix"
        )
    if _is_memtree_meta(os.path.join(dest, META_NAME)):
        return "tree"
    raise DestinationExistsError(
        f"{dest} exists, is not empty and is not a memtree directory; memtree never replaces "
        "it. Choose another prefix or empty it yourself"
    )


def _is_memtree_meta(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, 4096, 0)
        return b'"format":"memtree"' in head or orjson.loads(head).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False
    finally:
        os.close(fd)


_removals: list[threading.Thread] = []
_removals_lock = threading.Lock()


def _remove_old(path: str, background: bool) -> None:
    """Delete an old tree that no name but its hidden one refers to any more.

    ``background``: in a (non-daemon) thread, which the interpreter waits for at exit; a process
    killed meanwhile leaves the hidden directory to :func:`memtree.recover`.
    """
    if background:
        t = threading.Thread(
            target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True}, name="memtree-remove-old"
        )
        try:
            t.start()
        except RuntimeError:  # no thread to be had: delete it here
            pass
        else:
            with _removals_lock:
                _removals[:] = [r for r in _removals if r.is_alive()]
                _removals.append(t)
            return
    shutil.rmtree(path, ignore_errors=True)


def wait_for_removals(timeout: float | None = None) -> bool:
    """Wait until the old trees that overwrites are deleting in the background are gone.

    An overwrite of a large tree (:data:`BACKGROUND_REMOVAL_FILES`) returns as soon as the new
    tree is published; its old copy, already renamed to a hidden staging name that nothing
    loads, is deleted by a background thread. The interpreter waits for those threads at exit.

    Args:
        timeout: the most seconds to wait (``None``: until done).

    Returns:
        True when no deletion is running any more.

    Example:
        >>> wait_for_removals(timeout=10)
        True
    """
    with _removals_lock:
        pending = list(_removals)
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in pending:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with _removals_lock:
        _removals[:] = [r for r in _removals if r.is_alive()]
        return not _removals


def publish(
    staging: str, dest: str, state: str, fsync: bool, lock: WriterLock, *, background_removal: bool = False
) -> None:
    """Make the complete staging tree the destination, in one atomic step (see format.md).

    ``background_removal``: when an old tree is replaced, delete it in a background thread
    (:func:`wait_for_removals`) instead of before returning.
    """
    parent = os.path.dirname(dest)
    point("before_publish")
    if state == "absent":
        try:
            renamed = rename_noreplace(staging, dest)
        except FileExistsError:
            renamed = False
        if not renamed:
            if os.path.lexists(dest):  # created by someone else (memtree writers hold the lock)
                raise DestinationExistsError(
                    f"{dest} appeared while memtree was writing it; nothing was replaced. "
                    "Choose another prefix or remove it"
                )
            os.rename(staging, dest)  # no RENAME_NOREPLACE on this filesystem
    elif state == "empty":
        os.rename(staging, dest)  # replaces an empty directory, fails (ENOTEMPTY) on any other
    elif exchange(staging, dest):
        point("after_publish")
        if fsync:
            fsync_dir(parent)
        point("before_old_removed")
        _remove_old(staging, background_removal)  # staging now holds the old tree
        return
    else:  # no RENAME_EXCHANGE on this filesystem: two renames, journaled for recovery
        old = old_path(parent, os.path.basename(dest))
        lock.write_journal(
            {"staging": os.path.basename(staging), "old": os.path.basename(old)}, fsync=fsync
        )
        os.rename(dest, old)
        point("between_renames")
        try:
            os.rename(staging, dest)
        except BaseException:
            os.rename(old, dest)
            raise
        point("after_publish")
        if fsync:
            fsync_dir(parent)
        _remove_old(old, background_removal)
        return
    point("after_publish")
    if fsync:
        fsync_dir(parent)
