"""A leaf file shared by hard links gets its own copy before it is written in place.

Incremental saves hard-link the unchanged leaves of a new tree to the previous tree's files
(:mod:`memtree.store.writing.linking`), so one file may hold a leaf of several trees. A write through
any memtree API into one tree must never change another, so memtree writes in place only into a
file with no other hard link:

* before a leaf is mapped read-write (``load_memmap(..., mode="r+")``, the mappings a growth
  makes), it is opened read-write and, if it has another link, :func:`own_file` copies it to a
  new file in the same directory (``copy_file_range``: a clone where the filesystem has
  reflinks; flushed; with the old file's permissions and times) and renames the copy over the
  leaf's name. The bytes are the same, so the checksums in ``meta.json`` stay right; processes
  that map the old file keep it, unchanged; the other trees keep it too;
* a growth writes a new generation of such a file instead (:mod:`memtree.store.writing.grow`);
* every other read-write mapping (``MemoryMappedTensor.from_filename(..., mode="r+")``, a
  tensor sent to another process, tensordict's layout) of a file with another link is refused
  with :class:`~memtree.errors.UnsafePathError` (:func:`~memtree.store.primitives.files.shared_file_error`).

The copy is made under the tree's writer lock, and the leaf is opened again under it: two
processes opening the same tree ``r+`` at once end up mapping the *same* copy (a dataset filled
by both loses no rows). A tree replaced or grown since it was opened is not copied into (its
directory is no longer the tree's): that load raises ``MissingLeafError``, as a lazily loaded
level of a re-saved tree does. A process killed during the copy leaves nothing behind (the copy
is an ``O_TMPFILE`` until it gets a name, ``.memtree-copy-<hex>``, renamed over the leaf at once).

The other order (a file mapped read-write first, then linked into a new tree) is the linker's:
it links only files that no process has open for writing, proven by a read lease
(:mod:`memtree.store.primitives.lease`). Opening the file read-write *before* reading its link count is
what makes the two sides meet: either the linker saw this writer (and wrote its leaf instead),
or its link is already counted here (and the file is copied).

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> tree = os.path.join(d, "t")
    >>> os.mkdir(tree)
    >>> _ = open(os.path.join(tree, "w.memmap"), "wb").write(b"data")
    >>> os.link(os.path.join(tree, "w.memmap"), os.path.join(d, "other"))   # another tree's name
    >>> fd = os.open(os.path.join(tree, "w.memmap"), os.O_RDWR)
    >>> fd, st = own_file(fd, os.fstat(fd), os.path.join(tree, "w.memmap"), "w", root=tree)
    >>> _ = os.pwrite(fd, b"DATA", 0); os.close(fd)
    >>> open(os.path.join(tree, "w.memmap"), "rb").read(), open(os.path.join(d, "other"), "rb").read()
    (b'DATA', b'data')
"""

from __future__ import annotations

import errno
import os
import stat
import threading

from ...errors import LockError, MemtreeError, MissingLeafError
from ...format.names import copy_name, lock_path
from ..primitives.commit import WriterLock, lock_holder
from ..primitives.files import copy_range, open_leaf, preallocate_fd, storage_error
from .storage import open_dir

__all__ = ["LOCK_TIMEOUT", "own_file"]

#: Seconds a process waits for the tree's writer lock before it copies a shared leaf (another
#: process may be copying a large one, or writing the tree).
LOCK_TIMEOUT = 300.0
#: ``O_TMPFILE`` errors that mean "not here": a named file is used instead.
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT)
_PROC_FD = os.path.isdir("/proc/self/fd")


