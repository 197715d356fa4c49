"""``memtree.Checkpointer``: training checkpoints, atomic, async, incremental, with retention.

A root directory holds one complete memtree tree per step, ``root/<step>/`` (the decimal step, no
padding), each committed by :func:`memtree.store.writing.write.write_tree`'s atomic rename under the
step's writer lock. What is a step is one rule, :mod:`memtree.store.reading.steps` (a real directory
whose root ``meta.json`` parses; ``memtree info`` and ``memtree du`` apply it too); anything else
in the root (staging directories, lock files, stray directories) is ignored, and
:func:`memtree.recover` cleans up what crashed writers left when a checkpointer opens the root.
An encrypted root also holds its record (:mod:`memtree.training.root`), checked when a
checkpointer opens it and before each save. What a save does (``docs/guide/training.md``):

1. the state becomes levels (:mod:`memtree.training.state`), every input error raised here; a
   step below the newest one is refused (``StepOrderError``) unless ``discard_newer=True``, which
   deletes the newer steps first;
2. ``blocking=False``: every tensor is copied into one staging buffer (pinned host memory when a
   CUDA tensor is saved), reused by the next save (:mod:`memtree.training.snapshot`); that copy
   is the training loop's whole pause;
3. a writer thread writes the tree (checksums computed in the write pass), hard-linking every
   leaf whose bytes equal the previous checkpoint's (``WriteOptions.link_from``), commits it,
   fsyncs it with ``fsync=True``, then applies the retention rule, which never deletes the step
   just written nor the newest one, and whose failures are warnings (``RetentionWarning``), never
   a failed save; only then does the future resolve. One save is in flight at a time: the next
   ``save`` first waits for it, and an error of a background save is raised by its future *and*
   by the next ``save``/``wait``, saying whether its step was committed.

``restore`` verifies what save recorded (every leaf's checksum and the tree hash over every
``meta.json``) unless ``verify=False``, reads only ``keys=`` when given, and fills ``into=``
(:mod:`memtree.training.filling`), partially with ``strict=False``; ``ckpt.last_restore`` says
what was read and filled.

With ``encryption=key`` every step is written with ``WriteOptions(encryption=...)`` under a key
of its own, derived from ``key``, the root's identity and the step number, so that a step copied
or renamed to another number or root fails authentication on restore (``docs/guide/encryption.md``,
:mod:`memtree.training.root`); always whole: no leaf is linked.

Example:
    >>> import tempfile, torch, memtree
    >>> ckpt = memtree.Checkpointer(tempfile.mkdtemp(), keep_last=2)
    >>> for step in range(3):
    ...     _ = ckpt.save(step, {"w": torch.full((2,), float(step)), "betas": (0.9, 0.99)})
    >>> ckpt.steps(), ckpt.restore()["betas"]
    ([1, 2], (0.9, 0.99))
"""

from __future__ import annotations

import dataclasses
import operator
import os
import shutil
import stat
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from ..errors import (
    check_keywords,
    CheckpointNotFoundError,
    CheckpointSaveError,
    DecryptionError,
    DestinationExistsError,
    InvalidArgumentError,
    LockError,
    MemtreeError,
    MissingLeafError,
    NotAMemtreeError,
    RetentionWarning,
    StepOrderError,
)
from ..dist.dtensor import has_dtensor
from ..format.level import Level
from ..format.names import MAX_STEP, lock_path, staging_path
from ..format.schema import CONTAINER_TYPES, LevelMeta
from ..store.primitives.commit import WriterLock, make_dirs
from ..store.primitives.crypto import EncryptionKey, key_matches
from ..store.primitives.files import storage_error
from ..store.reading.options import KeySelection, ReadOptions, Selection, WriteOptions
from ..store.reading.read import PendingLevel, load_pending_at, open_tree
from ..store.writing.recovery import recover
from ..store.reading.steps import StepListing, list_steps, read_step
from ..store.reading.storage import local_path, open_dir
from ..store.writing.write import WriteStats
from .commit import write_state_tree
from .filling import RestoreReport, fill_into
from .root import RootRecord, check_unchanged, open_root
from .snapshot import Fence, StagingBuffer
from .state import copy_values, level_to_state, state_to_level

__all__ = ["Checkpointer"]

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


