"""What a step of a checkpoint root is: the one rule of ``Checkpointer.steps()``, ``memtree info``
and ``memtree du``.

A checkpoint root (:class:`memtree.Checkpointer`) holds one tree per step, ``root/<step>/``. An
entry of the root is a **step** when

1. its name is a step name (:func:`~memtree.format.names.is_step_name`: the decimal step, ``0``
   to ``2**63 - 1``, no sign, no padding);
2. it is a directory, not a symbolic link (a link could lead anywhere, out of the root too);
3. its ``meta.json`` is a regular file (not a link, a FIFO, a device) of at most
   :data:`~memtree.format.schema.MAX_META_BYTES` bytes that parses as a memtree root level
   (:func:`~memtree.format.schema.parse_level`, every check a loader makes): a committed tree,
   since a write renames its complete staging directory into place, and a ``meta.json`` that
   parses is written last.

Any other entry with a step name (a stray or empty directory, an empty, truncated or foreign
``meta.json``, a symbolic link, a FIFO) is **not a step**: it is never listed, ranked by
retention, restored, deleted by retention or measured, and ``memtree info`` shows it as ignored,
with the reason. Staging directories, lock files and the root record never have step names. Only
the root level of a step is read: a step whose deeper levels are damaged is still a step
(``restore`` then raises, ``memtree info`` marks it damaged).

Example:
    >>> import os, tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> root = tempfile.mkdtemp()
    >>> _ = write_tree(os.path.join(root, "10"), Level((), {"w": torch.ones(2)}))
    >>> os.mkdir(os.path.join(root, "20"))   # no meta.json: not a step
    >>> listing = list_steps(root)
    >>> list(listing.steps), list(listing.ignored)
    ([10], ['20'])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...errors import MemtreeError, MissingLeafError
from ...format.names import is_step_name
from ...format.schema import LevelMeta
from .storage import open_dir, read_meta

__all__ = ["StepListing", "list_steps", "read_step"]


@dataclass
class StepListing:
    """One listing of a checkpoint root by the rule of this module.

    Attributes:
        steps: each step and its root level (``meta.json`` parsed), in increasing order.
        ignored: each entry with a step name that is not a step, and why (the error of the rule
            it breaks).
        vanished: a listed step name was gone when it was checked (renamed away by retention or
            an overwrite of another writer meanwhile): the listing may miss a step committed
            after the directory was read.
    """

    steps: dict[int, LevelMeta] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    vanished: bool = False


def read_step(root_fd: int, root: str, name: str) -> LevelMeta:
    """The root level of the step ``name`` of the root open as ``root_fd``, checked by the rule
    of this module.

    Raises:
        MissingLeafError: no entry ``name`` (any more).
        MemtreeError: the entry is not a step (a symbolic link, not a directory, no ``meta.json``,
            or one that is not a regular file or does not parse); the message says which.
    """
    where = os.path.join(root, name)
    fd = open_dir(name, where, root_fd)
    try:
        return read_meta(fd, where, depth=0, root=True)
    finally:
        os.close(fd)


def list_steps(root: str, *, around: int | None = None) -> StepListing:
    """The steps of the checkpoint root ``root`` (a directory; a symbolic link to one is
    followed, the entries in it never are), by the rule of this module.

    ``around``: only what a save of that step needs, so that its cost does not grow with the
    steps a root keeps: every step above ``around``, ``around`` itself, and the newest step below
    it (names below are checked from the newest down until one is a step; ``ignored`` lists
    only the names checked).

    Raises:
        NotAMemtreeError: ``root`` does not exist or is not a directory.
        StorageError: ``root`` cannot be read.

    Example:
        >>> import tempfile
        >>> list_steps(tempfile.mkdtemp())
        StepListing(steps={}, ignored={}, vanished=False)
    """
    listing = StepListing()
    root_fd = open_dir(root, root, None)
    try:
        names = sorted(((int(name), name) for name in os.listdir(root_fd) if is_step_name(name)), reverse=True)
        found: list[tuple[int, LevelMeta]] = []
        for step, name in names:  # the newest first
            if around is not None and step < around and found and found[-1][0] < around:
                break  # the newest step below `around` is found: a save needs no older one
            try:
                found.append((step, read_step(root_fd, root, name)))
            except MissingLeafError:
                listing.vanished = True  # renamed away since the listing (retention, an overwrite)
            except MemtreeError as err:
                listing.ignored[name] = str(err)
        listing.steps = dict(reversed(found))
    finally:
        os.close(root_fd)
    return listing
