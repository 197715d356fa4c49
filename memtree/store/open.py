"""Which reader opens a prefix: a remote URL, tensordict's layout, or a memtree directory.

The one place that chooses the backend for :func:`memtree.load_memmap` (and the CLI):

* a ``file://`` URL is the local path it names (:func:`memtree.store.reading.storage.local_path`);
* a URL with a scheme other than ``file://`` (``s3://``, ``https://``, ``memory://``...) is read
  with :mod:`memtree.store.urls.remote` (the optional fsspec extra), always loaded whole;
* a directory whose root ``meta.json`` is tensordict's (``_type``, no ``format``) is read with
  :mod:`memtree.store.foreign.tensordict`, loaded whole;
* anything else is a memtree directory, opened lazily by :func:`memtree.store.reading.read.open_tree`.

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
    >>> from memtree.store.reading.options import ReadOptions
    >>> type(open_prefix(d, ReadOptions())).__name__
    'PendingLevel'
"""

from __future__ import annotations

import os
from typing import Any


from ..format.level import Level
from ..errors import InvalidArgumentError
from .reading.options import ReadOptions
from .reading.read import PendingLevel, open_tree
from .reading.storage import is_url, local_path
from .foreign.tensordict import is_tensordict_dir, read_tensordict_level

__all__ = ["is_url", "open_prefix"]


def open_prefix(prefix: str | os.PathLike[str], options: ReadOptions, **remote: Any) -> Level | PendingLevel:
    """Open ``prefix`` with the reader its kind needs (see the module docstring).

    Returns a :class:`~memtree.store.reading.read.PendingLevel` (loaded level by level on use) for a
    memtree directory, a fully loaded :class:`~memtree.format.level.Level` otherwise.

    Raises:
        InvalidArgumentError: remote-only options (``storage_options``, ``cache_dir``...) for a
            local path.
        MemtreeError: as the chosen reader raises.
    """
    prefix = local_path(prefix)  # file:///path is the local path
    if is_url(prefix):
        from .urls.remote import load_url  # optional extra: fsspec

        return load_url(str(prefix), options, **remote)
    if remote:
        raise InvalidArgumentError(
            f"load_memmap() got options for remote URLs only ({sorted(remote)}) with the local path {prefix!r}"
        )
    if is_tensordict_dir(prefix):  # tensordict's layout, read-only compatibility (SPEC §5)
        return read_tensordict_level(prefix, options)
    return open_tree(prefix, options)
