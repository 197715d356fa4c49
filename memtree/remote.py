"""Remote trees over fsspec (the optional extra ``memtree[remote]``): :func:`upload` and :func:`load`.

The implementation is the remote store, :mod:`memtree.store.urls.remote`; ``memtree.load_memmap(url)``
reads through it too. This module is the public name for its two entry points.

Example:
    >>> import torch, memtree
    >>> from memtree.remote import upload, load
    >>> upload(memtree.TensorTree({"x": torch.arange(3)}), "memory://remote-doc/t")
    >>> memtree.load_memmap("memory://remote-doc/t")["x"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

from .store.urls.remote import DEFAULT_CHUNK_BYTES, DEFAULT_NUM_THREADS, load, upload

__all__ = ["load", "upload", "DEFAULT_CHUNK_BYTES", "DEFAULT_NUM_THREADS"]
