"""A leaf's checksum and its chunks' checksums from the CRCs of the pieces the ranks wrote.

Each rank of a collective write hashes the bytes it writes as it writes them, one piece per
range and chunk (a piece never crosses a chunk boundary: :func:`~memtree.format.placement.split_runs`),
and sends ``(offset, length, crc)`` of each piece to rank 0. The pieces of a leaf tile its file
exactly; rank 0 sorts them by offset and chains their CRCs (``crc(a + b) = shift(crc(a)) ^
crc(b)``, :func:`~memtree.store.primitives.checksums.crc_shifter`) into each chunk's CRC, then the chunks'
into the leaf's: nothing is read again. Pure: no I/O.

Example:
    >>> import zlib
    >>> data = bytes(range(200)) * 50                      # 10,000 bytes, chunks of 4,096
    >>> pieces = [(o, n, zlib.crc32(data[o : o + n])) for o, n in [(0, 4096), (4096, 100), (4196, 3996), (8192, 1808)]]
    >>> checksum, chunks = combine_pieces("crc32", len(data), 4096, pieces, "leaf 'w'")
    >>> checksum == f"crc32:{zlib.crc32(data):08x}", len(chunks.sums)
    (True, 3)
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import DistributedCheckpointError
from ..format.chunks import ChunkSums, chunk_count
from ..store.primitives.checksums import crc_shifter

__all__ = ["combine_pieces"]


def combine_pieces(
    algorithm: str, nbytes: int, chunk: int, pieces: Iterable[tuple[int, int, int]], what: str
) -> tuple[str, ChunkSums | None]:
    """The leaf's ``checksum`` and its ``chunks`` (``None`` for a leaf of one chunk) from the
    ``(offset, length, crc)`` pieces of its ``nbytes`` bytes, each within one chunk of ``chunk``
    bytes.

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
    whole = 0
    for i, value in enumerate(sums):
        whole = crc_shifter(algorithm, min(chunk, nbytes - i * chunk))(whole) ^ value
    chunks = ChunkSums(chunk, tuple(f"{s:08x}" for s in sums)) if chunk_count(nbytes, chunk) > 1 else None
    return f"{algorithm}:{whole:08x}", chunks
