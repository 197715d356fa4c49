"""The collective write: a tree of ``DTensor`` s written by every rank into one memtree directory.

Every rank of the default process group calls ``memmap`` with the same tree (the same keys,
dtypes, global shapes, placements and values); the result is an ordinary memtree directory in
which each ``DTensor`` is stored as its full tensor, with its layout recorded beside it
(``docs/format.md``, "Version 3"). The steps, each agreed by every rank
(:meth:`~memtree.dist.comm.Comm.agree`: if one rank fails, every rank raises
:class:`~memtree.errors.DistributedCheckpointError` and nothing is committed):

1. **planning the write**: each rank plans the tree (:func:`~memtree.store.writing.write.plan_write`,
   with each ``DTensor`` as its global shape, and every leaf in a file of its own: a collective
   write packs no small leaves) and the distinct shards of each leaf
   (:func:`~memtree.dist.placement.shards`; a plain tensor is one shard every rank holds),
   and the ranks compare a digest of their plans (:mod:`memtree.dist.compare`): trees that
   differ are refused on every rank with :class:`~memtree.errors.PlacementError` naming the
   first difference. Each shard gets one writer (:func:`~memtree.dist.placement.assign_writers`:
   replicas spread over their holders by bytes);
2. **preparing the staging directory**: rank 0 takes the destination's writer lock and creates
   the staging directory (:func:`~memtree.store.writing.staged.staged_commit`), every level's directory
   and every leaf file at its full size;
3. **writing the shards**: each rank ``pwrite`` s the ranges of the shards it writes into the
   shared files (``Shard(0)``: one range; ``Shard(d > 0)``: one per row), each range cut at the
   boundaries of the leaf's checksummed chunks (:func:`~memtree.format.chunks.chunk_bytes_for`,
   as any write) and hashed as it is written (with ``fsync=True``, each file fsynced), and
   sends the CRCs of its pieces to rank 0;
4. **committing**: rank 0 combines the pieces' CRCs into the checksum of each chunk of each
   leaf (:mod:`memtree.dist.sums`; nothing read again; a leaf of one chunk records its
   ``checksum``), writes every ``meta.json`` (the root's last,
   :func:`~memtree.store.writing.write.write_levels`) and renames the staging directory onto the
   destination: the tree is committed once, atomically.

Example:
    >>> collective_checksum("crc32"), collective_checksum(None)
    ('crc32', None)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import DistributedCheckpointError, InvalidArgumentError, MemtreeError, PlacementError
from ..format.chunks import ChunkSums, chunk_bytes_for
from ..format.level import Level
from ..format.names import is_uncommitted_name
from ..format.entries import DTensorLayout
from .placement import Layout, Shard, assign_writers, to_annotation, box_runs, box_shape, full_box, local_box, shards, split_runs
from ..format.schema import Entry, LeafMeta
from ..store.primitives.checksums import COMBINABLE, available_checksums, check_checksum_option, crc32, new_digest
from ..store.primitives.files import allocate_fd, new_file, preallocate_fd, pwrite_from, storage_error
from ..store.reading.mapped import to_storable
from ..store.primitives.memory import byte_view, is_plain_memory
from ..store.reading.options import WriteOptions
from ..store.writing.staged import Staging, staged_commit
from ..store.reading.storage import local_path
from ..store.reading.walk import map_all
from ..store.writing.write import BACKGROUND_REMOVAL_FILES, WritePlan, plan_write, write_levels
from .comm import Comm
from .compare import first_difference, summary_digest, tree_summary
from .dtensor import DistLeaf, dist_leaf, is_dtensor
from .sums import combine_pieces

__all__ = ["collective_checksum", "write_collective", "pwrite_from"]

_OPEN_WRITE = os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def collective_checksum(checksum: str | None) -> str | None:
    """The checksum a collective write records for ``checksum=``: ``"auto"`` is ``crc32c`` (the
    ``crc32c`` package installed) or ``crc32``, whose pieces rank 0 combines.

    Raises:
        InvalidArgumentError: an algorithm whose pieces do not combine (``xxh3``, ``sha256``).
    """
    if checksum == "auto":
        return "crc32c" if "crc32c" in available_checksums() else "crc32"
    if checksum is not None and checksum not in COMBINABLE:
        raise InvalidArgumentError(
            "a collective write (a tree of DTensors, written by every rank) records crc32c or crc32, "
            f"which rank 0 combines from the pieces the ranks wrote; got checksum={checksum!r:.40}. "
            "Pass checksum='auto' (crc32c when the crc32c package is installed, else crc32), "
            "'crc32c', 'crc32' or None"
        )
    check_checksum_option(checksum)
    return checksum


@dataclass
class _Leaf:
    """One leaf file of a collective write."""

    key: tuple[str, ...]  # the key path
    rel: str  # the file, relative to the root
    where: str  # "leaf 'w'", for messages
    shape: tuple[int, ...]
    itemsize: int
    nbytes: int
    chunk: int  # bytes per checksummed chunk (the whole leaf when it is one chunk)
    shards: list[Shard]  # the distinct shards, each written by one rank
    dist: DistLeaf | None  # a DTensor's layout and this rank's shard
    data: torch.Tensor | None  # a plain tensor's bytes (contiguous, on the CPU; None for memmap_like)


@dataclass
class _Plan:
    """A rank's plan of the write: the files and levels, and the leaves with their shards."""

    write: WritePlan
    leaves: list[_Leaf]
    summary: list[list[Any]]


