"""Reading some byte ranges of a leaf as they are, from any storage: :func:`read_runs`.

The leaf's bytes are read through a ``read(offset, view)`` callable
(:data:`~memtree.store.primitives.chunk_check.Reader`: a local file's ``preadv``, a remote
storage's ranged request). :func:`read_runs` reads the ranges and nothing else, except the gaps
it reads over to make one request of several close ranges (at most a fraction of the range
after each). A checked read of ranges is :func:`~memtree.store.primitives.chunk_check.read_ranges`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

from ..primitives.chunk_check import Reader

__all__ = ["SPAN_BYTES", "read_runs"]

#: Most bytes one request reads (ranges read over as one, or a batch of a shard's ranges).
SPAN_BYTES = 8 * 1024 * 1024


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
