"""Reading some byte ranges of a leaf, from any storage: checked, or as they are.

The leaf's bytes are read through a ``read(offset, view)`` callable: a local file's ``preadv``
(:func:`file_reader`) or a remote storage's ranged request
(:meth:`~memtree.store.reading.storage.Storage.read_into`).

* :func:`read_ranges` checks what it reads against the leaf's chunk checksums (``chunks``,
  format version 3: :mod:`memtree.format.chunks`): the chunks its ranges touch are read whole,
  a bounded span at a time, each checked, and the ranges' bytes copied out. A leaf without chunk
  checksums is checked against its whole-leaf ``checksum``: the whole file is read (in bounded
  memory) and hashed, the ranges copied out on the way;
* :func:`read_runs` reads the ranges and nothing else, except the gaps it reads over to make
  one request of several close ranges (at most a fraction of the range after each).

Example:
    >>> import os, tempfile, torch
    >>> from memtree.format.schema import LeafMeta
    >>> path = os.path.join(tempfile.mkdtemp(), "w.memmap")
    >>> data = torch.arange(8, dtype=torch.uint8)
    >>> _ = open(path, "wb").write(data.numpy().tobytes())
    >>> from memtree.store.primitives.checksums import tensor_checksum
    >>> entry = LeafMeta("w", "w.memmap", "uint8", (8,), tensor_checksum(data, "crc32"))
    >>> out = bytearray(3)
    >>> fd = os.open(path, os.O_RDONLY)
    >>> read_ranges(file_reader(fd, "leaf 'w'"), entry, [(2, 1), (5, 2)], memoryview(out), "leaf 'w'"); os.close(fd)
    8
    >>> list(out)
    [2, 5, 6]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import replace

from ...errors import IntegrityError, InvalidArgumentError
from ...format.schema import LeafMeta
from ..primitives.checksums import new_digest
from ..primitives.fill import read_exact

__all__ = ["SPAN_BYTES", "Reader", "file_reader", "read_ranges", "read_runs", "check_leaf"]

Reader = Callable[[int, memoryview], None]
"""``read(offset, view)``: fill ``view`` with the leaf's bytes from ``offset`` (exactly)."""


def file_reader(fd: int, what: str) -> Reader:
    """The :data:`Reader` of an open local file (``preadv``, short reads continued)."""
    return lambda offset, view: read_exact(fd, view, offset, what)

#: Most bytes read into memory at once to check them (whole chunks; a chunk larger than this is
#: read alone).
SPAN_BYTES = 8 * 1024 * 1024


def _damaged(what: str, part: str, found: str, recorded: str) -> IntegrityError:
    return IntegrityError(
        f"{what}: {part}hashes to {found}, the tree records {recorded}: the file is damaged. Restore "
        "it or re-save the tree (`memtree verify` lists every damaged leaf)"
    )


def check_leaf(read: Reader, entry: LeafMeta, what: str) -> None:
    """Hash the whole leaf (read through ``read``) and compare it with the leaf's ``checksum``.

    Raises:
        IntegrityError: it differs.
        StorageError: the file is shorter than the leaf, or a read failed.
    """
    if entry.checksum is None or entry.chunk_bytes is not None:
        raise InvalidArgumentError(f"{what} records no checksum of its bytes: it cannot be verified")
    read_ranges(read, replace(entry, chunks=None), [], memoryview(bytearray(0)), what)


def _copy_out(runs: Sequence[tuple[int, int]], starts: list[int], out: memoryview, span: memoryview,
              begin: int, first: int) -> int:
    """Copy the parts of ``runs`` (their bytes land at ``starts`` in ``out``) that lie in the
    file bytes ``[begin, begin + len(span))``, from run ``first`` on; returns the first run
    that may still reach past the span."""
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


