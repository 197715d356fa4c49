"""Where the tree of a routed ``torch.save``/``torch.load`` is: one :class:`Route` per context.

Example:
    >>> import os
    >>> from memtree.routing.route import Route
    >>> Route(None).directory("/ckpt/last.pt")
    ('/ckpt/last.pt.memtree', True)
    >>> Route("/fast/trees").directory("/ckpt/last.pt")
    ('/fast/trees', False)
    >>> Route(lambda f: None).directory("/ckpt/last.pt") is None
    True
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any, Union

from ..errors import InvalidArgumentError
from ..format.names import ROUTED_SUFFIX
from ..store.reading.options import WriteOptions

__all__ = ["PathChoice", "Route", "is_path", "target_path", "tag"]

#: Where a save's tree goes: a directory, ``None`` (save normally), or a function of the target.
PathChoice = Union[str, "os.PathLike[str]", None, Callable[[Any], Union[str, "os.PathLike[str]", None]]]


def is_path(f: Any) -> bool:
    """Whether a ``torch.save`` target / ``torch.load`` source is a path (not a stream)."""
    return isinstance(f, (str, bytes, os.PathLike))


def target_path(f: Any) -> str:
    """The absolute path of a path target, as routing names it."""
    return os.path.abspath(os.fsdecode(os.fspath(f)))


def tag(target: str | None) -> str:
    """The 12 hex digits that start the names of ``target``'s trees (a stream: ``None``)."""
    key = target if target is not None else "<stream>"
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:12]


class Route:
    """One ``saving(...)``/``loading(...)``: where trees go, and how they are written."""

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
        """The tree directory for target ``f``, and whether it is the default ``<f>.memtree``; or None.

        The default directory is the file's own: memtree never follows a symbolic link in its
        place. A directory chosen with ``path=`` is the caller's, links and all.
        """
        default = target_path(f) + ROUTED_SUFFIX if is_path(f) else None
        where = self.path(f) if callable(self.path) else self.path
        if where is None:
            where = None if callable(self.path) else default
        if where is None:
            return None
        where = os.path.abspath(os.fsdecode(os.fspath(where)))
        return where, where == default
