"""Installing memtree's ``torch.save``/``torch.load`` wrappers while a routing context is active.

memtree's wrapper replaces ``torch.<name>`` while a context is active, and calls through to what
it replaced (:func:`call_through`). Users and libraries wrap ``torch.save``/``torch.load`` too,
before, inside and after the contexts; three rules keep every mix loop-free, each wrapper
running once per call:

- a function that already calls memtree's wrapper (a ``functools.partial`` of it, or a decorator
  made with ``functools.wraps``) is left in place by the next context: it routes as it is;
- memtree's wrapper never calls through to a function that is already running in this call (a
  wrapper of it that does not say so: it called memtree's wrapper);
- a call of the wrapper that comes back from what it called through goes to torch's own function.

Example:
    >>> import io, torch
    >>> from memtree.routing import patch
    >>> buf = io.BytesIO()
    >>> patch.call_through("save", torch.arange(3), buf)   # what torch.save was before memtree
    >>> _ = buf.seek(0)
    >>> patch.call_through("load", buf)
    tensor([0, 1, 2])
"""

from __future__ import annotations

import contextvars
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TORCH", "install", "uninstall", "call_through", "calls"]

#: torch's own functions (as ``torch.serialization`` held them when memtree was imported): what
#: every chain of wrappers ends in, and what memtree itself calls to write and read pickles.
TORCH: dict[str, Callable[..., Any]] = {"save": torch.serialization.save, "load": torch.serialization.load}

_LOCK = threading.Lock()
_COUNTS = {"save": 0, "load": 0}  # active contexts, all threads together
#: What ``torch.<name>`` was when the first active context installed the wrapper.
_ORIGINAL: dict[str, Callable[..., Any]] = {"save": torch.save, "load": torch.load}
#: Set while the wrapper calls a foreign original: a call of the wrapper meanwhile comes back.
_CALLING: dict[str, contextvars.ContextVar[bool]] = {
    name: contextvars.ContextVar(f"memtree_calling_{name}", default=False) for name in ("save", "load")
}


def install(name: str, wrapper: Callable[..., Any]) -> None:
    """Make ``torch.<name>`` (and ``torch.serialization.<name>`` if it is the same) ``wrapper``.

    Counted: only the first of several active contexts installs it.
    """
    with _LOCK:
        _COUNTS[name] += 1
        if _COUNTS[name] > 1:
            return
        current = getattr(torch, name)
        if calls(current, wrapper):  # the wrapper itself, or a wrapper of it: it routes as it is
            return
        _ORIGINAL[name] = current
        if getattr(torch.serialization, name) is current:
            setattr(torch.serialization, name, wrapper)
        setattr(torch, name, wrapper)


def uninstall(name: str, wrapper: Callable[..., Any]) -> None:
    """Undo :func:`install` once the last active context exits.

    The original comes back only where ``wrapper`` is still installed: a function someone
    assigned over it meanwhile (a wrapper of the wrapper) stays, and keeps working, because the
    wrapper outside every context only calls through.
    """
    with _LOCK:
        _COUNTS[name] -= 1
        if _COUNTS[name]:
            return
        for module in (torch, torch.serialization):
            if getattr(module, name) is wrapper:
                setattr(module, name, _ORIGINAL[name])


def call_through(name: str, *args: Any, **kwargs: Any) -> Any:
    """Call what ``torch.<name>`` was before the wrapper, or torch's own function on a loop.

    A loop is a foreign original (a wrapper made around memtree's wrapper) calling the wrapper
    again: that second call, found by a context variable, goes to torch's function, with the
    arguments the foreign wrapper gave; and an original already running in this call (it is the
    caller of the wrapper) is not called again. A call made from inside torch's function (a
    pickle that loads another file) starts afresh, except while a foreign original runs: then it
    too goes to torch's function.
    """
    calling = _CALLING[name]
    function = _ORIGINAL[name]
    foreign = not calling.get() and function is not TORCH[name] and not _running(function)
    if not foreign:
        function = TORCH[name]
    token = calling.set(foreign)
    try:
        return function(*args, **kwargs)
    finally:
        calling.reset(token)


def calls(function: Any, wrapper: Callable[..., Any]) -> bool:
    """Whether ``function`` is ``wrapper`` or says it wraps it (``functools.partial``, ``__wrapped__``)."""
    for _ in range(100):  # a chain of wrappers, not a loop
        if function is wrapper:
            return True
        inner = function.func if isinstance(function, functools.partial) else getattr(function, "__wrapped__", None)
        if inner is None:
            return False
        function = inner
    return False


def _running(function: Any) -> bool:
    """Whether the Python code of ``function`` is running in this thread's call stack."""
    while isinstance(function, functools.partial):
        function = function.func
    function = getattr(function, "__func__", function)  # a bound method
    code = getattr(function, "__code__", None) or getattr(getattr(type(function), "__call__", None), "__code__", None)
    frame = sys._getframe(2) if code is not None else None
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
