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
another thread's ``torch.save`` is unaffected, and a task or thread that copied the context
(``asyncio.create_task``, ``asyncio.to_thread``) is routed while the block that made it runs,
never after. They nest (the innermost one decides). They replace the attributes
``torch.save``/``torch.load`` (and ``torch.serialization.save``/``load``) while active, and put the
original functions back once the last one exits, whatever the order of the exits and even on an
error; wrappers that users or libraries assign to them before, inside or after the contexts keep
working, each running once per call (:mod:`memtree.routing.patch`). Code that imported the
functions themselves beforehand (``from torch import save``) is not routed. File-like targets
(``BytesIO``) are saved and loaded normally unless a ``path=`` callback names a directory for them.

Modules: :mod:`~memtree.routing.route` (where a tree goes), :mod:`~memtree.routing.save` (the
pickler, the commit of the pair, which trees a save deletes), :mod:`~memtree.routing.load` (the
tree of a load, opened without following links, and each reference checked against its leaf),
:mod:`~memtree.routing.patch` (installing the wrappers).

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
import inspect
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from ..errors import MemtreeError, RoutingError, check_keywords
from . import patch
from .load import SESSION, LoadSession, _routed_storage  # noqa: F401  (routed files name memtree.routing._routed_storage)
from .route import PathChoice, Route, is_path
from .save import save_routed

__all__ = ["saving", "loading"]


# ------------------------------------------------------------------------- the active contexts
class _Entered:
    """One entry into a context: its route, for as long as the ``with`` block runs.

    A task or thread that copied the context (``asyncio.create_task``, ``asyncio.to_thread``,
    ``contextvars.copy_context``) sees the entry; once the block has exited, it is inactive for
    all of them, whatever else runs in the process.
    """

    __slots__ = ("route", "active")

    def __init__(self, route: Route) -> None:
        self.route = route
        self.active = True


_SAVING: contextvars.ContextVar[tuple[_Entered, ...]] = contextvars.ContextVar("memtree_saving", default=())
_LOADING: contextvars.ContextVar[tuple[_Entered, ...]] = contextvars.ContextVar("memtree_loading", default=())


def _innermost(var: contextvars.ContextVar[tuple[_Entered, ...]]) -> Route | None:
    """The route of the innermost active context of the caller's context, or None."""
    return next((e.route for e in reversed(var.get()) if e.active), None)


@contextmanager
def _active(var: contextvars.ContextVar[tuple[_Entered, ...]], route: Route, name: str) -> Iterator[None]:
    entered = _Entered(route)
    patch.install(name, _WRAPPERS[name])
    try:
        var.set(var.get() + (entered,))
        try:
            yield
        finally:  # remove this entry wherever it is: contexts may exit in any order
            entered.active = False
            var.set(tuple(e for e in var.get() if e is not entered))
    finally:
        patch.uninstall(name, _WRAPPERS[name])


@check_keywords
def saving(
    path: PathChoice = None, *, fsync: bool = False, num_threads: int = 0
) -> AbstractContextManager[None]:
    """Route ``torch.save`` calls in this thread/task through memtree while the context is active.

    Each ``torch.save(obj, f)`` writes ``f`` as a small ``torch.save`` file whose tensors are
    references, and the tensors' storages as a memtree tree in ``<f>.memtree/`` (see the module
    docstring for the layout and its atomicity). Load it with :func:`loading`.

    Args:
        path: where the tree of each save goes. ``None``: ``<f>.memtree`` for a path target (a
            real directory, never a link), and a file-like target (``BytesIO``) is saved
            normally. A directory: used for every save (a tag derived from each target keeps
            them apart; a copy of a file beside it keeps its tree, see
            :mod:`~memtree.routing.save`). A function: called with the target ``f`` as given to
            ``torch.save``; it returns the directory, or ``None`` to save that target normally.
        fsync: make each save durable across a power loss (the files, the tree, every directory
            the save creates and the file's directory fsynced into their parents, in commit
            order); without it a save is still atomic against a crash of the process.
        num_threads: write the tree's leaves with up to this many threads.

    Returns:
        A context manager.

    Raises:
        RoutingError: (from ``torch.save``) a ``pickle_module`` other than ``pickle`` was passed.
        UnsafePathError: (from ``torch.save``) ``<f>.memtree`` is a symbolic link.

    Example:
        >>> import os, tempfile, torch, memtree
        >>> d = tempfile.mkdtemp()
        >>> with memtree.saving(path=lambda f: None):          # decide per target: here, never
        ...     torch.save(torch.ones(2), os.path.join(d, "plain.pt"))
        >>> os.listdir(d)
        ['plain.pt']
    """
    return _active(_SAVING, Route(path, fsync, num_threads), "save")


