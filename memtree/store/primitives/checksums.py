"""Leaf checksums: the algorithms a ``meta.json`` may record, and computing them.

``"<algorithm>:<hex digest>"`` of a leaf's bytes, one of :data:`CHECKSUMS`; a write records
:func:`default_checksum` (the fastest installed) unless told otherwise, and for a leaf larger
than one chunk the checksum of each chunk (:class:`ChunkDigest`, :func:`view_sums`,
:func:`file_sums`; the format's side is :mod:`memtree.format.chunks`). :func:`crc32` is zlib's
CRC-32, computed by ISA-L where the optional ``isal`` package is installed. The optional
algorithms' packages are imported on first use (:func:`available_checksums`). Every algorithm
releases the GIL while it hashes a large buffer, so threads hash in parallel.

Example:
    >>> import torch
    >>> tensor_checksum(torch.arange(3, dtype=torch.uint8), "crc32")
    'crc32:0854897f'
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import InvalidArgumentError
from ...format.chunks import ChunkSums
from .memory import byte_view

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHECKSUMS",
    "DIGEST_SLICE",
    "Digest",
    "available_checksums",
    "default_checksum",
    "check_checksum_option",
    "new_digest",
    "digest_factory",
    "ChunkDigest",
    "view_sums",
    "file_sums",
    "tensor_checksum",
    "file_checksum",
    "crc32",
    "COMBINABLE",
    "crc_combine",
    "crc_shifter",
]

#: Slice size when a checksum is computed during a write: small enough to stay in the CPU cache
#: between ``pwrite`` and the hash, large enough that the extra syscalls cost nothing.
DIGEST_SLICE = 4 * 1024 * 1024
#: Checksum algorithms a leaf may record in ``meta.json`` (``"<algorithm>:<hex digest>"``):
#: ``xxh3`` (xxh3_64 of the ``xxhash`` package) and ``crc32c`` (the ``crc32c`` package) are
#: optional extras (``pip install memtree[fast-checksums]``); ``crc32`` and ``sha256`` come with
#: Python. ``sha256`` also detects deliberate changes, given a trusted ``meta.json``.
CHECKSUMS = ("xxh3", "crc32c", "crc32", "sha256")
#: The algorithms ``checksum="auto"`` (the default of a write) picks from, fastest first.
_AUTO_ORDER = ("xxh3", "crc32c", "crc32")


class Digest(Protocol):
    """What :func:`~memtree.store.primitives.files.write_fd` needs from a running checksum (``hashlib``
    objects qualify)."""

    def update(self, data: Any, /) -> None:
        """Add bytes to the checksum."""

    def hexdigest(self) -> str:
        """The checksum so far, as lowercase hex digits."""


_CRC32: Callable[[Any, int], int] | None = None  # the implementation, found on first use


def _fastest_crc32() -> Callable[[Any, int], int]:
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:
        return zlib.crc32
    fast: Callable[[Any, int], int] = isal_crc32
    return fast


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 (the polynomial of zip, gzip and PNG) of the bytes of ``data``, continued
    from ``value``, as ``zlib.crc32`` computes it.

    Where the optional ``isal`` package is installed (``pip install memtree[fast-checksums]``)
    it computes it (ISA-L's folded CRC-32: 14 GB/s on one core of this project's test machine,
    zlib 1.2.13's 4.2 GB/s); both release the GIL for large buffers, so reader threads check
    what they read in parallel.

    Example:
        >>> import zlib
        >>> crc32(b"world", crc32(b"hello ")) == zlib.crc32(b"hello world")
        True
    """
    global _CRC32
    if _CRC32 is None:
        _CRC32 = _fastest_crc32()
    return _CRC32(data, value)


