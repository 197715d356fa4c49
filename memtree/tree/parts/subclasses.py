"""Tensor subclasses and DTensors in modules: loading them in place, and DTensor leaves.

A tensor subclass is stored as a group and rebuilt through the registry
(:mod:`memtree.format.subclass_registry`); this module is what binding and loading into modules
need on top of it: whether a source can be filled into a module's tensor inner tensor by inner
tensor (:func:`layout_problem`), the plain tensors such a fill writes (:func:`fill_dests`,
:func:`fill_into`), and DTensors: a DTensor is stored as its full logical tensor with its
layout (:func:`dtensor_leaf`), and a load into a module of DTensors gets, on each rank, its part
of the full tensor (:func:`as_dtensor_like`), with no communication.

Example:
    >>> import torch
    >>> layout_problem(torch.ones(2), torch.zeros(2)) is None
    True
"""

from __future__ import annotations

import torch

from ...errors import SubclassError
from ...format.level import fmt_key
from ...format.subclass import DTensorLayout, Placement, layout_dict, parse_layout
from ...format.subclass_registry import inner_tensors, is_dtensor, is_plain, layout_of

__all__ = ["layout_problem", "fill_dests", "fill_into", "dtensor_leaf", "as_dtensor_like"]


def layout_problem(source: torch.Tensor, target: torch.Tensor) -> str | None:
    """What keeps ``source`` from being filled into ``target`` inner tensor by inner tensor
    (``None``: they have one layout: the same class, the same inner names, shapes and dtypes,
    and the same flatten context).

    Example:
        >>> import torch
        >>> layout_problem(torch.ones(2), torch.zeros(2)) is None
        True
    """
    if is_dtensor(target) or is_dtensor(source):
        return None if is_dtensor(target) and not is_dtensor(source) else (
            "the source is a DTensor: store its full tensor (t.full_tensor())" if is_dtensor(source) else None
        )
    plain_s, plain_t = is_plain(source), is_plain(target)
    if plain_s and plain_t:
        return None
    if plain_s != plain_t:
        return (
            f"the source is a {type(source).__name__}, the module's tensor a {type(target).__name__}: "
            "load into a module quantized the same way (or build it under memtree.empty_init() to bind "
            "the source's tensors), or dequantize the source"
        )
    if type(source) is not type(target):
        return f"the source is a {type(source).__name__}, the module's tensor a {type(target).__name__}"
    (spec, ctx_s), (mine, ctx_t) = layout_of(source), layout_of(target)
    if spec != mine:
        return f"their inner tensors differ: source {_show(spec)}, module {_show(mine)}"
    if ctx_s != ctx_t:
        return f"their {type(target).__name__} contexts differ: source {ctx_s!r:.200}, module {ctx_t!r:.200}"
    return None


def fill_dests(target: torch.Tensor) -> list[tuple[tuple[str, ...], torch.Tensor]] | None:
    """The plain tensors that filling ``target`` in place writes, by inner attribute path:
    ``[((), target)]`` for a plain tensor, its inner tensors for a subclass, its local tensor for
    a DTensor that holds its whole tensor on this rank; ``None`` for a DTensor holding a part
    (its part of the full tensor is sliced out by :func:`fill_into`).

    Example:
        >>> import torch
        >>> [(p, tuple(t.shape)) for p, t in fill_dests(torch.zeros(2, 3))]
        [((), (2, 3))]
    """
    if is_dtensor(target):
        local = target.to_local()  # type: ignore[attr-defined]
        return [((), local.detach())] if local.shape == target.shape and is_plain(local) else None
    return [(p, t.detach().as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t.detach())
            for p, t in inner_tensors(target)]


def fill_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source``'s values into ``target`` in place, inner tensor by inner tensor (for
    tensors that :func:`layout_problem` finds nothing wrong with); a DTensor ``target`` gets its
    part of the full tensor ``source``. Without autograd.

    Example:
        >>> import torch
        >>> t = torch.zeros(2); fill_into(t, torch.ones(2)); t.tolist()
        [1.0, 1.0]
    """
    with torch.no_grad():
        if is_dtensor(target) and not is_dtensor(source):
            target.to_local().copy_(as_dtensor_like(source, target).to_local())  # type: ignore[attr-defined]
            return
        for (_, dest), (_, value) in zip(inner_tensors(target), inner_tensors(source)):
            dest.copy_(value)


def _show(spec: list[tuple[tuple[str, ...], torch.dtype, tuple[int, ...]]]) -> str:
    return ", ".join(f"{'.'.join(p)}: {str(d).replace('torch.', '')}{list(s)}" for p, d, s in spec)


# ---------------------------------------------------------------------------------------------
# DTensor: the full tensor, and its layout


def dtensor_leaf(t: torch.Tensor, path: tuple[str, ...]) -> tuple[torch.Tensor, DTensorLayout]:
    """A DTensor's full logical tensor and its layout (what a DTensor leaf stores).

    Raises:
        SubclassError: a ``Partial`` placement (reduce it first), or a local tensor that is
            itself a subclass.
    """
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    placements = []
    for p in t.placements:  # type: ignore[attr-defined]
        if isinstance(p, _StridedShard):
            placements.append(Placement("strided_shard", p.dim % max(t.ndim, 1), int(p.split_factor)))
        elif isinstance(p, Shard):
            placements.append(Placement("shard", p.dim % max(t.ndim, 1)))  # Shard(-1): the last dim
        elif isinstance(p, Replicate):
            placements.append(Placement("replicate"))
        else:
            raise SubclassError(
                f"leaf {fmt_key(path)} is a DTensor with the placement {p}, whose values are not "
                "reduced yet; redistribute it first (t.redistribute(placements=[Replicate()]), or "
                "Shard) so that its full tensor is known"
            )
    mesh = t.device_mesh  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names
    layout = DTensorLayout(tuple(mesh.shape), tuple(placements), tuple(names) if names else None)

    def unrecordable(pointer: str, problem: str) -> SubclassError:
        return SubclassError(f"leaf {fmt_key(path)}: meta.json's {pointer} {problem}: name the mesh dims with "
                             "Python identifiers")

    parse_layout(layout_dict(layout), "dtensor", unrecordable, tuple(t.shape))  # what is recorded loads
    full = t.full_tensor()  # type: ignore[attr-defined]
    if not is_plain(full):
        raise SubclassError(
            f"leaf {fmt_key(path)} is a DTensor of {type(full).__name__}: a DTensor is stored as its "
            "full plain tensor; store the local tensor or dequantize it"
        )
    return full, layout


def as_dtensor_like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full`` (a DTensor's full tensor) as a DTensor laid out as ``target`` is (its mesh and
    placements): this rank's part of it, a view where the placements allow, no communication.

    Example:
        >>> import torch
        >>> as_dtensor_like(torch.ones(2), torch.zeros(2)).tolist()   # a plain target: as it is
        [1.0, 1.0]
    """
    if not is_dtensor(target) or is_dtensor(full):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full.detach(), target.device_mesh, target.placements, src_data_rank=None  # type: ignore[attr-defined]
    )
