"""Writing a tree to a prefix: plan, write into a staging directory, commit by rename.

What ``memmap``/``memmap_``/``memmap_like`` write, in order (``docs/format.md``, "How a write is
committed"):

1. :func:`plan_write` turns a :class:`~memtree.format.level.Level` into a :class:`WritePlan` (pure: no
   I/O): escaped names, one job per leaf, the metadata of every level. Every error the input
   can cause (bad dtype, non-JSON value, foreign memmap...) is raised here, before any file
   exists.
2. :func:`write_tree` takes the destination's writer lock ``.<name>.memtree.lock`` (cleaning up
   after a writer that crashed, see :mod:`memtree.store.writing.recovery`), creates ``.<name>.memtree-tmp-<hex>``
   next to the destination, writes the leaves (each file opened once, filled with ``pwrite``
   straight from the tensor's memory, hashed on the way with ``checksum=``; by ``num_threads``
   threads when there is enough work for them; a leaf whose bytes lie in another file, such as a
   checkpoint's tensor, is copied file to file), then each level's ``meta.json`` and the root's
   last, and renames the staging directory onto the destination: ``RENAME_NOREPLACE`` for a new
   destination, an atomic ``RENAME_EXCHANGE`` when it replaces an older tree (two journaled
   renames where the filesystem lacks it). The old tree is then deleted; for a large tree in a
   background thread (:func:`wait_for_removals`), so that the caller need not wait for it.
3. The new tree is returned opened lazily (:class:`~memtree.store.reading.read.PendingLevel`) from the
   metadata just written, still under the lock: no ``meta.json`` is read back and no leaf
   file is opened until a level is used.

Any failure before the rename removes the staging directory and leaves the destination as it was.
``memtree._faults.point`` marks each step for the crash tests.

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> out = write_tree(tempfile.mkdtemp() + "/t", Level((), {"x": torch.ones(2)}))
    >>> out.load()["x"].filename.endswith("x.memmap")
    True
"""

from __future__ import annotations

import os
import pickle
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from ...format.dtypes import dtype_name
from ...errors import (
    BatchSizeError,
    DtypeError,
    ExistingMemmapError,
    InvalidArgumentError,
    InvalidKeyError,
    LimitError,
    MemtreeError,
)
from ..primitives.crypto import TreeCipher, hide_names
from ..primitives.faults import point
from ..primitives.files import FileRange, create_leaf, gc_paused, storage_error
from ..primitives.checksums import digest_factory, file_sums, view_sums
from ..primitives.memory import byte_view, is_plain_memory
from .pieces import PIECE_BYTES, Hasher, Pieces, write_piece
from ..reading.integrity import bytes_checksum, tree_hash
from .linking import LinkSource, WriteStats
from ..primitives.commit import fsync_dir, wait_for_removals, write_small_file
from ..primitives.durability import open_batch, sync_batch
from ...format.schema import (
    MAX_NBYTES,
    ChildMeta,
    Entry,
    JsonMeta,
    LeafMeta,
    LevelMeta,
    PickleMeta,
    SubclassMeta,
    check_writable,
    dump_level,
    extent_bytes,
    starts_with_batch,
)
from ...format.chunks import ChunkSums, chunk_bytes_for
from ...format.names import META_NAME, encode_level
from ...format.level import Level, as_level, fmt_key
from ...format.packs import PACK_BELOW, PackMeta, is_pack_name, layout_packs, packs_threshold
from ..reading.mapped import MemoryMappedTensor, to_storable
from ...format.values import NonTensor, check_json, json_problem, tuples_to_lists
from .packing import PackJob, PackMember, assemble, write_pack
from ..primitives.progress import Progress
from ..reading.options import ReadOptions, WriteOptions, check_mode
from ..reading.read import PendingLevel, open_tree
from ...format.names import LEAF_SUFFIX, PICKLE_SUFFIX
from .staged import staged_commit
from ..reading.storage import join_rel, local_path

__all__ = [
    "LeafJob",
    "WriteStats",
    "LevelPlan",
    "WritePlan",
    "plan_write",
    "write_tree",
    "write_levels",
    "share_tree",
    "wait_for_removals",
]

