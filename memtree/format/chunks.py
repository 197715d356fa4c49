"""Per-chunk checksums of a leaf (format version 3): verify a byte range without reading the rest.

A leaf's file is cut into chunks of ``chunk_bytes`` (the last one shorter); ``chunks`` records
the checksum of each, in the algorithm of the leaf's own ``checksum``, so that a reader of part of
the leaf (a rank reading its shard) checks the chunks its ranges touch and nothing else
(``docs/format.md``, "Version 3"). Pure: no I/O.

Example:
    >>> chunk_bytes_for(3 << 20), chunk_bytes_for(4 << 30)
    (1048576, 4194304)
    >>> chunk_span_of(ChunkSums(1 << 20, ("0" * 8,) * 3), 3 << 20, 1_500_000, 10)
    (1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .record import Record

__all__ = ["MIN_CHUNK_BYTES", "MAX_CHUNKS", "ChunkSums", "chunk_bytes_for", "chunk_count", "chunk_span_of",
           "chunks_to_json", "chunks_from_json"]

#: Smallest chunk memtree writes (a verified range reads at most one chunk more at each end).
MIN_CHUNK_BYTES = 1 << 20
#: Chunks a leaf has at most: larger leaves get larger chunks (a power of two).
MAX_CHUNKS = 1024
#: Bounds a reader accepts for ``chunks.bytes``.
_READ_MIN, _READ_MAX = 4096, 1 << 40


@dataclass(init=False, repr=False, eq=False)
class ChunkSums(Record):
    """The checksums of a leaf's chunks: ``sums[i]`` covers bytes ``[i * nbytes, (i+1) * nbytes)``.

    Attributes:
        nbytes: bytes per chunk (the last chunk is shorter).
        sums: hex digests, in the algorithm of the leaf's ``checksum``.
    """

    nbytes: int
    sums: tuple[str, ...]

    def __init__(self, nbytes: int, sums: tuple[str, ...]) -> None:
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "sums", tuple(sums))


def chunk_bytes_for(nbytes: int) -> int:
    """The chunk size memtree writes for a leaf of ``nbytes``: at least :data:`MIN_CHUNK_BYTES`,
    a power of two, and at most :data:`MAX_CHUNKS` chunks."""
    size = MIN_CHUNK_BYTES
    while size * MAX_CHUNKS < nbytes:
        size *= 2
    return size


def chunk_count(nbytes: int, chunk: int) -> int:
    """How many chunks of ``chunk`` bytes a leaf of ``nbytes`` has (an empty leaf has one)."""
    return max(1, -(-nbytes // chunk))


def chunk_span_of(chunks: ChunkSums, nbytes: int, offset: int, length: int) -> tuple[int, int]:
    """The chunks ``[first, last]`` that the range ``[offset, offset + length)`` of a leaf of
    ``nbytes`` touches (``length > 0``)."""
    last = min(chunk_count(nbytes, chunks.nbytes) - 1, (offset + length - 1) // chunks.nbytes)
    return offset // chunks.nbytes, last


def chunks_to_json(chunks: ChunkSums) -> dict[str, Any]:
    """The ``chunks`` field of a leaf in ``meta.json``.

    Example:
        >>> chunks_to_json(ChunkSums(4096, ("00000001", "00000002")))
        {'bytes': 4096, 'sums': ['00000001', '00000002']}
    """
    return {"bytes": chunks.nbytes, "sums": list(chunks.sums)}


def chunks_from_json(raw: Any, nbytes: int, digits: int) -> ChunkSums:
    """Parse the ``chunks`` field of a leaf of ``nbytes`` whose checksum has ``digits`` hex digits.

    Raises:
        ValueError: what is wrong with it.

    Example:
        >>> chunks_from_json({"bytes": 4096, "sums": ["00000001", "00000002"]}, 5000, 8).nbytes
        4096
    """
    if type(raw) is not dict or raw.keys() != {"bytes", "sums"}:
        raise ValueError(f"must be an object with 'bytes' and 'sums', got {raw!r:.80}")
    size, sums = raw["bytes"], raw["sums"]
    if type(size) is not int or not _READ_MIN <= size <= _READ_MAX:
        raise ValueError(f"bytes must be an int in [{_READ_MIN}, 2**40], got {size!r:.40}")
    want = chunk_count(nbytes, size)
    if type(sums) is not list or len(sums) != want:
        raise ValueError(f"sums must list {want} checksums (one per chunk of the leaf), got {str(sums):.80}")
    for s in sums:
        if type(s) is not str or len(s) != digits or s.strip("0123456789abcdef"):
            raise ValueError(f"sums must be {digits} lowercase hex digits each, got {s!r:.40}")
    return ChunkSums(size, tuple(sums))
