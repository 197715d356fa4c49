"""Lightning checkpoints as memtree trees: ``Trainer(plugins=[MemtreeCheckpointIO()])``.

Lightning hands each checkpoint to its ``CheckpointIO`` plugin as a dict (``state_dict``,
``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``, ``hyper_parameters``...) and
a path (``checkpoints/epoch=0-step=10.ckpt``). :class:`MemtreeCheckpointIO` writes the dict as a
memtree tree *at that path* (a directory: one file per tensor, a ``meta.json`` per level), so
that everything Lightning does by path keeps working: ``ModelCheckpoint`` (top-k, ``last.ckpt``,
``save_last="link"``), ``fit(ckpt_path=...)`` (a path, ``"last"``, ``"best"``),
``validate``/``test(ckpt_path=...)``. What each checkpoint is (``docs/guide/lightning.md``):

* **atomic**: written in a staging directory and renamed onto the path (an existing checkpoint
  there, such as ``last.ckpt``, is exchanged in one ``renameat2``): a ``kill -9`` at any moment
  leaves the previous checkpoint whole and the new one absent, never a torn file (Lightning
  issue #19970); ``fsync=True`` makes that hold across power loss too;
* **checksummed**: each tensor's checksum is recorded, and checked when it is loaded;
* **incremental**: each tensor whose bytes equal the previous checkpoint's (the one this plugin
  saved or resumed from last, while it exists) is a hard link to that file, not a copy (frozen
  layers, embeddings, anything that did not change);
* **no pickle**: tensors are raw files, plain values JSON. Values JSON cannot hold exactly are
  kept with their type (:mod:`memtree.integrations.values`: ``inf``/NaN floats such as
  ``ReduceLROnPlateau``'s ``best``, the ``OrderedDict`` of ``state_dict`` and its ``_metadata``,
  numpy arrays, dtypes, devices); any other object (say, a ``Namespace`` in the hyper-parameters)
  is refused with its path, unless ``allow_pickle=True`` (then it is pickled, and unpickled only
  by a plugin built with ``allow_pickle=True``, never when Lightning asks ``weights_only=True``).

``remove_checkpoint`` (what ``ModelCheckpoint`` calls to drop a checkpoint that left the top k)
removes the tree at once for every reader. ``load_checkpoint`` returns the dict as
``torch.load`` would (tensors on the CPU, Python types kept); a ``torch.save`` file from before
the switch to memtree is read by Lightning's own ``TorchCheckpointIO``.

``blocking=False`` is the asynchronous form (Lightning's ``AsyncCheckpointIO``, made safe):
``save_checkpoint`` copies the tensors and returns (after waiting for the oldest save when two
are already queued: at most two copies of the state exist); one background thread writes each
checkpoint, fsynced before it is committed (``fsync=True`` unless told otherwise), then runs
the removals Lightning asked for meanwhile, in order: a checkpoint is removed only once the one
saved before that removal is durable, and never when that save failed. A failure is raised by
the next call (``save_checkpoint``, ``remove_checkpoint``, ``load_checkpoint``, ``teardown``).

Example:
    >>> import os, tempfile, torch
    >>> io = MemtreeCheckpointIO()
    >>> path = os.path.join(tempfile.mkdtemp(), "epoch=0-step=1.ckpt")
    >>> io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, path)
    >>> io.load_checkpoint(path)["state_dict"]["w"]
    tensor([1., 1.])
    >>> io.remove_checkpoint(path); os.path.exists(path)
    False
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError as err:  # pragma: no cover - the extra is installed in the tests
    from ..errors import MissingDependencyError

    raise MissingDependencyError(
        "memtree.integrations.lightning needs Lightning: pip install 'memtree[lightning]'"
    ) from err

from ..errors import CheckpointSaveError, InvalidArgumentError
from ..training.state import state_to_level
from .trees import is_tree, load_tree, local_checkpoint_path, newest_tree, remove_tree, write_level
from .values import encode

__all__ = ["MemtreeCheckpointIO"]

_PICKLE_HINT = "pass MemtreeCheckpointIO(allow_pickle=True) to store it pickled"
_UNPICKLE_HINT = "build the plugin with MemtreeCheckpointIO(allow_pickle=True)"
#: Paths remembered as link sources (the newest existing one is used).
_REMEMBERED = 8
#: Background saves queued or running at most: a save waits for the oldest beyond this (each
#: holds a copy of the state; ModelCheckpoint saves twice a time with save_last).
_MAX_PENDING_SAVES = 2


class MemtreeCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves each checkpoint as a memtree tree at its path.

    Args:
        blocking: ``False``: save in a background thread (see the module docstring).
        fsync: make each checkpoint durable before it counts (survives power loss); default
            ``False`` (atomic against crashes of the process), ``True`` with ``blocking=False``.
        incremental: hard-link the tensors equal to the previous checkpoint's; ``False`` writes
            every byte.
        allow_pickle: store values that neither tensors nor JSON can hold pickled (and load
            them); otherwise a checkpoint holding one is refused, naming its key.
        verify: check each tensor against its recorded checksum when loading.

    Use it as ``Trainer(plugins=[MemtreeCheckpointIO()])``; it also works on its own
    (``MemtreeCheckpointIO().load_checkpoint(path)`` reads a checkpoint without a Trainer).
    """

    def __init__(
        self,
        *,
        blocking: bool = True,
        fsync: bool | None = None,
        incremental: bool = True,
        allow_pickle: bool = False,
        verify: bool = True,
    ) -> None:
        for name, flag in (("blocking", blocking), ("incremental", incremental), ("allow_pickle", allow_pickle),
                           ("verify", verify), ("fsync", not blocking if fsync is None else fsync)):
            if type(flag) is not bool:
                raise InvalidArgumentError(f"{name} must be True or False, got {flag!r:.40}")
        self.blocking = blocking
        self.fsync = (not blocking) if fsync is None else fsync
        self.incremental = incremental
        self.allow_pickle = allow_pickle
        self.verify = verify
        self._recent: list[str] = []  # paths saved or loaded, newest first: the link sources
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []  # saves and removals
        self._saves: list[Future[None]] = []
        self._failed: BaseException | None = None  # a background failure, raised once
        #: Work submitted in one epoch is skipped after a failure in that epoch; an epoch ends
        #: when the failure is raised to the training thread (later work runs again).
        self._epoch = 0
        self._failed_epoch = -1

    def __repr__(self) -> str:
        return (
            f"MemtreeCheckpointIO(blocking={self.blocking}, fsync={self.fsync}, incremental={self.incremental}, "
            f"allow_pickle={self.allow_pickle}, verify={self.verify})"
        )

    # -- saving -------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` as a memtree tree at ``path`` (replacing the checkpoint there).

        Raises:
            InvalidArgumentError: ``storage_options`` (not supported), or a remote URL.
            DestinationExistsError: ``path`` is a file or a directory memtree did not write.
            NonTensorValueError: a value that needs pickle, without ``allow_pickle``.
            CheckpointSaveError: an earlier background save failed (its error is chained).
        """
        if storage_options is not None:
            raise InvalidArgumentError(
                f"MemtreeCheckpointIO.save_checkpoint got storage_options={storage_options!r:.60}, which it "
                "does not support (as Lightning's TorchCheckpointIO); leave them out"
            )
        dest = local_checkpoint_path(path, "MemtreeCheckpointIO")
        self._wait_below(_MAX_PENDING_SAVES)  # bounded memory: so many copies of the state at most
        self._raise_failure()
        level = state_to_level(
            encode(checkpoint, allow_pickle=self.allow_pickle, snapshot=not self.blocking, pickle_hint=_PICKLE_HINT)
        )
        self._run(lambda: self._write(dest, level), save=True)

    def _write(self, dest: str, level: Any) -> None:
        link_from = newest_tree(p for p in self._recent if p != dest) if self.incremental else None
        write_level(dest, level, link_from=link_from, fsync=self.fsync)
        self._remember(dest)

    def _remember(self, path: str) -> None:
        with self._lock:
            self._recent = [path] + [p for p in self._recent if p != path][: _REMEMBERED - 1]

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint at ``path`` (a tree, a ``torch.save`` file, or a link to one).

        With ``blocking=False`` the removal runs after the saves asked for before it, and only if
        they succeeded.

        Raises:
            InvalidArgumentError: ``path`` is a directory memtree did not write (left alone).
            CheckpointSaveError: an earlier background save failed (its error is chained).
        """
        dest = local_checkpoint_path(path, "MemtreeCheckpointIO")
        self._raise_failure()
        self._run(lambda: remove_tree(dest))

    # -- loading ------------------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint saved at ``path``, as ``torch.load`` returns it (tensors on the CPU).

        Args:
            path: a checkpoint directory (or a link to one, such as ``last.ckpt``), or a
                ``torch.save`` file (read by Lightning's ``TorchCheckpointIO``).
            map_location: ``None`` (the CPU), or a device (or its name) to move every tensor to.
            weights_only: ``True`` refuses values saved pickled even with ``allow_pickle``.

        Raises:
            CheckpointNotFoundError: nothing at ``path``.
            IntegrityError: a tensor's bytes differ from its checksum (damaged files).
            PickleNotAllowedError: a value saved pickled, and no ``allow_pickle`` (or
                ``weights_only=True``).
            CheckpointSaveError: an earlier background save failed (its error is chained).
        """
        dest = local_checkpoint_path(path, "MemtreeCheckpointIO")
        self.wait()
        real = os.path.realpath(dest)  # last.ckpt may be a link to the checkpoint it repeats
        if os.path.isfile(real):
            checkpoint: dict[str, Any] = TorchCheckpointIO().load_checkpoint(real, weights_only=weights_only)
        else:
            checkpoint = load_tree(
                real, allow_pickle=self.allow_pickle and weights_only is not True, verify=self.verify,
                pickle_hint=_UNPICKLE_HINT if weights_only is not True else "load it with weights_only=False",
            )
            if self.incremental and is_tree(real):
                self._remember(real)  # the first save after a resume links from it
        device = _device(map_location)
        if device is not None:
            checkpoint = _move(checkpoint, device)
        return checkpoint

    # -- background saves ---------------------------------------------------------------------

    def _run(self, work: Callable[[], None], *, save: bool = False) -> None:
        if self.blocking:
            work()
            return
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="memtree-lightning")
            self._pending = [f for f in self._pending if not f.done()]
            future = self._executor.submit(self._guarded, work, self._epoch)
            self._pending.append(future)
            if save:
                self._saves = [f for f in self._saves if not f.done()] + [future]

    def _wait_below(self, count: int) -> None:
        """Wait until fewer than ``count`` background saves are queued or running."""
        while True:
            with self._lock:
                saves = self._saves = [f for f in self._saves if not f.done()]
            if len(saves) < count:
                return
            futures_wait(saves[:1])

    def _guarded(self, work: Callable[[], None], epoch: int) -> None:
        with self._lock:
            if self._failed_epoch == epoch:
                return  # a save asked for before this failed: keep every checkpoint as it is
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - raised by the next call in the training thread
            with self._lock:
                self._failed, self._failed_epoch = err, epoch

    def _raise_failure(self) -> None:
        with self._lock:
            err, self._failed = self._failed, None
            if err is not None:
                self._epoch += 1
        if err is not None:
            raise CheckpointSaveError(
                f"a background checkpoint save failed: {err}; it was not committed, and the removals "
                "Lightning asked for after it were not made (every earlier checkpoint is kept)"
            ) from err

    def wait(self) -> None:
        """Wait for the background saves and removals; raise the first failure among them.

        Raises:
            CheckpointSaveError: a background save or removal failed (its error is chained).

        Example:
            >>> MemtreeCheckpointIO(blocking=False).wait()
        """
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()
        self._raise_failure()

    def teardown(self) -> None:
        """Finish the background work (Lightning calls this at the end of ``fit``).

        Raises:
            CheckpointSaveError: a background save or removal failed (its error is chained).
        """
        try:
            self.wait()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)


def _device(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        try:
            return torch.device(map_location)
        except (RuntimeError, TypeError) as err:
            raise InvalidArgumentError(f"map_location {map_location!r:.40} names no device: {err}") from None
    raise InvalidArgumentError(
        f"MemtreeCheckpointIO.load_checkpoint takes map_location=None (the CPU) or a device, got "
        f"{type(map_location).__name__}; move the tensors after loading instead"
    )


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):  # OrderedDict too: keep its type and _metadata
        out: Any = type(value)((k, _move(v, device)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata
        return out
    if type(value) in (list, tuple):
        return type(value)(_move(v, device) for v in value)
    return value
