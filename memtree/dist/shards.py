"""A rank's shard of a leaf: its box, the ranges of the leaf's file it covers, the reads that fill it.

The shard a rank holds of a leaf is a box of the full tensor (``DTensor``'s own split,
:func:`~memtree.dist.placement.local_box`), whose bytes are ranges of the leaf's file
(:func:`~memtree.dist.placement.box_runs`): one range for a row shard, one per row for a
column shard. :func:`fill_shards` reads those ranges and nothing else, except the gap between two
close ranges, read over (one read instead of two) only when it is at most :data:`OVER_READ` of
the range after it, straight into the shards' memory (:func:`~memtree.store.primitives.fill.fill`),
:data:`RANGES_PER_FILL` ranges at a time (a column shard's bookkeeping stays small beside it),
each rank starting on another file (:func:`rotated`).

Example:
    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "w.memmap")
    >>> _ = open(path, "wb").write(torch.arange(12.0).reshape(3, 4).numpy().tobytes())
    >>> fd, local = os.open(path, os.O_RDONLY), torch.zeros(3, 2)     # columns 2 and 3
    >>> box = (((0, 3),), ((2, 4),))
    >>> fill_shards([ShardRead(local, FileRange(fd, 0, 48, "w"), (3, 4), box, torch.float32)])
    >>> os.close(fd); local.tolist()
    [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..errors import PlacementError
from ..format.dtypes import itemsize
from .placement import Box, box_runs, local_box
from ..store.primitives.files import FileRange
from ..store.primitives.fill import FillJob, check_ranges, fill
from .targets import Target

__all__ = ["OVER_READ", "RANGES_PER_FILL", "ShardRead", "this_rank", "rotated", "shard_box", "fill_shards"]

#: A gap between two ranges of a file is read over only when it is at most this fraction of the
#: range after it (so a column shard's rank reads at most 1.25 times its bytes).
OVER_READ = 0.25
#: Most ranges one :func:`~memtree.store.primitives.fill.fill` reads (each costs a job, a view
#: and a read's bookkeeping, about a kilobyte: a column shard of many rows is read in batches).
RANGES_PER_FILL = 256

_T = TypeVar("_T", bound="ShardRead")


@dataclass(frozen=True)
class ShardRead:
    """A shard to read from a file: the box ``box`` of a full tensor of ``shape``, whose bytes
    (of dtype ``stored``, row-major) are ``span``, into the contiguous tensor ``local`` (cast
    when its dtype differs)."""

    local: torch.Tensor
    span: FileRange
    shape: tuple[int, ...]
    box: Box
    stored: torch.dtype

    def jobs(self) -> Iterator[FillJob]:
        """One :class:`FillJob` per range, filling ``local`` one range after another."""
        flat = self.local.view(-1)
        size = itemsize(self.stored)
        cast = self.stored if self.stored != self.local.dtype else None
        at = 0
        for offset, nbytes in box_runs(self.shape, size, self.box):
            count = nbytes // size
            source = FileRange(self.span.fd, self.span.offset + offset, nbytes, self.span.what)
            yield FillJob(flat[at : at + count], source, cast, max_gap=int(nbytes * OVER_READ))
            at += count


def this_rank() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group (``(0, 1)`` without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rotated(reads: Sequence[_T]) -> list[_T]:
    """``reads`` with their files in an order that starts at another file on each rank (rank
    ``r`` of ``n`` at the file ``r * files // n``); the reads of one file keep their order."""
    files: dict[int, list[_T]] = {}
    for read in reads:
        files.setdefault(read.span.fd, []).append(read)
    groups = list(files.values())
    rank, world = this_rank()
    start = rank * len(groups) // world
    return [read for group in groups[start:] + groups[:start] for read in group]


def shard_box(target: Target, shape: tuple[int, ...], where: str) -> Box:
    """This rank's box of a leaf of ``shape`` read as ``target``.

    Raises:
        PlacementError: this rank is not in the target's mesh.
    """
    coord = target.mesh.get_coordinate()
    if coord is None:
        raise PlacementError(f"{where}: this rank is not in the mesh {target.mesh}: every rank that loads is in it")
    return local_box(shape, target.layout, tuple(coord))


def fill_shards(reads: Sequence[ShardRead]) -> None:
    """Read every shard of ``reads`` (see the module docstring); every file is checked to hold
    its span before anything is read.

    Raises:
        StorageError: a file is shorter than its span (nothing read), or a read failed.
    """
    check_ranges(read.span for read in reads)
    batch: list[FillJob] = []
    for read in rotated(reads):
        for job in read.jobs():
            batch.append(job)
            if len(batch) >= RANGES_PER_FILL:
                fill(batch)
                batch = []
    if batch:
        fill(batch)