def own_file(
    fd: int,
    st: os.stat_result,
    name: str,
    where: str,
    *,
    root: str,
    dir_fd: int | None = None,
    dirs: tuple[str, ...] | None = None,
) -> tuple[int, os.stat_result]:
    """A read-write descriptor of the leaf ``name``, a file no other name shares.

    Args:
        fd: the leaf, opened read-write (before ``st`` was taken); returned as it is when it has
            a single link, else closed.
        st: ``fstat(fd)``.
        name: the leaf's file name (relative to ``dir_fd`` when given).
        where: the leaf's path, for messages.
        root: the tree's root directory (its writer lock is taken for the copy).
        dir_fd: the leaf's directory.
        dirs: the directory names from ``root`` to ``dir_fd``: the copy is made only while
            they still lead to that very directory (the tree was not replaced meanwhile).

    Returns:
        ``(descriptor, fstat)`` of the leaf's file, opened read-write, with one link.

    Raises:
        MissingLeafError: the tree was replaced or grown since ``dir_fd`` was opened.
        LockError: another writer held the tree's lock for :data:`LOCK_TIMEOUT` seconds, or
            another thread of this process holds it.
        StorageError: the copy failed (a full disk, permissions): the leaf is left as it was.
    """
    if st.st_nlink == 1:
        return fd, st
    os.close(fd)
    parent, base = os.path.split(root)
    path = lock_path(parent, base)
    holder = lock_holder(path)
    if holder == threading.get_ident():  # the writer of this tree, loading levels it is about to replace
        return _own_file_locked(name, where, dir_fd, dirs, root)
    if holder is not None:  # waiting could deadlock: that thread may wait for this load
        raise LockError(
            f"another thread of this process is writing the tree at {root} (it holds {path}), and "
            f"{where}, which shares its bytes with another tree, must be copied before it is mapped "
            "read-write; load the tree again once that write is done, or load it with mode='r'"
        )
    with WriterLock(path, root, timeout=LOCK_TIMEOUT):
        return _own_file_locked(name, where, dir_fd, dirs, root)


def _own_file_locked(
    name: str, where: str, dir_fd: int | None, dirs: tuple[str, ...] | None, root: str
) -> tuple[int, os.stat_result]:
    if dir_fd is not None and dirs is not None and not _still_the_tree(root, dirs, dir_fd):
        raise MissingLeafError(
            f"the tree at {root} was replaced (re-saved or grown) after it was opened, so {where} "
            "is no longer its file; load the tree again"
        )
    fd, st = open_leaf(name, 0, where, dir_fd=dir_fd, strict_size=False, writable=True)
    if st.st_nlink == 1:  # another process copied it meanwhile: share its copy
        return fd, st
    try:
        new = _copy_beside(fd, st, name, dir_fd, where)
    finally:
        os.close(fd)
    try:
        return new, os.fstat(new)
    except BaseException:
        os.close(new)
        raise


def _still_the_tree(root: str, dirs: tuple[str, ...], dir_fd: int) -> bool:
    """Whether ``root`` and then ``dirs`` still lead to the directory ``dir_fd``."""
    try:
        fd = open_dir(root, root, None)
        try:
            for i, name in enumerate(dirs):
                child = open_dir(name, os.path.join(root, *dirs[: i + 1]), fd)
                os.close(fd)
                fd = child
            return os.path.samestat(os.fstat(fd), os.fstat(dir_fd))
        finally:
            os.close(fd)
    except (MemtreeError, OSError):
        return False


def _copy_beside(fd: int, st: os.stat_result, name: str, dir_fd: int | None, where: str) -> int:
    """Copy the open file ``fd`` to a new file and rename it over ``name``; the new file, open
    read-write."""
    if dir_fd is None:  # a path: work relative to its directory (``linkat`` needs a descriptor)
        directory = os.open(os.path.dirname(os.path.abspath(name)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return _copy_beside(fd, st, os.path.basename(name), directory, where)
        finally:
            os.close(directory)
    tmp = copy_name()
    try:
        new, named = _new_file(tmp, dir_fd)
        try:
            preallocate_fd(new, st.st_size)
            copy_range(fd, 0, new, 0, st.st_size)
            os.fchmod(new, stat.S_IMODE(st.st_mode))
            os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))  # unchanged since its meta.json
            os.fsync(new)  # a crash after the rename never leaves the name without the data
            if not named:  # give the O_TMPFILE its name (linkat through /proc/self/fd)
                proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.link(str(new), tmp, src_dir_fd=proc, dst_dir_fd=dir_fd, follow_symlinks=True)
                finally:
                    os.close(proc)
                named = True
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            named = False
        except BaseException:
            os.close(new)
            if named:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except OSError:
                    pass
            raise
    except OSError as err:
        if isinstance(err, MemtreeError):
            raise
        raise storage_error(
            err,
            f"copying {where}, which shares its bytes with another tree by a hard link, before "
            "mapping it read-write (to only read the tree, load it with mode='r': nothing is copied)",
        ) from err
    return new


def _new_file(tmp: str, dir_fd: int) -> tuple[int, bool]:
    """An empty new file in the directory ``dir_fd``, open read-write: an ``O_TMPFILE`` (no name
    yet: False), or, where the filesystem has none, the new file ``tmp`` (True)."""
    if _PROC_FD:
        try:
            return os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd), False
        except OSError as err:
            if err.errno not in _NO_TMPFILE:
                raise
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    return os.open(tmp, flags, 0o600, dir_fd=dir_fd), True
