"""The user-facing tree: :class:`~memtree.TensorTree`, typed records, stacking, datasets.

Importing any part of it registers :class:`~memtree.TensorTree` with DataLoader's default
``collate_fn``, however the tree was reached (``memtree.TensorTree`` loads lazily, ``from
memtree.tree.tensortree import TensorTree`` directly). The collation itself
(:mod:`memtree.tree.dataset`, with stacking) is imported on the first batch, so that loading a
tree into a module (``memtree.load_memmap(d).to_module(m)``) imports no dataset or stacking code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data._utils.collate import default_collate_fn_map

from .tensortree import TensorTree


def _collate_trees(batch: Sequence[TensorTree] | TensorTree, *, collate_fn_map: Any = None) -> TensorTree:
    """:func:`memtree.collate` in the form ``torch.utils.data.default_collate`` calls for a
    registered type."""
    from .dataset import collate

    return collate(batch)


# torch's documented extension point of default_collate (torch.utils.data._utils.collate.collate):
# the default collate_fn looks an item's type up here, subclasses (tensorclasses) included.
default_collate_fn_map[TensorTree] = _collate_trees
