"""The tree side of growth: normalise the rows to append, then grow on disk with :mod:`memtree.store.writing.grow`.

Example:
    >>> import tempfile, torch, memtree
    >>> buf = memtree.TensorTree({"x": torch.zeros(0, 2)}, batch_size=[0]).memmap(tempfile.mkdtemp() + "/b")
    >>> buf.extend_({"x": torch.ones(3, 2)}).batch_size
    torch.Size([3])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ...errors import BatchSizeError, ShapeMismatchError
from ...format.level import Level
from ...store.writing.grow import check_growable, extend_level, resize_level

if TYPE_CHECKING:
    from .core import TreeCore
    from .shape_ops import ShapeOps

__all__ = ["extend", "resize"]


def extend(tree: ShapeOps, rows: Any, *, single: bool, fsync: bool, base: type[TreeCore]) -> Level:
    """Append ``rows`` (one item with ``single=True``) to ``tree`` on disk; return its new leaves.

    ``base`` is the ``TensorTree`` class (a mapping of rows becomes one).
    """
    current = tree._to_level()
    check_growable(current)
    return extend_level(current, _as_rows(tree, rows, single, base)._to_level(), fsync=fsync)


def resize(tree: TreeCore, length: int, *, fsync: bool) -> Level:
    """Set ``tree``'s first batch dim to ``length`` on disk; return its new leaves."""
    return resize_level(tree._to_level(), length, fsync=fsync)


def _as_rows(tree: TreeCore, rows: Any, single: bool, cls: type[TreeCore]) -> TreeCore:
    tail = list(tree.batch_size[1:])
    if isinstance(rows, Mapping):
        rows = cls(rows, batch_size=tail if single else [])
        if not single:
            rows.batch_size = [_first_rows(rows)] + tail
    if not isinstance(rows, cls):
        raise ShapeMismatchError(
            f"what to append must be a TensorTree (or a mapping of tensors), got {type(rows).__name__}"
        )
    fits = list(rows.batch_size) == tail if single else rows.ndim > 0 and list(rows.batch_size[1:]) == tail
    if not fits:
        raise BatchSizeError(
            f"{'an item' if single else 'rows'} to append to a tree of batch_size "
            f"{list(tree.batch_size)} must have batch_size {tail if single else ['k'] + tail}, got "
            f"{list(rows.batch_size)}"
        )
    unsqueezed: TreeCore = rows.unsqueeze(0) if single else rows  # type: ignore[attr-defined]  # ShapeOps
    return unsqueezed


def _first_rows(tree: TreeCore) -> int:
    for value in tree.values(include_nested=True, leaves_only=True):
        if isinstance(value, torch.Tensor) and value.ndim:
            return int(value.shape[0])
    raise BatchSizeError("rows to append hold no tensor with a first dim; pass a TensorTree")
