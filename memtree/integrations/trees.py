"""A framework's checkpoint dict as a memtree tree at a path the framework chooses.

Lightning names a checkpoint by its path (``checkpoints/epoch=1-step=10.ckpt``), the Trainer by
its directory (``checkpoint-500``); :class:`memtree.Checkpointer` numbers steps under one root.
The integrations therefore write each checkpoint with the very steps a Checkpointer takes for a
step, at the framework's path:

* :func:`save_tree`: the dict becomes levels (:func:`memtree.integrations.values.encode`, then
  :func:`memtree.training.state.state_to_level`), written by
  :func:`memtree.training.commit.write_state_tree`, as a Checkpointer writes a step: atomic (a staging directory renamed onto the path, the
  old tree replaced in one ``renameat2`` exchange), checksummed, every leaf whose bytes equal the
  ``link_from`` tree's hard-linked instead of written, fsynced with ``fsync=True``;
* :func:`load_tree`: the tree read whole into memory (never mapped: training updates the
  tensors in place), every leaf checked against its checksum, the dict rebuilt with its types;
* :func:`remove_tree`: under the path's writer lock (no save of it in flight), the directory
  renamed to a staging name (gone for every reader at once), then deleted; a crash before the
  deletion ends leaves a staging directory that the lock's journal names, which the next writer
  of that path (or :func:`memtree.recover`) removes.

Example:
    >>> import os, tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> _ = save_tree(os.path.join(d, "a.ckpt"), {"w": torch.ones(2), "best": float("inf")})
    >>> stats = save_tree(os.path.join(d, "b.ckpt"), {"w": torch.ones(2), "best": 1.0},
    ...                   link_from=os.path.join(d, "a.ckpt"))
    >>> stats.files_linked, load_tree(os.path.join(d, "a.ckpt"))["best"]
    (1, inf)
    >>> remove_tree(os.path.join(d, "a.ckpt")); sorted(os.listdir(d))
    ['b.ckpt']
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import CheckpointFormatError, CheckpointNotFoundError, InvalidArgumentError, LockError
from ..format.names import META_NAME, lock_path, staging_path
from ..store.primitives.commit import LOCK_TIMEOUT, WriterLock
from ..store.reading.options import ReadOptions, normalize_keys
from ..store.reading.read import open_tree
from ..store.reading.storage import local_path
from ..store.writing.write import WriteStats
from ..training.commit import write_state_tree
from ..training.state import level_to_state, state_to_level
from .values import RECORD_KEY, decode, encode

#: Times a write waits the writer lock's timeout (:data:`~memtree.store.primitives.commit.LOCK_TIMEOUT`)
#: for another process writing the same path, before the ``LockError`` is raised.
_LOCK_ATTEMPTS = 60

__all__ = ["local_checkpoint_path", "is_tree", "newest_tree", "save_tree", "write_level", "load_tree", "remove_tree"]


def local_checkpoint_path(path: str | os.PathLike[str], who: str) -> str:
    """The absolute local path of a checkpoint ``path`` (a ``file://`` URL is its path).

    Raises:
        InvalidArgumentError: a remote URL (``s3://``...): ``who`` writes local directories.

    Example:
        >>> local_checkpoint_path("file:///tmp/x.ckpt", "MemtreeCheckpointIO")
        '/tmp/x.ckpt'
    """
    where = local_path(
        path,
        remote=f"{who} writes checkpoints as local directories; write them to a local (or mounted) "
        "directory, then copy them to remote storage (memtree.remote.upload reads them from there)",
    )
    return os.path.abspath(os.fspath(where))


def is_tree(path: str) -> bool:
    """True if ``path`` is a directory (not a link) holding a committed ``meta.json``.

    Example:
        >>> import tempfile
        >>> is_tree(tempfile.mkdtemp())
        False
    """
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(os.lstat(os.path.join(path, META_NAME)).st_mode)
    except OSError:
        return False


def newest_tree(paths: Iterable[str]) -> str | None:
    """The first of ``paths`` (newest first) that is a tree now (:func:`is_tree`), or ``None``.

    Example:
        >>> newest_tree(["/nonexistent/a", "/nonexistent/b"]) is None
        True
    """
    return next((p for p in paths if is_tree(p)), None)


def save_tree(
    path: str,
    state: Mapping[str, Any],
    *,
    link_from: str | None = None,
    fsync: bool = False,
    allow_pickle: bool = False,
    snapshot: bool = False,
    pickle_hint: str = "pass allow_pickle=True",
) -> WriteStats:
    """Write the checkpoint dict ``state`` as a tree at ``path`` (replacing a tree there).

    Args:
        path: the destination (absolute, local).
        state: the checkpoint (:func:`memtree.integrations.values.encode` says what it may hold).
        link_from: a committed tree (the previous checkpoint): leaves with equal bytes are linked.
        fsync: make the checkpoint durable (files, directories, the parent) before it counts.
        allow_pickle: pickle the values nothing else can hold (see
            :mod:`memtree.integrations.values`); else they are refused.
        snapshot: copy the tensors before converting (for a save that runs in the background).
        pickle_hint: how the user turns ``allow_pickle`` on, for the refusal message.

    Returns:
        What was written and linked.

    Raises:
        DestinationExistsError: ``path`` exists and is not a memtree tree (a file, another
            directory): memtree never replaces it.
        NonTensorValueError, KeyTypeError, KeyCollisionError: a value or key a tree cannot keep.
        LockError: another writer holds ``path`` longer than the lock timeout.
    """
    level = state_to_level(encode(state, allow_pickle=allow_pickle, snapshot=snapshot, pickle_hint=pickle_hint))
    return write_level(path, level, link_from=link_from, fsync=fsync)


def write_level(path: str, level: Any, *, link_from: str | None, fsync: bool) -> WriteStats:
    """Write levels made by :func:`save_tree`'s first step (the part an async save defers).

    Example:
        >>> import tempfile, torch
        >>> from memtree.training.state import state_to_level
        >>> write_level(tempfile.mkdtemp() + "/t", state_to_level({"x": torch.ones(1)}),
        ...             link_from=None, fsync=False).files_written
        1
    """
    for attempt in range(_LOCK_ATTEMPTS):
        try:
            return write_state_tree(path, level, link_from=link_from, fsync=fsync)
        except LockError:  # another process writes this very path (two trainers, one name)
            if attempt == _LOCK_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def load_tree(
    path: str,
    *,
    keys: list[str] | None = None,
    allow_pickle: bool = False,
    verify: bool = True,
    pickle_hint: str = "pass allow_pickle=True",
) -> dict[str, Any]:
    """The checkpoint dict saved at ``path`` by :func:`save_tree`, tensors in memory (CPU).

    Args:
        path: the checkpoint's directory.
        keys: read only these top-level keys (the others are not opened); ``None``: all.
        allow_pickle: unpickle values saved pickled; else such a checkpoint is refused.
        verify: check every leaf against its recorded checksum before it is used.
        pickle_hint: how the user turns ``allow_pickle`` on, for the refusal message.

    Raises:
        CheckpointNotFoundError: nothing at ``path``.
        NotAMemtreeError, MetaFormatError, IntegrityError, ...: a damaged or foreign directory
            (the loader's checks, each naming the file).
        CheckpointFormatError: a tree that does not hold a checkpoint dict.
        PickleNotAllowedError: a value saved pickled, without ``allow_pickle``.
    """
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    options = ReadOptions(mode="r", mmap=False, verify=verify)
    level = open_tree(path, options)
    if keys is not None:  # those of them the checkpoint holds (a scaler, say, may be absent)
        present = {e.key for e in level.meta.entries}
        wanted = [k for k in (*keys, RECORD_KEY) if k in present]
        if not wanted:
            return {}
        level = open_tree(path, ReadOptions(normalize_keys(wanted), mode="r", mmap=False, verify=verify))
    state = level_to_state(level)
    if type(state) is not dict:
        raise CheckpointFormatError(
            f"{path} holds a {type(state).__name__}, not a checkpoint dict: it was not written as a "
            "checkpoint (load it with memtree.load_memmap)"
        )
    return decode(state, allow_pickle=allow_pickle, pickle_hint=pickle_hint, partial=keys is not None)


def remove_tree(path: str, *, replaceable: Callable[[str], bool] = is_tree) -> None:
    """Remove the checkpoint directory ``path`` at once for every reader, then delete it.

    Nothing happens if ``path`` does not exist. A regular file or a symbolic link (a
    ``torch.save`` checkpoint of an earlier run, Lightning's ``last.ckpt`` link) is unlinked.

    Args:
        path: the checkpoint (absolute).
        replaceable: accepts the directories that may be removed (default: memtree trees);
            others are refused, so that a wrong path never deletes a foreign directory.

    Raises:
        InvalidArgumentError: ``path`` is a directory ``replaceable`` refuses.
        LockError: a save of ``path`` holds its lock longer than the lock timeout.
    """
    parent, name = os.path.split(path)
    with WriterLock(lock_path(parent, name), path, timeout=LOCK_TIMEOUT * _LOCK_ATTEMPTS) as lock:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return
        if not replaceable(path):
            raise InvalidArgumentError(
                f"{path} is a directory memtree did not write as a checkpoint; it is left as it is "
                "(remove it yourself if it should go)"
            )
        gone = staging_path(parent, name)
        lock.write_journal({"staging": os.path.basename(gone)}, fsync=False)
        os.rename(path, gone)
        shutil.rmtree(gone, ignore_errors=True)  # under the lock: its journal names what is left
