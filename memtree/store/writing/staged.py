"""Staging directories: how every memtree directory is written and then published atomically.

:func:`staged_commit` is the one definition of the steps around a directory write (``docs/format.md``,
"How a write is committed"): create the parent, take the destination's writer lock
``.<name>.memtree.lock`` (cleaning up after a writer that crashed, :mod:`memtree.store.writing.recovery`),
decide what an existing destination is (:func:`~memtree.store.primitives.commit.destination_state`), let the
trees this process opened from it keep their data (:func:`~memtree.store.reading.read.load_pending_at`),
check the free space, record the staging directory ``.<name>.memtree-tmp-<hex>`` in the lock's
journal and create it. The caller fills it and calls :meth:`Staging.publish`
(:func:`~memtree.store.primitives.commit.publish`: ``RENAME_NOREPLACE``, or ``RENAME_EXCHANGE`` over an old
copy), still under the lock. Any failure before the publish removes the staging directory and
leaves the destination as it was.

:func:`~memtree.store.writing.write.write_tree` writes a memtree tree this way.
:func:`staged_directory` publishes directories of other layouts (Hugging Face shards and their
index, tensordict's ``memmap`` layout) by the very same steps: the caller fills the staging
directory it is given, and the destination appears complete, or not at all.

An existing destination is refused unless ``existsok``; even then only an empty directory, a
memtree tree, or a directory that ``replaceable(path)`` accepts (one that holds what the caller
writes: a model directory, a tensordict directory) is replaced, never an arbitrary directory.

:func:`staged_file` is the same for one file (a ``.safetensors`` file): under the destination's
writer lock, the temporary file ``.<name>.memtree-tmp-<hex>`` is named in the lock's journal
before it is created, and renamed onto the destination when complete. A writer killed at any
point leaves the destination as it was or complete; its temporary file is removed by the next
write of the same destination (which replays the journal) and by :func:`memtree.recover`.

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

from ...errors import DestinationExistsError, MemtreeError
from ...format.names import lock_path, staging_path
from ..primitives import commit
from ..primitives.commit import WriterLock, destination_state, fsync_dir, publish
from ..primitives.faults import point
from ..primitives.files import check_free_space, replacing_file, storage_error
from ..reading.read import load_pending_at
from .recovery import recover_locked
from ..reading.storage import local_path

__all__ = ["Staging", "staged_commit", "staged_directory", "staged_file"]


class Staging:
    """A staging directory being filled, under its destination's writer lock (:func:`staged_commit`).

    Attributes:
        path: the staging directory (``.<name>.memtree-tmp-<hex>`` next to ``dest``).
        dest: the destination it becomes.
        state: what ``dest`` was (:func:`~memtree.store.primitives.commit.destination_state`).
        published: :meth:`publish` has made it ``dest``.
    """

    def __init__(self, path: str, dest: str, state: str, lock: WriterLock) -> None:
        self.path = path
        self.dest = dest
        self.state = state
        self.published = False
        self._lock = lock

    def publish(self, *, fsync: bool, background_removal: bool = False) -> None:
        """Make the complete staging directory the destination (:func:`~memtree.store.primitives.commit.publish`).

        Args:
            fsync: fsync the parent directory after the rename.
            background_removal: delete a replaced old copy in a background thread.
        """
        publish(self.path, self.dest, self.state, fsync, self._lock, background_removal=background_removal)
        self.published = True


def _state(dest: str, existsok: bool, replaceable: Callable[[str], bool] | None) -> str:
    try:
        return destination_state(dest, existsok)
    except DestinationExistsError:
        if existsok and replaceable is not None and os.path.isdir(dest) and not os.path.islink(dest):
            if replaceable(dest):
                return "tree"
        raise


@contextmanager
def staged_commit(
    dest: str,
    *,
    existsok: bool,
    nbytes: int = 0,
    replaceable: Callable[[str], bool] | None = None,
) -> Iterator[Staging]:
    """Hold ``dest``'s writer lock and yield a new, empty :class:`Staging` next to it.

    The block fills ``staging.path`` and calls ``staging.publish(...)``; what it does after the
    publish still runs under the lock (``write_tree`` opens the tree it has just written). A
    block that raises, or ends without publishing, leaves ``dest`` unchanged and the staging
    directory removed. The steps and their fault points are those of the module docstring.

    Args:
        dest: the absolute destination (its parents are created if needed).
        existsok: replace an existing destination (atomically) instead of refusing it.
        nbytes: bytes the caller will write, checked against the free space first.
        replaceable: with ``existsok``, accepts a non-memtree directory as one that may be
            replaced; others are refused.

    Raises:
        DestinationExistsError: ``dest`` exists (see the module docstring).
        LockError: another memtree writer holds the destination.
        StorageError: the filesystem refused something (an ``OSError`` of the block before the
            publish is raised as one).

    Example:
        >>> import os, tempfile
        >>> d = os.path.join(tempfile.mkdtemp(), "out")
        >>> with staged_commit(d, existsok=False) as staging:
        ...     os.mkdir(os.path.join(staging.path, "sub"))
        ...     staging.publish(fsync=False)
        ...     os.listdir(d)
        ['sub']
    """
    parent, name = os.path.split(dest)
    try:
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise storage_error(err, f"creating the parent directory of {dest}") from err
    with WriterLock(lock_path(parent, name), dest, timeout=commit.LOCK_TIMEOUT) as lock:
        try:
            recover_locked(parent, name, lock)
            point("after_lock")
            state = _state(dest, existsok, replaceable)
            load_pending_at(dest)  # trees this process opened from dest keep their data
            check_free_space(parent, nbytes, f"writing {dest}")
            path = staging_path(parent, name)
            lock.write_journal({"staging": os.path.basename(path)}, fsync=False)
            os.mkdir(path, 0o700)
        except MemtreeError:
            raise
        except OSError as err:
            raise storage_error(err, f"preparing to write {dest}") from err
        point("staging_created")
        staging = Staging(path, dest, state, lock)
        try:
            yield staging
        except BaseException as err:
            if staging.published:  # dest is the new tree: nothing to undo
                raise
            shutil.rmtree(path, ignore_errors=True)
            if isinstance(err, OSError) and not isinstance(err, MemtreeError):
                raise storage_error(err, f"writing {dest}") from err
            raise
        if not staging.published:
            shutil.rmtree(path, ignore_errors=True)


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
            every directory is fsynced before the rename, the parent after it).
        nbytes: bytes the caller will write, checked against the free space first.
        replaceable: with ``existsok``, accepts a non-memtree directory as one that may be
            replaced (e.g. "holds only model shards"); others are refused.

    Raises:
        DestinationExistsError: ``dest`` exists (see the module docstring).
        LockError: another memtree writer holds the destination.
        StorageError: the filesystem refused something; ``dest`` is then unchanged and the
            staging directory removed.

    Example:
        >>> import os, tempfile
        >>> d = os.path.join(tempfile.mkdtemp(), "shards")
        >>> with staged_directory(d, existsok=False, fsync=True) as staging:
        ...     os.mkdir(os.path.join(staging, "part"))
        >>> os.listdir(d)
        ['part']
    """
    where = local_path(dest, remote="this writes a local directory; write it locally, then copy it")
    dest = os.path.realpath(os.fspath(where))
    with staged_commit(dest, existsok=existsok, nbytes=nbytes, replaceable=replaceable) as staging:
        yield staging.path
        os.chmod(staging.path, 0o755)
        if fsync:
            for here, _dirs, _files in os.walk(staging.path):  # the files were fsynced by their writers
                fsync_dir(here)
        staging.publish(fsync=fsync)


