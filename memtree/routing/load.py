"""The load side of routing: the tree of one routed ``torch.load``, opened without following
links out of its directory, and the storages its references name, each checked against its leaf.

A reference (:func:`_routed_storage`, called by torch's unpickler) names a tree, a leaf, a dtype
and a location; it becomes a storage that cannot grow, holding exactly its leaf's bytes. torch's
rebuild then places the tensor (offset, size, stride) on it; one that does not fit fails there,
and :meth:`LoadSession.explain` turns torch's error into a
:class:`~memtree.errors.CheckpointFormatError` naming the file, the leaf and the geometry.

Example:
    >>> import os, tempfile, torch, memtree
    >>> d = tempfile.mkdtemp()
    >>> with memtree.saving():
    ...     torch.save({"w": torch.arange(3.0)}, os.path.join(d, "c.pt"))
    >>> session = LoadSession(os.path.join(d, "c.pt.memtree"), True, os.path.join(d, "c.pt"), None)
    >>> (entry,) = os.listdir(os.path.join(d, "c.pt.memtree"))
    >>> session.storage(entry, "0", "float32", "cpu").tolist()
    [0.0, 1.0, 2.0]
"""

from __future__ import annotations

import contextvars
import errno
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointFormatError, NotAMemtreeError, RoutingError, UnsafePathError
from ..format.dtypes import dtype_from_name
from ..format.names import ROUTED_ENTRY, ROUTED_SUFFIX
from ..store.primitives.files import storage_error
from ..store.reading.options import ReadOptions
from ..store.reading.read import open_tree
from .route import is_path, tag, target_path

__all__ = ["LoadSession", "SESSION", "LOCATION_PREFIXES"]

#: Locations a reference may name (what routed saves write).
LOCATION_PREFIXES = ("cpu", "cuda")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ = ReadOptions.of(mode="r")  # copy-on-write mappings: a loaded tensor never writes its file


