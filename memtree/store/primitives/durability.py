"""Batched durability: one ``syncfs`` per commit instead of an ``fsync`` per file and directory.

A write with ``fsync=True`` must make everything in its staging directory durable before the
publishing rename, and the rename durable after it (``docs/format.md``, "How a write is committed"). Nothing
in the staging directory is visible to a reader before that rename, so the order in which its
files reach the disk does not matter: only that all of them have when the rename is made.
``syncfs`` (Linux) writes out and waits for every dirty page and every piece of metadata of one
filesystem: the leaves, packs, ``meta.json`` files and directory entries of the staging
directory among them. One call replaces the thousands of ``fsync`` calls (each a journal commit
on ext4 and xfs) of a tree of many files.

It is used only where it is as safe as the per-file calls (:func:`syncfs_refusal`):

* Linux 5.8 or later: before 5.8, ``syncfs`` returned 0 even when writing a page back failed,
  where ``fsync`` reports it; since 5.8 it reports any writeback error of the filesystem
  since the descriptor it is given was opened (:func:`open_batch` opens it before the first
  file is written, so an error while the tree was written is never missed, and an error of
  another process's file in that time fails the write too: never a silent loss);
* a local filesystem whose ``sync_fs`` flushes its journal (:data:`SYNCFS_FILESYSTEMS`:
  ext2/3/4, xfs, btrfs, f2fs, zfs, tmpfs). A network filesystem (NFS, CIFS, FUSE...) may not
  commit data on ``syncfs`` the way its ``fsync`` does; there the per-file ``fsync`` calls are kept.

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> fd = open_batch(d)
    >>> if fd is not None:
    ...     sync_batch(fd, d)
"""

from __future__ import annotations

import ctypes
import os

from .files import libc_function, storage_error
from .lease import LEASE_FILESYSTEMS, filesystem_type

__all__ = ["SYNCFS_FILESYSTEMS", "syncfs_refusal", "open_batch", "sync_batch"]

#: Filesystems (``statfs`` ``f_type``) whose ``syncfs`` makes every file and directory written
#: on them durable, as ``fsync`` of each would: the local ones, each with one inode per file,
#: whose leases memtree trusts too (:data:`~memtree.store.primitives.lease.LEASE_FILESYSTEMS`).
SYNCFS_FILESYSTEMS = LEASE_FILESYSTEMS
#: The first kernel whose ``syncfs`` reports writeback errors (``errseq`` on the superblock).
SYNCFS_ERRORS_SINCE = (5, 8)
_syncfs = libc_function("syncfs", [ctypes.c_int])


def _kernel() -> tuple[int, ...]:
    release = os.uname().release
    parts = []
    for part in release.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def syncfs_refusal(fd: int) -> str | None:
    """Why one ``syncfs`` of the filesystem of ``fd`` would not be as safe as an ``fsync`` of
    each file (see the module docstring), or None when it is.

    Example:
        >>> import os, tempfile
        >>> fd = os.open(tempfile.mkdtemp(), os.O_RDONLY)
        >>> syncfs_refusal(fd) is None or isinstance(syncfs_refusal(fd), str)
        True
        >>> os.close(fd)
    """
    if _syncfs is None or os.uname().sysname != "Linux":
        return "this platform has no syncfs"
    if _kernel() < SYNCFS_ERRORS_SINCE:
        return f"Linux {os.uname().release} does not report writeback errors from syncfs (5.8 does)"
    kind = filesystem_type(fd)
    if kind not in SYNCFS_FILESYSTEMS:
        return f"the filesystem (type {kind if kind is None else hex(kind)}) is not one where syncfs is known to flush every file"
    return None


def open_batch(path: str) -> int | None:
    """A descriptor of the staging directory ``path`` when one :func:`sync_batch` can replace the
    per-file ``fsync`` calls of the write (opened before any file is written: the errors
    ``syncfs`` reports are those since); None where the files must be fsynced one by one."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if syncfs_refusal(fd) is None:
        return fd
    os.close(fd)
    return None


def sync_batch(fd: int, what: str) -> None:
    """Make every file and directory written on ``fd``'s filesystem durable (``syncfs``); the
    caller closes ``fd``.

    Raises:
        StorageError: ``syncfs`` failed: a page of this filesystem could not be written back
            since ``fd`` was opened (the write must not be published).
    """
    assert _syncfs is not None
    if _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise storage_error(OSError(err, os.strerror(err)), f"flushing {what} to disk (syncfs)")
