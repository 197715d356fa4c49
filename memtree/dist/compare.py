"""What each rank says about the tree it writes, and the first difference between two ranks.

Every rank of a collective write plans the same tree. :func:`tree_summary` lists, in the
tree's order, every key path with what it holds (a level's batch size and type; a tensor's
dtype, global shape, placement and mesh ranks, and for a plain tensor the CRC-32 of its bytes,
which every rank must hold equal since one rank writes it; a value as JSON; a pickle's CRC),
and the options of the write. The ranks compare a digest of it; when the digests differ,
:func:`first_difference` names the first key where the ranks' summaries differ. Pure: no I/O.

Example:
    >>> a = [[None, {"dest": "/t"}], [["w"], ["tensor", "float32", [2], None, None, 1, False]]]
    >>> b = a + [[["extra"], ["tensor", "float32", [1], None, None, 7, False]]]
    >>> first_difference([a, b])
    "'extra' is in the tree of rank 1 only"
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from ..format.level import fmt_key
from .placement import from_annotation
from ..format.schema import ChildMeta, JsonMeta, LeafMeta, LevelMeta, PickleMeta

__all__ = ["tree_summary", "summary_digest", "first_difference"]


def tree_summary(
    levels: Mapping[str, LevelMeta],
    tensors: Mapping[str, tuple[Any, int | None]],
    pickles: Mapping[str, int],
    options: Mapping[str, Any],
) -> list[list[Any]]:
    """The summary of a planned write: ``[key path, description]`` items, root first.

    Args:
        levels: each level's planned metadata (placements set), by directory relative to the root.
        tensors: by leaf file (relative to the root): the mesh's global ranks (``None`` for a
            plain tensor) and the CRC-32 of a plain tensor's bytes (``None`` for a ``DTensor``).
        pickles: the CRC-32 of each pickle file's bytes, by file.
        options: the write's options (and destination): the ranks must pass the same.
    """
    out: list[list[Any]] = [[None, dict(options)]]
    todo: list[tuple[str, tuple[str, ...]]] = [("", ())]
    while todo:
        rel, keys = todo.pop(0)
        meta = levels[rel]
        out.append([list(keys), ["level", list(meta.batch_size), meta.type]])
        for e in meta.entries:
            path = list(keys) + [e.key]
            file = f"{rel}/{getattr(e, 'file', '')}" if rel else getattr(e, "file", "")
            if isinstance(e, LeafMeta):
                ranks, crc = tensors[file]
                layout = from_annotation(e.layout) if e.layout is not None else None
                placement = None if layout is None else [list(layout.mesh), list(layout.placements),
                                                     None if layout.dim_names is None else list(layout.dim_names)]
                out.append([path, ["tensor", e.dtype_name, list(e.shape), placement, ranks, crc, e.int_key]])
            elif isinstance(e, ChildMeta):
                todo.append((f"{rel}/{e.dir}" if rel else e.dir, keys + (e.key,)))
            elif isinstance(e, JsonMeta):
                out.append([path, ["value", e.value, e.tuples, e.int_key]])
            elif isinstance(e, PickleMeta):
                out.append([path, ["pickle", pickles[file], e.int_key]])
    return out


def summary_digest(summary: list[list[Any]]) -> str:
    """A digest of a summary (what the ranks compare first)."""
    return hashlib.sha256(orjson.dumps(summary)).hexdigest()


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def _describe(item: list[Any]) -> str:
    kind = item[0]
    if kind == "level":
        return f"a level of batch size {item[1]} (type {item[2]!r})"
    if kind == "tensor":
        _, dtype, shape, placement, ranks, _, _ = item
        if placement is None:
            return f"a tensor of {dtype} {shape}"
        return (f"a DTensor of {dtype} {shape} placed {placement[1]} on a mesh of shape "
                f"{placement[0]} over ranks {ranks}")
    if kind == "value":
        return f"the value {orjson.dumps(item[1]).decode()[:80]}"
    return "a pickled value"


def first_difference(summaries: Sequence[list[list[Any]]]) -> str:
    """What differs first between the ranks' summaries (in rank 0's order, then the keys only
    other ranks have), as a sentence.

    Example:
        >>> row = lambda crc: [["p"], ["tensor", "float32", [3], None, None, crc, False]]
        >>> first_difference([[row(1)], [row(2)]])
        "the plain tensor 'p' holds different values on rank 0 and rank 1 (one rank writes a plain tensor: every rank must hold the same values; make it a DTensor, or broadcast it)"
    """
    tables = [{orjson.dumps(k): (k, d) for k, d in s} for s in summaries]
    order: dict[bytes, Any] = {}
    for table in tables:
        for key, (path, _) in table.items():
            order.setdefault(key, path)
    for key, path in order.items():
        holders = [r for r, table in enumerate(tables) if key in table]
        if path is None:  # the options of the write
            values = {orjson.dumps(tables[r][key][1]) for r in holders}
            if len(values) > 1:
                calls = "; ".join(f"rank {r}: {tables[r][key][1]}" for r in holders)
                return f"the ranks call the write with different options or destinations ({calls})"
            continue
        name = fmt_key(tuple(path)) if path else "the root"
        if len(holders) < len(tables):
            return f"{name} is in the tree of {_ranks(holders)} only"
        items = [tables[r][key][1] for r in holders]
        first = items[0]
        for r, item in enumerate(items):
            if item == first:
                continue
            if item[0] == first[0] == "tensor" and item[:5] == first[:5]:
                return (
                    f"the plain tensor {name} holds different values on rank 0 and rank {r} (one rank "
                    "writes a plain tensor: every rank must hold the same values; make it a DTensor, "
                    "or broadcast it)"
                )
            return f"{name} is {_describe(first)} on rank 0 and {_describe(item)} on rank {r}"
    return "the ranks' trees hold the same keys in different orders: build the tree in the same order on every rank"
