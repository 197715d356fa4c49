"""A rank's shard of a leaf: its box, the ranges of the leaf's file it covers, the reads that fill it.

The shard a rank holds of a leaf is a box of the full tensor (``DTensor``'s own split,
:func:`~memtree.format.placement.local_box`), whose bytes are ranges of the leaf's file
(:func:`~memtree.format.placement.box_runs`): one range for a row shard, one per row for a
column shard. A rank reads those ranges and nothing else, except the gap between two close
ranges, read over (one read instead of two) only when it is at most :data:`OVER_READ` of the
range after it; and the ranks start on different files (:func:`rotated`).

Example:
    >>> import os, tempfile, torch
    >>> from memtree.store.primitives.fill import fill
    >>> path = os.path.join(tempfile.mkdtemp(), "w.memmap")
    >>> _ = open(path, "wb").write(torch.arange(12.0).reshape(3, 4).numpy().tobytes())
    >>> fd, local = os.open(path, os.O_RDONLY), torch.zeros(3, 2)     # columns 2 and 3
    >>> fill(shard_jobs(local, FileRange(fd, 0, 48, "w"), [(8, 8), (24, 8), (40, 8)], torch.float32))
    >>> os.close(fd); local.tolist()
    [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]
"""

from __future__ import annotations

import torch

from ..errors import PlacementError
from ..format.dtypes import itemsize
from ..format.placement import Box, local_box
from ..store.primitives.files import FileRange
from ..store.primitives.fill import FillJob
from .targets import Target

__all__ = ["OVER_READ", "this_rank", "rotated", "shard_box", "shard_jobs"]

#: A gap between two ranges of a file is read over only when it is at most this fraction of the
#: range after it (so a column shard's rank reads at most 1.25 times its bytes).
OVER_READ = 0.25


def this_rank() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group (``(0, 1)`` without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rotated(jobs: list[FillJob]) -> list[FillJob]:
    """``jobs`` with their files in an order that starts at another file on each rank (rank ``r``
    of ``n`` at the file ``r * files // n``); the jobs of one file keep their order."""
    files: dict[int, list[FillJob]] = {}
    for job in jobs:
        files.setdefault(getattr(job.source, "fd", -1), []).append(job)
    groups = list(files.values())
    rank, world = this_rank()
    start = rank * len(groups) // world
    return [job for group in groups[start:] + groups[:start] for job in group]


def shard_box(target: Target, shape: tuple[int, ...], where: str) -> Box:
    """This rank's box of a leaf of ``shape`` read as ``target``.

    Raises:
        PlacementError: this rank is not in the target's mesh.
    """
    coord = target.mesh.get_coordinate()
    if coord is None:
        raise PlacementError(f"{where}: this rank is not in the mesh {target.mesh}: every rank that loads is in it")
    return local_box(shape, target.layout, tuple(coord))


def shard_jobs(local: torch.Tensor, span: FileRange, runs: list[tuple[int, int]], stored: torch.dtype) -> list[FillJob]:
    """One :class:`FillJob` per range ``runs`` (of the full tensor's bytes in ``span``'s file),
    filling the contiguous ``local`` one range after another; a gap before a range is read over
    only when it is at most :data:`OVER_READ` of the range."""
    flat = local.view(-1)
    size = itemsize(stored)
    cast = stored if stored != local.dtype else None
    out: list[FillJob] = []
    at = 0
    for offset, nbytes in runs:
        count = nbytes // size
        source = FileRange(span.fd, span.offset + offset, nbytes, span.what)
        out.append(FillJob(flat[at : at + count], source, cast, max_gap=int(nbytes * OVER_READ)))
        at += count
    return out
