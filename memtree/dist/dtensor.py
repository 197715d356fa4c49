"""A ``DTensor`` as memtree sees it: its :class:`~memtree.dist.placement.Layout`, the global
ranks of its mesh, this rank's coordinate in it and its local shard; placements to and from the
strings ``meta.json`` records.

Nothing here imports ``torch.distributed`` before a ``DTensor`` exists: :func:`is_dtensor` looks
for ``torch.distributed.tensor`` among the imported modules (no ``DTensor`` can exist before it
is imported), so the tree layer asks every leaf without paying for the import.

Example:
    >>> import torch
    >>> from memtree.format.level import Level
    >>> is_dtensor(torch.ones(2)), has_dtensor(Level((), {"a": Level((), {"w": torch.ones(1)})}))
    (False, False)
    >>> [str(p) for p in torch_placements(("S(1)", "R", "_S(0, 2)"))]
    ['S(1)', 'R', '_S(0, 2)']
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ..errors import InvalidArgumentError, PlacementError, SubclassError
from ..format.level import Level
from .placement import Layout, check_layout, parse_placement, to_annotation
from ..format.subclass import layout_dict, parse_layout

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "DistLeaf",
    "is_dtensor",
    "has_dtensor",
    "placement_text",
    "torch_placements",
    "layout_of",
    "dist_leaf",
    "mesh_ranks",
    "mesh_device",
    "local_of",
    "from_local",
]


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """True for a ``torch.distributed.tensor.DTensor`` (a parameter holding one included).

    Example:
        >>> import torch
        >>> is_dtensor(torch.ones(1))
        False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def has_dtensor(level: Level) -> bool:
    """True when a leaf of ``level`` (at any depth) is a ``DTensor``: the tree is written by
    every rank at once.

    Example:
        >>> import torch
        >>> has_dtensor(Level((), {"w": torch.ones(1)}))
        False
    """
    if "torch.distributed.tensor" not in sys.modules:
        return False
    todo = [level]
    while todo:
        for value in todo.pop().entries.values():
            if isinstance(value, Level):
                todo.append(value)
            elif is_dtensor(value):
                return True
    return False


def placement_text(placement: Any, ndim: int, where: str) -> str:
    """The string ``meta.json`` records for a torch placement of a tensor of ``ndim`` dims
    (``"R"``, ``"S(d)"``, ``"_S(d, k)"``; a negative dim counted from the end).

    Raises:
        SubclassError: ``Partial`` (a partial sum holds no value to store).
        PlacementError: a placement memtree does not know.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> placement_text(Shard(-1), 2, "leaf 'w'")
        'S(1)'
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    if placement.is_replicate():
        return "R"
    dim = getattr(placement, "dim", None)
    if type(dim) is int and dim < 0:
        dim += ndim
    if isinstance(placement, _StridedShard) and type(dim) is int:
        return f"_S({dim}, {placement.split_factor})"
    if placement.is_shard() and type(dim) is int:
        return f"S({dim})"
    if placement.is_partial():
        raise SubclassError(
            f"{where} is a DTensor with the placement {placement} (Partial: a partial sum holds no value "
            "to store); redistribute it first: tensor.redistribute(tensor.device_mesh, [Replicate()]) "
            "(or the placements you want stored)"
        )
    raise PlacementError(f"{where} has the placement {placement!r:.60}, which memtree cannot store")


def torch_placements(texts: Sequence[str]) -> list[Any]:
    """The torch placements of stored placement strings (:func:`placement_text`'s inverse)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for text in texts:
        kind, dim, split = parse_placement(text)
        out.append(Replicate() if kind == "R" else Shard(dim) if kind == "S" else _StridedShard(dim, split_factor=split))
    return out


def layout_of(mesh: Any, placements: Sequence[Any], shape: Sequence[int], where: str) -> Layout:
    """The :class:`Layout` of a tensor of ``shape`` placed by ``placements`` on ``mesh``.

    Raises:
        PlacementError: a placement memtree cannot store, one that does not fit the tensor
            (a dim it lacks), or not one placement per mesh dim.
    """
    texts = tuple(placement_text(p, len(shape), where) for p in placements)
    names = getattr(mesh, "mesh_dim_names", None)
    layout = Layout(tuple(int(n) for n in mesh.shape), texts, tuple(names) if names else None)
    try:
        check_layout(layout, len(shape))
        parse_layout(layout_dict(to_annotation(layout)), "dtensor", _value_error, tuple(shape))
    except ValueError as err:  # what meta.json records is what a reader accepts
        raise PlacementError(f"{where}: {err}") from None
    return layout


def _value_error(pointer: str, problem: str) -> ValueError:
    return ValueError(f"meta.json's {pointer} {problem}: name the mesh dims with Python identifiers")


def mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """The global ranks of ``mesh``'s devices, in row-major mesh order."""
    return tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())


def mesh_device(mesh: Any) -> torch.device:
    """Where this rank's shards of ``mesh`` live: the CPU, or the current device of its type."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(kind, index)


def local_of(tensor: Any) -> torch.Tensor:
    """The local shard of a ``DTensor``, as a plain tensor over its memory (no autograd)."""
    with torch.no_grad():
        local: torch.Tensor = tensor.to_local()
    local = local.detach()
    return local if type(local) is torch.Tensor else local.as_subclass(torch.Tensor)


@dataclass(frozen=True)
class DistLeaf:
    """A ``DTensor`` leaf as a collective write plans it.

    Attributes:
        shape: the global shape.
        dtype: its dtype.
        layout: how it is split (mesh shape, placement strings, dim names).
        ranks: the global ranks of the mesh's devices, row-major.
        coord: this rank's coordinate in the mesh (``None``: not in it).
        local: this rank's shard (a plain tensor; empty when it holds nothing).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    ranks: tuple[int, ...]
    coord: tuple[int, ...] | None
    local: torch.Tensor


def dist_leaf(tensor: Any, where: str) -> DistLeaf:
    """``tensor`` (a ``DTensor``) as :class:`DistLeaf`.

    Raises:
        SubclassError: a ``Partial`` placement.
        PlacementError: its placements cannot be stored.
    """
    mesh = tensor.device_mesh
    shape = tuple(int(n) for n in tensor.shape)
    layout = layout_of(mesh, tensor.placements, shape, where)
    coord = mesh.get_coordinate()
    return DistLeaf(shape, tensor.dtype, layout, mesh_ranks(mesh), None if coord is None else tuple(coord),
                    local_of(tensor))


def from_local(local: torch.Tensor, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> DTensor:
    """A ``DTensor`` of global ``shape`` (contiguous strides) whose shard on this rank is ``local``
    (no communication: every rank passes its own).

    Raises:
        InvalidArgumentError: ``mesh`` is not a ``DeviceMesh``.
    """
    from torch.distributed.tensor import DTensor as _DTensor

    if not hasattr(mesh, "get_coordinate"):
        raise InvalidArgumentError(f"mesh= is a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    stride = tuple(prod(shape[d + 1 :]) for d in range(len(shape)))
    return _DTensor.from_local(local, mesh, list(placements), run_check=False, shape=torch.Size(shape), stride=stride)