@contextmanager
def staged_file(
    dest: str | os.PathLike[str],
    *,
    existsok: bool,
    hint: str = "pass existsok=True to replace it",
) -> Iterator[str]:
    """Hold ``dest``'s writer lock and yield a temporary path next to it, named in the lock's
    journal; when the block succeeds, the complete file is renamed onto ``dest``.

    A previous writer of ``dest`` that was killed is cleaned up first (its temporary file
    removed: :func:`~memtree.store.writing.recovery.recover_locked`). The commit is
    :func:`~memtree.store.primitives.files.replacing_file`'s: a new inode, an existing file replaced only
    with ``existsok``; on any failure the temporary file is removed and ``dest`` is unchanged.

    Args:
        dest: the file to create (its directory must exist).
        existsok: replace an existing file instead of refusing it.
        hint: the fix a refusal of an existing ``dest`` suggests.

    Raises:
        DestinationExistsError: ``dest`` exists and ``existsok`` is False.
        LockError: another memtree writer holds ``dest``.
        StorageError: the filesystem refused something.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> with staged_file(os.path.join(d, "m.bin"), existsok=False) as tmp:
        ...     _ = open(tmp, "wb").write(b"complete")
        >>> os.listdir(d), open(os.path.join(d, "m.bin"), "rb").read()
        (['m.bin'], b'complete')
    """
    where = local_path(dest, remote="this writes a local file; write it locally, then copy it")
    path = os.path.abspath(os.fspath(where))
    parent, name = os.path.split(path)
    with WriterLock(lock_path(parent, name), path, timeout=commit.LOCK_TIMEOUT) as lock:
        try:
            recover_locked(parent, name, lock)
            point("after_lock")
            tmp = staging_path(parent, name)
            lock.write_journal({"staging": os.path.basename(tmp)}, fsync=False)
        except MemtreeError:
            raise
        except OSError as err:
            raise storage_error(err, f"preparing to write {path}") from err
        with replacing_file(path, existsok=existsok, hint=hint, tmp=tmp) as staging:
            yield staging
