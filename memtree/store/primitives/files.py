"""Low-level file operations on leaf files: write, preallocate, check, read, map.

The rules every function here follows (see ``../shared/RELIABILITY.md`` §0):

* data is written with ``pwrite`` straight from the tensor's memory (no copy through numpy or
  ``bytes``), never through a mapping, so a full disk raises ``ENOSPC`` instead of SIGBUS; data
  that already lies in another file as it is (a :class:`FileRange`) is copied file to file by
  :func:`copy_range`, without passing through the process's memory;
* a file is checked (regular file, exact size, opened without following symlinks) **before** it
  is mapped, and is mapped through the already-opened descriptor, so that mapping can never
  create or extend a file;
* a published file is never rewritten in place: new content goes to a new inode (see
  :func:`write_file_replace`);
* a checksum, when asked for, is computed in the same pass as the write (each slice is hashed
  right after ``pwrite``, while it is still in the CPU cache), never by reading the file back.

The directory-level primitives of the commit (renames, directory fsync, the writer lock) are
in :mod:`memtree.store.primitives.commit`.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.store.primitives.files import write_file_replace, open_checked, map_fd
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
import gc
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...format.dtypes import itemsize
from ...format.record import Record
from ...format.names import staging_path
from ...errors import (
    DestinationExistsError,
    InsufficientSpaceError,
    LeafSizeError,
    MemtreeError,
    MissingLeafError,
    StorageError,
    UnsafePathError,
)
from .checksums import DIGEST_SLICE, Digest, new_digest
from .faults import point
from .memory import PYBUF_READ, byte_view, is_plain_memory, view_of_memory

if TYPE_CHECKING:  # imported by the functions that handle tensors; opening and checksumming
    import torch  # files need none (``memtree info`` starts without torch)

__all__ = [
    "CHUNK_BYTES",
    "write_fd",
    "pwrite_from",
    "FileRange",
    "copy_range",
    "equal_bytes",
    "allocate_fd",
    "preallocate_fd",
    "new_file",
    "create_leaf",
    "write_file_replace",
    "replacing_file",
    "check_free_space",
    "open_checked",
    "open_leaf",
    "leaf_size_error",
    "shared_file_error",
    "map_fd",
    "read_fd",
    "storage_error",
    "libc_function",
    "RW_FLAGS",
    "regular_files",
    "gc_paused",
]

CHUNK_BYTES = 64 * 1024 * 1024
#: Leaf files at least this large get their blocks in one ``fallocate`` before the data is
#: written: the page-cache writes then skip delayed allocation (W1 in ``benchmarks/``: 1 GiB in
#: 195 leaves 0.80 s preallocated vs 1.37 s not, on ext4). Smaller files gain nothing from the
#: extra system call.
PREALLOCATE_MIN = 1024 * 1024
#: The buffer of :func:`copy_range` where the kernel cannot copy between the files itself (or a
#: checksum needs the bytes): the most memory a file-to-file copy ever holds.
COPY_BUFFER = 8 * 1024 * 1024
#: ``copy_file_range`` errors that mean "not between these files": copy through a buffer instead.
_NO_KERNEL_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = (
    os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
)
#: An existing file written in place (a growth): no link followed, a FIFO never blocks the open.
#: How memtree opens an existing file to write it: never through a link, never blocking on a FIFO.
RW_FLAGS = (
    os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
)
_PROC_FD = os.path.isdir("/proc/self/fd")


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection meanwhile (where it was enabled: it is enabled again after).

    Building a plan of many leaves (a write's, or a load's walk of a tree's structure) allocates
    tens of thousands of objects, none of them garbage, which would trigger collections of the
    whole heap (0.05 to 0.3 s each with torch loaded: more than reading a warm model).

    Example:
        >>> with gc_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def libc_function(name: str, argtypes: list[Any]) -> Any:
    """A C library function that sets ``errno`` (``None`` where the platform lacks it)."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