def write_collective(prefix: str | os.PathLike[str], level: Level, options: WriteOptions) -> str:
    """Write ``level`` (holding ``DTensor`` s) from every rank into one tree at ``prefix`` (see the
    module docstring); every rank of the default process group calls it. Returns the
    destination, committed.

    Raises:
        InvalidArgumentError: no process group, ``encryption=``, ``link_from=`` or a positive
            ``pack_below=`` (a collective write packs nothing), or a checksum
            that does not combine (raised by every rank before any exchange).
        PlacementError: the ranks' trees differ (every rank raises it, naming the first difference).
        DistributedCheckpointError: a step failed on some rank (``failures``: which, and why), or
            a rank died or hung; nothing was committed.

    Example:
        >>> write_collective("/tmp/t", Level((), {}), WriteOptions())
        Traceback (most recent call last):
        ...
        memtree.errors.InvalidArgumentError: a tree of DTensors is written by every rank at once: torch.distributed is not initialised. Call torch.distributed.init_process_group(...) on every rank first
    """
    comm = Comm.default("a tree of DTensors is written by every rank at once")
    for name, value in (("encryption", options.encryption), ("link_from", options.link_from),
                        ("pack_below", options.pack_below or None)):
        if value is not None:
            raise InvalidArgumentError(
                f"a tree of DTensors is written by every rank at once, and {name}= is not supported "
                f"there: leave {name}= out (or gather the tensors and write them from one process)"
            )
    checksum = None if options.like else collective_checksum(options.checksum)
    remote = "memmap() writes a local directory every rank shares; write it, then memtree.remote.upload(tree, url)"
    dest = os.path.realpath(os.fspath(local_path(prefix, remote=remote)))
    planned: list[_Plan] = []
    digests = comm.agree("planning the write", lambda: _plan(level, options, dest, checksum, comm.world, planned))
    plan = planned[0]
    if len(set(digests)) > 1:
        summaries = comm.exchange("comparing the ranks' trees", plan.summary)
        raise PlacementError(
            f"the ranks write different trees to {dest}: {first_difference(summaries)}. Nothing was written"
        )
    writers = assign_writers([leaf.shards for leaf in plan.leaves], comm.world)
    staged: list[Staging] = []
    with ExitStack() as stack:
        names = comm.agree("preparing the staging directory",
                           lambda: _prepare(stack, staged, dest, plan, options) if comm.rank == 0 else None)
        staging = _staging_dir(dest, names[0])
        mine = [(i, leaf, shard) for i, leaf in enumerate(plan.leaves)
                for shard, writer in zip(leaf.shards, writers[i]) if writer == comm.rank and not options.like]
        pieces: list[list[int]] = []
        comm.agree("writing the shards", lambda: pieces.extend(_write_shards(staging, mine, checksum, options)))
        gathered = comm.gather("sending the checksums to rank 0", pieces) if checksum is not None else None
        comm.agree("committing", lambda: _commit(staged[0], plan, checksum, gathered, options) if comm.rank == 0 else None,
                   done=lambda: (f"Rank 0 had committed the tree at {dest}: it is complete, but a rank may "
                                 "not know it") if staged and staged[0].published else None)
    return dest


# ---------------------------------------------------------------------------------------------
# 1. planning


