"""Leaf checksums: the algorithms a ``meta.json`` may record, and computing them.

``"<algorithm>:<hex digest>"`` of a leaf's bytes, one of :data:`CHECKSUMS`; a write records
:func:`default_checksum` (the fastest installed) unless told otherwise. :func:`crc32` is zlib's
CRC-32, computed by ISA-L where the optional ``isal`` package is installed. The optional
algorithms' packages are imported on first use (:func:`available_checksums`).

Example:
    >>> import torch
    >>> tensor_checksum(torch.arange(3, dtype=torch.uint8), "crc32")
    'crc32:0854897f'
"""

from __future__ import annotations

import errno
import hashlib
import os
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import InvalidArgumentError
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
    "tensor_checksum",
    "file_checksum",
    "crc32",
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
    check_checksum_option(algorithm)
    digest: Digest = _factories()[algorithm]()
    return digest


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
    buf = bytearray(min(nbytes, buffer or DIGEST_SLICE))
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[: min(len(buf), nbytes - done)]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"unexpected end of file after {done} of {nbytes} bytes")
        digest.update(view[:n])
        done += n
    return f"{algorithm}:{digest.hexdigest()}"
