"""Per-chunk checksums of a leaf (format version 3, ``docs/format.md`` "Per-chunk checksums").

A leaf larger than one chunk records, instead of one ``checksum`` over all its bytes, the
checksum of each ``chunk_bytes`` of them (the last chunk shorter): the ``chunks`` field of its
entry, ``{"algorithm": "xxh3", "chunk_bytes": 4194304, "digests": "<hex><hex>..."}``. Each
chunk is hashed on its own, so that

* a writer hashes the chunks of one large leaf in several threads (and while it writes);
* a reader checks a byte range (a slice, one rank's shard, a range fetched from a remote store)
  by reading only the chunks that cover it (:func:`chunks_covering`);
* a leaf of one chunk keeps the plain ``checksum`` of versions 1 and 2: :func:`leaf_sums` shows
  either as a :class:`ChunkSums`, so that readers need one code path.

Pure: no I/O. :func:`parse_chunks` checks every field of a ``chunks`` object read from a file;
:func:`chunk_bytes_for` is the writer's choice of chunk size.

Example:
    >>> sums = ChunkSums("crc32", 4096, "00000000" + "ffffffff")
    >>> sums.count, sums.digest(1), chunk_span(1, 5000, 4096)
    (2, 'crc32:ffffffff', (4096, 5000))
    >>> list(chunks_covering(4000, 4100, 5000, 4096))
    [0, 1]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .record import Record

__all__ = [
    "CHECKSUM_DIGITS",
    "CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_CHUNKS",
    "ChunkSums",
    "ChunksFormatError",
    "chunk_bytes_for",
    "chunk_count",
    "chunk_span",
    "chunks_covering",
    "leaf_sums",
    "CHUNKS_VERSION",
    "uses_chunks",
    "parse_chunks",
    "dump_chunks",
]

#: The format version of a level that holds a leaf with per-chunk checksums.
CHUNKS_VERSION = 3
#: Checksum algorithms a ``meta.json`` may record, and the hex digits of one digest.
CHECKSUM_DIGITS = {"crc32": 8, "sha256": 64, "crc32c": 8, "xxh3": 16}
#: The chunk size a writer records by default: a leaf of at most this many bytes records one
#: ``checksum``. 4 MiB: per-chunk work (a ``pwrite``, a digest object, 16 hex digits in
#: ``meta.json``) is about 1% of hashing and writing the chunk; a chunk stays in the CPU's
#: last-level cache between its ``pwrite`` and its hash; a ranged check reads at most two
#: chunks it did not ask for; 1 GiB of leaves records 256 digests (4 KiB of ``meta.json`` with
#: ``xxh3``). ``docs/format.md`` gives the measurements.
CHUNK_BYTES = 4 * 1024 * 1024
#: Bounds of a recorded ``chunk_bytes`` (a power of two).
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 1024 * 1024 * 1024
#: Most chunks a writer gives one leaf: a larger leaf gets larger chunks (:func:`chunk_bytes_for`),
#: so that a 1 TiB leaf records 65,536 digests (1 MiB of ``meta.json``), not 262,144.
MAX_CHUNKS = 65_536

_HEX = "0123456789abcdef"
_set = object.__setattr__


class ChunksFormatError(ValueError):
    """A ``chunks`` object that breaks a rule: ``field`` (``""``: the object) and ``problem``.

    The parser of ``meta.json`` turns it into a :class:`~memtree.errors.MetaFormatError` naming
    the file and the entry.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


@dataclass(init=False, repr=False, eq=False)
class ChunkSums(Record):
    """The checksums of a leaf's chunks: chunk ``i`` is bytes ``[i * chunk_bytes, (i + 1) *
    chunk_bytes)`` of the tensor's data (the last one ends with the data).

    Attributes:
        algorithm: one of :data:`CHECKSUM_DIGITS`.
        chunk_bytes: bytes per chunk.
        digests: the chunks' digests, lowercase hex, concatenated in chunk order (each
            ``CHECKSUM_DIGITS[algorithm]`` digits).
    """

    algorithm: str
    chunk_bytes: int
    digests: str

    def __init__(self, algorithm: str, chunk_bytes: int, digests: str) -> None:
        _set(self, "algorithm", algorithm)
        _set(self, "chunk_bytes", chunk_bytes)
        _set(self, "digests", digests)

    @property
    def digits(self) -> int:
        """Hex digits of one digest."""
        return CHECKSUM_DIGITS[self.algorithm]

    @property
    def count(self) -> int:
        """Number of chunks."""
        return len(self.digests) // self.digits

    def digest(self, i: int) -> str:
        """``"<algorithm>:<hex>"`` of chunk ``i`` (as :func:`~memtree.store.primitives.checksums.tensor_checksum`
        would give for its bytes)."""
        d = self.digits
        return f"{self.algorithm}:{self.digests[i * d : (i + 1) * d]}"


