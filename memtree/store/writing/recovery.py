"""The names a write uses next to its destination, and recovery after a crashed write.

A write of ``<parent>/<name>`` (``docs/format.md``, "How a write is committed") uses three kinds
of siblings of the destination, all hidden (leading ``.``) and all in the same directory:

* ``.<name>.memtree-tmp-<32 hex>/``: the staging directory the new tree is written into (for a
  single file, such as a ``.safetensors`` file: the temporary file it is written into,
  :func:`memtree.store.writing.staged.staged_file`);
* ``.<name>.memtree-old-<32 hex>/``: the old tree, only during an overwrite on a filesystem
  without ``renameat2(RENAME_EXCHANGE)`` (between the two renames of the fallback);
* ``.<name>.memtree.lock``: the writer lock; it exists while a writer holds it, or after a
  writer died, and then holds the *journal* of that writer (its staging and old-copy names).

A growth of a one-level tree (``append_``) also writes ``<name>/.meta.json.memtree-tmp-<32 hex>``
and renames it over ``meta.json``; its journal names that file too. A growth that lengthens leaf
files before committing their new capacity journals the save id it commits; the replay
(:func:`undo_interrupted_growth`) cuts the files back when that commit never happened.

A writer killed at any point leaves the destination either as it was or fully replaced, but it
may leave a staging directory, an old copy or a lock file behind. They are cleaned up

* by the **next write** to the same destination, which replays the journal in the lock file it
  takes (constant cost: one read of the lock file, no listing of the parent directory);
* by :func:`recover`, which lists the directory and applies the recovery rule to every
  destination whose lock it can take.

**Recovery rule.** If the destination is missing and exactly one old copy of it exists, the old
copy is renamed back (the interrupted overwrite never happened). Otherwise old copies and staging
directories are garbage and are deleted. Recovery only touches a destination while holding its
lock, so it never races a live writer.

Example:
    >>> import os, tempfile, torch
    >>> from memtree import TensorTree, recover
    >>> parent = tempfile.mkdtemp()
    >>> _ = TensorTree({"x": torch.ones(2)}).memmap(os.path.join(parent, "t"))
    >>> os.mkdir(os.path.join(parent, ".t.memtree-tmp-" + "0" * 32))   # a crashed write's staging
    >>> [a.split(": ")[0] for a in recover(parent)]
    ['removed staging directory']
    >>> sorted(os.listdir(parent))
    ['t']
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from dataclasses import dataclass, field
from typing import Any

from ...errors import LockError, MemtreeError, UnsafePathError
from ...format.schema import LeafMeta, LevelMeta
from .cache import remove_stale_downloads
from ..primitives.commit import WriterLock, rename_noreplace
from ..primitives.files import open_leaf
from ..reading.read import open_dir, read_meta, walk_levels
from ..reading.storage import local_path
from ...format.names import META_TMP, SIBLING, lock_path

__all__ = ["GROWTH_JOURNAL", "recover_locked", "recover"]

#: The journal field of a growth's commit: the ``save_id`` it is about to commit.
GROWTH_JOURNAL = "grow_save_id"


def _is_real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _journal_name(value: Any, name: str, kind: str) -> str | None:
    """A journal entry, accepted only if it is a sibling name of ``name`` of the given kind."""
    if type(value) is not str:
        return None
    m = SIBLING.fullmatch(value)
    if m is None or m.group("name") != name or m.group("kind") != kind:
        return None
    return value


def _restore(old: str, dst: str) -> None:
    if not rename_noreplace(old, dst):
        if os.path.lexists(dst):
            raise FileExistsError(dst)
        os.rename(old, dst)


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _remove_staging(path: str) -> str | None:
    """Remove a staging directory, or a single file's temporary file (never what a symbolic
    link names); returns what was done, or None when there is no such entry."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        _remove(path)
        return f"removed staging directory: {path}"
    if stat.S_ISREG(mode):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        return f"removed temporary file: {path}"
    return None


