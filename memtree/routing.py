"""``torch.save``/``torch.load`` routed through memtree: :func:`saving` and :func:`loading`.

Code that calls ``torch.save`` itself (a training loop's callback, a trainer saving
``optimizer.pt``) writes its tensors as a memtree tree when run inside ``with memtree.saving():``,
and ``torch.load`` inside ``with memtree.loading():`` maps them back lazily, without reading them.

Layout. ``torch.save(obj, "ckpt.pt")`` under :func:`saving` writes two things:

* ``ckpt.pt``: an ordinary ``torch.save`` file of ``obj`` in which each tensor's storage is a small
  reference (a call of :func:`_routed_storage`, which ``weights_only=True`` loads accept);
* ``ckpt.pt.memtree/<tag>-<random>/``: a memtree tree with one 1-d leaf per storage (keys ``"0"``,
  ``"1"``, ...), written atomically. The tag is a hash of the target's path.

The pair is atomic: the tree is committed under a fresh name first, then ``ckpt.pt`` is replaced by
one rename (the commit point), and only then is the previous save's tree deleted. A crash leaves
the old pair, or the new one, never a mix (an orphaned tree left by a crash is removed by the next
save to the same file). Tensors that share a storage (tied weights, views, even views of one
storage as different dtypes) still share it after loading. Only CPU and CUDA storages of the dtypes
memtree stores are routed; others (quantized, ``meta``, other devices) stay inside ``ckpt.pt``.

Loading maps each storage's leaf copy-on-write (like ``torch.load(mmap=True)``): nothing is read
until used, and in-place changes to a loaded tensor never reach the files. ``map_location`` is
applied as ``torch.load`` does: a CUDA tensor comes back on its device unless told otherwise.
A routed file loaded *without* :func:`loading` raises :class:`~memtree.errors.RoutingError`
saying so (with ``weights_only=True`` in a process that has not imported ``memtree.routing``,
torch's own "Unsupported global: memtree.routing._routed_storage" error).

Scope. Both context managers are local to the thread and to the ``asyncio`` task (contextvars):
another thread's ``torch.save`` is unaffected. They nest (the innermost one decides) and
``torch.save``/``torch.load`` are the original functions again once the last one exits, whatever the
order of the exits and even on an error. They replace the attributes ``torch.save``/``torch.load``
(and ``torch.serialization.save``/``load``) while active, so code that imported the functions
themselves beforehand (``from torch import save``) is not routed. File-like targets (``BytesIO``)
are saved and loaded normally unless a ``path=`` callback names a directory for them.

Example:
    >>> import os, tempfile, torch, memtree
    >>> d = tempfile.mkdtemp()
    >>> w = torch.randn(4, 4)
    >>> with memtree.saving():
    ...     torch.save({"w": w, "tied": w[0], "step": 3}, os.path.join(d, "ckpt.pt"))
    >>> sorted(os.listdir(d))
    ['ckpt.pt', 'ckpt.pt.memtree']
    >>> with memtree.loading():
    ...     ckpt = torch.load(os.path.join(d, "ckpt.pt"))       # weights_only=True by default
    >>> torch.equal(ckpt["w"], w), ckpt["tied"].data_ptr() == ckpt["w"].data_ptr(), ckpt["step"]
    (True, True, 3)
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import io
import os
import pickle
import shutil
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Union

import numpy as np
import torch

from .errors import (
    CheckpointFormatError,
    DtypeError,
    InvalidArgumentError,
    MemtreeError,
    NotAMemtreeError,
    RoutingError,
)
from .format.dtypes import dtype_from_name, dtype_name, itemsize
from .format.names import (
    META_NAME,
    ROUTED_ENTRY,
    ROUTED_SUFFIX,
    SIBLING,
    lock_path,
    old_path,
    routed_entry_name,
    staging_path,
)
from .store.commit import WriterLock, fsync_dir
from .store.options import WriteOptions
from .store.recovery import recover_locked
from .tree.tensortree import TensorTree, load_memmap

__all__ = ["saving", "loading"]

#: Where a save's tree goes: a directory, ``None`` (save normally), or a function of the target.
PathChoice = Union[str, "os.PathLike[str]", None, Callable[[Any], Union[str, "os.PathLike[str]", None]]]

#: Seconds a save waits for another save of the same file (in any thread or process) to finish.
LOCK_TIMEOUT = 3600.0
#: Locations a reference may name (what routed saves write).
_LOCATION_PREFIXES = ("cpu", "cuda")


class _Route:
    """One active ``saving(...)``/``loading(...)``: where trees go, and how they are written."""

    def __init__(self, path: PathChoice, fsync: bool = False, num_threads: int = 0) -> None:
        if path is not None and not callable(path) and not isinstance(path, (str, bytes, os.PathLike)):
            raise InvalidArgumentError(
                f"path must be None, a directory or a function of the torch.save target, not {path!r}"
            )
        WriteOptions.of(fsync=fsync, num_threads=num_threads)  # refused now, not at the first save
        self.path = path
        self.fsync = fsync
        self.num_threads = num_threads

    def directory(self, f: Any) -> tuple[str, bool] | None:
        """The tree directory for target ``f`` (and whether it is the default one), or None."""
        default = _default_directory(f)
        where = self.path(f) if callable(self.path) else self.path
        if where is None:
            where = None if callable(self.path) else default
        if where is None:
            return None
        where = os.path.abspath(os.fsdecode(os.fspath(where)))
        return where, default is not None and where == os.path.abspath(default)


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, bytes, os.PathLike))


def _default_directory(f: Any) -> str | None:
    return os.fsdecode(os.fspath(f)) + ROUTED_SUFFIX if _is_path(f) else None


# ------------------------------------------------------------------------- the active contexts
_SAVING: contextvars.ContextVar[tuple[_Route, ...]] = contextvars.ContextVar("memtree_saving", default=())
_LOADING: contextvars.ContextVar[tuple[_Route, ...]] = contextvars.ContextVar("memtree_loading", default=())


@contextmanager
def _active(var: contextvars.ContextVar[tuple[_Route, ...]], route: _Route, name: str) -> Iterator[None]:
    _install(name)
    try:
        var.set(var.get() + (route,))
        try:
            yield
        finally:  # remove this route wherever it is: contexts may exit in any order
            stack = var.get()
            i = max((k for k, r in enumerate(stack) if r is route), default=None)
            if i is not None:
                var.set(stack[:i] + stack[i + 1 :])
    finally:
        _uninstall(name)


def saving(
    path: PathChoice = None, *, fsync: bool = False, num_threads: int = 0
) -> AbstractContextManager[None]:
    """Route ``torch.save`` calls in this thread/task through memtree while the context is active.

    Each ``torch.save(obj, f)`` writes ``f`` as a small ``torch.save`` file whose tensors are
    references, and the tensors' storages as a memtree tree in ``<f>.memtree/`` (see the module
    docstring for the layout and its atomicity). Load it with :func:`loading`.

    Args:
        path: where the tree of each save goes. ``None``: ``<f>.memtree`` for a path target, and a
            file-like target (``BytesIO``) is saved normally. A directory: used for every save (a
            tag derived from each target keeps them apart). A function: called with the target
            ``f`` as given to ``torch.save``; it returns the directory, or ``None`` to save that
            target normally.
        fsync: make each save durable across a power loss (files and directories fsynced before
            the commit); without it a save is still atomic against a crash of the process.
        num_threads: write the tree's leaves with up to this many threads.

    Returns:
        A context manager.

    Raises:
        RoutingError: (from ``torch.save``) a ``pickle_module`` other than ``pickle`` was passed.

    Example:
        >>> import os, tempfile, torch, memtree
        >>> d = tempfile.mkdtemp()
        >>> with memtree.saving(path=lambda f: None):          # decide per target: here, never
        ...     torch.save(torch.ones(2), os.path.join(d, "plain.pt"))
        >>> os.listdir(d)
        ['plain.pt']
    """
    return _active(_SAVING, _Route(path, fsync, num_threads), "save")


def loading(path: PathChoice = None) -> AbstractContextManager[None]:
    """Route ``torch.load`` calls in this thread/task through memtree while the context is active.

    A file written under :func:`saving` is loaded with its tensors mapped from its tree,
    copy-on-write (the files never change), lazily; any other file loads as usual. All of
    ``torch.load``'s arguments keep their meaning (``weights_only``, ``map_location``, ``mmap``).

    Args:
        path: where the tree of each load is. ``None``: ``<f>.memtree`` for a path ``f`` (for a
            file-like source, no tree). A directory, or a function of the source ``f`` returning the
            directory or ``None``, as in :func:`saving`.

    Returns:
        A context manager.

    Raises:
        NotAMemtreeError: (from ``torch.load``) the file's tree is missing.
        CheckpointFormatError: (from ``torch.load``) a reference in the file names no leaf of its
            tree, or a tree or location memtree never writes (an altered or hostile file).

    Example:
        >>> import io, torch, memtree
        >>> buf = io.BytesIO()
        >>> with memtree.saving():
        ...     torch.save([torch.arange(3)], buf)       # a stream: saved normally
        >>> _ = buf.seek(0)
        >>> with memtree.loading():
        ...     torch.load(buf)
        [tensor([0, 1, 2])]
    """
    return _active(_LOADING, _Route(path), "load")


# ------------------------------------------------------------------ installing the wrappers
_INSTALL_LOCK = threading.Lock()
_COUNTS = {"save": 0, "load": 0}
_ORIGINAL: dict[str, Callable[..., Any]] = {"save": torch.save, "load": torch.load}


def _install(name: str) -> None:
    with _INSTALL_LOCK:
        _COUNTS[name] += 1
        if _COUNTS[name] > 1:
            return
        wrapper = _WRAPPERS[name]
        current = getattr(torch, name)
        if current is wrapper:  # left installed because someone patched over it meanwhile
            return
        _ORIGINAL[name] = current
        if getattr(torch.serialization, name) is current:
            setattr(torch.serialization, name, wrapper)
        setattr(torch, name, wrapper)


def _uninstall(name: str) -> None:
    with _INSTALL_LOCK:
        _COUNTS[name] -= 1
        if _COUNTS[name]:
            return
        wrapper = _WRAPPERS[name]
        # put back what was there, unless another library has patched over the wrapper since
        # (the wrapper then stays, doing nothing but call the original outside a context)
        for module in (torch, torch.serialization):
            if getattr(module, name) is wrapper:
                setattr(module, name, _ORIGINAL[name])


@functools.wraps(torch.save)
def _save(
    obj: object,
    f: Any,
    pickle_module: Any = pickle,
    pickle_protocol: int = torch.serialization.DEFAULT_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
) -> None:
    kwargs = {
        "pickle_protocol": pickle_protocol,
        "_use_new_zipfile_serialization": _use_new_zipfile_serialization,
        "_disable_byteorder_record": _disable_byteorder_record,
    }
    routes = _SAVING.get()
    where = routes[-1].directory(f) if routes else None
    if where is None:
        _ORIGINAL["save"](obj, f, pickle_module, **kwargs)
        return
    if pickle_module is not pickle:
        raise RoutingError(
            f"torch.save({f!r}) under memtree.saving() was given pickle_module={pickle_module!r}; "
            "routing works with the default pickle module only: drop the argument, or save "
            "outside memtree.saving()"
        )
    _save_routed(obj, f, where, routes[-1], kwargs)


@functools.wraps(torch.load)
def _load(
    f: Any,
    map_location: Any = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    **pickle_load_args: Any,
) -> Any:
    routes = _LOADING.get()
    where = routes[-1].directory(f) if routes else None
    for attempt in range(_LOAD_ATTEMPTS):
        before = _identity(f) if where is not None else None
        token = _LOAD_SESSION.set(None if where is None else _LoadSession(where[0], f, map_location))
        try:
            return _ORIGINAL["load"](
                f, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **pickle_load_args
            )
        except (MemtreeError, OSError):
            # a save of the same file committed meanwhile: the pickle read names the tree that save
            # removed. The file is another one now: load it again (a file not replaced is damage).
            if before is None or attempt == _LOAD_ATTEMPTS - 1 or _identity(f) in (before, None):
                raise
        finally:
            _LOAD_SESSION.reset(token)
    raise AssertionError("unreachable")  # the last attempt returns or raises


#: Loads of a routed file that a concurrent save replaced while it was read, tried again at most.
_LOAD_ATTEMPTS = 20


def _identity(f: Any) -> tuple[int, int, int, int] | None:
    """What changes when a routed save replaces the file ``f`` (a path), or None."""
    if not isinstance(f, (str, bytes, os.PathLike)):
        return None
    try:
        st = os.stat(f)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_WRAPPERS = {"save": _save, "load": _load}


# ------------------------------------------------------------------------------------ saving
_SAVE_SESSION: contextvars.ContextVar[_SaveSession | None] = contextvars.ContextVar(
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
        if untyped.device.type not in _LOCATION_PREFIXES or untyped.nbytes() and not untyped.data_ptr():
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
    """The pickler ``torch.save`` uses under :func:`saving`: tensors' storages become references."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = _SAVE_SESSION.get()

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


