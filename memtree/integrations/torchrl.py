"""torchrl replay buffers on memtree: ``MemtreeStorage`` and ``MemtreeStorageCheckpointer``.

:class:`MemtreeStorage` is a torchrl storage (``ReplayBuffer(storage=MemtreeStorage(n, path))``)
whose data is a memtree tree at ``path``, one file per key (``docs/guide/torchrl.md``):

* it **grows**: the tree is created at the first write with no rows and grows (memtree's
  ``resize_``: file capacity doubling, a committed length) to the highest row written, up to
  ``max_size``; :func:`memtree.load_memmap` of ``path`` (in any process, at any moment) returns
  exactly the rows written so far, never a torn level;
* it is **filled by index from several processes**: pickled to a worker (fork or spawn), it
  reopens the tree from ``path``; a process that writes past the rows it maps reloads the tree,
  and grows it under the tree's writer lock if no other process has (a process that lost that
  race reloads and writes). Rows are written in place into the mapped files, as
  ``LazyMemmapStorage`` writes them: a replay buffer overwrites its rows when it wraps around,
  so readers that need a fixed copy take a checkpoint;
* it reopens: ``MemtreeStorage(n, path, existsok=True)`` on an existing tree adopts its rows
  (the buffer survives its process without a dump).

:class:`MemtreeStorageCheckpointer` (the default checkpointer of ``MemtreeStorage``, and usable
with any TensorDict-backed torchrl storage: ``ReplayBuffer(storage=LazyMemmapStorage(n),
checkpointer=MemtreeStorageCheckpointer())``) writes ``storage.dumps(path)`` (what ``ReplayBuffer.dumps``
calls for its ``storage/``) as one memtree tree holding the valid rows only: atomic (staged and
renamed, an older dump exchanged in one rename), checksummed (verified by ``loads``), no pickle,
and incremental: each key whose bytes equal the previous dump's (of this checkpointer, or the
dump being replaced) is a hard link to it. ``loads`` checks the dump against the storage (keys,
dtypes, shapes, ``max_size``) before changing anything. The rest of ``ReplayBuffer.dumps``
(sampler, writer, ``transform.t``, ``prefetch.pkl``) is torchrl's own.

Example:
    >>> import os, tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import ReplayBuffer
    >>> d = tempfile.mkdtemp()
    >>> rb = ReplayBuffer(storage=MemtreeStorage(100, os.path.join(d, "buffer")), batch_size=4)
    >>> _ = rb.extend(TensorDict(obs=torch.arange(10.0).view(5, 2), batch_size=[5]))
    >>> len(rb), rb.sample()["obs"].shape
    (5, torch.Size([4, 2]))
    >>> import memtree
    >>> memtree.load_memmap(os.path.join(d, "buffer"))["obs"][:, 0].tolist()
    [0.0, 2.0, 4.0, 6.0, 8.0]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from copy import copy
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch

try:
    from tensordict import TensorDict, TensorDictBase, is_non_tensor, is_tensor_collection
    from torchrl.data.replay_buffers.checkpointers import StorageCheckpointerBase
    from torchrl.data.replay_buffers.storages import Storage, TensorStorage
except ImportError as err:  # pragma: no cover - the extra is installed in the tests
    from ..errors import MissingDependencyError

    raise MissingDependencyError("memtree.integrations.torchrl needs torchrl: pip install 'memtree[torchrl]'") from err

from ..errors import (
    DestinationExistsError,
    InvalidArgumentError,
    InvalidIndexError,
    LeafSizeError,
    LockError,
    MissingLeafError,
    NotAMemtreeError,
    NotGrowableError,
    ShapeMismatchError,
)
from ..tree.tensortree import TensorTree, load_memmap
from .trees import is_tree, local_checkpoint_path, write_level

__all__ = ["MemtreeStorage", "MemtreeStorageCheckpointer"]

#: Reloads of the tree a process tries when other processes keep growing it meanwhile.
_GROW_ATTEMPTS = 64
#: What a load raises while another process grows the tree (memtree.store.writing.grow: "retry it").
_TRANSIENT = (NotAMemtreeError, MissingLeafError, LeafSizeError)


def _leaves(td: Any, where: str) -> dict[tuple[str, ...], torch.Tensor]:
    """The tensor leaves of a TensorDict by key path; anything else is refused clearly."""
    if not isinstance(td, TensorDictBase):
        raise InvalidArgumentError(
            f"{where} keeps TensorDict data, got {type(td).__name__}; wrap it: "
            "TensorDict(obs=tensor, batch_size=[n]) (tensorclasses: their .to_tensordict())"
        )
    out: dict[tuple[str, ...], torch.Tensor] = {}

    def walk(level: Any, prefix: tuple[str, ...]) -> None:
        for key, value in level.items():
            path = prefix + (key,)
            if isinstance(value, torch.Tensor) and not is_tensor_collection(value):
                out[path] = value
            elif isinstance(value, TensorDictBase) and not is_non_tensor(value):
                walk(value, path)
            else:  # non-tensor data, a tensorclass, a lazy stack's odd member...
                raise InvalidArgumentError(
                    f"{where}: key {path!r} holds {type(value).__name__}, not a tensor; a memtree storage "
                    "keeps tensors (store the value as a tensor, or drop the key before extending)"
                )

    walk(td, ())
    return out


def _tensordict(tree: TensorTree) -> TensorDict:
    """A TensorDict over a tree's leaves (no copy: writes reach the files)."""
    leaves = {
        (k,) if isinstance(k, str) else tuple(k): tree[k] for k in tree.keys(include_nested=True, leaves_only=True)
    }
    td = TensorDict({}, batch_size=tree.batch_size[:1])
    for path, value in leaves.items():
        td.set(path, value)
    return td


