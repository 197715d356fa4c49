"""``TensorTree``: a nested mapping of str keys to tensors that behaves like one tensor along its
leading ``batch_size`` dims, and writes itself to disk as one raw file per leaf.

The class is assembled from one module per concern: :mod:`~memtree.tree.parts.core` (entries, keys,
batch indexing, equality, locking), :mod:`~memtree.tree.parts.shape_ops`,
:mod:`~memtree.tree.parts.persistence` (memmap, load_memmap, growth, modules),
:mod:`~memtree.tree.parts.tensor_ops` (``float()``, ``split``, ``masked_fill_``... on every leaf) and
:mod:`~memtree.tree.parts.repr`.

Example:
    >>> import torch, memtree
    >>> tree = memtree.TensorTree({"obs": torch.zeros(4, 3), "info": {"step": torch.arange(4)}},
    ...                           batch_size=[4])
    >>> tree[1:3]["info", "step"].tolist()
    [1, 2]
    >>> tree["name"] = "run-1"           # non-tensor leaves are kept (as JSON on disk)
    >>> tree.keys(include_nested=True)
    ['obs', 'info', ('info', 'step'), 'name']
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import check_keywords
from ..store.reading.options import KeySelection
from .parts.args import Key
from .parts.persistence import Persistence
from .parts.repr import TreeRepr
from .parts.tensor_ops import TensorOps

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..store.primitives.crypto import EncryptionKey
    from ..store.reading.options import RemoteKeywords

__all__ = ["TensorTree", "load_memmap", "Key"]


class TensorTree(Persistence, TensorOps, TreeRepr):
    """A nested mapping of str keys to tensors, sub-trees and small non-tensor values.

    Every tensor leaf's shape starts with ``batch_size``; indexing the tree indexes every leaf
    along those dims. Written with :meth:`memmap`, each leaf becomes one raw ``.memmap`` file.

    Args:
        source: a mapping (nested mappings become sub-trees) or another tree.
        batch_size: the leading dims shared by every leaf (default ``()``, or the source
            tree's).
        device: if given, every tensor set into the tree is moved to this device.

    Example:
        >>> import torch, memtree
        >>> t = memtree.TensorTree({"a": torch.zeros(2, 5)}, batch_size=[2])
        >>> t.shape, len(t)
        (torch.Size([2]), 2)
    """

    @classmethod
    def _base(cls) -> type[TensorTree]:
        return TensorTree


@check_keywords
def load_memmap(
    prefix: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    keys: Iterable[KeySelection] | None = None,
    mode: str = "r+",
    mmap: bool = True,
    allow_pickle: bool = False,
    verify: bool = False,
    unknown_classes: str = "error",
    lazy: bool = True,
    encryption: EncryptionKey | None = None,
    mesh: Any = None,
    placements: Any = None,
    **remote: Unpack[RemoteKeywords],
) -> TensorTree:
    """Load a tree written by :meth:`TensorTree.memmap`: :meth:`TensorTree.load_memmap`, whose
    arguments it takes (``mode="r"`` maps read-only; the default ``"r+"`` lets writes reach
    the files; the keywords of a remote load apply to URLs only).

    Example:
        >>> import tempfile, memtree, torch
        >>> d = tempfile.mkdtemp() + "/m"
        >>> _ = memtree.TensorTree({"a": torch.arange(3)}).memmap(d)
        >>> memtree.load_memmap(d, mode="r")["a"].tolist()
        [0, 1, 2]
    """
    return TensorTree.load_memmap(
        prefix, device=device, keys=keys, mode=mode, mmap=mmap, allow_pickle=allow_pickle, verify=verify,
        unknown_classes=unknown_classes, lazy=lazy, encryption=encryption, mesh=mesh, placements=placements,
        **remote,
    )