def _placeholders(level: Level, path: tuple[str, ...], found: dict[tuple[str, ...], Any]) -> Level:
    """``level`` with each ``DTensor`` (recorded in ``found`` by key path) replaced by a tensor of
    its global shape and dtype that holds one element (what :func:`plan_write` plans from)."""
    out = Level(level.batch_size, {}, level.type, level.foreign_type, level.int_keys)
    for key, value in level.entries.items():
        if isinstance(value, Level):
            out.entries[key] = _placeholders(value, path + (key,), found)
        elif is_dtensor(value):
            found[path + (key,)] = value
            out.entries[key] = torch.empty((), dtype=value.dtype).expand(value.shape)
        else:
            out.entries[key] = value
    return out


def _host_bytes(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """A plain contiguous CPU tensor holding ``tensor``'s values (copied only when needed)."""
    data = to_storable(tensor, where)
    if is_plain_memory(data):
        return data
    plain = torch.empty(data.shape, dtype=data.dtype)
    plain.copy_(data)
    return plain


def _set_leaf_field(write: WritePlan, name: str, values: dict[str, Any]) -> None:
    """Set the field ``name`` (``layout``) of each planned leaf entry whose file
    (relative to the root) ``values`` names."""

    def updated(entry: Entry, rel: str) -> Entry:
        value = values.get(f"{rel}/{entry.file}" if rel else entry.file) if isinstance(entry, LeafMeta) else None
        return entry if value is None else replace(entry, **{name: value})

    for lp in write.levels:
        lp.meta = replace(lp.meta, entries=tuple(updated(e, lp.rel) for e in lp.meta.entries))


def _chunk_bytes(nbytes: int) -> int:
    """The bytes of a leaf's checksummed chunks: those of any write
    (:func:`~memtree.format.chunks.chunk_bytes_for`), or the whole leaf when it is one chunk."""
    return chunk_bytes_for(nbytes) or max(nbytes, 1)


def _plan(level: Level, options: WriteOptions, dest: str, checksum: str | None, world: int, out: list[_Plan]) -> str:
    """Plan the write on this rank (into ``out``); returns the digest the ranks compare."""
    dtensors: dict[tuple[str, ...], Any] = {}
    # every leaf in a file of its own (no packs): the ranks write their shards into the files
    write = plan_write(_placeholders(level, (), dtensors), replace(options, pack_below=0), dest=dest)
    leaves: list[_Leaf] = []
    layouts: dict[str, DTensorLayout] = {}
    tensors: dict[str, tuple[Any, int | None]] = {}
    for job in write.leaves:
        where = f"leaf {job.where}"
        shape, size = tuple(job.tensor.shape), job.tensor.element_size()
        value = dtensors.get(job.key)
        dist = data = None
        if value is not None:
            dist = dist_leaf(value, where)
            layouts[job.rel] = to_annotation(dist.layout)
            found = shards(shape, size, dist.layout, dist.ranks)
            tensors[job.rel] = (list(dist.ranks), None)
        else:
            data = None if options.like else _host_bytes(job.tensor, where)
            found = [Shard(full_box(shape), tuple(range(world)), job.nbytes)] if job.nbytes else []
            tensors[job.rel] = (None, None if data is None else crc32(byte_view(data)))
        leaves.append(_Leaf(job.key, job.rel, where, shape, size, job.nbytes, _chunk_bytes(job.nbytes), found, dist, data))
    _set_leaf_field(write, "layout", layouts)
    settings = {"dest": dest, "existsok": options.existsok, "checksum": checksum, "fsync": options.fsync,
                "like": options.like, "reserve": options.reserve}
    summary = tree_summary({lp.rel: lp.meta for lp in write.levels}, tensors,
                           {rel: crc32(data) for rel, data in write.pickles}, settings)
    out.append(_Plan(write, leaves, summary))
    return summary_digest(summary)


# ---------------------------------------------------------------------------------------------
# 2. preparing (rank 0)


@contextmanager
def _leaf_file(path: str, what: str, *, create: bool, fsync: bool) -> Iterator[int]:
    """A leaf file of the staging directory, new (``create``) or made by rank 0, open for
    writing during the block (no link followed), then fsynced (``fsync``) and closed; an
    ``OSError`` is raised as a :class:`~memtree.errors.StorageError` saying ``what`` failed."""
    try:
        fd = new_file(path) if create else os.open(path, _OPEN_WRITE)
        try:
            yield fd
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        if isinstance(err, MemtreeError):
            raise
        raise storage_error(err, what) from err


def _prepare(stack: ExitStack, out: list[Staging], dest: str, plan: _Plan, options: WriteOptions) -> str:
    """Take the lock, create the staging directory (kept in ``out``, held by ``stack``), its
    directories and every leaf file at its full size; returns the staging directory's name."""
    staging = stack.enter_context(staged_commit(dest, existsok=options.existsok, nbytes=plan.write.total_bytes))
    out.append(staging)
    plan.write.make_dirs(staging.path)
    for job in plan.write.leaves:
        with _leaf_file(f"{staging.path}/{job.rel}", f"creating the leaf files of {dest}", create=True,
                        fsync=options.fsync) as fd:
            if options.like:
                allocate_fd(fd, job.nbytes, reserve=options.reserve)
            else:
                preallocate_fd(fd, job.nbytes)  # a full disk fails here, before any rank writes
                os.ftruncate(fd, job.nbytes)
    return os.path.basename(staging.path)


def _staging_dir(dest: str, name: Any) -> str:
    """The staging directory rank 0 made, from the name it sent."""
    own = f".{os.path.basename(dest)}."
    if type(name) is not str or "/" in name or not name.startswith(own) or not is_uncommitted_name(name):
        raise DistributedCheckpointError(f"rank 0 named {name!r:.80} as the staging directory of {dest}: not a staging name")
    return os.path.join(os.path.dirname(dest), name)


# ---------------------------------------------------------------------------------------------
# 3. writing (every rank)


def _shard_bytes(leaf: _Leaf, shard: Shard) -> torch.Tensor:
    """The bytes this rank writes for ``shard`` of ``leaf`` (its local shard, on the CPU)."""
    if leaf.dist is None:
        assert leaf.data is not None
        return leaf.data
    dist = leaf.dist
    box = local_box(leaf.shape, dist.layout, dist.coord) if dist.coord is not None else None
    if box != shard.box or tuple(dist.local.shape) != box_shape(shard.box):
        raise DistributedCheckpointError(
            f"{leaf.where}: this rank was given a shard of indices {shard.box} to write, and holds "
            f"{list(dist.local.shape)} at {box}: its DTensor does not split as its placements say"
        )
    return _host_bytes(dist.local, leaf.where)


def _write_shards(
    staging: str, mine: list[tuple[int, _Leaf, Shard]], checksum: str | None, options: WriteOptions
) -> list[list[int]]:
    """Write this rank's shards into the staging files; returns, per shard, ``[leaf index,
    offset, length, crc, offset, length, crc...]`` of the pieces it wrote (with ``checksum``)."""

    def one(job: tuple[int, _Leaf, Shard]) -> list[int]:
        i, leaf, shard = job
        data = _shard_bytes(leaf, shard)  # a copy to host memory, one shard at a time, if needed
        runs = box_runs(leaf.shape, leaf.itemsize, shard.box)
        path = f"{staging}/{leaf.rel}"
        out = [i]
        with _leaf_file(path, f"writing the shard of {leaf.where} into {path}", create=False, fsync=options.fsync) as fd:
            base, done = data.data_ptr(), 0
            for offset, nbytes in runs if checksum is None else split_runs(runs, leaf.chunk):
                digest = new_digest(checksum) if checksum is not None else None
                pwrite_from(fd, base + done, nbytes, offset, digest)
                if digest is not None:
                    out += [offset, nbytes, int(digest.hexdigest(), 16)]
                done += nbytes
        return out

    threads = min(options.num_threads, len(mine))
    if threads < 2:
        return [one(job) for job in mine]
    with ThreadPoolExecutor(threads, thread_name_prefix="memtree-shards") as pool:
        return map_all(pool, one, mine)


# ---------------------------------------------------------------------------------------------
# 4. committing (rank 0)


def _commit(staging: Staging, plan: _Plan, checksum: str | None, gathered: list[Any] | None, options: WriteOptions) -> None:
    """Combine the ranks' pieces into checksums, write every ``meta.json`` and publish."""
    sums: dict[tuple[str, ...], str | ChunkSums] = {}
    if checksum is not None:
        assert gathered is not None
        pieces: list[list[tuple[int, int, int]]] = [[] for _ in plan.leaves]
        for rows in gathered:
            for row in rows:
                pieces[row[0]].extend(zip(row[1::3], row[2::3], row[3::3]))
        for leaf, found in zip(plan.leaves, pieces):
            sums[leaf.key] = combine_pieces(checksum, leaf.nbytes, leaf.chunk, found, leaf.where)
    write_levels(staging.path, plan.write, checksum=checksum, sums=sums, fsync=options.fsync,
                 num_threads=options.num_threads)
    staging.publish(fsync=options.fsync, background_removal=plan.write.total_files >= BACKGROUND_REMOVAL_FILES)