def _structure(leaves: dict[tuple[str, ...], torch.Tensor], rows_first: bool) -> dict[tuple[str, ...], Any]:
    """key path -> (dtype, shape of one row), for comparing a storage with data or a dump."""
    return {k: (v.dtype, tuple(v.shape[1:] if rows_first else v.shape)) for k, v in leaves.items()}


class MemtreeStorageCheckpointer(StorageCheckpointerBase):  # type: ignore[misc]
    """A torchrl storage checkpointer writing ``storage.dumps(path)`` as a memtree tree.

    Args:
        fsync: make each dump durable (files, directories) before it is committed.
        verify: ``loads`` checks every leaf against its recorded checksum first.

    See the module docstring for what a dump is and what ``loads`` checks.
    """

    def __init__(self, *, fsync: bool = False, verify: bool = True) -> None:
        super().__init__()
        for name, flag in (("fsync", fsync), ("verify", verify)):
            if type(flag) is not bool:
                raise InvalidArgumentError(f"{name} must be True or False, got {flag!r:.40}")
        self.fsync = fsync
        self.verify = verify
        self._last: str | None = None  # the previous dump: the source of hard links

    def dumps(self, storage: Any, path: Any) -> None:
        """Write the valid rows of ``storage`` as a memtree tree at ``path`` (atomically).

        Raises:
            InvalidArgumentError: the storage is not initialized, not TensorDict-backed, has
                ``ndim > 1``, ``path`` is a ``MemtreeStorage``'s own directory, or a remote URL.
            DestinationExistsError: ``path`` exists and is not a memtree tree.
        """
        dest = local_checkpoint_path(path, "MemtreeStorageCheckpointer")
        if not storage.initialized:
            raise InvalidArgumentError(f"cannot dump a storage that holds no data yet (nothing was written to it) to {dest}")
        if getattr(storage, "ndim", 1) != 1:
            raise InvalidArgumentError("MemtreeStorageCheckpointer dumps storages of ndim=1 only")
        if isinstance(storage, MemtreeStorage) and os.path.realpath(dest) == os.path.realpath(storage.path):
            raise InvalidArgumentError(
                f"{dest} is the storage's own directory, where its rows live; dump it to another path"
            )
        data = storage.get(slice(0, len(storage))) if len(storage) else storage._storage[:0]
        tree = TensorTree(batch_size=data.batch_size[:1])
        for key, value in _leaves(data, "MemtreeStorageCheckpointer").items():
            tree[key] = value
        link_from = self._last if self._last is not None and is_tree(self._last) else None
        if link_from is None and is_tree(dest):
            link_from = dest  # a dump replaced in place: its unchanged keys are linked
        write_level(dest, tree, link_from=link_from, fsync=self.fsync)
        self._last = dest

    def loads(self, storage: Any, path: Any) -> None:
        """Fill ``storage`` with the rows dumped at ``path`` (its length becomes theirs).

        Raises:
            NotAMemtreeError, IntegrityError, ...: a missing or damaged dump (nothing changed).
            ShapeMismatchError: the dump's keys, dtypes or row shapes differ from the
                storage's, or it holds more rows than ``max_size`` (nothing changed).
        """
        src = local_checkpoint_path(path, "MemtreeStorageCheckpointer")
        tree = load_memmap(src, mode="r", verify=self.verify)
        rows = tree.batch_size[0] if tree.batch_size else 0
        leaves = {
            (k,) if isinstance(k, str) else tuple(k): tree[k] for k in tree.keys(include_nested=True, leaves_only=True)
        }
        if rows > storage.max_size:
            raise ShapeMismatchError(
                f"the dump at {src} holds {rows} rows, more than this storage's max_size {storage.max_size}; "
                "load it into a storage at least that large"
            )
        if storage.initialized:
            have = _structure(_leaves(storage._storage, "the storage"), rows_first=True)
            want = _structure(leaves, rows_first=True)
            if have != want:
                diff = sorted(set(have.items()) ^ set(want.items()), key=str)[:4]
                raise ShapeMismatchError(
                    f"the dump at {src} does not fit this storage (keys, dtypes or row shapes differ: "
                    f"{diff}); load it into a storage built for the same data"
                )
        if rows:
            storage.set(torch.arange(rows), _tensordict(tree), set_cursor=False)
        storage._len = rows
        self._last = src


