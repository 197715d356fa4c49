"""Proving that no process has a file open for writing: a read lease (Linux ``F_SETLEASE``).

The linker of incremental saves (:mod:`memtree.store.writing.linking`) may hard-link a leaf file into a
new tree only if nothing can write into it: a file some process maps read-write (a tree loaded
with ``mode="r+"``, a module bound to it, a DataLoader worker) would change both trees. The
kernel answers exactly that question, for every process of the machine, without any marker on
disk and whatever happened to the writers since (a ``kill -9`` ends their mappings):

* a read lease is granted only while no process, this one included, has the file open for
  writing, and a read-write shared mapping keeps its file open for writing as long as it lives
  (in a forked child too), even after the descriptor it was made from is closed;
* once granted, a process that opens the file for writing *breaks* it, and
  :meth:`Lease.intact` (``F_GETLEASE``) answers False from then on.

So a check, a link and then :meth:`Lease.intact` prove that no writer existed when the link
was made; a writer that opens the file after that sees the second link (memtree's writers open
the file read-write *before* they look at its link count, :mod:`memtree.store.reading.unshare`).

No lease is taken (:func:`lease_refusal` says why, and :func:`read_lease` yields None) where
its answer would not cover every writer: a filesystem other than the local ones in
:data:`LEASE_FILESYSTEMS` (a network filesystem has writers on other machines; overlayfs maps
the underlying file, whose writers its own inode does not count), a platform without leases, a
file of another owner without ``CAP_LEASE``, or leases disabled (``fs.leases-enable``).

A breaking writer waits (at most ``fs.lease-break-time`` seconds) until the lease is released,
and the holder is told by a signal: ``SIGIO`` by default, which would terminate this process.
Each lease here is taken with ``SIGURG`` as its signal (ignored by default) and its owner is
cleared right after it is granted, so no signal is sent; a process that handles ``SIGURG``
itself takes no lease.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "f")
    >>> _ = open(path, "wb").write(b"data")
    >>> fd = os.open(path, os.O_RDONLY)
    >>> with read_lease(fd) as lease:
    ...     lease is None or lease.intact()
    True
    >>> os.close(fd)
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from .files import libc_function

__all__ = ["LEASE_FILESYSTEMS", "Lease", "lease_refusal", "read_lease"]

#: Filesystems whose leases see every writer (``statfs`` ``f_type``: local, one inode per file).
LEASE_FILESYSTEMS = {
    0xEF53: "ext2/ext3/ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0xF2F52010: "f2fs",
    0x2FC12FC1: "zfs",
}
# Linux fcntl commands (Python names them only on some versions).
_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", 1025)
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)
_F_SETOWN = getattr(fcntl, "F_SETOWN", 8)
_fstatfs = libc_function("fstatfs", [ctypes.c_int, ctypes.c_void_p])


def filesystem_type(fd: int) -> int | None:
    """``statfs``'s ``f_type`` of the filesystem holding ``fd`` (None where unknown)."""
    if _fstatfs is None:  # pragma: no cover - non-glibc platforms
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) comes first
    if _fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def lease_refusal(fd: int) -> str | None:
    """Why a read lease cannot prove that the files of ``fd``'s filesystem have no writer (None: it can).

    Example:
        >>> import tempfile
        >>> fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
        >>> lease_refusal(fd) is None or "filesystem" in lease_refusal(fd)
        True
        >>> os.close(fd)
    """
    if not hasattr(fcntl, "fcntl") or os.uname().sysname != "Linux":  # pragma: no cover
        return "this platform has no file leases (Linux F_SETLEASE)"
    kind = filesystem_type(fd)
    if kind not in LEASE_FILESYSTEMS:
        return (
            f"its filesystem (statfs type {'unknown' if kind is None else hex(kind)}) is not one of "
            f"the local filesystems whose leases see every writer ({', '.join(LEASE_FILESYSTEMS.values())})"
        )
    if signal.getsignal(signal.SIGURG) not in (signal.SIG_DFL, signal.SIG_IGN):
        return "this process handles SIGURG, the signal a file lease would be taken with"
    try:
        with open("/proc/sys/fs/leases-enable", "rb") as f:
            if f.read().strip() == b"0":
                return "file leases are disabled on this machine (sysctl fs.leases-enable = 0)"
    except OSError:
        pass
    return None


class Lease:
    """A read lease held on a descriptor (see :func:`read_lease`)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def intact(self) -> bool:
        """True while no process has opened the file for writing since the lease was granted."""
        try:
            return fcntl.fcntl(self.fd, _F_GETLEASE) == fcntl.F_RDLCK
        except OSError:
            return False


@contextmanager
def read_lease(fd: int) -> Iterator[Lease | None]:
    """Hold a read lease on ``fd`` (a regular file opened read-only) while the block runs.

    Yields None, taking nothing, when the lease is refused: a process has the file open for
    writing (or maps it read-write), or leases are not available (:func:`lease_refusal`; the
    caller checks that first for a clear reason). Keep the block short: a process opening the
    file for writing waits for its end.
    """
    try:
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError:  # EAGAIN: a writer; EACCES: another owner; EINVAL: no leases here
        yield None
        return
    try:
        fcntl.fcntl(fd, _F_SETOWN, 0)  # no owner: a lease break signals nobody
        yield Lease(fd)
    finally:
        try:
            fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        except OSError:  # broken and removed meanwhile: nothing to release
            pass
