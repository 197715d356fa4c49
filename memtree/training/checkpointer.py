"""``memtree.Checkpointer``: training checkpoints, atomic, async, incremental, with retention.

A root directory holds one complete memtree tree per step, ``root/<step>/`` (the decimal step, no
padding), each committed by :func:`memtree.store.writing.write.write_tree`'s atomic rename under the
step's writer lock; anything else in the root (staging directories, lock files) is ignored by
:meth:`Checkpointer.steps` and cleaned up by :func:`memtree.recover` when a checkpointer opens the
root. What a save does (``docs/guide/training.md``):

1. the state becomes levels (:mod:`memtree.training.state`), every input error raised here;
2. ``blocking=False``: every tensor is copied into one staging buffer (pinned host memory when a
   CUDA tensor is saved), reused by the next save (:mod:`memtree.training.snapshot`); that copy
   is the training loop's whole pause;
3. a writer thread writes the tree (checksums computed in the write pass), hard-linking every
   leaf whose bytes equal the previous checkpoint's (``WriteOptions.link_from``), commits it,
   fsyncs it with ``fsync=True``, then applies the retention rule; only then does the future
   resolve. One save is in flight at a time: the next ``save`` first waits for it, and an error
   of a background save is raised by its future *and* by the next ``save``/``wait``.

With ``encryption=key`` the same write is made with ``WriteOptions(encryption=key)`` (every step
encrypted and authenticated, ``docs/guide/encryption.md``), always whole: no leaf is linked.

Example:
    >>> import tempfile, torch, memtree
    >>> ckpt = memtree.Checkpointer(tempfile.mkdtemp(), keep_last=2)
    >>> for step in range(3):
    ...     _ = ckpt.save(step, {"w": torch.full((2,), float(step)), "betas": (0.9, 0.99)})
    >>> ckpt.steps(), ckpt.restore()["betas"]
    ([1, 2], (0.9, 0.99))
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import stat
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch

from ..errors import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    DestinationExistsError,
    InvalidArgumentError,
    LockError,
    MemtreeError,
    MemtreeKeyError,
)
from ..format.level import Level
from ..format.names import META_NAME, lock_path, staging_path
from ..store.primitives.commit import WriterLock, make_dirs
from ..store.primitives.crypto import EncryptionKey
from ..store.primitives.files import storage_error
from ..store.reading.options import ReadOptions, WriteOptions
from ..store.reading.read import open_tree
from ..store.writing.recovery import recover
from ..store.reading.storage import local_path
from ..store.writing.write import WriteStats, write_tree
from ..nn.loading import load_into_module
from .snapshot import Fence, StagingBuffer
from .state import copy_values, level_to_state, state_to_level

__all__ = ["Checkpointer"]

_STEP_NAME = re.compile(r"0|[1-9][0-9]{0,18}")
#: Largest step number (steps are stored as decimal directory names of an int64).
MAX_STEP = 2**63 - 1
#: Reads of :meth:`Checkpointer.restore` (and listings of :meth:`Checkpointer.steps`) before
#: giving up on steps that other processes keep retiring or replacing while they are read.
_READ_ATTEMPTS = 64


def _check_step(step: object) -> int:
    if isinstance(step, bool):
        raise InvalidArgumentError(f"step must be an int >= 0, got the bool {step}")
    try:
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"step must be an int >= 0, got {type(step).__name__} {step!r:.40}") from None
    if not 0 <= value <= MAX_STEP:
        raise InvalidArgumentError(f"step must be an int in [0, 2**63), got {value}")
    return value


def _check_keep(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be None or an int >= 1, got {value!r:.40}")
    return value


class Checkpointer:
    """Saves and restores training state under ``root/<step>/``, one complete memtree per step.

    Args:
        root: the directory of the checkpoints (created if missing).
        keep_last: keep only the newest ``keep_last`` steps (by step number); ``None``: all.
        keep_every: also keep every step divisible by ``keep_every`` (``None``: none extra).
            Retention runs after each save and never deletes the newest complete step.
        fsync: fsync files and directories before a save counts as done (survives power loss).
        incremental: hard-link each leaf whose bytes equal the newest step's instead of writing
            it (decided by checksum, in the writer threads; the old file is hashed too, so a
            damaged one is never linked); ``False`` writes every byte. Default: ``True``, and
            ``False`` with ``encryption``.
        encryption: an :class:`~memtree.EncryptionKey`: every step is written encrypted and
            authenticated (``docs/guide/encryption.md``), and :meth:`restore` decrypts with it
            (a step of another key, or an encrypted step restored without a key, raises
            ``DecryptionError``). Encrypted steps are always written whole: a hard link would
            share one ciphertext between steps whose keys differ, so ``incremental=True`` with
            ``encryption`` is refused.

    Opening a root cleans up what crashed writers left in it (:func:`memtree.recover`: staging
    directories and stale lock files of steps no live writer holds). Several checkpointers, in
    one process or several, may share a root: each step has its own writer lock, a step is
    never committed twice at once, and readers only ever see committed steps.

    Example:
        >>> import tempfile, torch
        >>> ckpt = Checkpointer(tempfile.mkdtemp())
        >>> fut = ckpt.save(10, {"model": {"w": torch.ones(2)}, "step": 10}, blocking=False)
        >>> fut.result() == ckpt.path(10), ckpt.latest()
        (True, 10)
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        fsync: bool = False,
        incremental: bool | None = None,
        encryption: EncryptionKey | None = None,
    ) -> None:
        self.keep_last = _check_keep("keep_last", keep_last)
        self.keep_every = _check_keep("keep_every", keep_every)
        for name, flag in (("fsync", fsync), ("incremental", True if incremental is None else incremental)):
            if type(flag) is not bool:
                raise InvalidArgumentError(f"{name} must be True or False, got {flag!r:.40}")
        #: The key of the steps (``None``: plain); checked as every ``encryption=`` is.
        self.encryption = ReadOptions.of(encryption=encryption).encryption
        if self.encryption is not None and incremental:
            raise InvalidArgumentError(
                "incremental=True cannot be combined with encryption: an encrypted step is always "
                "written whole (a hard link would share one ciphertext between steps with different "
                "keys); leave incremental out (or False) to save encrypted steps in full"
            )
        self.fsync = fsync
        self.incremental = self.encryption is None if incremental is None else incremental
        where = local_path(root, remote="a Checkpointer writes to a local directory; upload steps with memtree.remote")
        self.root = os.path.realpath(os.fspath(where))
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise DestinationExistsError(
                f"{self.root} exists and is not a directory: a Checkpointer root is a directory of "
                "steps; choose another path"
            )
        try:
            make_dirs(self.root, fsync=fsync)  # a new root: durable in its parent
        except OSError as err:
            raise storage_error(err, f"creating the checkpoint root {self.root}") from err
        recover(self.root)
        self._lock = threading.RLock()
        #: One writer thread, started on the first async save and reused (the interpreter waits
        #: for its work at exit: concurrent.futures joins its threads then).
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[str] | None = None
        self._failed: tuple[int, BaseException] | None = None
        self._staging = StagingBuffer()
        #: What the most recent save wrote and hard-linked (:class:`~memtree.store.writing.write.WriteStats`).
        self.last_stats: WriteStats | None = None

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every}, "
            f"fsync={self.fsync}, incremental={self.incremental}"
            f"{', encryption=EncryptionKey(<hidden>)' if self.encryption is not None else ''})"
        )

    # -- listing ----------------------------------------------------------------------------

    def path(self, step: int) -> str:
        """The directory of ``step`` (whether or not it exists).

        Example:
            >>> Checkpointer("/tmp/ckpts-doc").path(7)
            '/tmp/ckpts-doc/7'
        """
        return os.path.join(self.root, str(_check_step(step)))

    def steps(self) -> list[int]:
        """The committed steps in the root, ascending (staging directories and locks ignored).

        While another process saves and retires steps, the list is the root as it was at one
        moment: a listing in which a step vanished before it was checked (a newer one may have
        been committed meanwhile, unlisted) is taken again.

        Example:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).steps()
            []
        """
        found: list[int] = []
        for _ in range(_READ_ATTEMPTS):
            found, vanished = self._list_steps()
            if not vanished:
                break
        return found

    def _list_steps(self) -> tuple[list[int], bool]:
        """The committed steps of one listing, and whether a listed step vanished meanwhile."""
        found = []
        vanished = False
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return [], False
        for name in names:
            if _STEP_NAME.fullmatch(name) is None:
                continue
            path = os.path.join(self.root, name)
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    continue
                if not stat.S_ISREG(os.lstat(os.path.join(path, META_NAME)).st_mode):
                    continue
            except OSError:  # no meta.json: not a checkpoint; or retired meanwhile
                vanished = vanished or not os.path.lexists(path)
                continue
            found.append(int(name))
        return sorted(s for s in found if s <= MAX_STEP), vanished

    def latest(self) -> int | None:
        """The newest committed step (the largest number), or ``None`` when there is none.

        Example:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).latest() is None
            True
        """
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving -----------------------------------------------------------------------------

    def save(
        self, step: int, state: Any, *, blocking: bool = True, overwrite: bool = False
    ) -> str | Future[str]:
        """Save ``state`` as ``step``: its path, or a ``Future`` of it with ``blocking=False``.

        Args:
            step: an int >= 0; the directory is ``root/<step>``.
            state: a mapping of tensors and plain values (``model.state_dict()``,
                ``optimizer.state_dict()``, a ``TensorTree``, scheduler and RNG states...).
            blocking: ``False`` returns once the tensors are copied into the staging buffer;
                the write, commit and retention run in a background thread.
            overwrite: replace an existing ``step`` (atomically); otherwise it is an error.

        Raises:
            CheckpointSaveError: the previous background save failed (its error is chained).
            DestinationExistsError: ``step`` exists and ``overwrite`` is False.
            MemtreeError: the state cannot be stored (a key, a value, a dtype: names its path).
        """
        step = _check_step(step)
        if type(blocking) is not bool or type(overwrite) is not bool:
            raise InvalidArgumentError("blocking and overwrite must be True or False")
        with self._lock:
            self.wait()
            dest = self.path(step)
            if not overwrite and os.path.lexists(dest):
                raise DestinationExistsError(
                    f"step {step} already exists in {self.root}; pass overwrite=True to replace it, "
                    "or save under another step"
                )
            level = state_to_level(state)
            if blocking:
                return self._write(step, level, overwrite)
            fence = self._staging.take(level)
            copy_values(level)  # lists and dicts too: the loop may change them while this is written
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="memtree-checkpoint")
            self._pending = self._executor.submit(self._background, step, level, overwrite, fence)
            return self._pending

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise the error of a failed background save.

        Each failure is raised once here (or by the next :meth:`save`), besides by its future.

        Raises:
            CheckpointSaveError: a background save failed; nothing of it was committed.

        Example:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).wait()
        """
        with self._lock:
            self._join()
            if self._failed is not None:
                step, err = self._failed
                self._failed = None
                raise CheckpointSaveError(
                    f"the background save of step {step} to {self.root} failed: {err}; nothing of "
                    "it was committed"
                ) from err

    def _join(self) -> None:
        if self._pending is not None:
            futures_wait([self._pending])
            self._pending = None

    def _background(self, step: int, level: Level, overwrite: bool, fence: Fence) -> str:
        try:
            fence.wait()  # the copies into the staging buffer are done, from every device
            return self._write(step, level, overwrite)
        except BaseException as err:  # noqa: BLE001 - raised by the future, and by the next save
            self._failed = (step, err)
            raise

    def _write(self, step: int, level: Level, overwrite: bool) -> str:
        dest = self.path(step)
        previous = [s for s in self.steps() if s != step] if self.incremental else []
        link_from = self.path(previous[-1]) if previous else None
        options = WriteOptions.of(
            existsok=overwrite, fsync=self.fsync, copy_existing=True, progress=False,
            num_threads=min(8, os.cpu_count() or 1), link_from=link_from, encryption=self.encryption,
        )
        stats = WriteStats()
        written = write_tree(dest, level, options, stats=stats)
        del written  # the lazily opened tree: nothing of it is used here
        self.last_stats = stats
        self._prune()
        return dest

    # -- retention ------------------------------------------------------------------------

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        steps = self.steps()
        if not steps:
            return  # the step just saved was deleted already (by hand, or by another process)
        keep = set(steps[-self.keep_last :])
        keep.add(steps[-1])  # the newest complete step, always
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        for s in steps:
            if s not in keep:
                self._delete(s)

    def _delete(self, step: int) -> None:
        """Remove a step: renamed to a staging name under its writer lock (readers and
        :meth:`steps` stop seeing it at once), then deleted; a crash in between leaves a staging
        directory that :func:`memtree.recover` removes."""
        name = str(step)
        lock = WriterLock(lock_path(self.root, name), self.path(step), timeout=0)
        try:
            lock.acquire()
        except LockError:
            return  # someone is writing this step right now: leave it to the next pass
        try:
            gone = staging_path(self.root, name)
            try:
                os.rename(self.path(step), gone)
            except FileNotFoundError:
                return
        finally:
            lock.release()
        shutil.rmtree(gone, ignore_errors=True)

    # -- restoring ------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, into: Any = None) -> Any:
        """The state saved as ``step`` (default: the newest), with its Python types.

        Tensors are read into ordinary memory (never mapped from the checkpoint, so training
        can update them in place). ``into`` fills live objects instead:

        * an ``nn.Module``: through :func:`memtree.load_into_module` (its parameters filled in
          place, the same objects; those on the meta device, e.g. built under
          :func:`memtree.empty_init`, bound to the loaded tensors);
        * anything else with ``load_state_dict`` (an optimizer, a scheduler): called with the
          saved state;
        * a mapping mirroring the state (``{"model": model, "optim": optimizer}``): each of its
          values filled from the state at its key.

        The returned state then holds the filled objects at their keys.

        Raises:
            CheckpointNotFoundError: no committed checkpoint, or not ``step``.
            DecryptionError: the step is encrypted and this checkpointer has no key or another
                key, or it is not encrypted and this checkpointer has a key, or its files were
                changed (every byte of an encrypted step is authenticated).
            MemtreeKeyError: ``into`` names a key the checkpoint does not have.

        Example:
            >>> import tempfile, torch
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> model = torch.nn.Linear(2, 2)
            >>> _ = ckpt.save(1, {"model": model.state_dict(), "epoch": 3})
            >>> ckpt.restore(into={"model": torch.nn.Linear(2, 2)})["epoch"]
            3
        """
        with self._lock:
            self._join()  # the save in flight is part of what can be restored
            state = self._read(None if step is None else _check_step(step))
        return state if into is None else _fill(into, state, ())

    def _read(self, wanted: int | None) -> Any:
        """The state of step ``wanted`` (``None``: the newest), read whole into memory.

        Another process may retire the step (retention) or replace it (``overwrite=True``) while
        it is read. Its files are never changed in place, so what is read is right, but the read
        can fail halfway on a file that is gone. Such a failure is told from damage by the step's
        directory: if the path no longer names the directory that was opened, the newest step is
        read again (``wanted=None``); a named step is read again if it was replaced, and is
        reported missing if it was retired.
        """
        options = ReadOptions(mode="r", mmap=False, encryption=self.encryption)
        lost: list[int] = []  # steps retired or replaced while they were read
        last: BaseException | None = None
        for _ in range(_READ_ATTEMPTS):
            step = self.latest() if wanted is None else wanted
            if step is None:
                raise CheckpointNotFoundError(f"{self.root} holds no committed checkpoint yet")
            path = self.path(step)
            opened = _dir_identity(path)
            if opened is None or step not in self.steps():
                if wanted is None:
                    continue  # retired between latest() and here: take the next newest
                retired = (
                    " (it was deleted while it was read: another Checkpointer's retention, keep_last, "
                    "retired it; restore a newer step)" if lost else ""
                )
                raise CheckpointNotFoundError(
                    f"step {step} is not a committed checkpoint in {self.root}{retired} (steps there: "
                    f"{self.steps()[-20:]})"
                )
            try:
                return level_to_state(open_tree(path, options))
            except (MemtreeError, OSError) as err:
                if _dir_identity(path) == opened:
                    raise  # the same step is still there: the error is its own
                lost.append(step)
                last = err
        raise CheckpointNotFoundError(
            f"the newest steps of {self.root} ({lost[-5:]}) were retired or replaced while they were "
            f"read, {len(lost)} times in a row: another process saves with a retention rule faster "
            "than this one reads a step; restore again, or keep more steps (keep_last)"
        ) from last


def _dir_identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the directory at ``path`` (no link followed), ``None`` if none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _fill(into: Any, state: Any, path: tuple[Any, ...]) -> Any:
    if isinstance(into, torch.nn.Module):
        load_into_module(into, state)
        return into
    if hasattr(into, "load_state_dict"):
        into.load_state_dict(state)
        return into
    if isinstance(into, Mapping):
        if not isinstance(state, Mapping):
            raise InvalidArgumentError(
                f"into{''.join(f'[{p!r}]' for p in path)} is a mapping, but the checkpoint holds a "
                f"{type(state).__name__} there"
            )
        out = dict(state)
        for key, target in into.items():
            if key not in state:
                raise MemtreeKeyError(
                    f"into has the key {path + (key,)!r}, which the checkpoint does not hold "
                    f"(keys there: {list(state)[:20]})"
                )
            out[key] = _fill(target, state[key], path + (key,))
        return out
    raise InvalidArgumentError(
        f"into{''.join(f'[{p!r}]' for p in path)} must be an nn.Module, an object with "
        f"load_state_dict, or a mapping of them, got {type(into).__name__}"
    )
