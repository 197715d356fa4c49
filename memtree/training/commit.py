"""A training state's levels written as one committed tree: the write a :class:`memtree.Checkpointer`
step and a framework checkpoint (:mod:`memtree.integrations`) share, defined once.

The tree is written by :func:`memtree.store.writing.write.write_tree` into a staging directory
and renamed onto ``path`` (an existing tree there is exchanged in one ``renameat2``), every leaf
checksummed in the write pass, every leaf whose bytes equal the ``link_from`` tree's hard-linked
instead of written, everything fsynced before the rename with ``fsync=True``.
"""

from __future__ import annotations

import os
from typing import Any

from ..store.primitives.crypto import EncryptionKey
from ..store.reading.options import WriteOptions
from ..store.writing.write import WriteStats, write_tree

__all__ = ["write_state_tree"]


def write_state_tree(
    path: str,
    level: Any,
    *,
    link_from: str | None,
    fsync: bool,
    existsok: bool = True,
    encryption: EncryptionKey | None = None,
) -> WriteStats:
    """Write ``level`` (from :func:`memtree.training.state.state_to_level`) as a tree at ``path``.

    Args:
        path: the destination (local).
        level: the state's root level.
        link_from: a committed tree whose leaves of equal bytes are hard-linked, or ``None``.
        fsync: make the tree durable before it is renamed into place.
        existsok: replace a tree at ``path`` (else :class:`~memtree.DestinationExistsError`).
        encryption: write the tree encrypted with this key.

    Returns:
        What was written and linked.

    Example:
        >>> import tempfile, torch
        >>> from memtree.training.state import state_to_level
        >>> write_state_tree(tempfile.mkdtemp() + "/t", state_to_level({"x": torch.ones(1)}),
        ...                  link_from=None, fsync=False).files_written
        1
    """
    options = WriteOptions.of(
        existsok=existsok, fsync=fsync, copy_existing=True, progress=False,
        num_threads=min(8, os.cpu_count() or 1), link_from=link_from, encryption=encryption,
    )
    stats = WriteStats()
    write_tree(path, level, options, stats=stats)  # returns the tree opened lazily: not used here
    return stats