class _Crc32:
    """:func:`crc32` with the ``hashlib`` interface (8 lowercase hex digits)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = crc32(data, self.value)  # releases the GIL for large buffers

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _digest_factories() -> dict[str, Any]:
    out: dict[str, Any] = {"crc32": _Crc32, "sha256": hashlib.sha256}
    try:
        import xxhash

        out["xxh3"] = xxhash.xxh3_64  # releases the GIL for large buffers
    except ImportError:
        pass
    try:
        import crc32c

        out["crc32c"] = crc32c.CRC32CHash  # 8 hex digits, releases the GIL
    except ImportError:
        pass
    return out


_FACTORIES: dict[str, Any]  # found on first use (importing xxhash and crc32c takes time)


def _factories() -> dict[str, Any]:
    """The digest factories by algorithm (tests replace ``_FACTORIES`` to hide one)."""
    global _FACTORIES
    try:
        return _FACTORIES
    except NameError:
        _FACTORIES = _digest_factories()
        return _FACTORIES


def __getattr__(name: str) -> Any:
    if name == "_FACTORIES":
        return _factories()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def available_checksums() -> tuple[str, ...]:
    """The checksum algorithms this installation can compute, fastest first.

    Example:
        >>> "crc32" in available_checksums() and "sha256" in available_checksums()
        True
    """
    return tuple(a for a in CHECKSUMS if a in _factories())


def default_checksum() -> str:
    """The algorithm a write records when ``checksum=`` is not given: the fastest installed
    (``xxh3``, else ``crc32c``, else ``crc32``).

    Example:
        >>> default_checksum() in ("xxh3", "crc32c", "crc32")
        True
    """
    return next(a for a in _AUTO_ORDER if a in _factories())


def check_checksum_option(checksum: str | None) -> None:
    """Refuse a ``checksum=`` value other than ``None`` or an installed one of :data:`CHECKSUMS`."""
    if checksum is not None and checksum not in CHECKSUMS:
        raise InvalidArgumentError(
            f"checksum must be None or one of {list(CHECKSUMS)}, got {checksum!r:.40}"
        )
    if checksum is not None and checksum not in _factories():
        raise InvalidArgumentError(
            f"checksum={checksum!r} needs the {'xxhash' if checksum == 'xxh3' else checksum} "
            "package: pip install 'memtree[fast-checksums]', or pick one of "
            f"{list(available_checksums())}"
        )


def new_digest(algorithm: str) -> Digest:
    """A running checksum for ``algorithm`` (one of :func:`available_checksums`)."""
    return digest_factory(algorithm)()


def digest_factory(algorithm: str) -> Callable[[], Digest]:
    """What makes a running checksum for ``algorithm``, checked once (for a loop over leaves).

    Raises:
        InvalidArgumentError: ``algorithm`` is not one of :func:`available_checksums`.
    """
    check_checksum_option(algorithm)
    factory: Callable[[], Digest] = _factories()[algorithm]
    return factory


class ChunkDigest:
    """A running checksum of every ``chunk_bytes`` of a stream of bytes, fed in pieces of any
    size (the :class:`Digest` interface, so :func:`~memtree.store.primitives.files.write_fd` and
    :func:`~memtree.store.primitives.files.copy_range` hash with it as they write).

    ``chunk_bytes=None`` makes one chunk of everything. :meth:`sums` gives the result.

    Example:
        >>> d = ChunkDigest("crc32", 2)
        >>> d.update(b"abc"); d.update(b"d")
        >>> d.sums() == view_sums(memoryview(b"abcd"), "crc32", 2)
        True
    """

    def __init__(self, algorithm: str, chunk_bytes: int | None) -> None:
        self.algorithm = algorithm
        self.factory = digest_factory(algorithm)
        self.chunk_bytes = chunk_bytes
        self.current = self.factory()
        self.filled = 0  # bytes in the current chunk
        self.total = 0
        self.digests: list[str] = []  # of the finished chunks

    def update(self, data: Any) -> None:
        """Add bytes (any buffer of bytes)."""
        view = data if isinstance(data, memoryview) else memoryview(data)
        self.total += len(view)
        size = self.chunk_bytes
        if size is None:
            self.current.update(view)
            return
        while len(view):
            part = view[: size - self.filled]
            self.current.update(part)
            self.filled += len(part)
            view = view[len(part) :]
            if self.filled == size:
                self.digests.append(self.current.hexdigest())
                self.current, self.filled = self.factory(), 0

    def hexdigest(self) -> str:
        """Every chunk's digest so far, concatenated (the last chunk's as it stands)."""
        return "".join(self.digests) + (self.current.hexdigest() if self.filled or not self.digests else "")

    def sums(self) -> ChunkSums:
        """The checksums of the chunks of all the bytes added (an empty stream is one empty chunk)."""
        return ChunkSums(self.algorithm, self.chunk_bytes or max(self.total, 1), self.hexdigest())


def view_sums(view: memoryview, algorithm: str, chunk_bytes: int | None) -> ChunkSums:
    """The checksums of the ``chunk_bytes`` chunks of a buffer of bytes (``None``: one chunk).

    Example:
        >>> view_sums(memoryview(bytes(range(3))), "crc32", None).digest(0)
        'crc32:0854897f'
    """
    digest = ChunkDigest(algorithm, chunk_bytes)
    for start in range(0, len(view), DIGEST_SLICE):
        digest.update(view[start : start + DIGEST_SLICE])
    return digest.sums()


def file_sums(
    fd: int, nbytes: int, algorithm: str, chunk_bytes: int | None, offset: int = 0, buffer: int | None = None
) -> ChunkSums:
    """The checksums of the chunks of ``nbytes`` of an open file from ``offset``, read with
    ``pread`` through one buffer of ``buffer`` bytes (default :data:`DIGEST_SLICE`).

    Raises:
        OSError: the file ends first (``EIO``), or a read fails.
    """
    digest = ChunkDigest(algorithm, chunk_bytes)
    _hash_file(fd, nbytes, offset, buffer, digest)
    return digest.sums()


def tensor_checksum(tensor: torch.Tensor, algorithm: str) -> str:
    """``"<algorithm>:<hex>"`` of a contiguous CPU tensor's bytes."""
    digest = new_digest(algorithm)
    view = byte_view(tensor)
    for start in range(0, len(view), DIGEST_SLICE):
        digest.update(view[start : start + DIGEST_SLICE])
    return f"{algorithm}:{digest.hexdigest()}"