#: Linux ``fallocate(2)``: unlike ``os.posix_fallocate`` it never falls back to writing zeros
#: into every block where the filesystem cannot preallocate.
_fallocate = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
#: ``memcmp(3)``: compares two buffers at memory speed, with the GIL released.
_memcmp = libc_function("memcmp", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t])


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


def pwrite_from(
    fd: int, address: int, nbytes: int, offset: int = 0, digest: Digest | None = None
) -> None:
    """``pwrite`` ``nbytes`` of memory at ``address`` to ``offset`` of ``fd``: no copy, GIL released.

    The memory must stay valid during the call: pass ``t.data_ptr()`` and ``t.nbytes`` of a
    contiguous CPU tensor ``t`` that the caller holds. With ``digest``, see :func:`write_fd`.

    Example:
        >>> import os, tempfile, torch
        >>> t = torch.arange(3, dtype=torch.int16)
        >>> fd = os.open(os.path.join(tempfile.mkdtemp(), "f"), os.O_RDWR | os.O_CREAT)
        >>> pwrite_from(fd, t.data_ptr(), t.nbytes, 1)
        >>> os.pread(fd, 8, 0)
        b'\\x00\\x00\\x00\\x01\\x00\\x02\\x00'
        >>> os.close(fd)
    """
    if nbytes:
        _pwrite_view(fd, view_of_memory(address, nbytes, PYBUF_READ), offset, digest)


def _pwrite_view(fd: int, view: memoryview, offset: int, digest: Digest | None) -> None:
    step = CHUNK_BYTES if digest is None else DIGEST_SLICE
    done = 0
    total = len(view)
    while done < total:
        part = view[done : done + step]
        n = os.pwrite(fd, part, offset + done)
        if n <= 0:  # pragma: no cover - pwrite on a regular file raises instead
            raise OSError(errno.EIO, "short write")
        if digest is not None:
            digest.update(part[:n])
        done += n


def write_fd(fd: int, tensor: torch.Tensor, offset: int = 0, digest: Digest | None = None) -> None:
    """Write a contiguous CPU tensor's bytes at ``offset`` with ``pwrite`` (GIL released).

    With ``digest``, each slice is hashed right after it is written (one pass over the data).
    A plain tensor's memory is written as it is (:func:`pwrite_from`: about 1 µs of overhead,
    which matters for 20,000 small leaves); other tensors go through
    :func:`~memtree.store.primitives.memory.byte_view`, which also serves subclasses whose ``data_ptr()``
    is no real memory (wrapper subclasses such as
    :class:`~memtree.nn.offloading.OffloadedTensor` produce their data on demand).
    """
    if is_plain_memory(tensor):
        pwrite_from(fd, tensor.data_ptr(), tensor.nbytes, offset, digest)
    else:
        _pwrite_view(fd, byte_view(tensor), offset, digest)


@dataclass(init=False, repr=False, eq=False)  # frozen: a Record (cheaper to define at import)
class FileRange(Record):
    """A leaf's data that lies, byte for byte, in another open file: ``nbytes`` at ``offset``.

    :func:`create_leaf` copies it with :func:`copy_range` instead of writing from memory. The
    descriptor belongs to whoever made the range and must stay open until the copy is done.

    Attributes:
        fd: the source file, open for reading.
        offset: where the data starts in it.
        nbytes: the data's size.
        what: the data and the file, for messages (``"tensor 'w' of /ckpt/model.pt"``).
    """

    fd: int
    offset: int
    nbytes: int
    what: str

    def __init__(self, fd: int, offset: int, nbytes: int, what: str) -> None:
        object.__setattr__(self, "fd", fd)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "what", what)


