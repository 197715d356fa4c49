"""The save side of routing: a pickle whose storages are references, the tree of those storages,
and the commit of the pair (see the package docstring for the layout and its atomicity).

Ownership of trees: a tree belongs to the file name it was saved as (the tag in its name). The
next save of that name deletes it, unless the trees are in a shared ``path=`` directory and a
``torch.save`` file in the saved file's own directory still references it (a copy, a rename, a
hard link: ``cp last.pt best.pt``); such a tree is deleted by the first later save of its name
that finds no file referencing it.

Example:
    >>> import os, tempfile, torch, memtree
    >>> d = tempfile.mkdtemp()
    >>> with memtree.saving(path=os.path.join(d, "trees")):
    ...     torch.save({"w": torch.ones(2)}, os.path.join(d, "last.pt"))
    >>> import shutil; _ = shutil.copy(os.path.join(d, "last.pt"), os.path.join(d, "best.pt"))
    >>> with memtree.saving(path=os.path.join(d, "trees")):
    ...     torch.save({"w": torch.zeros(2)}, os.path.join(d, "last.pt"))
    >>> len(os.listdir(os.path.join(d, "trees")))      # best.pt's tree is kept
    2
"""

from __future__ import annotations

import contextvars
import io
import os
import pickle
import shutil
import stat
import types
import zipfile
from typing import Any

import torch

from ..errors import DtypeError, RoutingError, UnsafePathError
from ..format.dtypes import dtype_name, itemsize
from ..format.names import (
    META_NAME,
    ROUTED_ENTRY,
    SIBLING,
    lock_path,
    old_path,
    routed_entry_name,
    staging_path,
)
from ..store.primitives.commit import WriterLock, fsync_dir, make_dirs
from ..store.writing.recovery import recover_locked
from ..tree.tensortree import TensorTree
from .load import LOCATION_PREFIXES, _routed_storage
from .patch import TORCH
from .route import Route, is_path, tag, target_path

__all__ = ["save_routed", "LOCK_TIMEOUT", "MAX_SCANNED_BYTES"]

#: Seconds a save waits for another save of the same file (in any thread or process) to finish.
LOCK_TIMEOUT = 3600.0
#: Most bytes of pickle read from one file when looking for references to a tree (a routed
#: pickle holds no tensor data; a bigger one keeps no tree alive).
MAX_SCANNED_BYTES = 64 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: How a legacy (pre-zip) torch.save file starts, after the pickle header: its magic number.
_LEGACY_MAGIC = b"\x8a\x0a" + torch.serialization.MAGIC_NUMBER.to_bytes(10, "little")
_SCAN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)

_SESSION: contextvars.ContextVar[_SaveSession | None] = contextvars.ContextVar(
    "memtree_save_session", default=None
)


class _StorageRef:
    """What a routed storage is pickled as: a call of :func:`_routed_storage`."""

    __slots__ = ("args",)

    def __init__(self, *args: str) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (_routed_storage, self.args)


