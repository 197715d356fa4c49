"""The one walker of a tree's ``meta.json`` levels, over any :class:`~memtree.store.reading.storage.Storage`.

:func:`walk` yields every level a read needs, each one validated by
:func:`memtree.format.schema.parse_level` (the same checks for a local directory and a URL):

* only the levels on the path to a ``keys=`` selection are read, and each level keeps only its
  selected entries (:func:`normalize_keys`, :func:`select_entries`); a selected key that is not
  there, or a sub-key of a tensor leaf, raises :class:`~memtree.errors.MemtreeKeyError`;
* a sub-level's ``batch_size`` must start with its parent's
  (:class:`~memtree.errors.MetaFormatError` otherwise); depth is bounded by the schema's limit;
* ``order="breadth"`` reads each generation of sub-levels together, concurrently when given a
  thread pool (what a remote read wants: one round trip per generation); ``order="depth"``
  yields levels in pre-order (parents before children, children in entry order);
* ``on_error=`` turns the walk into a survey (``memtree verify``): a level whose ``meta.json``
  cannot be read or validated, or whose batch size does not nest, is reported to the callback
  instead of raised; an unreadable level is skipped with everything below it.

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> from memtree.store.reading.storage import LocalStorage
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = write_tree(d, Level((), {"x": torch.ones(1), "b": Level((), {"c": torch.ones(2)})}))
    >>> with LocalStorage(d) as s:
    ...     [(lvl.rel, [e.key for e in lvl.meta.entries]) for lvl in walk(s)]
    [('', ['x', 'b']), ('b', ['c'])]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from typing import Any, TypeVar

from ...errors import InvalidArgumentError, MemtreeError, MetaFormatError
from ...format.names import META_NAME
from ...format.schema import ChildMeta, LevelMeta, parse_level, starts_with_batch
from ...format.subclass import SubclassMeta, check_group
from .options import Selection, select_entries
from .storage import Storage, join_rel

__all__ = ["WalkedLevel", "NestingError", "walk", "read_level", "map_all"]

_T = TypeVar("_T")
#: ``on_error(where, keys, error)``: ``where`` is the file concerned, ``keys`` the level's key path.
OnError = Callable[[str, tuple[str, ...], MemtreeError], None]


class NestingError(MetaFormatError):
    """A sub-level's ``batch_size`` does not start with its parent's (``memtree verify`` reports
    it as a ``"structure"`` problem)."""


@dataclasses.dataclass(frozen=True)
class WalkedLevel:
    """One validated level of a walk.

    Attributes:
        dirs: the directory names from the root to this level (``()`` for the root).
        keys: the key path from the root.
        meta: the level's ``meta.json``, with only the selected entries.
        selection: the ``keys=`` selection below this level (``None``: everything).
    """

    dirs: tuple[str, ...]
    keys: tuple[str, ...]
    meta: LevelMeta
    selection: Selection | None = None

    @property
    def rel(self) -> str:
        """The level's directory, relative to the root (``""`` for the root)."""
        return "/".join(self.dirs)

    def file(self, name: str) -> str:
        """The ``rel`` path of a file of this level (a leaf's ``entry.file``, ``meta.json``)."""
        return join_rel(self.rel, name)


def map_all(pool: Executor, fn: Callable[[Any], _T], items: Iterable[Any]) -> list[_T]:
    """``fn`` over ``items`` in ``pool``, results in order; the first failure cancels what has
    not started, waits for what has, and is raised.

    Example:
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> with ThreadPoolExecutor(2) as pool:
        ...     map_all(pool, lambda x: x * x, [1, 2, 3])
        [1, 4, 9]
    """
    futures: list[Future[_T]] = [pool.submit(fn, item) for item in items]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


def read_level(
    storage: Storage,
    dirs: tuple[str, ...],
    keys: tuple[str, ...] = (),
    *,
    selection: Selection | None = None,
    parent: LevelMeta | None = None,
    entry: ChildMeta | None = None,
) -> WalkedLevel:
    """Read and validate the level at ``dirs``, check that it nests in ``parent`` (whose
    ``entry`` it is: its batch size starts with the parent's, or it is a subclass group), and
    keep its ``selection``.

    Raises:
        MetaFormatError: the ``meta.json`` is malformed, or its batch size does not nest.
        MemtreeKeyError: a selected key is not at this level.
        MemtreeError: as the storage raises (missing, unsafe, over the size limit...).
    """
    meta = _parse(storage, dirs)
    problem = _nesting_problem(storage, dirs, meta, parent, entry)
    if problem is not None:
        raise problem
    return _select(storage, dirs, keys, meta, selection)


