"""``Level``: the neutral nested structure passed between the tree layer and the store.

The tree layer (:mod:`memtree.tree`) turns a ``TensorTree`` into a ``Level`` to write it and turns
a loaded ``Level`` back into a ``TensorTree``; the store (:mod:`memtree.write`,
:mod:`memtree.read`) never sees the user-facing class. Entries keep the tree's key order.

Example:
    >>> import torch
    >>> from memtree.level import Level
    >>> Level((2,), {"x": torch.zeros(2, 3), "sub": Level((2,), {})}).batch_size
    (2,)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch

from .format import TREE_TYPE
from .nontensor import NonTensor

__all__ = ["Level", "Value"]


@dataclass
class Level:
    """One level of a tree: batch size and entries (tensors, sub-levels, non-tensor values)."""

    batch_size: tuple[int, ...]
    entries: dict[str, "Value"] = field(default_factory=dict)
    type: str = TREE_TYPE


Value = Union[torch.Tensor, Level, NonTensor]
