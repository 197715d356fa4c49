"""``staged_directory``: write a directory of any layout and publish it with memtree's commit.

A memtree tree is published by :func:`~memtree.store.write.write_tree`: a staging directory
next to the destination, filled, then renamed into place (``RENAME_NOREPLACE``, or
``RENAME_EXCHANGE`` over an old copy) under the writer lock, with the crash journal that
:func:`memtree.recover` replays. Directories of other layouts (Hugging Face shards and their
index, tensordict's ``memmap`` layout) are published by the very same steps through this
context manager: the caller fills the staging directory it is given, and the destination
appears complete, or not at all.

An existing destination is refused unless ``existsok``; even then only an empty directory, a
memtree tree, or a directory that ``replaceable(path)`` accepts (one that holds what the caller
writes: a model directory, a tensordict directory) is replaced, never an arbitrary directory.

Example:
    >>> import os, tempfile
    >>> d = os.path.join(tempfile.mkdtemp(), "out")
    >>> with staged_directory(d, existsok=False) as staging:
    ...     _ = open(os.path.join(staging, "a.txt"), "w").write("complete")
    >>> os.listdir(d), open(os.path.join(d, "a.txt")).read()
    (['a.txt'], 'complete')
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import DestinationExistsError, MemtreeError
from ..format.names import lock_path, staging_path
from .commit import WriterLock
from .faults import point
from .files import check_free_space, storage_error
from .recovery import recover_locked
from .storage import local_path
from .write import LOCK_TIMEOUT, destination_state, publish

__all__ = ["staged_directory"]


def _state(dest: str, existsok: bool, replaceable: Callable[[str], bool] | None) -> str:
    try:
        return destination_state(dest, existsok)
    except DestinationExistsError:
        if existsok and replaceable is not None and os.path.isdir(dest) and not os.path.islink(dest):
            if replaceable(dest):
                return "tree"
        raise


@contextmanager
def staged_directory(
    dest: str | os.PathLike[str],
    *,
    existsok: bool,
    fsync: bool = False,
    nbytes: int = 0,
    replaceable: Callable[[str], bool] | None = None,
) -> Iterator[str]:
    """Yield an empty staging directory; when the block succeeds, publish it as ``dest``.

    Args:
        dest: the directory to create (its parents are created if needed).
        existsok: replace an existing destination (atomically) instead of refusing it.
        fsync: make the published directory durable (the caller fsyncs the files it writes;
            the parent directory is fsynced after the rename).
        nbytes: bytes the caller will write, checked against the free space first.
        replaceable: with ``existsok``, accepts a non-memtree directory as one that may be
            replaced (e.g. "holds only model shards"); others are refused.

    Raises:
        DestinationExistsError: ``dest`` exists (see above).
        LockError: another memtree writer holds the destination.
        StorageError: the filesystem refused something; ``dest`` is then unchanged and the
            staging directory removed.
    """
    where = local_path(dest, remote="this writes a local directory; write it locally, then copy it")
    dest = os.path.realpath(os.fspath(where))
    parent, name = os.path.split(dest)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise storage_error(err, f"creating the parent directory of {dest}") from err
    with WriterLock(lock_path(parent, name), dest, timeout=LOCK_TIMEOUT) as lock:
        try:
            recover_locked(parent, name, lock)
            state = _state(dest, existsok, replaceable)
            check_free_space(parent, nbytes, f"writing {dest}")
            staging = staging_path(parent, name)
            lock.write_journal({"staging": os.path.basename(staging)}, fsync=False)
            os.mkdir(staging, 0o700)
        except MemtreeError:
            raise
        except OSError as err:
            raise storage_error(err, f"preparing to write {dest}") from err
        point("staging_created")
        try:
            yield staging
            os.chmod(staging, 0o755)
            if fsync:
                _fsync_tree(staging)
            publish(staging, dest, state, fsync, lock)
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, OSError) and not isinstance(err, MemtreeError):
                raise storage_error(err, f"writing {dest}") from err
            raise


def _fsync_tree(root: str) -> None:
    """fsync every directory under ``root`` (the files were fsynced by their writers)."""
    for here, _dirs, _files in os.walk(root):
        fd = os.open(here, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