def _parse(storage: Storage, dirs: tuple[str, ...]) -> LevelMeta:
    rel = "/".join(dirs)
    return parse_level(storage.read_meta(rel), storage.describe(join_rel(rel, META_NAME)), depth=len(dirs))


def _nesting_problem(
    storage: Storage, dirs: tuple[str, ...], meta: LevelMeta, parent: LevelMeta | None, entry: ChildMeta | None
) -> NestingError | None:
    if isinstance(entry, SubclassMeta):  # a tensor subclass's group: its own rules
        problem = check_group(entry, meta, storage.describe(join_rel(*dirs, META_NAME)))
        return None if problem is None else NestingError(f"{problem}; the tree is damaged")
    if parent is None or starts_with_batch(meta.batch_size, parent.batch_size):
        return None
    return NestingError(
        f"{storage.describe(join_rel(*dirs, META_NAME))}: batch_size {list(meta.batch_size)} does "
        f"not start with the parent's {list(parent.batch_size)}; the tree is damaged"
    )


def _select(
    storage: Storage, dirs: tuple[str, ...], keys: tuple[str, ...], meta: LevelMeta, selection: Selection | None
) -> WalkedLevel:
    where = storage.describe("/".join(dirs))
    return WalkedLevel(dirs, keys, select_entries(meta, selection, keys, where), selection)


_Job = tuple[tuple[str, ...], tuple[str, ...], "Selection | None", "LevelMeta | None", "ChildMeta | None"]


def _children(level: WalkedLevel) -> list[_Job]:
    """``(dirs, keys, selection, parent, entry)`` of the sub-levels to read below ``level``."""
    out: list[_Job] = []
    sel = level.selection
    for e in level.meta.entries:
        sub = sel.get(e.key) if sel is not None else None
        if isinstance(e, ChildMeta):  # keys inside a leaf were refused by select_entries
            out.append((level.dirs + (e.dir,), level.keys + (e.key,), sub, level.meta, e))
    return out


def walk(
    storage: Storage,
    *,
    selection: Selection | None = None,
    order: str = "breadth",
    pool: Executor | None = None,
    root: LevelMeta | None = None,
    on_error: OnError | None = None,
) -> Iterator[WalkedLevel]:
    """Yield the tree's levels (those on the path to ``keys``), each validated.

    Args:
        storage: where the tree is.
        selection: the levels on the path to these keys (:func:`~memtree.store.reading.options.normalize_keys`);
            ``None`` walks every level.
        order: ``"breadth"`` (generation by generation) or ``"depth"`` (pre-order).
        pool: with ``order="breadth"``, read the sub-levels of a generation concurrently.
        root: the root's ``meta.json``, already read and parsed (it is not read again).
        on_error: report level errors to this callback instead of raising them (see the
            module docstring); key selection errors are always raised.

    Raises:
        MemtreeError: the first level that cannot be read or validated (without ``on_error``).
    """
    if order not in ("breadth", "depth"):
        raise InvalidArgumentError(f"order must be 'breadth' or 'depth', got {order!r}")

    def load(job: _Job) -> WalkedLevel | None:
        dirs, path, sel, parent, entry = job
        try:
            meta = root if root is not None and not dirs else _parse(storage, dirs)
        except MemtreeError as err:
            if on_error is None:
                raise
            on_error(storage.describe(join_rel(*dirs, META_NAME)), path, err)
            return None
        problem = _nesting_problem(storage, dirs, meta, parent, entry)
        if problem is not None:
            if on_error is None:
                raise problem
            on_error(storage.describe(join_rel(*dirs, META_NAME)), path, problem)
        return _select(storage, dirs, path, meta, sel)

    first = load(((), (), selection, None, None))
    if first is None:
        return
    if order == "depth":
        stack = [first]
        while stack:
            level = stack.pop()
            yield level
            subs = [load(job) for job in _children(level)]
            stack.extend(reversed([s for s in subs if s is not None]))
        return
    frontier = [first]
    while frontier:
        jobs: list[_Job] = []
        for level in frontier:
            yield level
            jobs.extend(_children(level))
        found = map_all(pool, load, jobs) if pool is not None and len(jobs) > 1 else [load(j) for j in jobs]
        frontier = [lvl for lvl in found if lvl is not None]
