"""Writing a tree to a prefix: plan, write into a staging directory, commit by rename.

What ``memmap``/``memmap_``/``memmap_like`` write, in order (``docs/format.md``, "How a write is
committed"):

1. :func:`plan_write` turns a :class:`~memtree.level.Level` into a :class:`WritePlan` (pure: no
   I/O): escaped names, one job per leaf, the metadata of every level. Every error the input
   can cause (bad dtype, non-JSON value, foreign memmap...) is raised here, before any file
   exists.
2. :func:`write_tree` takes the destination's writer lock ``.<name>.memtree.lock`` (cleaning up
   after a writer that crashed, see :mod:`memtree.recover`), creates ``.<name>.memtree-tmp-<hex>``
   next to the destination, writes the leaves (in a thread pool when ``num_threads > 0``,
   hashing them on the way with ``checksum=``), then each level's ``meta.json`` deepest first and
   the root's last, and renames the staging directory onto the destination: ``RENAME_NOREPLACE``
   for a new destination, an atomic ``RENAME_EXCHANGE`` when it replaces an older tree (two
   journaled renames where the filesystem lacks it).
3. The written files are mapped (still under the lock) and returned as a ``Level`` of
   ``MemoryMappedTensor``.

Any failure before the rename removes the staging directory and leaves the destination as it was.
``memtree._faults.point`` marks each step for the crash tests.

Example:
    >>> import tempfile, torch
    >>> from memtree.level import Level
    >>> from memtree.write import write_tree
    >>> out = write_tree(tempfile.mkdtemp() + "/t", Level((), {"x": torch.ones(2)}))
    >>> out.entries["x"].filename.endswith("x.memmap")
    True
"""

from __future__ import annotations

import os
import pickle
import shutil
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from math import prod

import orjson
import torch

from .dtypes import dtype_name, itemsize
from .errors import (
    DestinationExistsError,
    DtypeError,
    ExistingMemmapError,
    InvalidKeyError,
    MemtreeError,
)
from ._faults import point
from .fileio import (
    WriterLock,
    check_checksum_option,
    check_free_space,
    create_leaf,
    exchange,
    fsync_dir,
    open_checked,
    rename_noreplace,
    storage_error,
    write_small_file,
)
from .format import (
    FORMAT,
    LEAF_SUFFIX,
    PICKLE_SUFFIX,
    ChildMeta,
    Entry,
    JsonMeta,
    LeafMeta,
    LevelMeta,
    PickleMeta,
    dump_level,
)
from .keys import META_NAME, encode_level
from .level import Level
from .mmap_tensor import MemoryMappedTensor, map_leaf, to_storable
from .nontensor import NonTensor, check_json, json_problem
from .progress import Progress
from .recover import lock_path, old_path, recover_locked, staging_path

__all__ = [
    "LeafJob",
    "LevelPlan",
    "WritePlan",
    "plan_write",
    "write_tree",
    "share_tree",
    "destination_state",
    "publish",
]


@dataclass
class LeafJob:
    """One file to write: where (relative path), what, and how big."""

    rel: str
    where: str
    tensor: torch.Tensor
    nbytes: int


@dataclass
class LevelPlan:
    """One level's directory (relative, ``""`` for the root) and its metadata."""

    rel: str
    meta: LevelMeta
    depth: int


