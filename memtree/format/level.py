"""``Level``: the neutral nested structure passed between the tree layer and the store.

The tree layer (:mod:`memtree.tree.tensortree`) turns a ``TensorTree`` into a ``Level`` to write it and turns
a loaded ``Level`` back into a ``TensorTree``; the store (:mod:`memtree.store.writing.write`,
:mod:`memtree.store.reading.read`) never sees the user-facing class. Entries keep the tree's key order.

Example:
    >>> import torch
    >>> from memtree.format.level import Level
    >>> Level((2,), {"x": torch.zeros(2, 3), "sub": Level((2,), {})}).batch_size
    (2,)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import torch

from .schema import TREE_TYPE
from .subclass import DTensorLayout, Subclass
from .values import NonTensor

__all__ = ["Level", "Value", "as_level", "fmt_key"]


@dataclass
class Level:
    """One level of a tree: batch size and entries (tensors, sub-levels, non-tensor values).

    Training state (format version 2, :mod:`memtree.training.state`) also records which keys are
    int dict keys (``int_keys``). A tensor subclass is a level of its inner tensors with
    ``subclass`` set (:mod:`memtree.format.subclass_registry` makes and rebuilds them).
    """

    batch_size: tuple[int, ...]
    entries: dict[str, "Value"] = field(default_factory=dict)
    type: str = TREE_TYPE
    #: The class another library recorded for this level (tensordict's ``_type``, e.g.
    #: ``"<class 'pkg.Step'>"``), as text: the tree layer maps it to a registered
    #: ``@tensorclass`` (:func:`memtree.tree.parts.registry.class_for_foreign`), the tensordict writer
    #: writes it back; memtree's own ``meta.json`` does not record it.
    foreign_type: str | None = None
    int_keys: frozenset[str] = frozenset()
    #: A tensor subclass's group (format version 3, :mod:`memtree.format.subclass`): what the
    #: subclass records; the entries are its inner tensors (or nested groups), by attribute name.
    subclass: Subclass | None = None
    #: The DTensor layouts of this level's tensors that hold a DTensor's full tensor, by key.
    layouts: dict[str, DTensorLayout] = field(default_factory=dict)


Value = Union[torch.Tensor, Level, NonTensor]


def as_level(obj: Any, keep_dtensors: bool = False) -> Level | None:
    """``obj`` as a ``Level``: itself, or what its ``__memtree_level__()`` returns; else ``None``.
    A ``DTensor`` leaf becomes its full tensor and layout, or stays with ``keep_dtensors`` (for
    a collective write).

    The layers below the tree accept a :class:`~memtree.TensorTree` through this protocol (as
    ``os.fspath`` accepts path-like objects), so they never import the tree layer.

    Example:
        >>> import memtree, torch
        >>> as_level(memtree.TensorTree({"x": torch.zeros(1)})).entries["x"].shape
        torch.Size([1])
    """
    if isinstance(obj, Level):
        return obj
    method = getattr(type(obj), "__memtree_level__", None)
    if method is None:
        return None
    level: Level = method(obj, keep_dtensors=True) if keep_dtensors else method(obj)
    return level


def fmt_key(path: tuple[str, ...]) -> str:
    """A key path as messages show it: ``'a'`` or ``('a', 'b')``.

    Example:
        >>> fmt_key(("a",)), fmt_key(("a", "b"))
        ("'a'", "('a', 'b')")
    """
    return repr(path[0]) if len(path) == 1 else repr(path)