class _SaveSession:
    """The storages of one routed ``torch.save``, collected while its pickle is written."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        self.keys: dict[int, str] = {}  # storage _cdata -> leaf key
        self.storages: list[tuple[torch.UntypedStorage, torch.dtype]] = []  # also keeps them alive
        self.refs: dict[tuple[str, torch.dtype], _StorageRef] = {}

    def ref(self, storage: Any, hint: torch.dtype | None) -> _StorageRef | None:
        """The reference for a typed or untyped storage (``hint``: the tensor's dtype), or None."""
        typed = isinstance(storage, torch.storage.TypedStorage)
        untyped = storage._untyped_storage if typed else storage
        dtype = storage.dtype if typed else hint if hint is not None else torch.uint8
        if untyped.device.type not in LOCATION_PREFIXES or untyped.nbytes() and not untyped.data_ptr():
            return None  # other devices, and storages without data (fake ones): left to torch.save
        try:
            dtype_name(dtype)
        except DtypeError:  # quantized storages
            return None
        key = self.keys.get(untyped._cdata)
        if key is None:
            key = self.keys[untyped._cdata] = str(len(self.storages))
            self.storages.append((untyped, dtype))
        # torch.load hands its rebuild functions typed storages, bytes for untyped ones
        ref_dtype = dtype if typed else torch.uint8
        ref = self.refs.get((key, ref_dtype))
        if ref is None:  # one object per (storage, dtype): pickle memoises it, so loads share it
            location = torch.serialization.location_tag(untyped)
            ref = _StorageRef(self.entry, key, dtype_name(ref_dtype), location)
            self.refs[(key, ref_dtype)] = ref
        return ref

    def swap(self, value: Any, depth: int = 0, hint: torch.dtype | None = None) -> Any:
        """``value`` (a tensor's reduction) with the storages in it replaced by references.

        Storages come typed (``_rebuild_tensor_v2``) or untyped, followed by their dtype
        (``_rebuild_tensor_v3``, dtypes without a typed storage class: uint16, float8...).
        """
        if isinstance(value, (torch.storage.TypedStorage, torch.UntypedStorage)):
            return self.ref(value, hint) or value
        if type(value) is tuple and depth < 4:
            hint = next((v for v in value if isinstance(v, torch.dtype)), None)
            return tuple(self.swap(v, depth + 1, hint) for v in value)
        return value

    def leaves(self) -> dict[str, torch.Tensor]:
        """Each storage as a flat tensor of the first dtype seen for it (bytes if it does not fit)."""
        out = {}
        for key, (untyped, dtype) in enumerate(self.storages):
            if untyped.nbytes() % itemsize(dtype):
                dtype = torch.uint8
            n = untyped.nbytes() // itemsize(dtype)
            out[str(key)] = torch.empty(0, dtype=dtype, device=untyped.device).set_(untyped, 0, (n,), (1,))
        return out


class _RoutingPickler(pickle.Pickler):
    """The pickler ``torch.save`` uses under ``saving()``: tensors' storages become references."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = _SESSION.get()

    def reducer_override(self, obj: Any) -> Any:
        # torch's pickler catches storages before this is called; tensors come here first
        if self._session is None or not isinstance(obj, torch.Tensor):
            return NotImplemented
        return self._session.swap(obj.__reduce_ex__(2))


class _PickleModule(types.ModuleType):
    """``pickle`` with :class:`_RoutingPickler` as its ``Pickler`` (torch.save's ``pickle_module``)."""

    Pickler = _RoutingPickler

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


_PICKLE_MODULE = _PickleModule("pickle")


def save_routed(obj: object, f: Any, where: tuple[str, bool], route: Route, kwargs: dict[str, Any]) -> None:
    """Pickle ``obj`` with its storages as references, write the tree, then commit the pickle.

    A path target is locked like a memtree destination (``.<name>.memtree.lock`` beside it, whose
    journal names the staging directory, so the next save cleans up after a killed one). Its
    pickle is written under its own name (torch names the archive's root folder after the file)
    in that staging directory, and renamed over the target: the commit. With ``route.fsync``,
    every directory the save creates is fsynced into its parent before the commit, and the
    file's directory into its parent after it.
    """
    directory, is_default = where
    target = target_path(f) if is_path(f) else None
    name_tag = tag(target)
    if target is not None:
        parent, name = os.path.split(target)
        if not os.path.isdir(parent):
            raise RoutingError(f"Parent directory {parent} does not exist.")  # as torch.save says
        lock = WriterLock(lock_path(parent, name), target, timeout=LOCK_TIMEOUT)
    else:
        lock = WriterLock(lock_path(directory, name_tag), f"the tree directory {directory}", timeout=LOCK_TIMEOUT)
    _make_directory(directory, is_default, route.fsync)
    session = _SaveSession(routed_entry_name(name_tag))
    entry_path = os.path.join(directory, session.entry)
    with lock:
        staging = None
        if target is not None:
            recover_locked(parent, name, lock)
            staging = staging_path(parent, name)
            lock.write_journal({"staging": os.path.basename(staging)}, fsync=route.fsync)
        try:
            if staging is not None:
                os.mkdir(staging)
            out: Any = os.path.join(staging, name) if staging is not None else io.BytesIO()
            token = _SESSION.set(session)
            try:
                TORCH["save"](obj, out, _PICKLE_MODULE, **kwargs)
            finally:
                _SESSION.reset(token)
            if session.storages:
                TensorTree(session.leaves()).memmap(  # each storage is its own file's whole mapping: no pack
                    entry_path, existsok=False, num_threads=route.num_threads, fsync=route.fsync, pack_below=0
                )
            if target is None:  # a stream: the pickle goes in last, once the tree is committed
                f.write(out.getvalue())
            else:
                if route.fsync:
                    _fsync_file(out)
                os.replace(out, target)  # the commit
                if route.fsync:
                    fsync_dir(parent)
                    fsync_dir(os.path.dirname(parent))  # the file's directory, if it is new
        except BaseException:
            if os.path.lexists(entry_path):
                shutil.rmtree(entry_path, ignore_errors=True)
            raise
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        if target is not None:  # a stream's trees are the caller's to remove
            _remove_older(directory, is_default, session.entry, target)


def _make_directory(directory: str, is_default: bool, fsync: bool) -> None:
    """Create the tree directory (and its missing parents), each fsynced into its parent."""
    if is_default and os.path.islink(directory):
        raise UnsafePathError(
            f"{directory} is a symbolic link; memtree writes a file's routed trees only into a "
            "real directory beside it: remove the link, or choose a directory with "
            "memtree.saving(path=...)"
        )
    if os.path.isfile(os.path.join(directory, META_NAME)):
        raise RoutingError(
            f"{directory} is a memtree tree, not a directory of routed saves; choose another "
            "directory with memtree.saving(path=...)"
        )
    try:
        make_dirs(directory, fsync=fsync)
    except OSError as err:
        raise RoutingError(f"cannot create {directory} for torch.save's tensors: {err}") from err


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_older(directory: str, is_default: bool, keep: str, target: str) -> None:
    """Delete what earlier saves of ``target`` left in ``directory``.

    Their trees (of the previous save, or orphaned by a crash before its commit), and the staging
    directories and lock files of tree writes that a crash interrupted. In the default directory
    every other tree is one; in a shared one, only those of the target's tag, and of those only
    the ones that no file beside the target references. The caller holds the target's lock, so
    no save of this target is in flight.
    """
    own = None if is_default else tag(target)
    try:
        dir_fd = os.open(directory, _DIR_FLAGS | (getattr(os, "O_NOFOLLOW", 0) if is_default else 0))
    except OSError:
        return  # gone or replaced by a link meanwhile: nothing of ours to remove
    try:
        trees: list[str] = []
        leftovers: list[str] = []
        for name in os.listdir(dir_fd):
            sibling = SIBLING.fullmatch(name)
            entry = ROUTED_ENTRY.fullmatch(sibling["name"] if sibling else name)
            if entry is None or name == keep or (own is not None and entry["tag"] != own):
                continue
            (leftovers if sibling else trees).append(name)
        if trees and not is_default:
            kept = _referenced(os.path.dirname(target), set(trees), os.path.basename(target))
            trees = [t for t in trees if t not in kept]
        for name in trees + leftovers:
            _remove(dir_fd, directory, name, tree=name in trees)
    finally:
        os.close(dir_fd)


def _remove(dir_fd: int, directory: str, name: str, *, tree: bool) -> None:
    try:
        if tree:
            old = os.path.basename(old_path(directory, name))
            os.rename(name, old, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # gone from its name at once
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
        elif name.endswith(".lock"):
            os.unlink(name, dir_fd=dir_fd)
        else:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    except OSError:
        pass


def _referenced(parent: str, trees: set[str], skip: str) -> set[str]:
    """Those of ``trees`` that a ``torch.save`` file in ``parent`` (other than ``skip``) names."""
    found: set[str] = set()
    try:
        names = os.listdir(parent)
    except OSError:
        return found
    wanted = {t: t.encode() for t in trees}
    for name in names:
        if name == skip or found == trees:
            continue
        data = _pickle_bytes(os.path.join(parent, name))
        if data:
            found.update(t for t, b in wanted.items() if b in data)
    return found


def _pickle_bytes(path: str) -> bytes | None:
    """The pickle of a ``torch.save`` file (zip or legacy), at most :data:`MAX_SCANNED_BYTES`.

    None for anything else: links, FIFOs, directories, other formats, unreadable files.
    """
    try:
        fd = os.open(path, _SCAN_FLAGS)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        f = os.fdopen(fd, "rb")
    except OSError:
        os.close(fd)
        return None
    with f:
        try:
            head = f.read(32)
            if head[:1] == b"\x80" and _LEGACY_MAGIC in head:  # legacy: pickles, then tensor data
                return head + f.read(MAX_SCANNED_BYTES)
            if head[:4] != b"PK\x03\x04":
                return None
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                for info in archive.infolist():
                    if info.filename.endswith("/data.pkl") and info.file_size <= MAX_SCANNED_BYTES:
                        with archive.open(info) as member:
                            return member.read(MAX_SCANNED_BYTES)
        except Exception:  # noqa: BLE001  (any file at all may be here: unreadable means unreferenced)
            return None
    return None
