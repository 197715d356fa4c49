"""A leaf's per-chunk checksums from the CRCs of the pieces the ranks wrote.

Each rank of a collective write hashes the bytes it writes as it writes them, one piece per
range and chunk (a piece never crosses a chunk boundary: :func:`~memtree.dist.placement.split_runs`),
and sends ``(offset, length, crc)`` of each piece to rank 0. The pieces of a leaf tile its file
exactly; rank 0 sorts them by offset and chains the CRCs of each chunk's pieces (``crc(a + b) =
shift(crc(a)) ^ crc(b)``, :func:`~memtree.store.primitives.checksums.crc_shifter`) into that
chunk's CRC: the leaf's :class:`~memtree.format.chunks.ChunkSums` (format version 3, one chunk:
its plain ``checksum``), exactly what a writer hashing the whole file records, with nothing read
again. Pure: no I/O.

Example:
    >>> import zlib
    >>> data = bytes(range(200)) * 50                      # 10,000 bytes, chunks of 4,096
    >>> pieces = [(o, n, zlib.crc32(data[o : o + n])) for o, n in [(0, 4096), (4096, 100), (4196, 3996), (8192, 1808)]]
    >>> sums = combine_pieces("crc32", len(data), 4096, pieces, "leaf 'w'")
    >>> sums.count, sums.digest(2) == f"crc32:{zlib.crc32(data[8192:]):08x}"
    (3, True)
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import DistributedCheckpointError
from ..format.chunks import ChunkSums
from ..store.primitives.checksums import crc_shifter

__all__ = ["combine_pieces"]


def combine_pieces(
    algorithm: str, nbytes: int, chunk: int, pieces: Iterable[tuple[int, int, int]], what: str
) -> ChunkSums:
    """The checksums of the chunks of ``chunk`` bytes of a leaf of ``nbytes`` bytes, from the
    ``(offset, length, crc)`` pieces of its bytes, each within one chunk (``chunk >= nbytes``:
    one chunk, recorded as the leaf's ``checksum``).

    Raises:
        DistributedCheckpointError: the pieces do not tile the leaf (a rank's bytes missing or
            written twice).
    """
    sums: list[int] = []
    crc = end = 0
    for offset, length, piece in sorted(pieces):
        if offset != end or length <= 0 or (offset + length - 1) // chunk != offset // chunk:
            problem = (
                f"bytes {end:,} to {offset:,} were written by no rank" if offset > end else
                f"bytes {offset:,} to {end:,} were written twice" if offset < end else
                f"the piece of bytes {offset:,} to {offset + length:,} crosses a chunk boundary"
            )
            raise DistributedCheckpointError(
                f"{what}: the pieces the ranks wrote do not tile its file ({problem}); nothing was committed"
            )
        if offset % chunk == 0 and offset:
            sums.append(crc)
            crc = 0
        crc = crc_shifter(algorithm, length)(crc) ^ piece
        end += length
    if end != nbytes:
        raise DistributedCheckpointError(
            f"{what}: the pieces the ranks wrote do not tile its file (bytes {end:,} to {nbytes:,} "
            "were written by no rank); nothing was committed"
        )
    sums.append(crc)
    return ChunkSums(algorithm, chunk, "".join(f"{s:08x}" for s in sums))