def chunk_bytes_for(nbytes: int, chunk_bytes: int | None = None) -> int | None:
    """The chunk size a writer records for a leaf of ``nbytes`` bytes: ``None`` when it is one
    chunk (a plain ``checksum``), else ``chunk_bytes`` (default :data:`CHUNK_BYTES`), doubled
    until the leaf has at most :data:`MAX_CHUNKS` chunks.

    Example:
        >>> chunk_bytes_for(4 << 20), chunk_bytes_for((4 << 20) + 1), chunk_bytes_for(1 << 40)
        (None, 4194304, 16777216)
    """
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES
    if nbytes <= chunk_bytes:
        return None
    while -(-nbytes // chunk_bytes) > MAX_CHUNKS:
        chunk_bytes *= 2
    return chunk_bytes


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Chunks of a leaf of ``nbytes`` bytes (an empty leaf has one, empty).

    Example:
        >>> chunk_count(0, 4096), chunk_count(4096, 4096), chunk_count(4097, 4096)
        (1, 1, 2)
    """
    return max(1, -(-nbytes // chunk_bytes))


def chunk_span(i: int, nbytes: int, chunk_bytes: int) -> tuple[int, int]:
    """Byte range ``(start, stop)`` of chunk ``i`` of a leaf of ``nbytes`` bytes."""
    start = i * chunk_bytes
    return start, min(start + chunk_bytes, nbytes)


def chunks_covering(start: int, stop: int, nbytes: int, chunk_bytes: int) -> range:
    """The chunks that hold bytes ``[start, stop)`` of a leaf of ``nbytes`` bytes (none for an
    empty range), what a ranged check reads; the caller has checked that
    ``0 <= start <= stop <= nbytes``.

    Example:
        >>> list(chunks_covering(0, 1, 10_000, 4096)), list(chunks_covering(4096, 8193, 10_000, 4096))
        ([0], [1, 2])
    """
    if start == stop:
        return range(0)
    return range(start // chunk_bytes, (stop - 1) // chunk_bytes + 1)


def leaf_sums(checksum: str | None, chunks: ChunkSums | None, nbytes: int) -> ChunkSums | None:
    """A leaf's checksums as chunks, whichever way its entry records them: its ``chunks``, or
    its one ``checksum`` as a single chunk of all ``nbytes`` (``None`` when it records none).

    Example:
        >>> leaf_sums("crc32:0854897f", None, 3)
        ChunkSums(algorithm='crc32', chunk_bytes=3, digests='0854897f')
    """
    if chunks is not None:
        return chunks
    if checksum is None:
        return None
    algorithm, _, digest = checksum.partition(":")
    return ChunkSums(algorithm, max(nbytes, 1), digest)


def uses_chunks(entries: Iterable[object]) -> bool:
    """Whether one of a level's ``entries`` records per-chunk checksums, which needs
    :data:`CHUNKS_VERSION` (the rule of :func:`memtree.format.schema.level_version`).

    Example:
        >>> from memtree.format.entries import LeafMeta
        >>> leaf = LeafMeta("w", "w.memmap", "uint8", (131072,))
        >>> uses_chunks([leaf]), uses_chunks([leaf.with_sums(ChunkSums("crc32", 65536, "0" * 16))])
        (False, True)
    """
    return any(getattr(e, "chunks", None) is not None for e in entries)


def parse_chunks(raw: Any, nbytes: int) -> ChunkSums:
    """Check a ``chunks`` object read from a ``meta.json`` for a leaf of ``nbytes`` bytes.

    Raises:
        ChunksFormatError: a field is missing, unknown or of the wrong type; ``chunk_bytes`` is
            not a power of two in ``[MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]``; the leaf fits in one
            chunk (it records ``checksum``); ``digests`` is not one lowercase hex digest per chunk.

    Example:
        >>> parse_chunks({"algorithm": "crc32", "chunk_bytes": 65536, "digests": "0" * 16}, 65537).count
        2
    """
    if type(raw) is not dict:
        raise ChunksFormatError("", f"must be a JSON object, got {type(raw).__name__}")
    fields = {"algorithm", "chunk_bytes", "digests"}
    if raw.keys() != fields:
        missing, extra = sorted(fields - raw.keys()), sorted(raw.keys() - fields)
        raise ChunksFormatError("", f"must have exactly the fields {sorted(fields)} (missing {missing}, unknown {extra})")
    algorithm, size, digests = raw["algorithm"], raw["chunk_bytes"], raw["digests"]
    if type(algorithm) is not str or algorithm not in CHECKSUM_DIGITS:
        raise ChunksFormatError("algorithm", f"must be one of {sorted(CHECKSUM_DIGITS)}, got {algorithm!r:.40}")
    if type(size) is not int or not MIN_CHUNK_BYTES <= size <= MAX_CHUNK_BYTES or size & (size - 1):
        raise ChunksFormatError(
            "chunk_bytes", f"must be a power of two in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {size!r:.40}"
        )
    if nbytes <= size:
        raise ChunksFormatError(
            "chunk_bytes", f"is {size}, but the leaf has {nbytes} bytes: a leaf of one chunk records 'checksum'"
        )
    want = chunk_count(nbytes, size) * CHECKSUM_DIGITS[algorithm]
    if type(digests) is not str or len(digests) != want or digests.strip(_HEX):
        got = f"{len(digests)} characters" if type(digests) is str else type(digests).__name__
        raise ChunksFormatError(
            "digests", f"must be {want} lowercase hex digits (one {algorithm} digest per chunk), got {got}"
        )
    return ChunkSums(algorithm, size, digests)


def dump_chunks(sums: ChunkSums) -> dict[str, Any]:
    """The ``chunks`` object of a ``meta.json`` entry (fields in the order of ``docs/format.md``)."""
    return {"algorithm": sums.algorithm, "chunk_bytes": sums.chunk_bytes, "digests": sums.digests}
