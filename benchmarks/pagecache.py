"""The page-cache state of the files a measurement reads: made cold or warm, and checked.

*Cold* (:func:`make_cold`): each file is ``fdatasync``ed (dirty pages cannot be dropped) and
``posix_fadvise(POSIX_FADV_DONTNEED)``ed, then every page of every file is looked up with
``mincore``: a run is cold only when none is left. Pages stay when the file lives on tmpfs
(its pages are the file), when a process still maps them, or when the kernel ignores the
advice; :func:`make_cold` reports what is left and the harness then refuses to call the run cold.
No privileges are needed and other processes' caches are left alone; directory entries and
inodes stay cached. (``/proc/sys/vm/drop_caches`` also drops those, but needs root and evicts
every process's pages; :func:`drop_all` is there for a quiet machine one owns.)

*Warm* (:func:`make_warm`): every file is read once, then checked with ``mincore`` the same way.

Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "f"), "wb") as f:
    ...     _ = f.write(b"x" * 100_000)
    >>> make_warm([d])
    1.0
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Iterable, Iterator

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
DROP_CACHES = "/proc/sys/vm/drop_caches"
_TMPFS = {"tmpfs", "ramfs", "devtmpfs", "shm"}


def iter_files(paths: Iterable[str]) -> Iterator[str]:
    """Every regular file under the given files or directories (links not followed)."""
    for p in paths:
        if os.path.isdir(p) and not os.path.islink(p):
            for root, _, files in os.walk(p):
                for name in files:
                    full = os.path.join(root, name)
                    if os.path.isfile(full) and not os.path.islink(full):
                        yield full
        elif os.path.isfile(p):
            yield p


def resident_pages(paths: Iterable[str]) -> tuple[int, int]:
    """(pages in the page cache, pages in all) of every file under ``paths`` (``mincore``)."""
    page = mmap.PAGESIZE
    resident = total = 0
    for path in iter_files(paths):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)  # private: never written
        finally:
            os.close(fd)
        try:
            npages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * npages)()
            anchor = ctypes.c_char.from_buffer(mm)
            rc = _libc.mincore(ctypes.addressof(anchor), size, vec)
            del anchor  # the mapping cannot close while ctypes holds it
            if rc != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore failed on {path}: {os.strerror(err)}")
            resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
            total += npages
        finally:
            mm.close()
    return resident, total


def is_tmpfs(path: str) -> bool:
    """True when ``path`` lives on a memory file system (its pages cannot be evicted)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mount = parts[1].replace("\\040", " ")
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, fstype = mount, parts[2]
    return fstype in _TMPFS


def make_cold(paths: list[str]) -> int:
    """Evict every file under ``paths`` from the page cache; returns the pages still cached
    (0 for a cold run)."""
    for path in iter_files(paths):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_pages(paths)[0]


def make_warm(paths: list[str]) -> float:
    """Read every file under ``paths`` once; returns the fraction of their pages now cached."""
    buf = bytearray(16 << 20)
    for path in iter_files(paths):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    resident, total = resident_pages(paths)
    return resident / total if total else 1.0


def can_drop_all() -> bool:
    """True when this process may write ``/proc/sys/vm/drop_caches`` (root, writable /proc)."""
    return os.access(DROP_CACHES, os.W_OK)


def drop_all() -> None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``: every process's clean pages, dentries and
    inodes (root only; disturbs every other process of the machine)."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3")
