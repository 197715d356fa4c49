"""Low-level file operations on leaf files: write, preallocate, check, read, map.

The rules every function here follows (see ``../shared/RELIABILITY.md`` §0):

* data is written with ``pwrite`` straight from the tensor's memory (no copy through numpy or
  ``bytes``), never through a mapping, so a full disk raises ``ENOSPC`` instead of SIGBUS;
* a file is checked (regular file, exact size, opened without following symlinks) **before** it
  is mapped, and is mapped through the already-opened descriptor, so that mapping can never
  create or extend a file;
* a published file is never rewritten in place: new content goes to a new inode (see
  :func:`write_file_replace`).

Example:
    >>> import os, tempfile, torch
    >>> from memtree.fileio import write_file_replace, open_checked, map_fd
    >>> path = os.path.join(tempfile.mkdtemp(), "x.memmap")
    >>> write_file_replace(path, torch.arange(4, dtype=torch.int32), 16, existsok=False)
    >>> fd = open_checked(path, 16, "x")
    >>> map_fd(fd, path, 16, writable=False).view(torch.int32).tolist()
    [0, 1, 2, 3]
    >>> os.close(fd)
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import uuid
from typing import Any

import torch

from .errors import (
    DestinationExistsError,
    InsufficientSpaceError,
    LeafSizeError,
    MissingLeafError,
    StorageError,
    UnsafePathError,
)

__all__ = [
    "CHUNK_BYTES",
    "byte_view",
    "write_fd",
    "allocate_fd",
    "create_leaf",
    "write_file_replace",
    "check_free_space",
    "open_checked",
    "map_fd",
    "read_fd",
    "storage_error",
    "exchange",
    "fsync_dir",
    "write_small_file",
]

CHUNK_BYTES = 64 * 1024 * 1024
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = (
    os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
)
_PROC_FD = os.path.isdir("/proc/self/fd")


def storage_error(err: OSError, what: str) -> StorageError:
    """Wrap an ``OSError`` into a :class:`StorageError` that keeps its errno and names ``what``."""
    hint = {
        errno.ENOSPC: "the filesystem is full; free space or choose another prefix",
        errno.EFBIG: "the file is larger than this filesystem or process allows",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EACCES: "permission denied; check the directory's permissions",
        errno.EPERM: "operation not permitted; check the directory's permissions",
        errno.EROFS: "the filesystem is read-only",
    }.get(err.errno or 0, "see the OS error above")
    out = StorageError(err.errno or 0, f"{what}: {err.strerror or err} ({hint})")
    out.filename = err.filename
    return out


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte ``memoryview`` of a contiguous CPU tensor, without copying."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_fd(fd: int, tensor: torch.Tensor, offset: int = 0) -> None:
    """Write a contiguous CPU tensor's bytes at ``offset`` with ``pwrite`` (GIL released)."""
    view = byte_view(tensor)
    done = 0
    total = len(view)
    while done < total:
        n = os.pwrite(fd, view[done : done + CHUNK_BYTES], offset + done)
        if n <= 0:  # pragma: no cover - pwrite on a regular file raises instead
            raise OSError(errno.EIO, "short write")
        done += n


def allocate_fd(fd: int, nbytes: int, *, reserve: bool) -> None:
    """Give a new file its size: sparse (``ftruncate``) or with blocks reserved."""
    if reserve and nbytes:
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.ftruncate(fd, nbytes)