def _check_flag(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r:.40}")
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
            Retention runs after each save and never deletes the step just written nor the
            newest step; a step this process has open lazily is loaded first (its data stays
            readable). A deletion that fails is a :class:`~memtree.RetentionWarning`: the step
            is kept, the save still succeeds, and the next save tries again.
        fsync: fsync files and directories before a save counts as done (survives power loss).
        incremental: hard-link each leaf whose bytes equal the newest step's instead of writing
            it (decided by checksum, in the writer threads; the old file is hashed too, so a
            damaged one is never linked); ``False`` writes every byte. Default: ``True``, and
            ``False`` with ``encryption``.
        encryption: an :class:`~memtree.EncryptionKey`: every step is written encrypted and
            authenticated (``docs/guide/encryption.md``) under a key of its own, derived from
            ``key``, the root's identity and the step number (:mod:`memtree.training.root`), and
            :meth:`restore` decrypts with it. A root holds steps of one kind: opening an
            encrypted root without its key or with another key, or a root of plain steps with a
            key, raises ``DecryptionError`` before anything is written. Encrypted steps are
            always written whole: a hard link would share one ciphertext between steps, so
            ``incremental=True`` with ``encryption`` is refused.

    Opening a root cleans up what crashed writers left in it (:func:`memtree.recover`: staging
    directories and stale lock files of steps no live writer holds). Several checkpointers, in
    one process or several, may share a root: each step has its own writer lock, a step is
    never committed twice at once, and readers only ever see committed steps.

    Raises:
        DestinationExistsError: ``root`` exists and is not a directory.
        DecryptionError: the root's encryption or key does not match ``encryption``.

    Example:
        >>> import tempfile, torch
        >>> ckpt = Checkpointer(tempfile.mkdtemp())
        >>> fut = ckpt.save(10, {"model": {"w": torch.ones(2)}, "step": 10}, blocking=False)
        >>> fut.result() == ckpt.path(10), ckpt.latest()
        (True, 10)
    """

    @check_keywords
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
        _check_flag("fsync", fsync)
        _check_flag("incremental", True if incremental is None else incremental)
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
        #: The root's record (encrypted roots), checked before every write.
        self._record: RootRecord | None = open_root(self.root, self.encryption, self._listing(), fsync=fsync)
        self._lock = threading.RLock()
        #: One writer thread, started on the first async save and reused (the interpreter waits
        #: for its work at exit: concurrent.futures joins its threads then).
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[str] | None = None
        #: A failed background save: its step, its error, and whether the step was committed.
        self._failed: tuple[int, BaseException, bool] | None = None
        self._staging = StagingBuffer()
        #: What the most recent save wrote and hard-linked (:class:`~memtree.store.writing.write.WriteStats`).
        self.last_stats: WriteStats | None = None
        #: What the most recent :meth:`restore` read and filled (:class:`~memtree.training.RestoreReport`).
        self.last_restore: RestoreReport | None = None

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
        """The steps in the root, ascending: directories named by their step whose root
        ``meta.json`` parses (the rule of :mod:`memtree.store.reading.steps`; staging directories, lock
        files and stray directories are not steps).

        While another process saves and retires steps, the list is the root as it was at one
        moment: a listing in which a step vanished before it was checked (a newer one may have
        been committed meanwhile, unlisted) is taken again.

        Example:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).steps()
            []
        """
        return list(self._listing().steps)

    def _listing(self, around: int | None = None) -> StepListing:
        """:func:`~memtree.store.reading.steps.list_steps`, taken again while a listed step vanished."""
        listing = StepListing()
        for _ in range(_READ_ATTEMPTS):
            try:
                listing = list_steps(self.root, around=around)
            except NotAMemtreeError:  # the root itself was removed
                return StepListing()
            if not listing.vanished:
                break
        return listing

    def latest(self) -> int | None:
        """The newest step (the largest number), or ``None`` when there is none.

        Example:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).latest() is None
            True
        """
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving -----------------------------------------------------------------------------

    @check_keywords
    def save(
        self, step: int, state: Any, *, blocking: bool = True, overwrite: bool = False, discard_newer: bool = False
    ) -> str | Future[str]:
        """Save ``state`` as ``step``: its path, or a ``Future`` of it with ``blocking=False``.

        Args:
            step: an int >= 0; the directory is ``root/<step>``. It may not be below the newest
                step of the root (:meth:`latest`): after a roll back (``restore(40)`` while step
                50 exists) a save of step 41 would otherwise never be the step to resume from.
            state: a mapping of tensors and plain values (``model.state_dict()``,
                ``optimizer.state_dict()``, a ``TensorTree``, scheduler and RNG states...).
            blocking: ``False`` returns once the tensors are copied into the staging buffer;
                the write, commit and retention run in a background thread.
            overwrite: replace an existing ``step`` (atomically); otherwise it is an error.
            discard_newer: roll back: delete every step above ``step`` (newest first, each
                atomically) before ``step`` is written.

        Raises:
            StepOrderError: ``step`` is below the newest step and ``discard_newer`` is False
                (names the newer steps); nothing was written.
            CheckpointSaveError: the previous background save failed (its error is chained), or
                a newer step could not be discarded (nothing of ``step`` was written).
            DestinationExistsError: ``step`` exists and ``overwrite`` is False, or ``root/<step>``
                exists but is not a step (a stray directory, a link): never replaced.
            DecryptionError: the root's encryption changed since this checkpointer opened it.
            MemtreeError: the state cannot be stored (a key, a value, a dtype: names its path).

        Example:
            >>> import tempfile
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> _ = ckpt.save(50, {"x": 50})
            >>> _ = ckpt.save(41, {"x": 41}, discard_newer=True)   # rolled back to 40, then saved 41
            >>> ckpt.steps()
            [41]
        """
        step = _check_step(step)
        for name, flag in (("blocking", blocking), ("overwrite", overwrite), ("discard_newer", discard_newer)):
            _check_flag(name, flag)
        with self._lock:
            self.wait()
            check_unchanged(self.root, self._record)
            listing = self._listing(around=step)  # the steps above, this one, the newest below
            newer = [s for s in listing.steps if s > step]
            if newer and not discard_newer:
                raise StepOrderError(
                    f"step {step} is below the newest step of {self.root}, {newer[-1]} (steps above "
                    f"it: {_few(newer)}): latest() and restore() would go on naming {newer[-1]}, "
                    f"not this save. To roll back, pass discard_newer=True (the steps above {step} "
                    f"are deleted, then {step} is written); otherwise save a step above {newer[-1]}. "
                    "Nothing was written"
                )
            dest = self.path(step)
            if os.path.lexists(dest):
                if step not in listing.steps:
                    raise DestinationExistsError(
                        f"{dest} exists but is not a step ({listing.ignored.get(str(step), 'it vanished meanwhile')}); "
                        "memtree never replaces it: remove it yourself, or save under another step"
                    )
                if not overwrite:
                    raise DestinationExistsError(
                        f"step {step} already exists in {self.root}; pass overwrite=True to replace "
                        "it, or save under another step"
                    )
            level = state_to_level(state, keep_dtensors=True)  # every input error before anything is deleted
            collective = has_dtensor(level)
            if collective:
                self._check_collective(blocking)
            if not collective or _first_rank():  # a collective save: rank 0 deletes, for every rank
                self._discard(step, newer)
            below = [s for s in listing.steps if s < step] if self.incremental and not collective else []
            link_from = self.path(below[-1]) if below else None
            before = _dir_identity(dest)
            if blocking:
                return self._write(step, level, overwrite, link_from)
            fence = self._staging.take(level)
            copy_values(level)  # lists and dicts too: the loop may change them while this is written
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="memtree-checkpoint")
            self._pending = self._executor.submit(
                self._background, step, level, overwrite, link_from, before, fence
            )
            return self._pending

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise the error of a failed background save.

        Each failure is raised once here (or by the next :meth:`save`), besides by its future.

        Raises:
            CheckpointSaveError: a background save failed; the message says whether its step
                was committed (a failure after the commit) or nothing of it was.

        Example:
            >>> import tempfile
            >>> Checkpointer(tempfile.mkdtemp()).wait()
        """
        with self._lock:
            self._join()
            if self._failed is not None:
                step, err, committed = self._failed
                self._failed = None
                what = (
                    f"step {step} was committed ({self.path(step)}) before the failure"
                    if committed else f"nothing of step {step} was committed"
                )
                raise CheckpointSaveError(
                    f"the background save of step {step} to {self.root} failed: {err}; {what}"
                ) from err

    def _join(self) -> None:
        if self._pending is not None:
            futures_wait([self._pending])
            self._pending = None

    def _background(
        self, step: int, level: Level, overwrite: bool, link_from: str | None, before: Any, fence: Fence
    ) -> str:
        try:
            fence.wait()  # the copies into the staging buffer are done, from every device
            return self._write(step, level, overwrite, link_from)
        except BaseException as err:  # noqa: BLE001 - raised by the future, and by the next save
            self._failed = (step, err, _dir_identity(self.path(step)) not in (None, before))
            raise

    def _step_key(self, step: int) -> EncryptionKey | None:
        """The key step ``step`` is encrypted with (``None`` in a plain root)."""
        if self._record is None or self.encryption is None:
            return None
        return self._record.step_key(self.encryption, step)

    def _check_collective(self, blocking: bool) -> None:
        """Refuse what a collective save (a state holding ``DTensor`` s) does not do."""
        if not blocking or self.encryption is not None:
            raise InvalidArgumentError(
                "a state holding DTensors is saved by every rank at once (memtree.dist): pass "
                "blocking=True, in a root without encryption. Nothing was written"
            )

    def _write(self, step: int, level: Level, overwrite: bool, link_from: str | None) -> str:
        """Write and commit ``step``, then apply retention (whose failures are warnings). A state
        holding ``DTensor`` s is written by every rank at once (:mod:`memtree.dist.write`:
        each rank its shards, one commit), and rank 0 applies the retention."""
        if has_dtensor(level):
            from ..dist.write import collective_checksum, write_collective

            write_collective(self.path(step), level, WriteOptions.of(
                existsok=overwrite, fsync=self.fsync,
                copy_existing=True, progress=False, num_threads=min(8, os.cpu_count() or 1),
                checksum=collective_checksum("auto"),
            ))
            self.last_stats = WriteStats()
            if _first_rank():
                self._retire(step)
            return self.path(step)
        self.last_stats = write_state_tree(
            self.path(step), level, link_from=link_from, fsync=self.fsync, existsok=overwrite,
            encryption=self._step_key(step),
        )
        self._retire(step)
        return self.path(step)

    # -- retention ------------------------------------------------------------------------

    def _retire(self, saved: int) -> None:
        """Apply the retention rule after ``saved`` was committed. It keeps ``saved`` and the
        newest step whatever the rule says; a step that cannot be deleted is kept, with a
        :class:`~memtree.RetentionWarning` (the save succeeded: it never fails because of this)."""
        if self.keep_last is None:
            return
        failed: dict[int, BaseException] = {}
        try:
            steps = self.steps()
        except MemtreeError as err:  # the root cannot be listed any more
            steps, failed[saved] = [], err
        keep = set(steps[-self.keep_last :]) | {saved} | set(steps[-1:])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        for s in steps:
            if s not in keep:
                try:
                    self._delete(s, busy_ok=True)
                except (MemtreeError, OSError) as err:
                    failed[s] = err
        if failed:
            why = "; ".join(f"step {s}: {err}" for s, err in failed.items())
            warnings.warn(
                RetentionWarning(
                    f"step {saved} was saved and committed to {self.path(saved)}, but retention "
                    f"could not delete {_few(list(failed))} of {self.root} ({why}). They are kept, "
                    "and the next save tries again: remove what blocks them (the file named above), "
                    "or delete those step directories yourself"
                ),
                stacklevel=4,  # a blocking save: the caller's save(); a background one: its thread
            )

    def _delete(self, step: int, *, busy_ok: bool) -> None:
        """Remove a step: renamed to a staging name under its writer lock (readers and
        :meth:`steps` stop seeing it at once), then deleted; a crash in between leaves a staging
        directory that :func:`memtree.recover` removes. Trees this process opened lazily from
        it load what they have not loaded yet first (their data stays readable).

        Raises:
            LockError: another writer is writing the step (unless ``busy_ok``: then it is left).
            MemtreeError: the entry is no longer a step, or its lock file is hostile.
        """
        name, path = str(step), self.path(step)
        lock = WriterLock(lock_path(self.root, name), path, timeout=0)
        try:
            lock.acquire()
        except LockError:
            if busy_ok:
                return  # someone is writing this step right now: leave it to the next pass
            raise
        try:
            root_fd = open_dir(self.root, self.root, None)
            try:
                read_step(root_fd, self.root, name)  # still a step: never delete anything else
            except MissingLeafError:
                return  # deleted meanwhile (by hand, or by another process's retention)
            finally:
                os.close(root_fd)
            load_pending_at(path)
            gone = staging_path(self.root, name)
            os.rename(path, gone)
        finally:
            lock.release()
        shutil.rmtree(gone, ignore_errors=True)

    def _discard(self, step: int, newer: list[int]) -> None:
        """``discard_newer=True``: delete the steps above ``step``, newest first, before it is written.

        Raises:
            CheckpointSaveError: a step could not be deleted (names it, and those deleted already).
        """
        done: list[int] = []
        for s in reversed(newer):
            try:
                self._delete(s, busy_ok=False)
            except (MemtreeError, OSError) as err:
                gone = f" (steps deleted already: {_few(done)})" if done else ""
                raise CheckpointSaveError(
                    f"save({step}, discard_newer=True): step {s} of {self.root} could not be "
                    f"deleted: {err}{gone}. Nothing of step {step} was written; remove what blocks "
                    "it and save again"
                ) from err
            done.append(s)

    # -- restoring ------------------------------------------------------------------------

    @check_keywords
    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        strict: bool = True,
        prefix: str | None = None,
        keys: Iterable[KeySelection] | KeySelection | None = None,
        ignore_mismatched: bool = False,
        verify: bool = True,
    ) -> Any:
        """The state saved as ``step`` (default: the newest), with its Python types.

        Tensors are read into ordinary memory (never mapped from the checkpoint, so training
        can update them in place). With ``verify=True`` (the default) every leaf is checked
        against the checksum recorded when it was saved, as it is read, and every ``meta.json``
        against the step's tree hash: a flipped bit, a truncated file, or a leaf changed through
        a hard link shared with another step raises ``IntegrityError`` instead of coming back.
        ``into`` fills live objects instead:

        * an ``nn.Module``: through :func:`memtree.load_into_module` from the state's tensors by
          dotted name (its parameters filled in place, the same objects; those on the meta
          device, e.g. built under :func:`memtree.empty_init`, bound to the loaded tensors);
        * anything else with ``load_state_dict`` (an optimizer, a scheduler): called with the
          saved state;
        * a mapping mirroring the state (``{"model": model, "optim": optimizer}``): each of its
          values filled from the state at its key.

        The returned state then holds the filled objects at their keys, and
        :attr:`last_restore` (a :class:`~memtree.training.RestoreReport`) says what each got.

        Args:
            step: the step (``None``: the newest).
            into: the live objects to fill (see above).
            strict: a key of ``into`` the state lacks, or a module tensor it lacks or an
                unexpected one, raises before anything is filled; ``False`` fills what matches
                and reports the rest (``last_restore.missing``, each module's ``LoadResult``).
            prefix: the dotted prefix one side's names have and the other's lack, for every
                module of ``into`` (``load_into_module``'s rule): ``into=model, prefix="model."``
                fills ``model`` from the state's ``"model"`` entry.
            keys: read only these keys of the state (``str``, or tuples for nested keys, as in
                ``load_memmap``; an int key is its decimal string); the state returned holds
                only them. Keys inside a list or tuple cannot be selected.
            ignore_mismatched: skip (and report) module tensors whose shape differs from the
                checkpoint's (a new head) instead of raising.
            verify: check checksums and the tree hash; ``False`` reads without them.

        Raises:
            CheckpointNotFoundError: no committed checkpoint, or not ``step``.
            IntegrityError: ``verify`` and a leaf or ``meta.json`` changed since it was saved.
            DecryptionError: the step fails authentication (a changed byte, or a step copied
                or renamed from another step number or root), or its encryption is not the
                root's (a plain step in an encrypted root, or the reverse).
            MemtreeKeyError: ``keys`` or ``into`` names a key the checkpoint does not have
                (``into``: with ``strict``), or a module's names do not match (with ``strict``).
            InvalidArgumentError: ``strict``/``prefix``/``ignore_mismatched`` without ``into``.

        Example:
            >>> import tempfile, torch
            >>> from torch import nn
            >>> ckpt = Checkpointer(tempfile.mkdtemp())
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            >>> _ = ckpt.save(1, {"model": model.state_dict(), "epoch": 3})
            >>> ckpt.restore(into={"model": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))})["epoch"]
            3
            >>> new_head = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 5))   # fine-tune: 5 classes
            >>> _ = ckpt.restore(into=new_head, keys=["model"], prefix="model.", ignore_mismatched=True)
            >>> ckpt.last_restore.modules[""]
            LoadResult(missing=[], unexpected=[], mismatched=['1.weight', '1.bias'])
        """
        for name, flag in (("strict", strict), ("ignore_mismatched", ignore_mismatched), ("verify", verify)):
            _check_flag(name, flag)
        if into is None and (not strict or prefix is not None or ignore_mismatched):
            raise InvalidArgumentError(
                "restore: strict=, prefix= and ignore_mismatched= say how into= is filled; without "
                "into= the state is returned as saved (keys= reads part of it)"
            )
        options = ReadOptions.of(keys=keys, mode="r", mmap=False, verify=verify)
        with self._lock:
            self._join()  # the save in flight is part of what can be restored
            found, state, verified = self._read(None if step is None else _check_step(step), options)
        report = RestoreReport(found, self.path(found), verified)
        if into is not None:
            state, filled = fill_into(into, state, strict=strict, prefix=prefix, ignore_mismatched=ignore_mismatched)
            report = dataclasses.replace(report, loaded=filled.loaded, missing=filled.missing, modules=filled.modules)
        self.last_restore = report
        return state

    def _read(self, wanted: int | None, options: ReadOptions) -> tuple[int, Any, bool]:
        """The step read, its state (``wanted``; ``None``: the newest), read into memory, and
        whether it was verified (``options.verify`` and the step records a tree hash).

        Another process may retire the step (retention) or replace it (``overwrite=True``) while
        it is read. Its files are never changed in place, so what is read is right, but the read
        can fail halfway on a file that is gone. Such a failure is told from damage by the step's
        directory: if the path no longer names the directory that was opened, the newest step is
        read again (``wanted=None``); a named step is read again if it was replaced, and is
        reported missing if it was retired.
        """
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
                key = self._step_key(step)
                self._authenticate(step, key)
                root = open_tree(path, dataclasses.replace(options, encryption=key))
                _check_selection(root, options.selection, ())
                return step, level_to_state(root), options.verify and root.meta.tree_hash is not None
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

    def _authenticate(self, step: int, key: EncryptionKey | None) -> None:
        """In an encrypted root: refuse a step encrypted for another step number or root."""
        if key is None:
            return
        meta = self._step_meta(step)
        if meta.encryption is not None and not key_matches(key, meta.encryption):
            raise DecryptionError(
                f"step {step} of {self.root} is not authenticated as step {step} of this root: it "
                "was encrypted for another step number or another root (copied or renamed here), "
                "so restoring it could roll the model back. Nothing was read; restore another step "
                f"(steps: {_few(self.steps())})"
            )

    def _step_meta(self, step: int) -> LevelMeta:
        root_fd = open_dir(self.root, self.root, None)
        try:
            return read_step(root_fd, self.root, str(step))
        finally:
            os.close(root_fd)


def _few(steps: list[int]) -> str:
    """A list of steps for a message: all of them, or the first and last few."""
    return str(steps) if len(steps) <= 10 else f"[{', '.join(map(str, steps[:5]))}, ..., {', '.join(map(str, steps[-5:]))}]"


def _check_selection(level: PendingLevel, selection: Selection | None, path: tuple[str, ...]) -> None:
    """Refuse ``keys=`` that select items inside a list or tuple (the state would come back
    with other indices); the levels on the way are loaded anyway."""
    if selection is None:
        return
    if path and level.type in CONTAINER_TYPES and level.type != "dict":
        raise InvalidArgumentError(
            f"keys= selects items inside the {level.type} at {path!r}; a {level.type} is restored "
            f"whole: select {path if len(path) > 1 else path[0]!r} itself"
        )
    loaded = level.load()
    for key, sub in selection.items():
        child = loaded.get(key)
        if sub is not None and isinstance(child, PendingLevel):
            _check_selection(child, sub, path + (key,))


def _first_rank() -> bool:
    """True in a single process, and on rank 0 of the default process group."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _dir_identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the directory at ``path`` (no link followed), ``None`` if none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


