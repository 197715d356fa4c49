"""Rank-aware reads: each rank reads only the bytes of its own shards (:mod:`memtree.dist.shards`).

* :func:`fill_dtensors` fills the ``DTensor`` parameters and buffers of a module in place
  (``load_into_module``): one :class:`~memtree.store.primitives.fill.FillJob` per range of the source's
  file, read with threaded ``preadv`` straight into the local shard's memory;
* :func:`load_sharded` is ``load_memmap(prefix, mesh=...)``: each leaf a ``DTensor`` holding this
  rank's shard (:class:`ShardReader`); a shard that is one range of its file (or, for a
  packed leaf, of its pack) is mapped
  (zero-copy), others are read into memory; ``verify=True`` reads and checks the chunks its
  ranges touch (:func:`~memtree.store.primitives.chunk_check.read_ranges`) and returns the bytes it checked;
* :func:`load_sharded_remote` is the same from a URL, by ranged requests (:mod:`memtree.dist.remote`);
* :func:`targets_for`, :func:`targets_like`: which leaves become ``DTensor`` s (:mod:`memtree.dist.targets`).

Example:
    >>> import tempfile, torch, memtree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = memtree.TensorTree({"w": torch.ones(2)}).memmap(d)
    >>> load_sharded(d, targets_like(Level((), {}))).entries["w"].tolist()   # no DTensor: plain leaves
    [1.0, 1.0]
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from itertools import islice
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PlacementError
from ..format.dtypes import itemsize
from ..format.level import Level, fmt_key
from .placement import Box, box_runs, box_shape, local_box
from ..format.schema import LeafMeta
from ..store.primitives.chunk_check import file_reader, read_ranges
from ..store.primitives.files import FileRange, open_checked
from ..store.reading.leaf_reader import MAX_PENDING_READS, LeafReader
from ..store.primitives.memory import byte_view
from ..store.reading.options import KeySelection, ReadOptions
from ..store.reading.read import open_tree
from .dtensor import dist_leaf, from_local, mesh_device
from .remote import load_sharded_remote
from .shards import ShardRead, fill_shards, shard_box
from .targets import Targets, targets_for, targets_like

__all__ = [
    "ShardSource",
    "ShardReader",
    "fill_dtensors",
    "load_sharded",
    "load_sharded_remote",
    "targets_for",
    "targets_like",
]


@dataclass(frozen=True)
class ShardSource:
    """Where a module's ``DTensor`` is filled from (exactly one of ``span``, ``local``, ``tensor``).

    Attributes:
        target: the module's ``DTensor`` (its local shard is filled in place).
        name: its name in the source, for messages.
        dtype: the dtype of the source's bytes (cast on the way when the target's differs).
        span: the bytes of the full tensor in a file (row-major): this rank's ranges are read.
        local: this rank's shard, already made (a ``DTensor`` source redistributed).
        tensor: the full tensor in memory: this rank's box is copied out of it.
    """

    target: Any
    name: str
    dtype: torch.dtype
    span: FileRange | None = None
    local: torch.Tensor | None = None
    tensor: torch.Tensor | None = None


def _box_of(full: torch.Tensor, box: Box) -> torch.Tensor:
    """The elements of ``full`` that ``box`` holds (a view where the box is one interval per dim)."""
    out = full
    for d, intervals in enumerate(box):
        if len(intervals) == 1:
            out = out.narrow(d, intervals[0][0], intervals[0][1] - intervals[0][0])
        elif not intervals:
            out = out.narrow(d, 0, 0)
        else:
            index = torch.tensor([i for a, b in intervals for i in range(a, b)], dtype=torch.long, device=full.device)
            out = out.index_select(d, index)
    return out


def fill_dtensors(shards: list[ShardSource]) -> None:
    """Fill each target's local shard in place from its source (see the module docstring): the
    ranges of files read in place (:func:`~memtree.dist.shards.fill_shards`), the others copied.

    Raises:
        PlacementError: a target's placements cannot be filled (``Partial``).
        StorageError: a file is shorter than its ranges (before anything is read), or a read failed.
    """
    reads: list[ShardRead] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s in shards:
        where = f"load_into_module: {s.name!r}"
        leaf = dist_leaf(s.target, where)
        if leaf.coord is None:  # this rank holds no part of it
            continue
        box = local_box(leaf.shape, leaf.layout, leaf.coord)
        local = leaf.local
        if tuple(local.shape) != box_shape(box):
            raise PlacementError(f"{where}: the local shard is {list(local.shape)}, its placements give {list(box_shape(box))}")
        if s.span is not None:
            dest = local if local.is_contiguous() else torch.empty(local.shape, dtype=local.dtype, device=local.device)
            reads.append(ShardRead(dest, s.span, leaf.shape, box, s.dtype))
            if dest is not local:
                copies.append((local, dest))
        elif s.local is not None:
            copies.append((local, s.local))
        else:
            assert s.tensor is not None
            copies.append((local, _box_of(s.tensor, box)))
    fill_shards(reads)
    with torch.no_grad():
        for dest, value in copies:
            dest.copy_(value)


class ShardReader(LeafReader):
    """A :class:`~memtree.store.reading.leaf_reader.LeafReader` that reads the leaves ``targets`` names
    as ``DTensor`` s holding this rank's shard (other leaves as the options say)."""

    def __init__(self, options: ReadOptions, targets: Targets) -> None:
        super().__init__(options)
        self.targets = targets
        self.shard_reads: list[ShardRead] = []  # read when the batch of levels ends, files kept open

    def leaf(
        self, dir_fd: int, where: str, entry: LeafMeta, parents: tuple[str, ...], dirs: tuple[str, ...]
    ) -> torch.Tensor:
        key = parents + (entry.key,)
        target = self.targets.resolve(key, entry)
        if target is None or self.on_meta:
            return super().leaf(dir_fd, where, entry, parents, dirs)
        box = shard_box(target, entry.shape, f"leaf {fmt_key(key)}")
        size = itemsize(entry.dtype)
        first = list(islice(box_runs(entry.shape, size, box), 2))
        shape, device = box_shape(box), mesh_device(target.mesh)
        if len(first) == 1 and self.mmap and not (self.verify and entry.sums is not None) and device.type == "cpu":
            full = super().leaf(dir_fd, where, entry, parents, dirs)  # checked, mapped: no byte read
            with torch._C.DisableTorchFunctionSubclass():
                flat = full.as_subclass(torch.Tensor).view(-1)
            start, nbytes = first[0]
            return from_local(flat[start // size : (start + nbytes) // size].view(shape),
                              target.mesh, target.placements, entry.shape)
        fd, path, base = self._open(dir_fd, where, entry)
        if self.verify and entry.sums is not None:  # what is checked is what is returned
            local = torch.empty(shape, dtype=entry.dtype)
            try:
                read = file_reader(fd, f"leaf {path}")
                read_ranges(lambda at, view: read(base + at, view), entry, list(box_runs(entry.shape, size, box)),
                            byte_view(local), f"leaf {fmt_key(key)} at {path}")
            finally:
                os.close(fd)
            return from_local(local.to(device), target.mesh, target.placements, entry.shape)
        local = torch.empty(shape, dtype=entry.dtype, device=device)
        span = FileRange(fd, base, entry.nbytes, f"leaf {path}")
        self.shard_reads.append(ShardRead(local, span, entry.shape, box, entry.dtype))
        if len(self.shard_reads) >= MAX_PENDING_READS:
            self.flush()
        return from_local(local, target.mesh, target.placements, entry.shape)

    def _open(self, dir_fd: int, where: str, entry: LeafMeta) -> tuple[int, str, int]:
        """A descriptor of the file that holds ``entry``'s bytes (owned by the caller), its path
        and the offset of the bytes there: the leaf's file, or its pack (format version 3: the
        level's packed ranges were checked when it was accepted)."""
        if entry.pack is None:
            path = os.path.join(where, entry.file)
            return open_checked(entry.file, entry.file_nbytes, path, dir_fd=dir_fd), path, 0
        assert self.packs is not None and entry.offset is not None
        return os.dup(self.packs.fd(entry.pack)), self.packs.path(entry.pack), entry.offset

    def flush(self) -> None:
        """Read the queued leaves, then the queued shards (each rank starting on another file)."""
        super().flush()
        reads, self.shard_reads = self.shard_reads, []
        try:
            fill_shards(reads)
        finally:
            for read in reads:
                os.close(read.span.fd)

    def discard(self) -> None:
        """Drop what is queued (a failed load) and close its files."""
        super().discard()
        reads, self.shard_reads = self.shard_reads, []
        for read in reads:
            os.close(read.span.fd)


def load_sharded(
    prefix: str | os.PathLike[str],
    targets: Targets,
    *,
    mode: str = "r+",
    mmap: bool = True,
    verify: bool = False,
    keys: Iterable[KeySelection] | None = None,
) -> Level:
    """Load the memtree directory ``prefix`` with each leaf ``targets`` names as a ``DTensor``
    holding this rank's shard (see the module docstring); every rank of the targets' meshes
    calls it. Other leaves load as ``load_memmap`` loads them (``mode``, ``mmap``, ``verify``).

    Raises:
        PlacementError: a leaf's placements do not fit it or the mesh.
        MemtreeKeyError: ``placements=`` names a key that is not a tensor leaf of the load.
        IntegrityError: ``verify=True`` and a chunk (or leaf) this rank reads is damaged.
        MemtreeError: as ``load_memmap``: a missing, damaged or hostile tree.

    """
    options = ReadOptions.of(keys=keys, mode=mode, mmap=mmap, verify=verify)
    reader = ShardReader(options, targets)
    level = open_tree(prefix, options, reader=reader).load_all()
    targets.check_used()
    return level