def recover_locked(parent: str, name: str, lock: WriterLock) -> list[str]:
    """Replay the journal of a crashed writer of ``<parent>/<name>`` (the caller holds ``lock``).

    Constant cost: one read of the lock file, and a ``stat`` of each name the journal holds.

    Returns:
        What was done, one line each (empty when the previous writer finished normally).
    """
    record = lock.read_journal()
    if not record:
        return []
    actions = []
    dst = os.path.join(parent, name)
    old = _journal_name(record.get("old"), name, "old")
    if old is not None and _is_real_dir(os.path.join(parent, old)):
        if not os.path.lexists(dst):
            _restore(os.path.join(parent, old), dst)
            actions.append(f"restored the old tree: {dst} (its overwrite was interrupted)")
        else:
            _remove(os.path.join(parent, old))
            actions.append(f"removed old copy: {os.path.join(parent, old)}")
    staging = _journal_name(record.get("staging"), name, "tmp")
    if staging is not None and (done := _remove_staging(os.path.join(parent, staging))):
        actions.append(done)
    meta_tmp = record.get("meta_tmp")
    if type(meta_tmp) is str and META_TMP.fullmatch(meta_tmp):
        path = os.path.join(dst, meta_tmp)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
                actions.append(f"removed temporary meta.json of an interrupted growth: {path}")
        except OSError:
            pass
    actions.extend(undo_interrupted_growth(dst, record))
    return actions


def undo_interrupted_growth(dest: str, record: dict[str, Any]) -> list[str]:
    """Cut back the leaf files that a growth lengthened and never committed (a journal step).

    A growth lengthens the files that need more rows right before it commits the new
    ``meta.json`` files. When its process dies in between, the committed ``meta.json`` files are
    the old ones (their ``save_id`` is not the journaled one), and every leaf file longer than
    its committed entry is cut back to that length: the tree loads as before the growth.

    Returns:
        What was done, one line per file.
    """
    pending = record.get(GROWTH_JOURNAL)
    if type(pending) is not str:
        return []
    actions: list[str] = []
    try:
        root = open_dir(dest, dest, None)
    except MemtreeError:
        return []

    def visit(dirs: tuple[str, ...], where: str, fd: int, meta: LevelMeta) -> None:
        for entry in meta.entries:
            if isinstance(entry, LeafMeta) and entry.pack is None:  # (a growth never lengthens a pack)
                actions.extend(_cut_back(fd, where, entry))

    try:
        if read_meta(root, dest, depth=0, root=True).save_id == pending:
            return []  # committed: the files are as long as the new meta.json files say
        walk_levels(root, dest, visit)
    except MemtreeError:  # a damaged tree: the loader names the problem
        pass
    finally:
        os.close(root)
    return actions


def _cut_back(dir_fd: int, where: str, entry: LeafMeta) -> list[str]:
    path = os.path.join(where, entry.file)
    try:
        fd, st = open_leaf(entry.file, entry.file_nbytes, path, dir_fd=dir_fd, strict_size=False, writable=True)
    except MemtreeError:  # missing, a link, not a regular file, shorter: not a growth's doing
        return []
    try:
        if st.st_size <= entry.file_nbytes:
            return []
        if st.st_nlink > 1:  # shares its bytes with another name: a growth never lengthens those
            return [f"left {path} alone: it is longer than its meta.json says but has other hard links"]
        os.ftruncate(fd, entry.file_nbytes)
    except OSError:
        return []
    finally:
        os.close(fd)
    return [f"cut {path} back to {entry.file_nbytes:,} bytes (its growth was interrupted)"]


@dataclass
class _Leftovers:
    staging: list[str] = field(default_factory=list)
    old: list[str] = field(default_factory=list)
    lock: bool = False