def copy_range(
    src_fd: int,
    src_offset: int,
    dst_fd: int,
    dst_offset: int,
    nbytes: int,
    digest: Digest | None = None,
) -> None:
    """Copy ``nbytes`` from ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset``.

    In the kernel with ``copy_file_range(2)`` (file to file: no byte passes through this
    process's memory; short copies are continued). Where the kernel cannot copy between these
    two files (``EXDEV``, ``EINVAL``, ``ENOSYS``, ``EOPNOTSUPP``, or no progress), or the
    platform lacks the call, the rest goes through ``pread``/``pwrite`` and one buffer of at most
    :data:`COPY_BUFFER` bytes. With ``digest``, always the buffer: each piece is hashed as it
    is written (one pass over the data, as in :func:`write_fd`).

    Raises:
        EOFError: the source ends before ``src_offset + nbytes`` (the caller names it).
        OSError: a read or write failed.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> src = os.open(os.path.join(d, "a"), os.O_RDWR | os.O_CREAT)
        >>> dst = os.open(os.path.join(d, "b"), os.O_RDWR | os.O_CREAT)
        >>> _ = os.write(src, b"0123456789")
        >>> copy_range(src, 2, dst, 1, 5)
        >>> os.pread(dst, 8, 0)
        b'\\x0023456'
        >>> os.close(src), os.close(dst)
        (None, None)
    """
    done = 0
    kernel_copy = getattr(os, "copy_file_range", None) if digest is None else None
    while kernel_copy is not None and done < nbytes:
        try:
            n = kernel_copy(
                src_fd,
                dst_fd,
                min(nbytes - done, CHUNK_BYTES),
                src_offset + done,
                dst_offset + done,
            )
        except OSError as err:
            if err.errno not in _NO_KERNEL_COPY:
                raise
            break
        if n <= 0:  # the end of the source, or a file the kernel cannot copy: pread tells which
            break
        done += n
    if done == nbytes:
        return
    buf = bytearray(min(nbytes - done, COPY_BUFFER))
    view = memoryview(buf)
    while done < nbytes:
        n = os.preadv(src_fd, [view[: min(len(buf), nbytes - done)]], src_offset + done)
        if n <= 0:
            raise EOFError(f"the file ends at byte {src_offset + done:,}")
        _pwrite_view(dst_fd, view[:n], dst_offset + done, digest)
        done += n


def equal_bytes(
    fd: int, nbytes: int, data: torch.Tensor | FileRange, keep_going: Callable[[], bool] | None = None
) -> bool:
    """Whether the first ``nbytes`` of the open file ``fd`` are exactly the bytes of ``data``.

    ``data`` is a contiguous CPU tensor of ``nbytes`` bytes, or a :class:`FileRange` of them.
    The file is read with ``pread`` through one buffer of at most :data:`COPY_BUFFER` bytes
    (a :class:`FileRange` through a second one) and compared with ``memcmp`` (GIL released);
    ``keep_going`` is asked before each piece, and a False answer stops the comparison (False).

    Returns:
        False as soon as a byte differs, or the file (or the range's file) ends early.

    Example:
        >>> import os, tempfile, torch
        >>> fd = os.open(os.path.join(tempfile.mkdtemp(), "f"), os.O_RDWR | os.O_CREAT)
        >>> _ = os.write(fd, bytes([1, 2, 3]))
        >>> equal_bytes(fd, 3, torch.tensor([1, 2, 3], dtype=torch.uint8)), equal_bytes(fd, 3, torch.zeros(3, dtype=torch.uint8))
        (True, False)
        >>> os.close(fd)
    """
    if nbytes == 0:
        return True
    old = memoryview(bytearray(min(nbytes, COPY_BUFFER)))
    other: memoryview | None = None  # a range's bytes, read into a second buffer
    if isinstance(data, FileRange):
        other = memoryview(bytearray(len(old)))
        new = other
    elif is_plain_memory(data):
        new = view_of_memory(data.data_ptr(), nbytes, PYBUF_READ)
    else:
        new = byte_view(data)  # a subclass (a mapped leaf...): its bytes, without a copy
    done = 0
    while done < nbytes:
        if keep_going is not None and not keep_going():
            return False
        n = min(len(old), nbytes - done)
        if not _read_exactly(fd, old[:n], done):
            return False
        if other is not None:
            assert isinstance(data, FileRange)
            if not _read_exactly(data.fd, other[:n], data.offset + done):
                return False
            if not _same(old[:n], other[:n]):
                return False
        elif not _same(old[:n], new[done : done + n]):
            return False
        done += n
    return True