def create_leaf(
    name: str,
    tensor: torch.Tensor | None,
    nbytes: int,
    *,
    dir_fd: int | None = None,
    reserve: bool = False,
    fsync: bool = False,
) -> None:
    """Create a new leaf file (never an existing one) and fill it.

    Args:
        name: file name (relative to ``dir_fd`` when given).
        tensor: contiguous CPU tensor whose bytes to write, or ``None`` for a file of zeros
            (sparse unless ``reserve``).
        nbytes: the file's size.
    """
    fd = os.open(name, _NEW_FILE, 0o644, dir_fd=dir_fd)
    try:
        if tensor is None:
            allocate_fd(fd, nbytes, reserve=reserve)
        else:
            write_fd(fd, tensor)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_file_replace(
    path: str, tensor: torch.Tensor | None, nbytes: int, *, existsok: bool, reserve: bool = False
) -> None:
    """Write one standalone leaf file at ``path`` through a temporary file and a rename.

    An existing file is replaced by a new inode (never truncated in place, so mappings of the
    old file stay valid) when ``existsok``, and refused otherwise.
    """
    if not existsok and os.path.lexists(path):
        raise DestinationExistsError(
            f"{path} already exists; pass existsok=True to replace it, or choose another filename"
        )
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.memtree-tmp-{uuid.uuid4().hex}")
    try:
        create_leaf(tmp, tensor, nbytes, reserve=reserve)
        if existsok:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if path appeared meanwhile: never clobber
            os.unlink(tmp)
    except FileExistsError:
        _unlink_quiet(tmp)
        raise DestinationExistsError(f"{path} already exists; pass existsok=True to replace it")
    except OSError as err:
        _unlink_quiet(tmp)
        raise storage_error(err, f"writing {path}") from err
    except BaseException:
        _unlink_quiet(tmp)
        raise


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_free_space(directory: str, nbytes: int, what: str) -> None:
    """Refuse up front when ``directory``'s filesystem cannot hold ``nbytes`` more bytes.

    Raises:
        InsufficientSpaceError: not enough free space (a sparse file that cannot be backed
            would kill the process with SIGBUS on a later write through its mapping).
    """
    free = shutil.disk_usage(directory).free
    if nbytes > free:
        raise InsufficientSpaceError(
            errno.ENOSPC,
            f"{what} needs {nbytes:,} bytes but the filesystem of {directory} has {free:,} free; "
            "free space, pick another prefix, or shrink the tree",
        )


def open_checked(
    name: str, nbytes: int, where: str, *, dir_fd: int | None = None, strict_size: bool = True
) -> int:
    """Open an existing leaf read-only and check it before anyone maps it.

    Args:
        name: file name (relative to ``dir_fd`` when given).
        nbytes: the size the metadata promises.
        where: the leaf's path for messages.
        strict_size: when False, a longer file is accepted (tensordict's padded leaves).

    Returns:
        An open descriptor of a regular file of the right size (the caller closes it).

    Raises:
        MissingLeafError, UnsafePathError (symlink, FIFO, directory...), LeafSizeError.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise MissingLeafError(
            f"leaf file {where} is missing (expected {nbytes:,} bytes); the tree is damaged: "
            "re-save it, or load the other keys with keys=[...]"
        ) from None
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.EMLINK):
            raise UnsafePathError(
                f"{where} is a symbolic link; memtree does not follow links inside a tree"
            ) from None
        if err.errno == errno.EISDIR:
            raise UnsafePathError(f"{where} is a directory, expected a leaf file") from None
        if err.errno in (errno.ENXIO, errno.ENODEV):
            raise UnsafePathError(f"{where} is a socket or device, not a regular leaf file") from None
        raise storage_error(err, f"opening {where}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{where} is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size != nbytes and (strict_size or st.st_size < nbytes):
            raise LeafSizeError(
                f"leaf file {where} has {st.st_size:,} bytes, expected {nbytes:,}: the write was "
                "interrupted or the file was changed; re-save the tree"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_fd(fd: int, path: str, nbytes: int, *, writable: bool) -> torch.Tensor:
    """Map the first ``nbytes`` of an open, checked file as a flat ``uint8`` tensor.

    ``writable=True`` maps shared (writes reach the file); ``False`` maps private
    copy-on-write (the file can never change through it).
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    source = f"/proc/self/fd/{fd}" if _PROC_FD else path
    return torch.from_file(source, shared=writable, size=nbytes, dtype=torch.uint8)


def read_fd(fd: int, out: torch.Tensor) -> None:
    """Fill a contiguous CPU tensor from the start of ``fd`` with large reads."""
    view = byte_view(out)
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done : done + CHUNK_BYTES]], done)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of file after {done} of {total} bytes")
        done += n


# -- directories and the commit rename ----------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_renameat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``).

    Returns:
        False when the platform or filesystem does not support the exchange (the caller then
        falls back to two renames); True when the paths were swapped.
    """
    if _renameat2 is None:  # pragma: no cover
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small_file(path: str, data: bytes, *, fsync: bool) -> None:
    """Create a new small file (e.g. a ``meta.json``) holding ``data``."""
    fd = os.open(path, _NEW_FILE, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