def _tag(target: str) -> str:
    return hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def _prepare_directory(where: str) -> None:
    if os.path.isfile(os.path.join(where, META_NAME)):
        raise RoutingError(
            f"{where} is a memtree tree, not a directory of routed saves; choose another "
            "directory with memtree.saving(path=...)"
        )
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as err:
        raise RoutingError(f"cannot create {where} for torch.save's tensors: {err}") from err


def _save_routed(obj: object, f: Any, where: tuple[str, bool], route: _Route, kwargs: dict[str, Any]) -> None:
    """Pickle ``obj`` with its storages as references, write the tree, then commit the pickle.

    A path target is locked like a memtree destination (``.<name>.memtree.lock`` beside it, whose
    journal names the staging directory, so the next save cleans up after a killed one). Its
    pickle is written under its own name (torch names the archive's root folder after the file)
    in that staging directory, and renamed over the target: the commit.
    """
    directory, is_default = where
    target = os.path.abspath(os.fsdecode(os.fspath(f))) if _is_path(f) else None
    tag = _tag(target if target is not None else "<stream>")
    if target is not None:
        parent, name = os.path.split(target)
        if not os.path.isdir(parent):
            raise RoutingError(f"Parent directory {parent} does not exist.")  # as torch.save says
        lock = WriterLock(lock_path(parent, name), target, timeout=LOCK_TIMEOUT)
    else:
        lock = WriterLock(lock_path(directory, tag), f"the tree directory {directory}", timeout=LOCK_TIMEOUT)
    _prepare_directory(directory)
    session = _SaveSession(routed_entry_name(tag))
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
            token = _SAVE_SESSION.set(session)
            try:
                _ORIGINAL["save"](obj, out, _PICKLE_MODULE, **kwargs)
            finally:
                _SAVE_SESSION.reset(token)
            if session.storages:
                TensorTree(session.leaves()).memmap(
                    entry_path, existsok=False, num_threads=route.num_threads, fsync=route.fsync
                )
            if target is None:  # a stream: the pickle goes in last, once the tree is committed
                f.write(out.getvalue())
            else:
                if route.fsync:
                    _fsync_file(out)
                os.replace(out, target)  # the commit
                if route.fsync:
                    fsync_dir(parent)
        except BaseException:
            if os.path.lexists(entry_path):
                shutil.rmtree(entry_path, ignore_errors=True)
            raise
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
        if target is not None:  # a stream's trees are the caller's to remove
            _remove_older(directory, session.entry, None if is_default else tag)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_older(directory: str, keep: str, tag: str | None) -> None:
    """Delete what earlier saves of this target left in ``directory`` (``tag``: every one when None).

    Their trees (of the previous save, or orphaned by a crash before its commit), and the staging
    directories and lock files of tree writes that a crash interrupted. The caller holds the
    target's lock, so no save of this target is in flight.
    """
    for name in os.listdir(directory):
        sibling = SIBLING.fullmatch(name)
        entry = ROUTED_ENTRY.fullmatch(sibling["name"] if sibling else name)
        if entry is None or name == keep or (tag is not None and entry["tag"] != tag):
            continue
        path = os.path.join(directory, name)
        try:
            if sibling is None:
                old = old_path(directory, name)
                os.rename(path, old)  # gone from its name at once, then deleted
                shutil.rmtree(old, ignore_errors=True)
            elif sibling["lock"]:
                os.unlink(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


# ----------------------------------------------------------------------------------- loading
class _LoadSession:
    """The tree of one routed ``torch.load``, opened at its first reference."""

    def __init__(self, directory: str, source: Any, map_location: Any) -> None:
        self.directory = directory
        self.source = source
        self.map_location = map_location
        self.entry: str | None = None
        self.tree: TensorTree | None = None
        self.storages: dict[tuple[str, str], Any] = {}  # restored UntypedStorages

    def _bad(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"torch.load({self.source!r}): {what}; the file was not written by memtree.saving() "
            "or was altered, and nothing of it was loaded"
        )

    def storage(self, entry: Any, key: Any, dtype: Any, location: Any) -> torch.storage.TypedStorage:
        if not isinstance(entry, str) or not ROUTED_ENTRY.fullmatch(entry):
            raise self._bad(f"a tensor reference names the tree {entry!r}, not a name memtree writes")
        if self.entry is None:
            path = os.path.join(self.directory, entry)
            try:
                self.tree = load_memmap(path, mode="r")
            except FileNotFoundError as err:
                raise NotAMemtreeError(
                    f"torch.load({self.source!r}): its tensors are in the memtree tree {path}, which "
                    f"cannot be loaded ({err}); copy the file together with its tree directory, or "
                    "pass memtree.loading(path=...) the directory where the tree is"
                ) from err
            self.entry = entry
        elif entry != self.entry:
            raise self._bad(f"tensor references name two trees, {self.entry!r} and {entry!r}")
        torch_dtype = dtype_from_name(dtype) if isinstance(dtype, str) else None
        if torch_dtype is None:
            raise self._bad(f"a tensor reference names the dtype {dtype!r}")
        if not isinstance(location, str) or location.split(":", 1)[0] not in _LOCATION_PREFIXES:
            raise self._bad(f"a tensor reference names the location {location!r}")
        cached = self.storages.get((key, location))
        if cached is None:
            cached = self.storages[(key, location)] = self._restore(self._leaf(key), location)
        return torch.storage.TypedStorage(wrap_storage=cached, dtype=torch_dtype, _internal=True)

    def _leaf(self, key: Any) -> torch.UntypedStorage:
        assert self.tree is not None
        leaf = self.tree.get(key) if isinstance(key, str) and key in self.tree.keys() else None
        if not isinstance(leaf, torch.Tensor):
            raise self._bad(f"a tensor reference names {key!r}, which is no leaf of the tree {self.entry}")
        storage = leaf.untyped_storage()
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


_LOAD_SESSION: contextvars.ContextVar[_LoadSession | None] = contextvars.ContextVar(
    "memtree_load_session", default=None
)


def _routed_storage(entry: str, key: str, dtype: str, location: str) -> torch.storage.TypedStorage:
    """The storage a routed ``torch.save`` file references (called by ``torch.load``'s unpickler).

    Raises:
        RoutingError: not inside :func:`loading` (or its ``path=`` gave no directory for this load).
    """
    session = _LOAD_SESSION.get()
    if session is None:
        raise RoutingError(
            "this file was written by torch.save under memtree.saving(): its tensors are in a "
            f"memtree tree beside it (<file>.memtree/{entry}/); load it inside "
            "`with memtree.loading(): torch.load(...)` (for a file-like source, pass "
            "memtree.loading(path=<the tree's directory>))"
        )
    return session.storage(entry, key, dtype, location)


if hasattr(torch.serialization, "add_safe_globals"):  # torch >= 2.4: weights_only loads accept it
    torch.serialization.add_safe_globals([_routed_storage])