def read_ranges(read: Reader, entry: LeafMeta, runs: Sequence[tuple[int, int]], out: memoryview, what: str) -> int:
    """Read the byte ranges ``runs`` (sorted, disjoint ``(offset, nbytes)`` of the leaf, read
    through ``read``) one after another into ``out``, checked against the leaf's checksums;
    returns the bytes read.

    Raises:
        InvalidArgumentError: the leaf records no checksum, or ``out`` is not the ranges' size.
        IntegrityError: a chunk (or the whole leaf) differs from its recorded checksum; ``out``
            may then hold some of its bytes.
        StorageError: the file is shorter than the leaf, or a read failed.
    """
    if entry.checksum is None or entry.chunk_bytes is not None:
        raise InvalidArgumentError(f"{what} records no checksum of its bytes: it cannot be verified")
    if sum(n for _, n in runs) != len(out):
        raise InvalidArgumentError(f"{what}: {len(out)} bytes of room for ranges of {sum(n for _, n in runs)}")
    algorithm, _, _ = entry.checksum.partition(":")
    starts: list[int] = []
    total = 0
    for _, n in runs:
        starts.append(total)
        total += n
    if entry.chunks is None:  # the whole leaf, hashed as it streams by
        digest = new_digest(algorithm)
        buf = memoryview(bytearray(min(SPAN_BYTES, entry.nbytes)))
        first = 0
        for begin in range(0, entry.nbytes, SPAN_BYTES):
            span = buf[: min(SPAN_BYTES, entry.nbytes - begin)]
            read(begin, span)
            digest.update(span)
            first = _copy_out(runs, starts, out, span, begin, first)
        found = f"{algorithm}:{digest.hexdigest()}"
        if found != entry.checksum:
            raise _damaged(what, "its bytes ", found, entry.checksum)
        return entry.nbytes
    size = entry.chunks.nbytes
    wanted = sorted({c for offset, n in runs if n for c in range(offset // size, (offset + n - 1) // size + 1)})
    per_span = max(1, SPAN_BYTES // size)
    buf = memoryview(bytearray(min(per_span * size, entry.nbytes)))
    done, first, i = 0, 0, 0
    while i < len(wanted):
        j = i
        while j + 1 < len(wanted) and wanted[j + 1] == wanted[j] + 1 and j + 1 - i < per_span:
            j += 1
        begin = wanted[i] * size
        end = min((wanted[j] + 1) * size, entry.nbytes)
        span = buf[: end - begin]
        read(begin, span)
        done += end - begin
        for c in range(wanted[i], wanted[j] + 1):
            digest = new_digest(algorithm)
            digest.update(span[(c - wanted[i]) * size : min((c + 1) * size, entry.nbytes) - begin])
            if digest.hexdigest() != entry.chunks.sums[c]:
                part = f"chunk {c} (bytes {c * size:,} to {min((c + 1) * size, entry.nbytes):,}) "
                raise _damaged(what, part, f"{algorithm}:{digest.hexdigest()}", f"{algorithm}:{entry.chunks.sums[c]}")
        first = _copy_out(runs, starts, out, span, begin, first)
        i = j + 1
    return done


def read_runs(read: Reader, runs: Sequence[tuple[int, int]], out: memoryview, over_read: float,
              pool: Executor | None = None) -> int:
    """Read the byte ranges ``runs`` (sorted, disjoint ``(offset, nbytes)``) one after another into
    ``out``, unchecked; ranges closer than ``over_read`` times the next range's length are read
    as one request (the gap into a scratch buffer, at most :data:`SPAN_BYTES` a request); with
    ``pool``, the requests run concurrently (a remote storage's round trips overlap). Returns
    the bytes read.

    Example:
        >>> data = bytes(range(10))
        >>> def read(offset, view): view[:] = data[offset : offset + len(view)]
        >>> out = bytearray(4)
        >>> read_runs(read, [(1, 2), (4, 2)], memoryview(out), 0.5), list(out)   # gap 1 <= 0.5 * 2
        (5, [1, 2, 4, 5])
    """
    groups: list[tuple[int, int, int]] = []  # (first run, last run, where the first lands in out)
    done = i = 0
    while i < len(runs):
        j = i
        while (j + 1 < len(runs) and runs[j + 1][0] - sum(runs[j]) <= over_read * runs[j + 1][1]
               and sum(runs[j + 1]) - runs[i][0] <= SPAN_BYTES):
            j += 1
        groups.append((i, j, done))
        done += sum(n for _, n in runs[i : j + 1])
        i = j + 1

    def one(group: tuple[int, int, int]) -> int:
        i, j, at = group
        first, end = runs[i][0], sum(runs[j])
        if i == j:
            read(first, out[at : at + end - first])
            return end - first
        span = memoryview(bytearray(end - first))
        read(first, span)
        for offset, n in runs[i : j + 1]:
            out[at : at + n] = span[offset - first : offset - first + n]
            at += n
        return end - first

    return sum(pool.map(one, groups) if pool is not None and len(groups) > 1 else map(one, groups))
