"""Checking a leaf's bytes against the checksums its entry records, chunk by chunk: the whole
leaf, or only the chunks that cover a byte range (a slice, one rank's shard, a range fetched
from a remote store).

A leaf records one ``checksum`` or, in format version 3, the checksum of each chunk
(:mod:`memtree.format.chunks`); :attr:`~memtree.format.entries.LeafMeta.sums` shows either as a
:class:`~memtree.format.chunks.ChunkSums`, and everything here works on that. The bytes come
from a *reader*, ``read(offset, view)``, which fills ``view`` with the leaf's bytes from
``offset`` (:func:`file_reader` for an open file; a :class:`~memtree.store.reading.storage.Storage`'s
``read_into`` for a remote one), so that the same code checks local and remote leaves.

* :func:`hash_chunks`: the digests of some chunks, each read through one bounded buffer;
* :func:`differing` and :func:`mismatch_words`: which chunks differ, and the words of the error
  (``"<recorded>, the file has <found>"``, naming the chunk and its bytes when there are several);
* :func:`check_range` and :func:`read_range`: a byte range checked (and read into memory) by
  reading only the chunks that cover it;
* :func:`read_ranges`: several ranges at once (one rank's shard: a range per row of a column
  shard), each covering chunk read and checked once.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> entry = write_tree(d, Level((), {"x": torch.zeros(3 << 20)})).meta.entries[0]
    >>> entry.chunks.count                       # 12 MiB of float32: three chunks of 4 MiB
    3
    >>> fd = os.open(d + "/x.memmap", os.O_RDONLY)
    >>> check_range(file_reader(fd, "x"), entry, 5_000_000, 5_000_100, "x")   # reads one chunk
    4194304
    >>> os.close(fd)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from ...errors import IntegrityError, InvalidArgumentError, StorageError
from ...format.chunks import ChunkSums, chunk_span, chunks_covering
from ...format.entries import LeafMeta
from .checksums import DIGEST_SLICE, digest_factory

__all__ = [
    "Reader",
    "file_reader",
    "hash_chunks",
    "differing",
    "mismatch_words",
    "check_range",
    "read_range",
    "read_ranges",
]

Reader = Callable[[int, memoryview], None]
"""``read(offset, view)`` fills ``view`` with a leaf's bytes from ``offset`` (raises when it
cannot)."""


def file_reader(fd: int, what: str) -> Reader:
    """A :data:`Reader` of the open file ``fd`` (``pread``, continued on short reads).

    Raises (when called):
        StorageError: the file ends first (``EIO``, naming ``what``), or a read fails.
    """

    def read(offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as err:
                raise StorageError(err.errno or errno.EIO, f"reading {what}: {err.strerror or err}") from err
            if n <= 0:
                raise StorageError(errno.EIO, f"reading {what}: the file ends at byte {offset + done:,}")
            done += n

    return read


def hash_chunks(
    read: Reader,
    sums: ChunkSums,
    nbytes: int,
    chunks: Iterable[int],
    *,
    buffer: int = DIGEST_SLICE,
    advance: Callable[[int], None] | None = None,
) -> dict[int, str]:
    """The hex digests (in ``sums``' algorithm) of ``chunks`` of a leaf of ``nbytes`` bytes, each
    chunk read through one buffer of at most ``buffer`` bytes (a chunk of any size is hashed in
    bounded memory); ``advance`` is called with the bytes of each read (a progress bar).

    Example:
        >>> from memtree.store.primitives.checksums import view_sums
        >>> data = bytes(range(256)) * 1000
        >>> sums = view_sums(memoryview(data), "crc32", 65536)
        >>> found = hash_chunks(lambda o, v: v.__setitem__(slice(None), data[o : o + len(v)]), sums, len(data), [1, 3])
        >>> found == {1: sums.digest(1)[6:], 3: sums.digest(3)[6:]}
        True
    """
    factory = digest_factory(sums.algorithm)
    buf = memoryview(bytearray(min(max(nbytes, 1), sums.chunk_bytes, buffer)))
    out: dict[int, str] = {}
    for k in chunks:
        start, stop = chunk_span(k, nbytes, sums.chunk_bytes)
        digest = factory()
        while start < stop:
            n = min(len(buf), stop - start)
            read(start, buf[:n])
            digest.update(buf[:n])
            start += n
            if advance is not None:
                advance(n)
        out[k] = digest.hexdigest()
    return out


def differing(recorded: ChunkSums, found: Mapping[int, str]) -> list[int]:
    """The chunks of ``found`` (hex digests by chunk) whose digest differs from the recorded one.

    Example:
        >>> differing(ChunkSums("crc32", 4, "00000000ffffffff"), {0: "00000000", 1: "00000000"})
        [1]
    """
    d = recorded.digits
    digests = recorded.digests
    return [k for k, hexd in sorted(found.items()) if digests[k * d : (k + 1) * d] != hexd]


def mismatch_words(recorded: ChunkSums, found: Mapping[int, str], bad: list[int], nbytes: int) -> str:
    """What differs, for an error message: ``"<recorded>, the file has <found>"`` for a leaf of
    one checksum; for per-chunk checksums the first chunk that differs, its bytes, and how many
    differ.

    Example:
        >>> rec = ChunkSums("crc32", 4, "00000000ffffffff")
        >>> mismatch_words(rec, {1: "00000000"}, [1], 6)
        'crc32:ffffffff for chunk 1 of 2 (bytes 4..6), the file has crc32:00000000'
    """
    first = bad[0]
    words = f"{recorded.digest(first)}"
    if recorded.count > 1:
        start, stop = chunk_span(first, nbytes, recorded.chunk_bytes)
        words += f" for chunk {first} of {recorded.count} (bytes {start:,}..{stop:,})"
    words += f", the file has {recorded.algorithm}:{found[first]}"
    if len(bad) > 1:
        words += f" ({len(bad)} of the {len(found)} chunks checked differ)"
    return words


def _recorded(entry: LeafMeta, where: str) -> ChunkSums:
    sums = entry.sums
    if sums is None or entry.chunk_bytes is not None:
        raise InvalidArgumentError(
            f"{where}: leaf {entry.key!r} records no checksum of its bytes (written with checksum=None, "
            "grown since, or encrypted), so no range of it can be checked"
        )
    return sums


def _damaged(entry: LeafMeta, where: str, words: str) -> IntegrityError:
    return IntegrityError(
        f"leaf {entry.key!r} at {where} is damaged: its meta.json records checksum {words}. The file "
        "changed after it was written; restore it or re-save the tree (`memtree verify DIR` lists "
        "every damaged leaf)"
    )


def _covering(start: int, stop: int, nbytes: int, chunk_bytes: int, where: str) -> range:
    """The chunks that cover bytes ``[start, stop)`` of a leaf of ``nbytes`` bytes, after checking
    that the range lies within it."""
    if not 0 <= start <= stop <= nbytes:
        raise InvalidArgumentError(
            f"{where}: bytes [{start}, {stop}) are not within the leaf's {nbytes} bytes; pass a "
            f"range with 0 <= start <= stop <= {nbytes}"
        )
    return chunks_covering(start, stop, nbytes, chunk_bytes)


def check_range(read: Reader, entry: LeafMeta, start: int, stop: int, where: str) -> int:
    """Check bytes ``[start, stop)`` of a leaf against its recorded checksums, reading only the
    chunks that cover them (a leaf of one checksum: all of it); returns the bytes read.

    Raises:
        IntegrityError: a chunk's bytes differ from its recorded checksum (the message names it).
        InvalidArgumentError: the range is not within the leaf, or the leaf records no checksum.
        MemtreeError: what ``read`` raises.
    """
    sums = _recorded(entry, where)
    nbytes = entry.nbytes
    chunks = _covering(start, stop, nbytes, sums.chunk_bytes, where)
    found = hash_chunks(read, sums, nbytes, chunks)
    bad = differing(sums, found)
    if bad:
        raise _damaged(entry, where, mismatch_words(sums, found, bad, nbytes))
    spans = [chunk_span(k, nbytes, sums.chunk_bytes) for k in chunks]
    return sum(b - a for a, b in spans)


def read_range(read: Reader, entry: LeafMeta, start: int, stop: int, out: memoryview, where: str) -> int:
    """Read bytes ``[start, stop)`` of a leaf into ``out`` (``stop - start`` bytes), checked
    against its recorded checksums: the chunks inside the range are read straight into ``out``
    and hashed there, the (at most two) chunks it cuts through a buffer of one chunk. Returns
    the bytes read. ``out`` may be partly written when a check fails.

    Raises:
        IntegrityError: a chunk's bytes differ from its recorded checksum (the message names it).
        InvalidArgumentError: the range is not within the leaf, ``out`` has another size, or
            the leaf records no checksum.
        MemtreeError: what ``read`` raises.

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> entry = write_tree(d, Level((), {"x": torch.arange(3 << 20, dtype=torch.int32)})).meta.entries[0]
        >>> out = torch.empty(2, dtype=torch.int32)
        >>> fd = os.open(d + "/x.memmap", os.O_RDONLY)
        >>> read_range(file_reader(fd, "x"), entry, 4 * 1_000_000, 4 * 1_000_002, memoryview(out.numpy()).cast("B"), "x")
        4194304
        >>> os.close(fd); out.tolist()
        [1000000, 1000001]
    """
    sums = _recorded(entry, where)
    nbytes, size = entry.nbytes, sums.chunk_bytes
    if len(out) != stop - start:
        raise InvalidArgumentError(f"{where}: bytes [{start}, {stop}) do not fit a buffer of {len(out)} bytes")
    chunks = _covering(start, stop, nbytes, size, where)
    factory = digest_factory(sums.algorithm)
    edge: memoryview | None = None
    found: dict[int, str] = {}
    done = 0
    for k in chunks:
        a, b = chunk_span(k, nbytes, size)
        if start <= a and b <= stop:  # inside the range: read in place
            view = out[a - start : b - start]
            read(a, view)
        else:  # cut by the range: the whole chunk through a buffer, its part copied
            if edge is None:
                edge = memoryview(bytearray(min(size, nbytes)))
            view = edge[: b - a]
            read(a, view)
            lo, hi = max(a, start), min(b, stop)
            out[lo - start : hi - start] = view[lo - a : hi - a]
        digest = factory()
        for s in range(0, len(view), DIGEST_SLICE):
            digest.update(view[s : s + DIGEST_SLICE])
        found[k] = digest.hexdigest()
        done += b - a
    bad = differing(sums, found)
    if bad:
        raise _damaged(entry, where, mismatch_words(sums, found, bad, nbytes))
    return done


def read_ranges(
    read: Reader, entry: LeafMeta, runs: Sequence[tuple[int, int]], out: memoryview, where: str,
    *, buffer: int = DIGEST_SLICE,
) -> int:
    """Read the byte ranges ``runs`` (sorted, disjoint ``(offset, nbytes)`` of a leaf) one after
    another into ``out``, checked against the leaf's recorded checksums: each chunk that covers
    one of them is read once (several ranges in one chunk: one read), through one buffer of at
    most ``buffer`` bytes, and hashed; the ranges' bytes are copied out on the way. A leaf of one
    checksum is read whole. Returns the bytes read. ``out`` may be partly written when a check
    fails.

    Raises:
        IntegrityError: a chunk's bytes differ from its recorded checksum (the message names it).
        InvalidArgumentError: a range is not within the leaf, ``out`` is not the ranges' size,
            or the leaf records no checksum.
        MemtreeError: what ``read`` raises.

    Example:
        >>> from memtree.store.primitives.checksums import view_sums
        >>> data = bytes(range(256)) * 1024                    # 256 KiB: four chunks of 64 KiB
        >>> entry = LeafMeta("x", "x.memmap", "uint8", (len(data),)).with_sums(view_sums(memoryview(data), "crc32", 65536))
        >>> out = bytearray(4)
        >>> read = lambda offset, view: view.__setitem__(slice(None), data[offset : offset + len(view)])
        >>> read_ranges(read, entry, [(1, 2), (200_000, 2)], memoryview(out), "x"), list(out)   # chunks 0 and 3
        (131072, [1, 2, 64, 65])
    """
    sums = _recorded(entry, where)
    nbytes, size = entry.nbytes, sums.chunk_bytes
    if sum(n for _, n in runs) != len(out):
        raise InvalidArgumentError(f"{where}: ranges of {sum(n for _, n in runs)} bytes do not fit a buffer of {len(out)} bytes")
    wanted = sorted({k for offset, n in runs for k in _covering(offset, offset + n, nbytes, size, where)})
    starts, total = [], 0
    for _, n in runs:
        starts.append(total)
        total += n
    factory = digest_factory(sums.algorithm)
    buf = memoryview(bytearray(min(buffer, max(nbytes, 1))))
    found: dict[int, str] = {}
    digest = factory()
    done = first = i = 0
    while i < len(wanted):  # a run of consecutive chunks, read a buffer at a time
        j = i
        while j + 1 < len(wanted) and wanted[j + 1] == wanted[j] + 1:
            j += 1
        pos, end = chunk_span(wanted[i], nbytes, size)[0], chunk_span(wanted[j], nbytes, size)[1]
        while pos < end:
            view = buf[: min(len(buf), end - pos)]
            read(pos, view)
            at = pos
            while at < pos + len(view):  # each chunk's part of the buffer to its digest
                k = at // size
                stop = min(chunk_span(k, nbytes, size)[1], pos + len(view))
                digest.update(view[at - pos : stop - pos])
                if stop == chunk_span(k, nbytes, size)[1]:
                    found[k] = digest.hexdigest()
                    digest = factory()
                at = stop
            first = _copy_out(runs, starts, out, view, pos, first)
            pos += len(view)
        done += end - chunk_span(wanted[i], nbytes, size)[0]
        i = j + 1
    bad = differing(sums, found)
    if bad:
        raise _damaged(entry, where, mismatch_words(sums, found, bad, nbytes))
    return done


def _copy_out(runs: Sequence[tuple[int, int]], starts: list[int], out: memoryview, span: memoryview,
              begin: int, first: int) -> int:
    """Copy the parts of ``runs`` (their bytes land at ``starts`` in ``out``) that lie in the
    leaf's bytes ``[begin, begin + len(span))`` (``span``), from run ``first`` on; returns the
    first run that may still reach past the span."""
    end = begin + len(span)
    i = first
    while i < len(runs):
        offset, n = runs[i]
        if offset >= end:
            break
        a, b = max(offset, begin), min(offset + n, end)
        if a < b:
            out[starts[i] + a - offset : starts[i] + b - offset] = span[a - begin : b - begin]
        if offset + n > end:
            break
        i += 1
    return i