@check_keywords
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
        NotAMemtreeError: (from ``torch.load``) the file's tree is missing (the message names
            both, and says where a tree of that name is when it finds one beside the file).
        CheckpointFormatError: (from ``torch.load``) a reference in the file names no leaf of its
            tree, a tree or location memtree never writes, or a tensor that does not fit its leaf
            (an altered or hostile pair).
        UnsafePathError: (from ``torch.load``) the tree, or ``<f>.memtree``, is a symbolic link
            or not a directory, or was replaced while it was opened.

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
    return _active(_LOADING, Route(path), "load")


# ------------------------------------------------------------------------------ the wrappers
# The wrappers pass their arguments on exactly as given (a wrapper of torch.load beyond them may
# tell a missing argument from a default one); torch's signatures say what each one is.
_SIGNATURES = {name: inspect.signature(function) for name, function in patch.TORCH.items()}


def _arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments of a ``torch.<name>`` call by parameter name, defaults included (None: torch
    would refuse them, and will say so)."""
    try:
        bound = _SIGNATURES[name].bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


@functools.wraps(patch.TORCH["save"])
def _save(*args: Any, **kwargs: Any) -> None:
    route = _innermost(_SAVING)
    given = _arguments("save", args, kwargs) if route is not None else None
    where = route.directory(given["f"]) if route is not None and given is not None else None
    if route is None or given is None or where is None:
        patch.call_through("save", *args, **kwargs)
        return
    f, pickle_module = given["f"], given["pickle_module"]
    if pickle_module is not pickle:
        raise RoutingError(
            f"torch.save({f!r}) under memtree.saving() was given pickle_module={pickle_module!r}; "
            "routing works with the default pickle module only: drop the argument, or save "
            "outside memtree.saving()"
        )
    options = {k: v for k, v in given.items() if k not in ("obj", "f", "pickle_module")}
    save_routed(given["obj"], f, where, route, options)


@functools.wraps(patch.TORCH["load"])
def _load(*args: Any, **kwargs: Any) -> Any:
    route = _innermost(_LOADING)
    given = _arguments("load", args, kwargs) if route is not None else None
    where = route.directory(given["f"]) if route is not None and given is not None else None
    if given is None or where is None:  # nothing routed: a reference in the file is an error
        token = SESSION.set(None)
        try:
            return patch.call_through("load", *args, **kwargs)
        finally:
            SESSION.reset(token)
    f = given["f"]
    for attempt in range(_LOAD_ATTEMPTS):
        before = _identity(f)
        session = LoadSession(where[0], where[1], f, given["map_location"])
        token = SESSION.set(session)
        try:
            return patch.call_through("load", *args, **kwargs)
        except (MemtreeError, OSError):
            # a save of the same file committed meanwhile: the pickle read names the tree that save
            # removed. The file is another one now: load it again (a file not replaced is damage).
            if before is None or attempt == _LOAD_ATTEMPTS - 1 or _identity(f) in (before, None):
                raise
        except Exception as err:
            explained = session.explain(err)  # torch placing a tensor that does not fit its leaf
            if explained is None:
                raise
            raise explained from err
        finally:
            SESSION.reset(token)
    raise AssertionError("unreachable")  # the last attempt returns or raises


#: Loads of a routed file that a concurrent save replaced while it was read, tried again at most.
_LOAD_ATTEMPTS = 20


def _identity(f: Any) -> tuple[int, int, int, int] | None:
    """What changes when a routed save replaces the file ``f`` (a path), or None."""
    if not is_path(f):
        return None
    try:
        st = os.stat(f)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_WRAPPERS: dict[str, Callable[..., Any]] = {"save": _save, "load": _load}