@dataclass
class WritePlan:
    """Everything a write will create, computed before any I/O."""

    levels: list[LevelPlan] = field(default_factory=list)
    leaves: list[LeafJob] = field(default_factory=list)
    pickles: list[tuple[str, bytes]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Bytes of leaf data the write needs on disk."""
        return sum(j.nbytes for j in self.leaves)


def _key_label(path: tuple[str, ...]) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


def plan_write(
    level: Level,
    *,
    dest: str | None = None,
    like: bool = False,
    allow_pickle: bool = False,
    copy_existing: bool = False,
) -> WritePlan:
    """Plan the files of a write (pure; raises every input error before anything is written).

    Args:
        level: the tree to write.
        dest: the final absolute prefix (to decide whether a memmapped leaf already lives there).
        like: plan empty files of the same shapes and dtypes (``memmap_like``).
        allow_pickle: pickle non-tensor values that JSON cannot hold.
        copy_existing: copy leaves that are already memory-mapped elsewhere.
    """
    plan = WritePlan()
    _plan_level(plan, level, "", (), 0, dest, like, allow_pickle, copy_existing)
    plan.levels.sort(key=lambda lp: -lp.depth)  # deepest first, root last
    return plan


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
                f"key {_key_label(path + (key,))} contains a lone surrogate and cannot be "
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
            entries.append(_plan_leaf(plan, value, key, name, child_rel, kpath, dest, like, copy_existing))
        elif isinstance(value, Level):
            entries.append(ChildMeta(key, name))
            _plan_level(plan, value, child_rel, kpath, depth + 1, dest, like, allow_pickle, copy_existing)
        elif suffix == PICKLE_SUFFIX:
            data = value.data if isinstance(value, NonTensor) else value
            plan.pickles.append((child_rel, pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)))
            entries.append(PickleMeta(key, name))
        else:
            entries.append(JsonMeta(key, value.data if isinstance(value, NonTensor) else value))
    plan.levels.append(LevelPlan(rel, LevelMeta(tuple(level.batch_size), tuple(entries), level.type), depth))


def _json_ok(value: object, path: tuple[str, ...], allow_pickle: bool) -> bool:
    data = value.data if isinstance(value, NonTensor) else value
    if allow_pickle:
        return json_problem(data) is None
    check_json(data, _key_label(path))
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
    where = _key_label(kpath)
    try:
        dtype_name(tensor.dtype)
    except DtypeError as err:
        raise DtypeError(f"leaf {where}: {err}") from None
    if tensor.layout != torch.strided or tensor.is_nested:
        raise DtypeError(f"leaf {where}: {tensor.layout} tensors cannot be stored; use .to_dense()")
    if not like:
        if tensor.device.type == "meta":
            raise DtypeError(
                f"leaf {where} is on the meta device and has no data; use memmap_like() to "
                "allocate files for it, or load real weights first"
            )
        if isinstance(tensor, MemoryMappedTensor) and tensor.filename is not None and not copy_existing:
            target = os.path.join(dest, rel) if dest else None
            if tensor.filename != target:
                raise ExistingMemmapError(
                    f"leaf {where} is already memory-mapped from {tensor.filename}; pass "
                    "copy_existing=True to copy it into the new prefix"
                )
    shape = tuple(tensor.shape)
    nbytes = prod(shape) * itemsize(tensor.dtype)
    plan.leaves.append(LeafJob(rel, where, tensor, nbytes))
    return LeafMeta(key, name, tensor.dtype, shape)


# ---------------------------------------------------------------------------------------------
# executing a plan

#: Seconds a writer waits for another writer of the same destination before raising LockError.
LOCK_TIMEOUT = 1.0


def destination_state(dest: str, existsok: bool) -> str:
    """``"absent"``, ``"empty"`` (an empty directory) or ``"tree"``; raise if it must not be replaced.

    Constant cost: it looks at one entry of the directory and at its ``meta.json``.
    """
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return "absent"
    if not stat.S_ISDIR(st.st_mode):
        raise DestinationExistsError(
            f"{dest} exists and is not a directory; choose another prefix or remove it"
        )
    with os.scandir(dest) as it:
        if next(it, None) is None:
            return "empty"
    if not existsok:
        raise DestinationExistsError(
            f"{dest} already exists; pass existsok=True to replace it, or choose another prefix"
        )
    if _is_memtree_meta(os.path.join(dest, META_NAME)):
        return "tree"
    raise DestinationExistsError(
        f"{dest} exists, is not empty and is not a memtree directory; memtree never replaces "
        "it. Choose another prefix or empty it yourself"
    )


def _is_memtree_meta(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, 4096, 0)
        return b'"format":"memtree"' in head or orjson.loads(head).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False
    finally:
        os.close(fd)


def write_tree(
    prefix: str | os.PathLike[str],
    level: Level,
    *,
    like: bool = False,
    num_threads: int = 0,
    existsok: bool = True,
    fsync: bool = False,
    reserve: bool = False,
    allow_pickle: bool = False,
    copy_existing: bool = False,
    mode: str = "r+",
    checksum: str | None = None,
    progress: bool | None = None,
) -> Level:
    """Write ``level`` under ``prefix`` atomically and return it mapped from the new files.

    Args:
        prefix: destination directory (created with its parents if needed).
        like: create zero-filled (sparse) files instead of copying data (``memmap_like``).
        num_threads: leaf files written concurrently by this many threads (0: this thread).
        existsok: allow replacing an existing memtree directory (atomically).
        fsync: fsync files and directories so the commit survives power loss.
        reserve: with ``like``, allocate disk blocks instead of leaving files sparse.
        allow_pickle: pickle non-tensor values JSON cannot hold.
        copy_existing: copy leaves already memory-mapped from another prefix.
        checksum: ``"crc32"`` or ``"sha256"`` records each leaf's checksum in ``meta.json``
            (computed while writing); not with ``like``.
        progress: a progress bar of the bytes written (:mod:`memtree.progress`): ``None``
            on a terminal only, ``True``/``False`` forced.

    Raises:
        LockError: another writer is writing the same destination.
        MemtreeError: any input or storage problem; the destination is then unchanged.
    """
    check_checksum_option(checksum)
    if like and checksum is not None:
        raise ValueError("memmap_like writes no data, so it records no checksum; pass checksum=None")
    dest = os.path.realpath(os.fspath(prefix))
    plan = plan_write(level, dest=dest, like=like, allow_pickle=allow_pickle, copy_existing=copy_existing)
    parent, name = os.path.split(dest)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise storage_error(err, f"creating the parent directory of {dest}") from err
    with WriterLock(lock_path(parent, name), dest, timeout=LOCK_TIMEOUT) as lock:
        try:
            recover_locked(parent, name, lock)
            point("after_lock")
            state = destination_state(dest, existsok)
            check_free_space(parent, plan.total_bytes, f"writing {dest}")
            staging = staging_path(parent, name)
            lock.write_journal({"staging": os.path.basename(staging)}, fsync=False)
            os.mkdir(staging, 0o700)
        except MemtreeError:
            raise
        except OSError as err:
            raise storage_error(err, f"preparing to write {dest}") from err
        point("staging_created")
        try:
            _write_staging(staging, plan, like, num_threads, fsync, reserve, checksum, progress)
            publish(staging, dest, state, fsync, lock)
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, OSError) and not isinstance(err, MemtreeError):
                raise storage_error(err, f"writing {dest}") from err
            raise
        return _map_written(dest, level, plan, mode)


def _write_staging(
    staging: str,
    plan: WritePlan,
    like: bool,
    num_threads: int,
    fsync: bool,
    reserve: bool,
    checksum: str | None,
    progress: bool | None,
) -> None:
    for lp in reversed(plan.levels):  # root first: parents before children
        if lp.rel:
            os.mkdir(os.path.join(staging, lp.rel))
    point("before_leaves")
    sums: dict[str, str] = {}

    def job(j: LeafJob) -> None:
        data = None if like else to_storable(j.tensor, j.where)
        try:
            digest = create_leaf(
                os.path.join(staging, j.rel), data, j.nbytes, reserve=reserve, fsync=fsync, checksum=checksum
            )
        except OSError as err:
            raise storage_error(err, f"writing leaf {j.where}") from err
        if digest is not None:
            sums[j.rel] = digest
        point("after_leaf")

    jobs = sorted(plan.leaves, key=lambda j: -j.nbytes)
    with Progress(total=plan.total_bytes, desc="memmap", unit="B", progress=progress) as bar:
        if num_threads > 0 and len(jobs) > 1:
            with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="memtree-write") as pool:
                futures = {pool.submit(job, j): j for j in jobs}
                try:
                    for f in as_completed(futures):
                        f.result()  # the first failure is raised once running threads stopped
                        bar.update(futures[f].nbytes)
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
        else:
            for j in jobs:
                job(j)
                bar.update(j.nbytes)
    for rel, data in plan.pickles:
        write_small_file(os.path.join(staging, rel), data, fsync=fsync)
    for lp in plan.levels:  # deepest first, the root's meta.json last
        directory = os.path.join(staging, lp.rel)
        meta = lp.meta
        if sums:
            meta = replace(meta, entries=tuple(_with_checksum(e, lp.rel, sums) for e in meta.entries))
        if lp.rel:
            point("before_meta")
        else:
            point("before_root_meta")
            meta = replace(meta, save_id=uuid.uuid4().hex)
            os.chmod(staging, 0o755)
        write_small_file(os.path.join(directory, META_NAME), dump_level(meta), fsync=fsync)
        if fsync:
            fsync_dir(directory)
    point("after_root_meta")


def _with_checksum(entry: Entry, rel: str, sums: dict[str, str]) -> Entry:
    if isinstance(entry, LeafMeta):
        return replace(entry, checksum=sums[f"{rel}/{entry.file}" if rel else entry.file])
    return entry


def publish(staging: str, dest: str, state: str, fsync: bool, lock: WriterLock) -> None:
    """Make the complete staging tree the destination, in one atomic step (see format.md)."""
    parent = os.path.dirname(dest)
    point("before_publish")
    if state == "absent":
        try:
            renamed = rename_noreplace(staging, dest)
        except FileExistsError:
            renamed = False
        if not renamed:
            if os.path.lexists(dest):  # created by someone else (memtree writers hold the lock)
                raise DestinationExistsError(
                    f"{dest} appeared while memtree was writing it; nothing was replaced. "
                    "Choose another prefix or remove it"
                )
            os.rename(staging, dest)  # no RENAME_NOREPLACE on this filesystem
    elif state == "empty":
        os.rename(staging, dest)  # replaces an empty directory, fails (ENOTEMPTY) on any other
    elif exchange(staging, dest):
        point("after_publish")
        if fsync:
            fsync_dir(parent)
        point("before_old_removed")
        shutil.rmtree(staging, ignore_errors=True)  # staging now holds the old tree
        return
    else:  # no RENAME_EXCHANGE on this filesystem: two renames, journaled for recovery
        old = old_path(parent, os.path.basename(dest))
        lock.write_journal(
            {"staging": os.path.basename(staging), "old": os.path.basename(old)}, fsync=fsync
        )
        os.rename(dest, old)
        point("between_renames")
        try:
            os.rename(staging, dest)
        except BaseException:
            os.rename(old, dest)
            raise
        point("after_publish")
        if fsync:
            fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    point("after_publish")
    if fsync:
        fsync_dir(parent)


def _map_written(dest: str, level: Level, plan: WritePlan, mode: str) -> Level:
    metas = {lp.rel: lp.meta for lp in plan.levels}

    def rebuild(lvl: Level, rel: str) -> Level:
        out = Level(lvl.batch_size, {}, lvl.type)
        for entry in metas[rel].entries:
            value = lvl.entries[entry.key]
            if isinstance(entry, LeafMeta):
                path = os.path.join(dest, rel, entry.file)
                fd = open_checked(path, entry.nbytes, path)
                try:
                    out.entries[entry.key] = map_leaf(
                        fd, path, entry.dtype, entry.shape, readonly=mode == "r"
                    )
                finally:
                    os.close(fd)
            elif isinstance(entry, ChildMeta):
                assert isinstance(value, Level)
                out.entries[entry.key] = rebuild(value, f"{rel}/{entry.dir}" if rel else entry.dir)
            else:
                out.entries[entry.key] = value
        return out

    return rebuild(level, "")


def share_tree(level: Level, *, like: bool = False) -> Level:
    """Move every tensor leaf into anonymous shared memory (``memmap(prefix=None)``).

    Leaves that are already ``MemoryMappedTensor`` stay where they are.
    """
    out = Level(level.batch_size, {}, level.type)
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