class MemtreeStorage(TensorStorage):  # type: ignore[misc]
    """A torchrl storage whose rows live in a memtree tree at ``path`` (see the module docstring).

    Args:
        max_size: the most rows the buffer holds (then its writer wraps around).
        path: the directory of the tree (created at the first write).
        existsok: adopt an existing tree at ``path`` (its rows become the buffer's); otherwise an
            existing ``path`` is an error.

    Its checkpointer is :class:`MemtreeStorageCheckpointer` (a ``ReplayBuffer`` sets the one its
    ``checkpointer=`` argument names, this one when that is ``None``).

    Raises:
        DestinationExistsError: ``path`` exists and ``existsok`` is False.
        InvalidArgumentError: a bad ``max_size``, or a remote URL.
    """

    _default_checkpointer = MemtreeStorageCheckpointer

    def __init__(
        self,
        max_size: int,
        path: str | os.PathLike[str],
        *,
        existsok: bool = False,
    ) -> None:
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise InvalidArgumentError(f"max_size must be an int >= 1, got {max_size!r:.40}")
        super().__init__(storage=None, max_size=max_size, device="cpu")
        self.path = local_checkpoint_path(path, "MemtreeStorage")
        self.existsok = existsok
        self._tree: TensorTree | None = None
        if os.path.lexists(self.path):
            if not existsok:
                raise DestinationExistsError(
                    f"{self.path} exists; pass existsok=True to use the buffer stored there, or choose "
                    "another path"
                )
            self._adopt(self._reload())
            self._len = min(self._tree_rows, max_size)

    def __repr__(self) -> str:
        return f"MemtreeStorage(max_size={self.max_size}, path={self.path!r}, len={len(self)})"

    # -- the tree --------------------------------------------------------------------------

    @property
    def _tree_rows(self) -> int:
        return 0 if self._tree is None else int(self._tree.batch_size[0])

    def _reload(self) -> TensorTree:
        """The tree as it is on disk now; a load that another process's growth disturbed (its
        directory exchanged, a file grown before its commit) is taken again."""
        for attempt in range(_GROW_ATTEMPTS):
            try:
                tree = load_memmap(self.path, mode="r+", lazy=False)
                break
            except _TRANSIENT:
                if attempt == _GROW_ATTEMPTS - 1 or not os.path.lexists(self.path):
                    raise
        if not tree.batch_size or tree.batch_size[0] > self.max_size:
            raise ShapeMismatchError(
                f"the tree at {self.path} has batch size {list(tree.batch_size)}; a storage of max_size "
                f"{self.max_size} holds at most that many rows along a first dimension"
            )
        return tree

    def _adopt(self, tree: TensorTree) -> None:
        self._tree = tree
        self._storage = _tensordict(tree)
        self.initialized = True

    def _create(self, item: Any) -> None:
        """Create the tree of no rows shaped like one ``item``, or adopt the one another
        process of this buffer created meanwhile (it must hold the same keys, dtypes, shapes)."""
        leaves = _leaves(item, "MemtreeStorage")
        tree = TensorTree(batch_size=[0])
        for key, value in leaves.items():
            tree[key] = torch.empty((0, *value.shape), dtype=value.dtype)
        try:
            self._adopt(tree.memmap(self.path, existsok=False))
            return
        except (DestinationExistsError, LockError):
            pass  # another process of this buffer created it first
        existing = self._reload()
        want = _structure(leaves, rows_first=False)
        have = _structure(
            {(k,) if isinstance(k, str) else tuple(k): existing[k] for k in existing.keys(include_nested=True, leaves_only=True)},
            rows_first=True,
        )
        if have != want:
            raise ShapeMismatchError(
                f"the data does not fit the buffer at {self.path} (keys, dtypes or row shapes differ: "
                f"{sorted(set(have.items()) ^ set(want.items()), key=str)[:4]})"
            )
        self._adopt(existing)

    def _ensure_rows(self, rows: int) -> None:
        """Make this process map at least ``rows`` rows, growing the tree if no process has."""
        if rows <= self._tree_rows:
            return
        for _ in range(_GROW_ATTEMPTS):
            try:
                tree = self._reload()  # what the other processes made of it meanwhile
                if tree.batch_size[0] < rows:
                    tree.resize_(rows)
            except (NotGrowableError, LockError) + _TRANSIENT:
                continue  # another process grew it meanwhile (or is growing it): look again
            self._adopt(tree)
            return
        raise LockError(
            f"could not grow the buffer at {self.path} to {rows} rows: other processes kept growing it "
            f"({_GROW_ATTEMPTS} attempts)"
        )

    def _rows_for(self, cursor: Any) -> int:
        """The rows a write at ``cursor`` needs (its highest index + 1)."""
        if isinstance(cursor, slice):
            cursor = range(*cursor.indices(self.max_size))
        if isinstance(cursor, (int, np.integer)):
            top, low = int(cursor), int(cursor)
        elif isinstance(cursor, range):
            if not len(cursor):
                return 0
            top, low = max(cursor[0], cursor[-1]), min(cursor[0], cursor[-1])
        else:
            idx = torch.as_tensor(cursor if not isinstance(cursor, Sequence) else list(cursor))
            if idx.dtype == torch.bool:
                idx = idx.nonzero().reshape(-1)
            if not idx.numel():
                return 0
            top, low = int(idx.max()), int(idx.min())
        if low < 0 or top >= self.max_size:
            raise InvalidIndexError(
                f"MemtreeStorage writes rows 0..{self.max_size - 1} by their index, got {low if low < 0 else top}; "
                "negative indices are not supported (the rows written so far grow)"
            )
        return top + 1

    # -- torchrl's Storage ------------------------------------------------------------------

    def _init(self, data: Any) -> None:
        self._create(data)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write ``data`` at rows ``cursor`` (torchrl's writers call this), growing the tree."""
        if not self.initialized or self._tree is None:
            if os.path.lexists(self.path):
                self._adopt(self._reload())
            else:
                is_int = isinstance(cursor, (int, np.integer))
                self._init(data if is_int else data[0])
        self._ensure_rows(self._rows_for(cursor))
        super().set(cursor, data, set_cursor=set_cursor)

    def get(self, index: Any) -> Any:
        """The rows at ``index`` among the ``len(storage)`` valid ones (a TensorDict)."""
        if self._tree is None and os.path.lexists(self.path):
            self._adopt(self._reload())
        self._ensure_rows(len(self))
        return super().get(index)

    @property
    def _total_shape(self) -> torch.Size:
        return torch.Size([self.max_size])

    def state_dict(self) -> dict[str, Any]:
        """The valid rows (tensors mapped from the files: no copy), ``initialized`` and ``_len``."""
        storage = self.get(slice(0, len(self))).state_dict() if self.initialized else {}
        return {"_storage": storage, "initialized": self.initialized, "_len": len(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Write the rows of a :meth:`state_dict` (of this class or of a ``LazyTensorStorage``)."""
        data = TensorDict().load_state_dict(copy(state_dict["_storage"]), strict=False)
        length = int(state_dict["_len"])
        if state_dict["initialized"] and data.batch_size and data.batch_size[0]:
            if data.batch_size[0] > self.max_size:
                raise ShapeMismatchError(
                    f"the state holds {data.batch_size[0]} rows, more than max_size {self.max_size}"
                )
            self.set(torch.arange(data.batch_size[0]), data, set_cursor=False)
        self._len = length
        self._bump_mutation_revision()

    def __getstate__(self) -> dict[str, Any]:
        """What a worker gets: the path (it reopens the tree), and the shared length when it is
        spawned by ``multiprocessing`` (a plain pickle copies the length)."""
        state: dict[str, Any] = Storage.__getstate__(self)
        if get_spawning_popen() is None:
            state.pop("_len_value", None)
            state["len__context"] = self._len
        state["_tree"] = None
        state["_storage"] = None
        return state
