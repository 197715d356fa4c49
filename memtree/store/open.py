"""Which reader opens a prefix: a remote URL, tensordict's layout, or a memtree directory.

The one place that chooses the backend for :func:`memtree.load_memmap` (and the CLI):

* a URL with a scheme other than ``file://`` (``s3://``, ``https://``, ``memory://``...) is read
  with :mod:`memtree.store.remote` (the optional fsspec extra), always loaded whole;
* a directory whose root ``meta.json`` is tensordict's (``_type``, no ``format``) is read with
  :mod:`memtree.store.tensordict`, loaded whole;
* anything else is a memtree directory, opened lazily by :func:`memtree.store.read.open_tree`.

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.write import write_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
    >>> type(open_prefix(d)).__name__
    'PendingLevel'
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from ..format.level import Level
from .read import KeySelection, PendingLevel, open_tree
from .tensordict import is_tensordict_dir, read_tensordict_dir

__all__ = ["is_url", "open_prefix"]


def is_url(prefix: str | os.PathLike[str]) -> bool:
    """True for an fsspec URL that the remote reader handles (any scheme but ``file://``)."""
    return isinstance(prefix, str) and "://" in prefix and not prefix.startswith("file://")


def open_prefix(
    prefix: str | os.PathLike[str],
    *,
    keys: Iterable[KeySelection] | None = None,
    mode: str = "r+",
    mmap: bool = True,
    device: torch.device | str | None = None,
    allow_pickle: bool = False,
    verify: bool = False,
    **remote: Any,
) -> Level | PendingLevel:
    """Open ``prefix`` with the reader its kind needs (see the module docstring).

    Returns a :class:`~memtree.store.read.PendingLevel` (loaded level by level on use) for a
    memtree directory, a fully loaded :class:`~memtree.format.level.Level` otherwise.

    Raises:
        TypeError: remote-only options (``storage_options``, ``cache_dir``...) for a local path.
        MemtreeError: as the chosen reader raises.
    """
    if is_url(prefix):
        from .remote import load as load_remote  # optional extra: fsspec

        return load_remote(str(prefix), keys=keys, device=device, mode=mode, mmap=mmap,
                           allow_pickle=allow_pickle, verify=verify, **remote)
    if remote:
        raise TypeError(
            f"load_memmap() got options for remote URLs only ({sorted(remote)}) with the local path {prefix!r}"
        )
    if is_tensordict_dir(prefix):  # tensordict's layout, read-only compatibility (SPEC §5)
        return read_tensordict_dir(prefix, keys=keys, mode=mode, mmap=mmap, device=device)
    return open_tree(prefix, keys=keys, mode=mode, mmap=mmap, device=device, allow_pickle=allow_pickle, verify=verify)