def _scan(parent: str) -> dict[str, _Leftovers]:
    found: dict[str, _Leftovers] = {}
    try:
        names = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in names:
        m = SIBLING.fullmatch(entry)
        if m is None:
            continue
        item = found.setdefault(m.group("name"), _Leftovers())
        if m.group("lock"):
            item.lock = True
        elif m.group("kind") == "tmp":
            item.staging.append(entry)
        else:
            item.old.append(entry)
    return found


def _recover_name(parent: str, name: str, left: _Leftovers) -> list[str]:
    dst = os.path.join(parent, name)
    lock = WriterLock(lock_path(parent, name), dst, timeout=0)
    try:
        lock.acquire()
    except LockError:
        return [f"skipped {dst}: a writer holds its lock right now"]
    except UnsafePathError as err:
        return [f"skipped {dst}: {err}"]
    try:
        actions = recover_locked(parent, name, lock)
        olds = sorted(o for o in left.old if _is_real_dir(os.path.join(parent, o)))
        if not os.path.lexists(dst) and olds:
            if len(olds) == 1:
                _restore(os.path.join(parent, olds[0]), dst)
                actions.append(f"restored the old tree: {dst} (its overwrite was interrupted)")
            else:
                actions.append(
                    f"left {len(olds)} old copies of the missing {dst} in place "
                    f"({', '.join(olds)}): which one is newest is unknown; rename one back by hand"
                )
            olds = []
        for old in olds:
            _remove(os.path.join(parent, old))
            actions.append(f"removed old copy: {os.path.join(parent, old)}")
        unnamed = []  # temporary files no journal names: their writers take no lock
        for staging in sorted(left.staging):
            path = os.path.join(parent, staging)
            if _is_real_dir(path):
                _remove(path)
                actions.append(f"removed staging directory: {path}")
            elif os.path.isfile(path) and not os.path.islink(path):
                unnamed.append(
                    f"left {path}: a temporary file that no crashed writer's journal names (a "
                    "MemoryMappedTensor file being written, or one left by a memtree older than "
                    "the journaled single-file writes); if no process is writing it, remove it: "
                    f"rm -- {shlex.quote(path)}"
                )
        if left.lock and not actions:
            actions.append(f"removed stale lock file: {lock.path}")
        return actions + unnamed
    finally:
        lock.release()


def recover(path: str | os.PathLike[str]) -> list[str]:
    """Finish what crashed writers left behind, next to a tree or in a directory of trees.

    For the destination ``path`` itself (``path`` is a tree's prefix, even a missing one) and, if
    ``path`` is a directory, for every destination inside it: restore a destination whose
    overwrite was interrupted between its two renames (the recovery rule in the module
    docstring), then delete stale staging directories, old copies and lock files, and the
    temporary file of a single-file write (a ``.safetensors`` file) that a crashed writer's
    journal names (a temporary file no journal names is left, with a line that gives the
    command to remove it: its writer may still be writing it). Destinations
    whose lock is held by a live writer are skipped, and so are those whose lock file is not a
    regular file with a single name (a link, a FIFO...: memtree would write its journal into
    it), each with a line that says why. Writers do the same for their own
    destination when they take its lock, so calling this is only needed to reclaim space (or to
    restore a tree) without writing to it again.

    Args:
        path: a tree's prefix, or a directory that holds trees.

    Returns:
        One line per action taken (empty when there was nothing to do).

    Example:
        >>> import tempfile
        >>> recover(tempfile.mkdtemp())
        []
    """
    where = local_path(path, remote="recover() repairs local directories only")
    real = os.path.realpath(os.fspath(where))
    actions: list[str] = []
    parent, name = os.path.split(real)
    if name:
        left = _scan(parent).get(name)
        if left is not None:
            actions += _recover_name(parent, name, left)
    if _is_real_dir(real):
        for child, left in sorted(_scan(real).items()):
            actions += _recover_name(real, child, left)
        actions += remove_stale_downloads(real)  # a remote cache directory (memtree.store.writing.cache)
    return actions