T = TypeVar("T")


@dataclass(slots=True)
class LeafJob:
    """One file to write: where (relative path), what, and how big; ``key`` is the tree key."""

    rel: str
    key: tuple[str, ...]
    tensor: torch.Tensor
    nbytes: int

    @property
    def where(self) -> str:
        """The key as error messages show it (``'w'`` or ``('a', 'w')``)."""
        return fmt_key(self.key)


@dataclass
class LevelPlan:
    """One level's directory (relative, ``""`` for the root), its metadata and key path."""

    rel: str
    meta: LevelMeta
    depth: int
    keys: tuple[str, ...] = ()


@dataclass
class WritePlan:
    """Everything a write will create, computed before any I/O."""

    levels: list[LevelPlan] = field(default_factory=list)
    leaves: list[LeafJob] = field(default_factory=list)
    pickles: list[tuple[str, bytes]] = field(default_factory=list)
    #: the pack files of small leaves (format version 3), at the root
    packs: list[PackJob] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes of leaf data the write needs on disk (leaf files and packs)."""
        return sum(j.nbytes for j in self.leaves) + sum(p.nbytes for p in self.packs)

    def make_dirs(self, staging: str) -> None:
        """Create the directory of every level below the root in ``staging``, parents first."""
        for lp in reversed(self.levels):  # deepest last
            if lp.rel:
                os.mkdir(f"{staging}/{lp.rel}")

    @property
    def total_files(self) -> int:
        """Files and directories the write creates (leaves, packs, pickles, ``meta.json`` files, levels)."""
        return len(self.leaves) + len(self.packs) + len(self.pickles) + 2 * len(self.levels)


def plan_write(level: Level, options: WriteOptions, *, dest: str | None = None) -> WritePlan:
    """Plan the files of a write (pure; raises every input error before anything is written).

    Args:
        level: the tree to write.
        options: ``like`` plans empty files of the same shapes and dtypes (``memmap_like``);
            ``allow_pickle`` pickles non-tensor values JSON cannot hold; ``copy_existing``
            copies leaves that are already memory-mapped elsewhere; ``pack_below`` packs the
            leaves smaller than that (:func:`_pack_small_leaves`).
        dest: the final absolute prefix (to decide whether a memmapped leaf already lives there).
    """
    plan = WritePlan()
    _plan_level(plan, level, "", (), 0, dest, options.like, options.allow_pickle, options.copy_existing)
    plan.levels.sort(key=lambda lp: -lp.depth)  # deepest first, root last
    if options.encryption is None:  # an encrypted leaf is never packed (WriteOptions refuses pack_below)
        _pack_small_leaves(plan, options.pack_below)
    return plan


def _pack_small_leaves(plan: WritePlan, pack_below: int | None) -> None:
    """Move the leaves under the threshold (:func:`~memtree.format.packs.packs_threshold`) from
    their own files into packs, in the order planned (so an unchanged tree gets the same packs),
    and make their entries packed ones (the root lists the packs)."""
    limit = pack_below if pack_below is not None else PACK_BELOW
    small = [j for j in plan.leaves if j.nbytes < limit]
    threshold = packs_threshold(pack_below, len(small))
    if not threshold or not small:
        return
    layout = layout_packs([j.nbytes for j in small])
    jobs = {name: PackJob(name, nbytes) for name, nbytes in layout.sizes}
    places: dict[tuple[str, ...], tuple[str, int]] = {}
    for j, (name, offset) in zip(small, layout.places):
        jobs[name].members.append(PackMember(j.key, j.tensor, j.nbytes, offset))
        places[j.key] = (name, offset)
    plan.packs = list(jobs.values())
    plan.leaves = [j for j in plan.leaves if j.key not in places]
    for lp in plan.levels:
        entries = tuple(
            _packed(e, places.get(lp.keys + (e.key,))) if isinstance(e, LeafMeta) else e for e in lp.meta.entries
        )
        packs = tuple(PackMeta(name, nbytes) for name, nbytes in layout.sizes) if not lp.rel else ()
        lp.meta = replace(lp.meta, entries=entries, packs=packs)


def _packed(entry: LeafMeta, place: tuple[str, int] | None) -> LeafMeta:
    if place is None:
        return entry
    packed: LeafMeta = entry.evolve(file="", pack=place[0], offset=place[1])
    return packed


def _plan_level(
    plan: WritePlan,
    level: Level,
    rel: str,
    path: tuple[str, ...],
    depth: int,
    dest: str | None,
    like: bool,
    allow_pickle: bool,
    copy_existing: bool,
) -> None:
    items = []
    for key, value in level.entries.items():
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKeyError(
                f"key {fmt_key(path + (key,))} contains a lone surrogate and cannot be "
                "written to meta.json (UTF-8); rename it"
            ) from None
        if isinstance(value, torch.Tensor):
            suffix = LEAF_SUFFIX
        elif isinstance(value, Level):
            suffix = ""
        elif not _json_ok(value, path + (key,), allow_pickle):
            suffix = PICKLE_SUFFIX
        else:
            suffix = None
        items.append((key, value, suffix))
    named = [(k, s) for k, _, s in items if s is not None]
    names = iter(encode_level(named))

    entries: list[Entry] = []
    for key, value, suffix in items:
        kpath = path + (key,)
        name = next(names) if suffix is not None else ""
        child_rel = f"{rel}/{name}" if rel else name
        if isinstance(value, torch.Tensor):
            leaf = _plan_leaf(plan, value, key, name, child_rel, kpath, dest, like, copy_existing)
            layout = level.layouts.get(key)
            entries.append(leaf if layout is None else replace(leaf, layout=layout))
        elif isinstance(value, Level):
            if value.subclass is not None and not starts_with_batch(value.subclass.shape, level.batch_size):
                raise BatchSizeError(
                    f"tensor subclass {fmt_key(kpath)} has shape {list(value.subclass.shape)}, which does "
                    f"not start with its level's batch_size {list(level.batch_size)}"
                )
            sub = value.subclass
            entries.append(ChildMeta(key, name) if sub is None else SubclassMeta(key, name, sub))
            _plan_level(plan, value, child_rel, kpath, depth + 1, dest, like, allow_pickle, copy_existing)
        elif suffix == PICKLE_SUFFIX:
            data = value.data if isinstance(value, NonTensor) else value
            plan.pickles.append((child_rel, pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)))
            entries.append(PickleMeta(key, name))
        else:
            data, tuples = tuples_to_lists(value.data if isinstance(value, NonTensor) else value)
            entries.append(JsonMeta(key, data, tuples=tuple(tuples) or None))
    if level.int_keys:  # a dict of training state with int keys (format version 2)
        entries = [replace(e, int_key=True) if e.key in level.int_keys else e for e in entries]
    meta = LevelMeta(tuple(level.batch_size), tuple(entries), level.type)
    check_writable(meta, _level_name(path), depth)
    plan.levels.append(LevelPlan(rel, meta, depth, path))


def _level_name(path: tuple[str, ...]) -> str:
    return f"level {fmt_key(path)}" if path else "the root level"


def _json_ok(value: object, path: tuple[str, ...], allow_pickle: bool) -> bool:
    data = value.data if isinstance(value, NonTensor) else value
    if allow_pickle:
        return json_problem(data) is None
    check_json(data, fmt_key(path))
    return True


def _plan_leaf(
    plan: WritePlan,
    tensor: torch.Tensor,
    key: str,
    name: str,
    rel: str,
    kpath: tuple[str, ...],
    dest: str | None,
    like: bool,
    copy_existing: bool,
) -> LeafMeta:
    dtype = tensor.dtype
    try:
        dtype_name(dtype)
    except DtypeError as err:
        raise DtypeError(f"leaf {fmt_key(kpath)}: {err}") from None
    if tensor.layout != torch.strided or tensor.is_nested:
        raise DtypeError(
            f"leaf {fmt_key(kpath)}: {tensor.layout} tensors cannot be stored; use .to_dense()"
        )
    if not like:
        if tensor.is_meta:
            raise DtypeError(
                f"leaf {fmt_key(kpath)} is on the meta device and has no data; use "
                "memmap_like() to allocate files for it, or load real weights first"
            )
        if type(tensor) is not torch.Tensor and isinstance(tensor, MemoryMappedTensor):
            target = os.path.join(dest, rel) if dest else None
            if tensor.filename is not None and not copy_existing and tensor.filename != target and not (
                dest and os.path.dirname(tensor.filename) == dest and is_pack_name(os.path.basename(tensor.filename))
            ):  # (a packed leaf of the destination's tree: its pack, at the root)
                raise ExistingMemmapError(
                    f"leaf {fmt_key(kpath)} is already memory-mapped from {tensor.filename}; "
                    "pass copy_existing=True to copy it into the new prefix"
                )
    shape = tuple(tensor.shape)
    if extent_bytes(shape, dtype) > MAX_NBYTES:  # a zero-element tensor: no other can be so large
        raise LimitError(
            f"leaf {fmt_key(kpath)} has the shape {list(shape)}: no element, but dims spanning "
            f"{extent_bytes(shape, dtype)} bytes, more than a reader accepts ({MAX_NBYTES}, zero "
            "dims counted as 1); give its empty dims smaller sizes"
        )
    plan.leaves.append(LeafJob(rel, kpath, tensor, tensor.nbytes))
    return LeafMeta(key, name, dtype_name(dtype), shape)


# ---------------------------------------------------------------------------------------------
# executing a plan

#: Bytes of data that cost about as much to write as creating one file (for sizing the threads).
FILE_COST = 64 * 1024
#: Work (data bytes + ``FILE_COST`` per file) each writer thread should have at least: below it,
#: starting a thread (~0.1 ms) costs more than it saves, so a small tree is written by fewer
#: threads than ``num_threads``, or by the calling thread alone.
THREAD_MIN_WORK = 4 * 1024 * 1024
#: An overwrite of a tree of at least this many files and directories deletes the old copy in a
#: background thread (a deletion of 20,000 files takes seconds); smaller old copies are deleted
#: before the write returns.
BACKGROUND_REMOVAL_FILES = 256
#: How often (seconds) a visible progress bar is advanced while writer threads run.
_PROGRESS_INTERVAL = 0.1




def write_tree(
    prefix: str | os.PathLike[str],
    level: Level | Any,
    options: WriteOptions | None = None,
    *,
    mode: str = "r+",
    stats: WriteStats | None = None,
) -> PendingLevel:
    """Write ``level`` under ``prefix`` atomically and return the new tree, opened lazily.

    The returned :class:`~memtree.store.reading.read.PendingLevel` maps each level's files when it is loaded
    (``TensorTree.memmap`` wraps it in a tree whose levels load on first use), with ``mode``.

    Args:
        prefix: destination directory (created with its parents if needed); a ``file://`` URL
            is its local path, other URLs are refused (:func:`memtree.remote.upload` writes them).
        level: the tree to write (a :class:`~memtree.format.level.Level`, or a
            :class:`~memtree.TensorTree`: anything :func:`~memtree.format.level.as_level` takes).
        options: how (:class:`~memtree.store.reading.options.WriteOptions`: sparse files or data,
            threads, replace, fsync, pickles, checksums, progress); defaults: a copy of the data,
            in this thread, replacing an existing tree, no fsync. ``num_threads`` is an upper
            bound: fewer when the tree is too small to keep them busy (:data:`THREAD_MIN_WORK`
            each).
        mode: how the returned tree maps its files (``"r+"`` or ``"r"``).
        stats: filled with what was written and linked (:class:`WriteStats`).

    With ``options.link_from`` (an incremental save), each tensor leaf whose key path exists in
    that committed tree with the same dtype and shape, no capacity, and a recorded checksum of
    the same algorithm equal to the checksum of the new bytes (computed in the writer thread
    before deciding) becomes a hard link to the old file instead of a copy, if the old file
    holds exactly the new bytes (compared; see :mod:`memtree.store.writing.linking`) and no process has
    it open for writing; the written tree stays standalone (deleting the old one loses
    nothing). The old file is opened relative to held directory descriptors without following
    links and must be a regular file of the exact size. Any failure (another filesystem,
    permissions, the link count limit, a writer, the old tree replaced meanwhile) writes the
    leaf instead. A write through memtree into either tree never changes the other: a shared
    file gets its own copy before it is written (:mod:`memtree.store.reading.unshare`), so with
    ``mode="r+"`` the returned tree copies its linked leaves when their levels load.

    Raises:
        LockError: another writer is writing the same destination.
        MemtreeError: any input or storage problem; the destination is then unchanged.
    """
    options = options if options is not None else WriteOptions()
    tree = as_level(level)
    if tree is None:
        raise InvalidArgumentError(f"write_tree writes a Level or a TensorTree, got {type(level).__name__}")
    level = tree
    remote = "memmap() writes a local directory; write the tree locally, then memtree.remote.upload(tree, url)"
    dest = os.path.realpath(os.fspath(local_path(prefix, remote=remote)))
    with gc_paused():
        plan = plan_write(level, options, dest=dest)
        if options.encrypt_names:  # random file names: the keys are only in the sealed meta.json
            hide_names(plan)
    with staged_commit(dest, existsok=options.existsok, nbytes=plan.total_bytes) as staging:
        batch = open_batch(staging.path) if options.fsync else None  # one syncfs for every file
        try:
            with LinkSource.open(options.link_from, options.checksum, staging.path, options.link_verify) as links:
                if stats is not None:
                    stats.link_error = links.error if links is not None else None
                metas = _write_staging(staging.path, plan, options, links, stats, fsync=options.fsync and batch is None)
            if batch is not None:
                sync_batch(batch, f"the new tree {dest}")
        finally:
            if batch is not None:
                os.close(batch)
        staging.publish(fsync=options.fsync, background_removal=plan.total_files >= BACKGROUND_REMOVAL_FILES)
        # the new tree, opened lazily from the metadata just written (while still locked, so it
        # is this very tree): its leaves are mapped when used, not re-opened here
        written = {tuple(rel.split("/")) if rel else (): meta for rel, meta in metas.items()}
        return open_tree(
            dest, ReadOptions(mode=check_mode(mode), allow_pickle=True, encryption=options.encryption), written=written
        )


def _thread_count(num_threads: int, files: int, nbytes: int) -> int:
    """How many writer threads ``files`` files of ``nbytes`` bytes in all keep busy (0: none)."""
    if num_threads < 2 or files < 2:
        return 0
    useful = (nbytes + FILE_COST * files) // THREAD_MIN_WORK
    return min(num_threads, files, useful) if useful >= 2 else 0


def _run(items: list[T], work: Callable[[T], int], threads: int, bar: Progress | None = None) -> None:
    """``work(item)`` for every item, by ``threads`` threads (0: this thread, in order).

    Each thread takes the next item in order when it is done with one, so big and small files
    spread evenly; ``bar`` advances by what ``work`` returns. The first failure (any exception,
    ``KeyboardInterrupt`` included) stops every thread before its next item and is raised here
    once they have all stopped.
    """
    if threads == 0:
        for item in items:
            done = work(item)
            if bar is not None:
                bar.update(done)
        return
    todo = iter(items)  # shared: each next() hands one item to one thread
    finished = [0] * threads
    failures: list[BaseException] = []

    def worker(slot: int) -> None:
        try:
            for item in todo:
                if failures:
                    return
                finished[slot] += work(item)
        except BaseException as err:  # noqa: BLE001 - raised by the calling thread
            failures.append(err)

    started: list[threading.Thread] = []
    try:
        for slot in range(threads):
            t = threading.Thread(target=worker, args=(slot,), name=f"memtree-write-{slot}")
            t.start()
            started.append(t)
        reported = 0
        for t in started:
            while t.is_alive():
                t.join(_PROGRESS_INTERVAL if bar is not None and bar.active else None)
                if bar is not None:
                    now = sum(finished)
                    bar.update(now - reported)
                    reported = now
    except BaseException as err:  # interrupted while waiting: stop the threads before raising
        failures.append(err)
        for t in started:
            t.join()
        raise
    if failures:
        raise failures[0]


def _write_staging(
    staging: str,
    plan: WritePlan,
    options: WriteOptions,
    links: LinkSource | None = None,
    stats: WriteStats | None = None,
    *,
    fsync: bool = False,
) -> dict[str, LevelMeta]:
    """Write the plan's files into ``staging`` (or link them from ``links``); returns each
    level's metadata as written (with checksums, the root's ``save_id`` and ``tree_hash``), by
    directory relative to the root. ``fsync``: fsync each file and directory (a durable write
    whose filesystem cannot flush the whole staging directory at once, :mod:`memtree.store.primitives.durability`).

    A leaf larger than one piece (a checksum chunk, or :data:`~memtree.store.writing.pieces.PIECE_BYTES`
    without checksums) is written in pieces that the writer threads share
    (:mod:`memtree.store.writing.pieces`); without writer threads, a :class:`~memtree.store.writing.pieces.Hasher`
    hashes its chunks while the calling thread writes. Link candidates, encrypted leaves and packs
    are written whole, by one thread each."""
    like, num_threads = options.like, options.num_threads
    checksum = None if like else options.checksum
    digest = digest_factory(checksum) if checksum is not None else None
    plan.make_dirs(staging)
    point("before_leaves")
    sums: dict[tuple[str, ...], str | ChunkSums] = {}  # each leaf's checksum(s), by key path
    key = options.encryption  # encryption at rest: store/primitives/crypto.py
    cipher = TreeCipher.new(key, names=options.encrypt_names) if key is not None else None

    def write_leaf(j: LeafJob) -> int:
        data = None if like else _storable(j)
        target = f"{staging}/{j.rel}"
        try:
            result: str | ChunkSums | None = None
            fallback = False
            if cipher is not None and data is not None:  # never with link_from (WriteOptions refuses it)
                result = cipher.write_leaf(
                    target, j.rel, data, j.tensor.dtype, tuple(j.tensor.shape), fsync=fsync, checksum=checksum
                )
            else:
                old = links.candidate(j.key, j.tensor) if links is not None and checksum is not None else None
                layout = chunk_bytes_for(j.nbytes)  # the chunks this write records
                if old is not None:
                    assert data is not None and checksum is not None and links is not None
                    old_layout = old.chunks.chunk_bytes if old.chunks is not None else None
                    result = _data_sums(data, j.nbytes, checksum, old_layout)  # decide before writing
                    linked = links.link(j.key, result, target, data, fsync=fsync)
                    if linked:
                        sums[j.key] = result
                        if stats is not None:
                            stats.add(j.nbytes, linked=True)
                        point("after_leaf")
                        return j.nbytes
                    fallback = linked is False  # the checksums matched, the link did not happen
                    if old_layout != layout:
                        result = None  # hashed again as written, in this write's chunks
                made = create_leaf(
                    target, data, j.nbytes, reserve=options.reserve, fsync=fsync,
                    checksum=checksum if result is None else None, chunk_bytes=layout,
                )
                if result is None:
                    result = made
        except MemtreeError:
            raise
        except OSError as err:
            raise storage_error(err, f"writing leaf {j.where}") from err
        if result is not None:
            sums[j.key] = result
        if stats is not None:
            stats.add(j.nbytes, linked=False, fallback=fallback)
        point("after_leaf")
        return j.nbytes

    hasher: Hasher | None = None

    def write_part(task: LeafJob | PackJob | tuple[Pieces, int]) -> int:
        if isinstance(task, PackJob):
            return write_pack_job(task)
        if not isinstance(task, tuple):
            return write_leaf(task)
        leaf, i = task
        try:
            last = write_piece(leaf, i, digest, fsync=fsync, hasher=hasher)
        except MemtreeError:
            raise
        except OSError as err:
            raise storage_error(err, f"writing leaf {leaf.where}") from err
        if last:
            if stats is not None:
                stats.add(leaf.nbytes, linked=False)
            point("after_leaf")
        start, stop = i * leaf.size, min((i + 1) * leaf.size, leaf.nbytes)
        return stop - start

    def write_pack_job(job: PackJob) -> int:
        data, pack_sums = (None, {}) if like else assemble(job, _storable, checksum)
        linked = None
        if data is not None and links is not None and checksum is not None:
            linked = links.link_pack(job, pack_sums, f"{staging}/{job.name}", data, fsync=fsync)
        if not linked:
            write_pack(staging, job, data, reserve=options.reserve, fsync=fsync)
        sums.update(pack_sums)
        if stats is not None:
            stats.add(job.nbytes, linked=bool(linked), fallback=linked is False)
        point("after_leaf")
        return job.nbytes

    tasks, pieced = _tasks(plan, staging, options, links, cipher is not None)
    total = plan.total_bytes
    threads = _thread_count(num_threads, len(tasks), 0 if like else total)
    with Progress(total=total, desc="memmap", unit="B", progress=options.progress) as bar:
        try:
            if threads == 0 and digest is not None and pieced and total >= THREAD_MIN_WORK:
                hasher = Hasher(digest)  # hashes the chunks while this thread writes the next ones
            _run(tasks, write_part, threads, bar)
            if hasher is not None:
                hasher.close()
        finally:
            if hasher is not None:
                hasher.close(check=False)
            for leaf in pieced.values():
                leaf.close()
    if checksum is not None:
        for key_path, leaf in pieced.items():
            sums[key_path] = leaf.sums(checksum)
    return write_levels(staging, plan, checksum=checksum, sums=sums, fsync=fsync, num_threads=num_threads,
                        cipher=cipher)


def write_levels(
    staging: str,
    plan: WritePlan,
    *,
    checksum: str | None,
    sums: dict[tuple[str, ...], str | ChunkSums],
    fsync: bool,
    num_threads: int = 0,
    cipher: TreeCipher | None = None,
) -> dict[str, LevelMeta]:
    """Write the plan's pickle files, then each level's ``meta.json`` into ``staging``, deepest
    first and the root's last (with a new ``save_id`` and, with ``checksum``, the ``tree_hash``),
    once every leaf file and pack is written.

    Args:
        staging: the staging directory of the write.
        plan: what :func:`plan_write` planned (its levels' entries as they are to be written).
        checksum: the algorithm of the leaves' checksums and of the tree hash, or ``None``.
        sums: each leaf's checksum (``"<algorithm>:<hex>"``) or per-chunk checksums, by key path.
        fsync: fsync each file and directory.
        num_threads: threads for the levels below the root.
        cipher: seals each level of an encrypted tree.

    Returns:
        Each level's metadata as written, by directory relative to the root.
    """
    written: dict[str, LevelMeta] = {}
    dumped: dict[str, bytes] = {}  # each level's meta.json bytes, for the tree hash
    pickle_sums: dict[str, str] = {}

    def write_meta(lp: LevelPlan) -> int:
        directory = f"{staging}/{lp.rel}" if lp.rel else staging
        meta = lp.meta
        if sums:
            meta = replace(meta, entries=tuple(_with_sums(e, lp.keys, sums) for e in meta.entries))
        if lp.rel:
            point("before_meta")
        else:
            point("before_root_meta")
            meta = replace(meta, save_id=uuid.uuid4().hex)
            if checksum is not None and not (cipher is not None and cipher.meta.names):  # sealed names: the macs
                hashed = meta if cipher is None else replace(cipher.seal_level(meta, ""), mac=None)
                meta = replace(meta, tree_hash=tree_hash(checksum, {**written, "": hashed}, pickle_sums, dumped))
            os.chmod(staging, 0o755)
        if cipher is not None:
            meta = cipher.seal_level(meta, lp.rel)
        data = dump_level(meta, join_rel(lp.rel, META_NAME))
        write_small_file(f"{directory}/{META_NAME}", data, fsync=fsync)
        dumped[lp.rel] = data
        if fsync:
            fsync_dir(directory)
        written[lp.rel] = meta
        return 0

    for rel, data in plan.pickles:
        write_small_file(f"{staging}/{rel}", data, fsync=fsync)
        if checksum is not None:
            pickle_sums[rel] = bytes_checksum(checksum, data)
    *children, root = plan.levels  # deepest first, the root's meta.json last
    _run(children, write_meta, _thread_count(num_threads, len(children), 0))
    write_meta(root)
    point("after_root_meta")
    return written


def _tasks(
    plan: WritePlan, staging: str, options: WriteOptions, links: LinkSource | None, encrypted: bool
) -> tuple[list[LeafJob | PackJob | tuple[Pieces, int]], dict[tuple[str, ...], Pieces]]:
    """The writer threads' tasks, biggest leaves first (so that they finish together): a leaf
    written whole (or a pack) is one task, a leaf written in pieces one task per piece, its pieces
    in a row; and the leaves written in pieces, by key path.

    Pieces serve leaves larger than one piece whose data is at hand (not ``memmap_like``), that
    are neither link candidates (decided on the whole leaf before writing) nor encrypted."""
    tasks: list[LeafJob | PackJob | tuple[Pieces, int]] = []
    pieced: dict[tuple[str, ...], Pieces] = {}
    checksum = None if options.like else options.checksum
    jobs: list[LeafJob | PackJob] = [*plan.leaves, *plan.packs]
    for j in sorted(jobs, key=lambda j: -j.nbytes):
        if isinstance(j, PackJob):
            tasks.append(j)
            continue
        size = (chunk_bytes_for(j.nbytes) if checksum is not None else None) or PIECE_BYTES
        if options.like or encrypted or j.nbytes <= size or (links is not None and links.candidate(j.key, j.tensor)):
            tasks.append(j)
            continue
        leaf = Pieces(f"{staging}/{j.rel}", _storable(j), j.nbytes, size, j.where)
        pieced[j.key] = leaf
        tasks.extend((leaf, i) for i in range(leaf.count))
    return tasks, pieced


def _storable(job: LeafJob | PackMember) -> torch.Tensor | FileRange:
    """What to write for a planned leaf: the tensor itself when it is a plain contiguous CPU
    tensor; the :class:`~memtree.store.primitives.files.FileRange` its ``file_range()`` method names, for a
    leaf whose bytes lie in another file as they are (a
    :class:`~memtree.interop.lazy.LazyLeaf` of a checkpoint: copied file to file); else a copy.

    :func:`plan_write` has checked dtype, layout and device; only the copy, when one is needed,
    is left to :func:`~memtree.store.reading.mapped.to_storable`.
    """
    tensor = job.tensor
    if is_plain_memory(tensor):
        return tensor
    file_range = getattr(tensor, "file_range", None)
    if file_range is not None:
        found: FileRange | None = file_range()
        if found is not None:
            return found
    return to_storable(tensor, fmt_key(job.key))


def _data_sums(data: torch.Tensor | FileRange, nbytes: int, algorithm: str, chunk_bytes: int | None) -> ChunkSums:
    """The checksums of a leaf's data before it is written (to decide whether to link it), in
    chunks of ``chunk_bytes`` (``None``: one chunk)."""
    if isinstance(data, FileRange):
        return file_sums(data.fd, nbytes, algorithm, chunk_bytes, data.offset)
    return view_sums(byte_view(data), algorithm, chunk_bytes)


def _with_sums(entry: Entry, keys: tuple[str, ...], sums: dict[tuple[str, ...], str | ChunkSums]) -> Entry:
    if type(entry) is LeafMeta:
        return entry.with_sums(sums[keys + (entry.key,)])
    return entry


def share_tree(level: Level, *, like: bool = False) -> Level:
    """Move every tensor leaf into anonymous shared memory (``memmap(prefix=None)``).

    Leaves that are already ``MemoryMappedTensor`` stay where they are.
    """
    out = replace(level, entries={})  # the same level: type, subclass, layouts
    for key, value in level.entries.items():
        if isinstance(value, Level):
            out.entries[key] = share_tree(value, like=like)
        elif isinstance(value, MemoryMappedTensor) and not like:
            out.entries[key] = value
        elif isinstance(value, torch.Tensor):
            out.entries[key] = MemoryMappedTensor.from_tensor(value, copy_data=not like)
        else:
            out.entries[key] = value
    return out

