"""Where the shards of a distributed tensor lie in its leaf file: pure functions, no I/O, no torch.

A ``DTensor`` leaf is stored as its full logical tensor in one ordinary leaf file (row-major,
as any leaf); its :class:`Layout` (the device mesh's shape and dim names, and one placement per
mesh dim) is recorded beside it (``docs/format.md``, "Version 3"). A rank of the mesh holds a
*box* of the full tensor: for each tensor dim, the sorted index intervals it holds
(:func:`local_box`, the very split ``DTensor`` makes: ``torch.chunk``'s sizes, uneven shards
and empty ones included). :func:`box_runs` turns a box into the byte ranges of the leaf file it
covers, in the order of the rank's local tensor: ``Shard(0)`` is one contiguous range,
``Shard(d)`` with ``d > 0`` one range per row of the dims before ``d``.

Placements are written as torch prints them: ``"S(d)"`` (``Shard(d)``), ``"R"``
(``Replicate()``) and ``"_S(d, k)"`` (``_StridedShard(d, split_factor=k)``, what FSDP2 uses on
top of tensor parallelism). ``Partial`` is not a placement of stored data: reduce it first.

Example:
    >>> layout = Layout((2,), ("S(1)",))
    >>> box = local_box((3, 4), layout, (1,))        # rank 1 of 2 holds columns 2 and 3
    >>> box, box_shape(box)
    ((((0, 3),), ((2, 4),)), (3, 2))
    >>> list(box_runs((3, 4), 4, box))                # float32: 8 bytes of each row
    [(8, 8), (24, 8), (40, 8)]
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import product
from math import prod
from typing import Any

from ..format.entries import DTensorLayout, Placement
from ..format.record import Record

__all__ = [
    "REPLICATE",
    "Layout",
    "Box",
    "Shard",
    "parse_placement",
    "check_layout",
    "to_annotation",
    "from_annotation",
    "chunk_span",
    "local_box",
    "box_shape",
    "box_offsets",
    "full_box",
    "box_runs",
    "split_runs",
    "shards",
    "assign_writers",
]

#: ``Replicate()``, as torch prints it.
REPLICATE = "R"
_SHARD = re.compile(r"S\((0|[1-9][0-9]{0,2})\)")
_STRIDED = re.compile(r"_S\((0|[1-9][0-9]{0,2}), ([1-9][0-9]{0,8})\)")
#: Most mesh dims a layout may have (torch's meshes have a handful).
MAX_MESH_DIMS = 16
#: Most devices along one mesh dim.
MAX_MESH_SIZE = 1 << 24

Box = tuple[tuple[tuple[int, int], ...], ...]
"""Per tensor dim, the sorted, disjoint, non-adjacent ``[start, stop)`` index intervals a shard
holds (an empty tuple for a dim of which it holds nothing)."""


@dataclass(init=False, repr=False, eq=False)
class Layout(Record):
    """How a distributed tensor is split: the mesh shape, one placement per mesh dim, dim names.

    Attributes:
        mesh: the device mesh's shape (``(8,)``, ``(2, 4)``).
        placements: one per mesh dim: ``"R"``, ``"S(d)"`` or ``"_S(d, k)"``.
        dim_names: the mesh dims' names (``("dp", "tp")``), if it has them.
    """

    mesh: tuple[int, ...]
    placements: tuple[str, ...]
    dim_names: tuple[str, ...] | None = None

    def __init__(
        self, mesh: tuple[int, ...], placements: tuple[str, ...], dim_names: tuple[str, ...] | None = None
    ) -> None:
        object.__setattr__(self, "mesh", tuple(mesh))
        object.__setattr__(self, "placements", tuple(placements))
        object.__setattr__(self, "dim_names", None if dim_names is None else tuple(dim_names))


@dataclass(init=False, repr=False, eq=False)
class Shard(Record):
    """One distinct shard of a leaf and the ranks that hold it (replicas hold the same box).

    Attributes:
        box: the indices it covers (:data:`Box`).
        holders: the global ranks that hold it, lowest first.
        nbytes: its size in bytes.
    """

    box: Box
    holders: tuple[int, ...]
    nbytes: int

    def __init__(self, box: Box, holders: tuple[int, ...], nbytes: int) -> None:
        object.__setattr__(self, "box", box)
        object.__setattr__(self, "holders", holders)
        object.__setattr__(self, "nbytes", nbytes)


def parse_placement(text: str) -> tuple[str, int, int]:
    """``(kind, dim, split_factor)`` of a placement string: ``("R", -1, 1)``, ``("S", d, 1)`` or
    ``("_S", d, k)``.

    Raises:
        ValueError: not a placement memtree stores (``Partial`` among them).

    Example:
        >>> parse_placement("S(1)"), parse_placement("R"), parse_placement("_S(0, 2)")
        (('S', 1, 1), ('R', -1, 1), ('_S', 0, 2))
    """
    if text == REPLICATE:
        return ("R", -1, 1)
    if type(text) is str:
        m = _SHARD.fullmatch(text)
        if m:
            return ("S", int(m.group(1)), 1)
        m = _STRIDED.fullmatch(text)
        if m:
            return ("_S", int(m.group(1)), int(m.group(2)))
    raise ValueError(
        f"{text!r:.40} is not a placement memtree stores: 'R' (Replicate), 'S(d)' (Shard) or "
        "'_S(d, k)' (_StridedShard); a Partial tensor must be reduced first "
        "(dtensor.redistribute(mesh, [Replicate()]))"
    )


def check_layout(layout: Layout, ndim: int) -> None:
    """Check that ``layout`` can split a tensor of ``ndim`` dims.

    Raises:
        ValueError: a placement is unknown or shards a dim the tensor lacks, the mesh shape and
            the placements differ in length, a mesh dim is empty or too large, or the dim names
            are not distinct non-empty strings, one per mesh dim.

    Example:
        >>> check_layout(Layout((2,), ("S(2)",)), 2)
        Traceback (most recent call last):
        ...
        ValueError: placement 'S(2)' shards dim 2 of a tensor of 2 dims
    """
    if not 0 < len(layout.mesh) <= MAX_MESH_DIMS or len(layout.placements) != len(layout.mesh):
        raise ValueError(
            f"a layout has 1 to {MAX_MESH_DIMS} mesh dims and one placement per mesh dim, got mesh "
            f"{list(layout.mesh)!r:.60} and placements {list(layout.placements)!r:.80}"
        )
    for n in layout.mesh:
        if type(n) is not int or not 0 < n <= MAX_MESH_SIZE:
            raise ValueError(f"mesh dims are ints in [1, {MAX_MESH_SIZE}], got {list(layout.mesh)!r:.60}")
    for text in layout.placements:
        kind, dim, split = parse_placement(text)
        if kind != "R" and dim >= ndim:
            raise ValueError(f"placement {text!r} shards dim {dim} of a tensor of {ndim} dims")
        if split > MAX_MESH_SIZE:
            raise ValueError(f"placement {text!r} has a split factor beyond {MAX_MESH_SIZE}")
    names = layout.dim_names
    if names is not None and (
        len(names) != len(layout.mesh)
        or len(set(names)) != len(names)
        or any(type(s) is not str or not s or len(s) > 200 for s in names)
    ):
        raise ValueError(
            f"mesh dim names are distinct non-empty strings, one per mesh dim, got {list(names)!r:.80}"
        )


_KINDS = {"R": "replicate", "S": "shard", "_S": "strided_shard"}


def to_annotation(layout: Layout) -> DTensorLayout:
    """The ``dtensor`` annotation ``meta.json`` records for ``layout`` (``docs/format.md``,
    "DTensor leaves"): one definition of a stored layout, whichever writer made it.

    Example:
        >>> a = to_annotation(Layout((2,), ("_S(0, 2)",)))
        >>> [(p.kind, p.dim, p.split_factor) for p in a.placements]
        [('strided_shard', 0, 2)]
        >>> from_annotation(a) == Layout((2,), ("_S(0, 2)",))
        True
    """
    placements = []
    for text in layout.placements:
        kind, dim, split = parse_placement(text)
        placements.append(Placement(_KINDS[kind], None if kind == "R" else dim, split if kind == "_S" else None))
    return DTensorLayout(layout.mesh, tuple(placements), layout.dim_names)


def from_annotation(annotation: DTensorLayout) -> Layout:
    """The :class:`Layout` of a leaf's ``dtensor`` annotation (:func:`to_annotation`'s inverse)."""
    texts = tuple(
        REPLICATE if p.kind == "replicate" else f"S({p.dim})" if p.kind == "shard" else f"_S({p.dim}, {p.split_factor})"
        for p in annotation.placements
    )
    return Layout(annotation.mesh, texts, annotation.dim_names)


def chunk_span(size: int, chunks: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` when ``size`` indices are split as ``torch.chunk``
    splits them (``ceil(size / chunks)`` each, the last ones shorter or empty), as ``Shard`` does.

    Example:
        >>> [chunk_span(7, 3, i) for i in range(3)], chunk_span(2, 4, 3)
        ([(0, 3), (3, 3), (6, 1)], (2, 0))
    """
    full = -(-size // chunks)
    start = min(full * index, size)
    return start, max(0, min(size, full * index + full) - start)


def _strided_positions(size: int, chunks: int, index: int, split: int) -> list[tuple[int, int]]:
    """The positions ``_StridedShard(d, split)`` gives piece ``index`` of ``chunks``: ``size``
    split in ``split`` parts, each part chunked, this piece's chunk of every part."""
    out: list[tuple[int, int]] = []
    for part in range(split):
        start, length = chunk_span(size, split, part)
        if not length:  # every later part is empty too: at most ``size`` parts are looked at
            break
        sub, sublen = chunk_span(length, chunks, index)
        if sublen:
            out.append((start + sub, start + sub + sublen))
    return out


def _select(intervals: tuple[tuple[int, int], ...], positions: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The indices at ``positions`` (``[a, b)`` ranges of places) of the index sequence that
    ``intervals`` lists, as merged intervals."""
    out: list[tuple[int, int]] = []
    for a, b in positions:
        seen = 0
        for lo, hi in intervals:
            n = hi - lo
            s, e = max(a, seen), min(b, seen + n)
            if s < e:
                start, stop = lo + s - seen, lo + e - seen
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], stop)
                else:
                    out.append((start, stop))
            seen += n
            if seen >= b:
                break
    return tuple(out)


def full_box(shape: Sequence[int]) -> Box:
    """The box of the whole tensor.

    Example:
        >>> full_box((2, 0))
        (((0, 2),), ())
    """
    return tuple(((0, n),) if n else () for n in shape)


def local_box(shape: Sequence[int], layout: Layout, coord: Sequence[int]) -> Box:
    """The indices of the full tensor of ``shape`` that the rank at mesh coordinate ``coord``
    holds: the placements applied mesh dim by mesh dim, as ``DTensor`` applies them.

    Example:
        >>> local_box((7, 2), Layout((2,), ("S(0)",)), (1,))   # an uneven split: 4 + 3 rows
        (((4, 7),), ((0, 2),))
        >>> local_box((8,), Layout((2, 2), ("_S(0, 2)", "S(0)")), (0, 1))
        (((4, 6),),)
    """
    box = list(full_box(shape))
    for mesh_dim, text in enumerate(layout.placements):
        kind, dim, split = parse_placement(text)
        if kind == "R":
            continue
        size = sum(b - a for a, b in box[dim])
        n, k = layout.mesh[mesh_dim], coord[mesh_dim]
        if kind == "S":
            start, length = chunk_span(size, n, k)
            positions = [(start, start + length)] if length else []
        else:
            positions = _strided_positions(size, n, k, split)
        box[dim] = _select(box[dim], positions)
    return tuple(box)


def box_shape(box: Box) -> tuple[int, ...]:
    """The shape of the local tensor of ``box``.

    Example:
        >>> box_shape((((0, 2), (5, 6)), ((1, 3),)))
        (3, 2)
    """
    return tuple(sum(b - a for a, b in dim) for dim in box)


def box_offsets(shape: Sequence[int], layout: Layout, box: Box) -> tuple[int, ...]:
    """The global offset of ``box`` per dim, as ``torch``'s ``compute_local_shape_and_global_offset``
    reports it (its first index; for an empty shard of a sharded dim, that dim's size).

    Example:
        >>> layout = Layout((4,), ("S(0)",))
        >>> box_offsets((2, 3), layout, local_box((2, 3), layout, (3,)))
        (2, 0)
    """
    sharded = {parse_placement(p)[1] for p in layout.placements if p != REPLICATE}
    return tuple(
        box[d][0][0] if box[d] else (shape[d] if d in sharded else 0) for d in range(len(shape))
    )


def box_runs(shape: Sequence[int], itemsize: int, box: Box) -> Iterator[tuple[int, int]]:
    """The byte ranges ``(offset, nbytes)`` of a row-major leaf file of ``shape`` that ``box``
    covers, in the order of the local tensor's bytes, each as long as it can be (ranges that
    touch are one).

    Example:
        >>> list(box_runs((4, 3), 2, (((1, 3),), ((0, 3),))))   # rows 1-2: one range
        [(6, 12)]
        >>> list(box_runs((2, 2, 2), 1, (((0, 2),), ((1, 2),), ((0, 2),))))
        [(2, 2), (6, 2)]
    """
    ndim = len(shape)
    if ndim == 0:
        yield (0, itemsize)
        return
    if any(not dim for dim in box):
        return
    k = ndim - 1
    while k > 0 and box[k] == ((0, shape[k]),):
        k -= 1
    inner = prod(shape[k + 1 :]) * itemsize  # bytes of one index of dim k
    strides = [prod(shape[d + 1 :]) * itemsize for d in range(k)]
    start, length = -1, 0
    for base in _row_offsets(box, strides, 0, 0):
        for a, b in box[k]:
            offset, n = base + a * inner, (b - a) * inner
            if offset == start + length:
                length += n
                continue
            if length:
                yield (start, length)
            start, length = offset, n
    if length:
        yield (start, length)


def _row_offsets(box: Box, strides: list[int], dim: int, base: int) -> Iterator[int]:
    """The byte offset of each index of the dims before ``len(strides)`` that ``box`` holds, in
    row-major order, one at a time (never a list of them: a column shard has millions)."""
    if dim == len(strides):
        yield base
        return
    for a, b in box[dim]:
        for i in range(a, b):
            yield from _row_offsets(box, strides, dim + 1, base + i * strides[dim])


def split_runs(runs: Iterator[tuple[int, int]], chunk: int) -> Iterator[tuple[int, int]]:
    """``runs`` cut at every multiple of ``chunk`` bytes (so that each piece lies in one chunk).

    Example:
        >>> list(split_runs(iter([(3, 10)]), 4))
        [(3, 1), (4, 4), (8, 4), (12, 1)]
    """
    for offset, n in runs:
        end = offset + n
        while offset < end:
            cut = min(end, (offset // chunk + 1) * chunk)
            yield (offset, cut - offset)
            offset = cut


def shards(shape: Sequence[int], itemsize: int, layout: Layout, ranks: Sequence[int]) -> list[Shard]:
    """The distinct shards of a tensor of ``shape`` split by ``layout`` over a mesh whose devices,
    in row-major mesh order, are the global ``ranks``; replicas are one shard with several
    holders. Empty shards are left out.

    Example:
        >>> [(s.box, s.holders) for s in shards((4,), 4, Layout((2, 2), ("R", "S(0)")), [0, 1, 2, 3])]
        [((((0, 2),),), (0, 2)), ((((2, 4),),), (1, 3))]
    """
    if len(ranks) != prod(layout.mesh):
        raise ValueError(f"a mesh of shape {list(layout.mesh)} has {prod(layout.mesh)} devices, got {len(ranks)} ranks")
    found: dict[Box, list[int]] = {}
    for flat, coord in enumerate(product(*(range(n) for n in layout.mesh))):
        box = local_box(shape, layout, coord)
        if all(box):
            found.setdefault(box, []).append(ranks[flat])
    out = []
    for box, holders in found.items():
        out.append(Shard(box, tuple(sorted(holders)), prod(box_shape(box)) * itemsize))
    return out


def assign_writers(leaves: Sequence[Sequence[Shard]], world: int) -> list[list[int]]:
    """Which rank writes each shard of each leaf: its only holder, or, among replicas, the one
    with the fewest bytes to write so far (ties: the lowest rank), so that every rank computes
    the same answer and the work spreads. Leaves are taken in the given order, shards with a
    single holder first.

    Example:
        >>> s = Shard(((((0, 4),),)), (0, 1), 16)
        >>> assign_writers([[s], [s], [s]], 2)
        [[0], [1], [0]]
    """
    load = [0] * world
    out: list[list[int]] = [[-1] * len(leaf) for leaf in leaves]
    for i, leaf in enumerate(leaves):
        for j, shard in enumerate(leaf):
            if len(shard.holders) == 1:
                out[i][j] = shard.holders[0]
                load[shard.holders[0]] += shard.nbytes
    for i, leaf in enumerate(leaves):
        for j, shard in enumerate(leaf):
            if len(shard.holders) > 1:
                rank = min(shard.holders, key=lambda r: (load[r], r))
                out[i][j] = rank
                load[rank] += shard.nbytes
    return out