def _same(a: memoryview, b: memoryview) -> bool:
    """Equal byte views of one length (``memcmp``: ~40 times faster than comparing views)."""
    if _memcmp is None:  # pragma: no cover - non-glibc platforms
        return a == b
    import numpy

    left, right = numpy.frombuffer(a, dtype=numpy.uint8), numpy.frombuffer(b, dtype=numpy.uint8)
    return bool(_memcmp(left.ctypes.data, right.ctypes.data, len(a)) == 0)


def _read_exactly(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``offset`` of ``fd``; False when the file ends first."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            return False
        done += n
    return True


def preallocate_fd(fd: int, nbytes: int) -> None:
    """Allocate the blocks of a new file that is about to be filled, where that is cheap.

    A hint: nothing happens for files under :data:`PREALLOCATE_MIN` bytes or where the
    filesystem cannot preallocate. A full disk or quota raises here, before any data is copied.
    """
    if nbytes < PREALLOCATE_MIN or _fallocate is None:
        return
    if _fallocate(fd, 0, 0, nbytes) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(err, os.strerror(err))


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


def new_file(name: str, *, dir_fd: int | None = None) -> int:
    """Create a file that does not exist yet (``O_EXCL``, no link followed); open for writing.

    The caller closes the returned descriptor.

    Example:
        >>> import os, tempfile
        >>> fd = new_file(os.path.join(tempfile.mkdtemp(), "f"))
        >>> os.write(fd, b"abc"), os.close(fd)
        (3, None)
    """
    return os.open(name, _NEW_FILE, 0o644, dir_fd=dir_fd)


def create_leaf(
    name: str,
    tensor: torch.Tensor | FileRange | None,
    nbytes: int,
    *,
    dir_fd: int | None = None,
    reserve: bool = False,
    fsync: bool = False,
    checksum: str | None = None,
) -> str | None:
    """Create a new leaf file (never an existing one) and fill it.

    Args:
        name: file name (relative to ``dir_fd`` when given).
        tensor: contiguous CPU tensor whose bytes to write; a :class:`FileRange` of ``nbytes``
            bytes to copy file to file (:func:`copy_range`); or ``None`` for a file of zeros
            (sparse unless ``reserve``).
        nbytes: the file's size.
        checksum: one of :data:`~memtree.store.primitives.checksums.CHECKSUMS` to hash the bytes while writing them (needs
            ``tensor``).

    Returns:
        ``"<algorithm>:<hex>"`` of the written bytes when ``checksum`` is set, else None.

    Raises:
        StorageError: a :class:`FileRange`'s file ends before the range does (``EIO``).
    """
    digest = new_digest(checksum) if checksum is not None else None
    if isinstance(tensor, FileRange) and tensor.nbytes != nbytes:
        raise ValueError(f"{tensor.what} has {tensor.nbytes:,} bytes, but the leaf needs {nbytes:,}")
    fd = new_file(name, dir_fd=dir_fd)
    try:
        if tensor is None:
            if digest is not None:
                raise ValueError("a checksum needs the data: create_leaf(tensor=None) writes none")
            allocate_fd(fd, nbytes, reserve=reserve)
        elif isinstance(tensor, FileRange):
            preallocate_fd(fd, nbytes)
            try:
                copy_range(tensor.fd, tensor.offset, fd, 0, nbytes, digest)
            except EOFError as err:
                raise StorageError(
                    errno.EIO,
                    f"{tensor.what} spans bytes {tensor.offset:,}..{tensor.offset + nbytes:,}, but "
                    f"{err}: the file was truncated or replaced while it was read; check it and "
                    "try again",
                ) from None
        else:
            preallocate_fd(fd, nbytes)
            write_fd(fd, tensor, 0, digest)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return f"{checksum}:{digest.hexdigest()}" if digest is not None else None


@contextmanager
def replacing_file(
    path: str, *, existsok: bool, hint: str = "pass existsok=True to replace it", tmp: str | None = None
) -> Iterator[str]:
    """Yield a temporary path next to ``path``; once the block succeeds, commit it in one rename.

    The new file gets a new inode: an existing file is replaced (``existsok``) but never
    truncated in place, so mappings of the old one stay valid; without ``existsok`` the
    destination is refused, and a file that appears meanwhile is never clobbered (``link``).
    On any failure the temporary file is removed and ``path`` is left as it was. A process
    killed meanwhile leaves the temporary file: :func:`memtree.store.writing.staged.staged_file` (this,
    under the destination's writer lock, with the name in its journal) is what lets the next
    write and :func:`memtree.recover` remove it.

    Args:
        tmp: the temporary path (default: a fresh staging name next to ``path``).

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "blob")
        >>> with replacing_file(path, existsok=False) as tmp:
        ...     _ = open(tmp, "wb").write(b"data")
        >>> open(path, "rb").read()
        b'data'
    """
    if not existsok and os.path.lexists(path):
        raise DestinationExistsError(f"{path} already exists; {hint}")
    directory, base = os.path.split(os.path.abspath(path))
    tmp = staging_path(directory, base) if tmp is None else tmp
    try:
        yield tmp
        point("before_publish")
        if existsok:
            os.replace(tmp, path)
            point("after_publish")
        else:
            os.link(tmp, path)
            point("after_publish")  # the temporary name is still a second name of the file
            os.unlink(tmp)
    except FileExistsError:
        _unlink_quiet(tmp)
        raise DestinationExistsError(f"{path} already exists; {hint}") from None
    except MemtreeError:
        _unlink_quiet(tmp)
        raise
    except OSError as err:
        _unlink_quiet(tmp)
        raise storage_error(err, f"writing {path}") from err
    except BaseException:
        _unlink_quiet(tmp)
        raise


def write_file_replace(
    path: str, tensor: torch.Tensor | None, nbytes: int, *, existsok: bool, reserve: bool = False
) -> None:
    """Write one standalone leaf file at ``path`` through :func:`replacing_file`."""
    with replacing_file(path, existsok=existsok) as tmp:
        create_leaf(tmp, tensor, nbytes, reserve=reserve)


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


def leaf_size_error(where: str, size: int, nbytes: int) -> LeafSizeError:
    """The error of a leaf file of ``size`` bytes where its metadata promises ``nbytes``, with
    the likely cause and the fix (the loader raises it; ``memtree verify`` reports it).

    Example:
        >>> str(leaf_size_error("t/x.memmap", 5, 32)).split(":")[0]
        'leaf file t/x.memmap has 5 bytes, expected 32'
    """
    why = (
        "a growth (append_, extend_, resize_) was killed before it committed, and "
        "memtree.recover() on the tree's parent directory cuts the file back; or the file "
        "was changed: then re-save the tree"
        if size > nbytes
        else "the write was interrupted or the file was changed; re-save the tree"
    )
    return LeafSizeError(f"leaf file {where} has {size:,} bytes, expected {nbytes:,}: {why}")


def shared_file_error(where: str, links: int) -> UnsafePathError:
    """The error of a leaf file that is about to be written in place (mapped read-write) but
    has other hard links: every other name, such as another checkpoint of an incremental save,
    would see the writes.

    Example:
        >>> str(shared_file_error("t/w.memmap", 2)).split(";")[0]
        't/w.memmap has 2 hard links: writing it in place would change the bytes every other name shares'
    """
    return UnsafePathError(
        f"{where} has {links} hard links: writing it in place would change the bytes every other "
        "name shares; another tree (e.g. a checkpoint written with link_from, which hard-links "
        "unchanged leaves) would change with it. Load the tree with load_memmap(..., mode='r+'), "
        "which gives each shared leaf its own copy first, map the file with mode='r', or copy it"
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
    return open_leaf(name, nbytes, where, dir_fd=dir_fd, strict_size=strict_size)[0]


def open_leaf(
    name: str,
    nbytes: int,
    where: str,
    *,
    dir_fd: int | None = None,
    strict_size: bool = True,
    writable: bool = False,
) -> tuple[int, os.stat_result]:
    """:func:`open_checked`, also returning the ``fstat`` it checked (the file's identity).

    ``writable=True`` opens the file read-write, for a caller that writes into it in place; that
    caller must check ``st_nlink`` of the returned ``fstat`` (a file with another hard link shares
    its bytes with a name that may lie outside the tree), which is final while the descriptor is
    open: the linker of incremental saves never links a file open for writing
    (:mod:`memtree.store.reading.unshare`).
    """
    try:
        fd = _open_for_writing(name, dir_fd) if writable else os.open(name, _READ_FLAGS, dir_fd=dir_fd)
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
        what = f"opening {where}" + (" read-write (to only read it, load with mode='r')" if writable else "")
        raise storage_error(err, what) from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{where} is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size != nbytes and (strict_size or st.st_size < nbytes):
            raise leaf_size_error(where, st.st_size, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


#: Seconds a read-write open waits for a read lease to be released (the linker of an incremental
#: save releases it at once when a writer comes; the kernel revokes a lease its holder does not
#: release within ``fs.lease-break-time``, 45 s by default).
LEASE_WAIT = 60.0


def _open_for_writing(name: str, dir_fd: int | None) -> int:
    """Open an existing file read-write (:data:`RW_FLAGS`), waiting while a read lease on it is
    being broken: ``O_NONBLOCK`` (which keeps a FIFO from blocking) makes such an open fail with
    ``EWOULDBLOCK`` instead of waiting, after starting the break (:mod:`memtree.store.primitives.lease`)."""
    deadline = time.monotonic() + LEASE_WAIT
    pause = 0.001
    while True:
        try:
            return os.open(name, RW_FLAGS, dir_fd=dir_fd)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


def map_fd(
    fd: int, path: str, nbytes: int, *, writable: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Map the first ``nbytes`` of an open, checked file as a flat tensor of ``dtype``.

    ``nbytes`` is a multiple of the dtype's item size. ``writable=True`` maps shared (writes
    reach the file); ``False`` maps private copy-on-write (the file can never change through
    it). ``dtype`` defaults to ``torch.uint8``.
    """
    import torch

    dtype = torch.uint8 if dtype is None else dtype
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    source = f"/proc/self/fd/{fd}" if _PROC_FD else path
    try:
        return torch.from_file(source, shared=writable, size=nbytes // itemsize(dtype), dtype=dtype)
    except RuntimeError as err:  # torch reopens the file (read-write when shared): find out why
        try:
            os.close(os.open(source, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC))
        except OSError as cause:
            what = f"mapping {path}" + (" read-write (load with mode='r' to map it read-only)" if writable else "")
            raise storage_error(cause, what) from err
        raise StorageError(errno.EIO, f"mapping {path} failed: {err}") from err


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


#: Deepest directory nesting :func:`regular_files` walks (a tree is at most 256 levels deep).
WALK_MAX_DEPTH = 300


def regular_files(top: str | os.PathLike[str]) -> list[os.stat_result]:
    """``lstat`` of every regular file below the directory ``top``, each name once.

    Symbolic links are never followed and the walk stays on ``top``'s filesystem (at most
    :data:`WALK_MAX_DEPTH` levels down); entries that vanish or cannot be read meanwhile are
    skipped. What ``memtree du`` counts: sizes (``st_size``), blocks (``st_blocks``) and hard
    links (``(st_dev, st_ino)``, ``st_nlink``).

    Raises:
        StorageError: ``top`` cannot be read (missing, not a directory, no permission).

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> os.makedirs(d + "/a/b"); open(d + "/a/b/f", "wb").write(b"12345")
        5
        >>> [st.st_size for st in regular_files(d)]
        [5]
    """
    root = os.fspath(top)
    try:
        dev = os.stat(root).st_dev
    except OSError as err:
        raise storage_error(err, f"walking {root}") from err
    out: list[os.stat_result] = []
    todo = [(root, 0)]
    while todo:
        directory, depth = todo.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_dev == dev and depth < WALK_MAX_DEPTH:
                todo.append((e.path, depth + 1))
            elif stat.S_ISREG(st.st_mode):
                out.append(st)
    return out
