"""Which leaves of a tree a rank-aware read returns as ``DTensor`` s, on which mesh, placed how.

:func:`targets_for` is ``load_memmap(..., mesh=, placements=)``: a leaf the caller names in
``placements`` (or for which its function returns placements) is split so; any other leaf that
records a layout (``meta.json``'s ``dtensor`` annotation: it was saved from a ``DTensor``) is split by
those placements on ``mesh``; every other leaf stays a plain tensor. :func:`targets_like` is what
``memmap`` returns after a collective write: each leaf that was a ``DTensor`` comes back on its
own mesh with its own placements.

Example:
    >>> targets_for(None, None)
    Traceback (most recent call last):
    ...
    memtree.errors.InvalidArgumentError: mesh= is the DeviceMesh to place the tensors on (every rank of it calls the load), got None
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, MemtreeKeyError, PlacementError
from ..format.level import Level, fmt_key
from .placement import Layout, from_annotation
from ..format.schema import LeafMeta
from .dtensor import is_dtensor, layout_of, torch_placements

__all__ = ["Target", "Targets", "targets_for", "targets_like"]

KeyPath = tuple[str, ...]
Pick = Callable[[KeyPath, tuple[int, ...]], Any]


@dataclass(frozen=True)
class Target:
    """How one leaf is read: as a ``DTensor`` on ``mesh`` with ``placements`` (``layout``: the
    same as strings, checked against the leaf's shape)."""

    mesh: Any
    placements: list[Any]
    layout: Layout


class Targets:
    """Which leaves are read as ``DTensor`` s (see the module docstring).

    Attributes:
        mesh: the mesh of every target (``None``: each leaf's own, from ``per_key``).
        given: placements by key path (``load_memmap(placements={...})``).
        pick: a function of ``(key path, shape)`` giving placements or ``None``.
        per_key: ``(mesh, placements)`` by key path, the only targets (``targets_like``).
        used: the keys of ``given`` that named a leaf of the read.
    """

    def __init__(
        self,
        mesh: Any = None,
        given: Mapping[KeyPath, Sequence[Any]] | None = None,
        pick: Pick | None = None,
        per_key: Mapping[KeyPath, tuple[Any, Sequence[Any]]] | None = None,
    ) -> None:
        self.mesh = mesh
        self.given = dict(given or {})
        self.pick = pick
        self.per_key = dict(per_key) if per_key is not None else None
        self.used: set[KeyPath] = set()

    def resolve(self, key: KeyPath, entry: LeafMeta) -> Target | None:
        """The target of the leaf at ``key`` (``entry`` its ``meta.json`` entry), ``None`` for a
        plain tensor.

        Raises:
            PlacementError: the placements do not fit the leaf or the mesh (a recorded layout
                of another number of mesh dims than ``mesh``'s, a dim the leaf lacks...).
            InvalidArgumentError: ``pick`` returned something other than placements.
        """
        where = f"leaf {fmt_key(key)}"
        if self.per_key is not None:
            found = self.per_key.get(key)
            if found is None:
                return None
            mesh, placements = found
        else:
            mesh, placements = self.mesh, None
            if key in self.given:
                placements = self.given[key]
                self.used.add(key)
            elif self.pick is not None:
                placements = self.pick(key, entry.shape)
            if placements is None:
                if entry.layout is None:
                    return None
                recorded = from_annotation(entry.layout)
                if len(recorded.mesh) != mesh.ndim:
                    raise PlacementError(
                        f"{where} was saved on a mesh of shape {list(recorded.mesh)} with placements "
                        f"{list(recorded.placements)}, and the mesh given has {mesh.ndim} dims "
                        f"({list(mesh.shape)}): the recorded placements do not apply. Pass "
                        "placements= (a mapping from keys to placements, one per mesh dim)"
                    )
                placements = torch_placements(recorded.placements)
        if isinstance(placements, (str, bytes)) or not isinstance(placements, Sequence):
            raise InvalidArgumentError(
                f"{where}: placements are a list of torch placements, one per mesh dim "
                f"([Shard(0)], [Replicate(), Shard(1)]), got {placements!r:.80}"
            )
        placements = list(placements)
        if len(placements) != mesh.ndim:
            raise PlacementError(
                f"{where}: {len(placements)} placement(s) {placements} for a mesh of {mesh.ndim} dims: "
                "give one per mesh dim"
            )
        return Target(mesh, placements, layout_of(mesh, placements, entry.shape, where))

    def check_used(self) -> None:
        """Refuse keys of ``given`` that named no tensor leaf of the read.

        Raises:
            MemtreeKeyError: naming them.
        """
        unused = [fmt_key(k) for k in self.given if k not in self.used]
        if unused:
            raise MemtreeKeyError(
                f"placements= names {', '.join(unused[:10])}, which {'is' if len(unused) == 1 else 'are'} "
                "not a tensor leaf of the tree as loaded (check the key, and keys=)"
            )


def _key_path(key: Any) -> KeyPath:
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
        return key
    raise InvalidArgumentError(f"placements= keys are str or tuples of str ('w', ('a', 'w')), got {key!r:.80}")


def targets_for(mesh: Any, placements: Any) -> Targets:
    """The targets of ``load_memmap(..., mesh=mesh, placements=placements)``.

    Raises:
        InvalidArgumentError: no ``mesh``, a ``mesh`` that is not a ``DeviceMesh``, or
            ``placements`` that is neither a mapping nor a function.
    """
    if mesh is None:
        raise InvalidArgumentError(
            "mesh= is the DeviceMesh to place the tensors on (every rank of it calls the load), got None"
            + (": placements= needs mesh=" if placements is not None else "")
        )
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise InvalidArgumentError(f"mesh= is a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if placements is None:
        return Targets(mesh)
    if isinstance(placements, Mapping):
        return Targets(mesh, given={_key_path(k): v for k, v in placements.items()})
    if callable(placements):
        return Targets(mesh, pick=placements)
    raise InvalidArgumentError(
        "placements= is a mapping from keys to placements ({'w': [Shard(0)], ('a', 'b'): "
        f"[Replicate()]}}) or a function of (key path, shape); got a {type(placements).__name__}: "
        "for which key?"
    )


def targets_like(level: Level) -> Targets:
    """The targets that give back each ``DTensor`` leaf of ``level`` as it is (its mesh, its
    placements); the other leaves stay plain.

    Example:
        >>> import torch
        >>> targets_like(Level((), {"w": torch.ones(1)})).per_key
        {}
    """
    found: dict[KeyPath, tuple[Any, Sequence[Any]]] = {}
    todo: list[tuple[KeyPath, Level]] = [((), level)]
    while todo:
        path, here = todo.pop()
        for key, value in here.entries.items():
            if isinstance(value, Level):
                todo.append((path + (key,), value))
            elif is_dtensor(value):
                found[path + (key,)] = (value.device_mesh, list(value.placements))
    return Targets(per_key=found)