class LoadSession:
    """The routed tree of one ``torch.load`` (of ``source``), opened at its first reference.

    Args:
        directory: where the tree is.
        default: whether ``directory`` is the file's own ``<file>.memtree`` (then it must be a
            real directory, not a link).
        source: the file (or stream) torch loads, for messages.
        map_location: ``torch.load``'s, applied to each storage as torch applies it.
    """

    def __init__(self, directory: str, default: bool, source: Any, map_location: Any) -> None:
        self.directory = directory
        self.default = default
        self.source = source
        self.map_location = map_location
        self.entry: str | None = None
        self.leaves: dict[str, Any] = {}
        self.storages: dict[tuple[str, str], Any] = {}  # restored UntypedStorages
        #: id of each storage handed to torch -> (the storage, its leaf's key)
        self.made: dict[int, tuple[Any, str]] = {}

    # ---------------------------------------------------------------------------- references
    def storage(self, entry: Any, key: Any, dtype: Any, location: Any) -> torch.storage.TypedStorage:
        """The storage one reference names, every part of it checked first."""
        if not isinstance(entry, str) or not ROUTED_ENTRY.fullmatch(entry):
            raise self._bad(f"a tensor reference names the tree {entry!r}, not a name memtree writes")
        if self.entry is None:
            self.leaves = self._open(entry)
            self.entry = entry
        elif entry != self.entry:
            raise self._bad(f"tensor references name two trees, {self.entry!r} and {entry!r}")
        torch_dtype = dtype_from_name(dtype) if isinstance(dtype, str) else None
        if torch_dtype is None:
            raise self._bad(f"a tensor reference names the dtype {dtype!r}")
        if not isinstance(location, str) or location.split(":", 1)[0] not in LOCATION_PREFIXES:
            raise self._bad(f"a tensor reference names the location {location!r}")
        if not isinstance(key, str):
            raise self._bad(f"a tensor reference names {key!r}, which is no leaf of the tree {entry}")
        cached = self.storages.get((key, location))
        if cached is None:
            cached = self.storages[(key, location)] = self._restore(self._leaf(key), location)
            self.made[id(cached)] = (cached, key)
        return torch.storage.TypedStorage(wrap_storage=cached, dtype=torch_dtype, _internal=True)

    def explain(self, err: BaseException) -> CheckpointFormatError | None:
        """``err`` as a typed error if torch raised it placing a tensor on one of our storages.

        torch's rebuild functions (``torch._utils._rebuild_*``) take the storage as ``storage``:
        the innermost such frame holding one of this load's storages is where a reference's
        offset, size or stride did not fit its leaf (or was not a valid one).
        """
        found = None
        tb = err.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_globals.get("__name__") == "torch._utils":
                held = frame.f_locals.get("storage")
                made = self.made.get(id(getattr(held, "_untyped_storage", held)))
                if made is not None and made[0] is getattr(held, "_untyped_storage", held):
                    found = made[1], frame.f_locals
            tb = tb.tb_next
        if found is None:
            return None
        key, f_locals = found
        leaf = self.leaves[key]
        geometry = ", ".join(
            f"{name} {f_locals[name]!r}" for name in ("size", "stride", "storage_offset") if name in f_locals
        )
        return self._bad(
            f"a tensor ({geometry}) does not fit the leaf {key!r} of the tree "
            f"{os.path.join(self.directory, str(self.entry))}, {leaf.numel() * leaf.element_size():,} "
            f"bytes ({type(err).__name__}: {err})"
        )

    # ------------------------------------------------------------------------------ the tree
    def _open(self, entry: str) -> dict[str, Any]:
        """The leaves of tree ``entry``: opened relative to its directory, never through a link."""
        path = os.path.join(self.directory, entry)
        dir_fd = self._open_dir(self.directory, None, self.directory, follow=not self.default, entry=entry)
        try:
            entry_fd = self._open_dir(entry, dir_fd, path, follow=False, entry=entry)
        finally:
            os.close(dir_fd)
        try:
            try:
                root = open_tree(path, _READ)
            except NotAMemtreeError:
                if os.path.lexists(path):
                    raise
                raise self._missing(path) from None  # removed since it was opened
            if _inode(os.fstat(root.source.fd)) != _inode(os.fstat(entry_fd)):
                raise UnsafePathError(
                    f"torch.load({self.source!r}): the routed tree {path} was replaced while it was "
                    "opened (by a link or another directory); nothing of it was loaded"
                )
            return root.load()
        finally:
            os.close(entry_fd)

    def _open_dir(self, name: str, dir_fd: int | None, where: str, *, follow: bool, entry: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS | (0 if follow else _NOFOLLOW), dir_fd=dir_fd)
        except FileNotFoundError:
            raise self._missing(os.path.join(self.directory, entry)) from None
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePathError(
                    f"torch.load({self.source!r}): {where} is a symbolic link or not a directory; "
                    "memtree reads a routed tree only from the real directory beside the file and "
                    "does not follow links out of it (a directory of your choice can be given with "
                    "memtree.loading(path=...)); nothing of it was loaded"
                ) from None
            raise storage_error(err, f"opening {where}") from err

    def _leaf(self, key: str) -> torch.UntypedStorage:
        leaf = self.leaves.get(key)
        if not isinstance(leaf, torch.Tensor):
            raise self._bad(f"a tensor reference names {key!r}, which is no leaf of the tree {self.entry}")
        storage = leaf.untyped_storage()
        nbytes = leaf.numel() * leaf.element_size()
        if leaf.dim() != 1 or leaf.storage_offset() or storage.nbytes() != nbytes or leaf.device.type != "cpu":
            raise self._bad(
                f"the leaf {key!r} of the tree {self.entry} is a {tuple(leaf.shape)} tensor over "
                f"{storage.nbytes():,} bytes; routed saves write flat leaves that are their whole file"
            )
        if not storage.resizable():
            return storage
        # an empty leaf's storage: a non-resizable one, so that no reference can grow it
        return torch.from_numpy(np.empty(0, np.uint8)).untyped_storage()

    def _restore(self, storage: torch.UntypedStorage, location: str) -> Any:
        """``storage`` where ``torch.load`` would put it: ``map_location`` applied as torch does."""
        ml = self.map_location
        restore: Callable[[Any, str], Any] = torch.serialization.default_restore_location
        if ml is None:
            return restore(storage, location)
        if isinstance(ml, dict):
            return restore(storage, ml.get(location, location))
        if isinstance(ml, (str, torch.device)):
            return restore(storage, str(ml))
        result = ml(storage, location)
        return restore(storage, location) if result is None else result

    # ------------------------------------------------------------------------------ errors
    def _bad(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"torch.load({self.source!r}): {what}; the file was not written by memtree.saving() "
            "or was altered, and nothing of it was loaded"
        )

    def _missing(self, path: str) -> NotAMemtreeError:
        """The error for a tree that is not there, naming the file, the tree and why."""
        why = ""
        if is_path(self.source):
            entry = os.path.basename(path)
            if entry[:12] != tag(target_path(self.source)):
                why = (
                    " The file was saved under another name and copied or renamed without its tree."
                    if self.default
                    else " The file was saved under another name and copied or renamed; the tree "
                    "belongs to that name, whose next save deleted it (a copy in the directory of "
                    "that file keeps it)."
                )
            beside = _found_beside(target_path(self.source), entry)
            if beside is not None and beside != path:
                why += f" That tree is in {beside}: pass memtree.loading(path={os.path.dirname(beside)!r})."
        return NotAMemtreeError(
            f"torch.load({self.source!r}): its tensors are in the memtree tree {path}, which does "
            f"not exist.{why} To load it, copy the file together with its tree directory, or pass "
            "memtree.loading(path=...) the directory where the tree is"
        )


def _inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _found_beside(source: str, entry: str) -> str | None:
    """A tree named ``entry`` in a ``*.memtree`` directory beside ``source``, for messages."""
    parent = os.path.dirname(source)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return None
    for name in names:
        path = os.path.join(parent, name, entry)
        if name.endswith(ROUTED_SUFFIX) and not os.path.islink(os.path.join(parent, name)) and os.path.isdir(path):
            return path
    return None


SESSION: contextvars.ContextVar[LoadSession | None] = contextvars.ContextVar("memtree_load_session", default=None)


def _routed_storage(entry: str, key: str, dtype: str, location: str) -> torch.storage.TypedStorage:
    """The storage a routed ``torch.save`` file references (called by ``torch.load``'s unpickler).

    Raises:
        RoutingError: not inside ``memtree.loading()`` (or its ``path=`` gave no directory).
    """
    session = SESSION.get()
    if session is None:
        raise RoutingError(
            "this file was written by torch.save under memtree.saving(): its tensors are in a "
            f"memtree tree beside it (<file>.memtree/{entry}/); load it inside "
            "`with memtree.loading(): torch.load(...)` (for a file-like source, pass "
            "memtree.loading(path=<the tree's directory>))"
        )
    return session.storage(entry, key, dtype, location)


# routed files name it memtree.routing._routed_storage (re-exported there), as they always have
_routed_storage.__module__ = "memtree.routing"
if hasattr(torch.serialization, "add_safe_globals"):  # torch >= 2.4: weights_only loads accept it
    torch.serialization.add_safe_globals([_routed_storage])