def file_checksum(
    fd: int, nbytes: int, algorithm: str, offset: int = 0, buffer: int | None = None
) -> str:
    """``"<algorithm>:<hex>"`` of ``nbytes`` of an open file from ``offset``, read with ``pread``
    through one buffer of ``buffer`` bytes (default :data:`DIGEST_SLICE`)."""
    digest = new_digest(algorithm)
    _hash_file(fd, nbytes, offset, buffer, digest)
    return f"{algorithm}:{digest.hexdigest()}"


def _hash_file(fd: int, nbytes: int, offset: int, buffer: int | None, digest: Digest) -> None:
    buf = bytearray(min(nbytes, buffer or DIGEST_SLICE))
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[: min(len(buf), nbytes - done)]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of file after {done} of {nbytes} bytes")
        digest.update(view[:n])
        done += n


# ---------------------------------------------------------------------------------------------
# combining CRCs: the CRC of a + b from the CRCs of a and b (zlib's crc32_combine, any polynomial)

#: The reflected polynomials of the checksums whose values combine: the CRC of ``a + b`` is
#: ``shift(crc(a), len(b)) ^ crc(b)``, ``shift`` linear over GF(2), so pieces of a file checked
#: by different processes make the file's checksum without reading it again.
_POLYNOMIALS = {"crc32": 0xEDB88320, "crc32c": 0x82F63B78}
#: The checksum algorithms :func:`crc_combine` combines.
COMBINABLE = tuple(_POLYNOMIALS)


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=len(_POLYNOMIALS))
def _zeros_operators(poly: int) -> list[list[int]]:
    """``ops[k]``: the GF(2) operator (32 columns) that appends ``2**k`` zero bytes to a CRC."""
    op = [poly] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # 8 bits: one byte
        op = [_gf2_times(op, op[n]) for n in range(32)]
    ops = [op]
    for _ in range(63):
        op = [_gf2_times(op, op[n]) for n in range(32)]
        ops.append(op)
    return ops


def crc_combine(algorithm: str, crc1: int, crc2: int, len2: int) -> int:
    """The CRC of ``a + b`` from ``crc1`` (of ``a``), ``crc2`` (of ``b``) and ``len(b)``, for an
    algorithm of :data:`COMBINABLE`.

    Example:
        >>> import zlib
        >>> crc_combine("crc32", zlib.crc32(b"hello "), zlib.crc32(b"world"), 5) == zlib.crc32(b"hello world")
        True
    """
    zeros = _zeros_operators(_POLYNOMIALS[algorithm])
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(zeros[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


@functools.lru_cache(maxsize=64)
def crc_shifter(algorithm: str, nbytes: int) -> Callable[[int], int]:
    """``shift``, such that ``crc(a + b) == shift(crc(a)) ^ crc(b)`` for every ``b`` of ``nbytes``:
    four table lookups per call (built once per length: combining many pieces of one length,
    such as a file's chunks or a column shard's rows, costs a few microseconds each).

    Example:
        >>> import zlib
        >>> shift = crc_shifter("crc32", 5)
        >>> shift(zlib.crc32(b"hello ")) ^ zlib.crc32(b"world") == zlib.crc32(b"hello world")
        True
    """
    zeros = _zeros_operators(_POLYNOMIALS[algorithm])
    columns = [1 << j for j in range(32)]
    k, n = 0, nbytes
    while n:
        if n & 1:
            columns = [_gf2_times(zeros[k], c) for c in columns]
        n >>= 1
        k += 1
    tables = []
    for b in range(4):
        table = [0] * 256
        for byte in range(1, 256):
            low = (byte & -byte).bit_length() - 1
            table[byte] = table[byte & (byte - 1)] ^ columns[8 * b + low]
        tables.append(table)
    t0, t1, t2, t3 = tables

    def shift(crc: int) -> int:
        return t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]

    return shift
