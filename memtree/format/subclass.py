"""Tensor subclasses and DTensor layouts on disk (format version 3): the schema, pure.

**A subclass leaf** (a torchao quantized weight, a low-bit optimizer state, a user's class with
``__tensor_flatten__``) is a *group*: an entry of kind ``"subclass"`` in its level, with the
class's registered name, the outer dtype, shape and stride, and its flatten context as tagged
JSON (:func:`check_context`); and a sub-directory, like a sub-tree's, whose ``meta.json`` lists
one ordinary tensor leaf per inner tensor (or a nested group), keyed by attribute name
(:func:`check_group`). :class:`SubclassMeta` is a :class:`~memtree.format.entries.ChildMeta`, so
every walker of a tree (verify, the tree hash, uploads, ``du``) reaches the inner files as it
reaches a sub-tree's. Which names may be rebuilt is the tree layer's registry
(:mod:`memtree.format.subclass_registry`); this module only checks the shape of the JSON.

**A DTensor leaf** is an ordinary tensor leaf holding the full logical tensor, with an optional
``"dtensor"`` annotation (:class:`DTensorLayout`): the device mesh's shape (and dim names) and
one placement per mesh dim, so that a load on the same layout can give DTensors back.

Both need format version 3 (:data:`SUBCLASS_VERSION`): a level holding either is written as
version 3, and a reader refuses them in an older level. ``docs/format.md``, "Version 3".

Example:
    >>> sub = Subclass("torchao.Int8Tensor", "float32", (4, 8), (8, 1), {"kind": "tuple", "items": [1, 8]})
    >>> entry = SubclassMeta("w", "w", sub)
    >>> subclass_fields(entry)["type"], check_context(sub.context, "context")
    ('torchao.Int8Tensor', None)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from .dtypes import DTYPE_ITEMSIZES, QUANTIZED_DTYPE_NAMES, V3_DTYPE_NAMES
from .entries import TREE_TYPE, DTensorLayout, Entry, LeafMeta, LevelMeta, Placement, Subclass, SubclassMeta

__all__ = [
    "SUBCLASS_VERSION",
    "SUBCLASS_KIND",
    "OUTER_DTYPE_NAMES",
    "CONTEXT_KINDS",
    "PLACEMENT_KINDS",
    "Subclass",
    "SubclassMeta",
    "Placement",
    "DTensorLayout",
    "subclass_fields",
    "layout_dict",
    "parse_subclass",
    "parse_layout",
    "check_context",
    "check_group",
    "uses_subclass_fields",
]

#: The format version that introduced subclass groups, DTensor annotations and the dtypes of
#: :data:`~memtree.format.dtypes.V3_DTYPE_NAMES`.
SUBCLASS_VERSION = 3
#: The ``kind`` of a subclass entry.
SUBCLASS_KIND = "subclass"
#: Dtype names a subclass's outer tensor may have: the leaf dtypes and torch's quantized ones.
OUTER_DTYPE_NAMES: frozenset[str] = frozenset(DTYPE_ITEMSIZES) | frozenset(QUANTIZED_DTYPE_NAMES)
#: The tagged JSON objects of a context (``{"kind": ..., ...}``) and their other fields.
CONTEXT_KINDS: dict[str, frozenset[str]] = {
    "tuple": frozenset({"items"}),
    "dict": frozenset({"items"}),
    "dtype": frozenset({"name"}),
    "size": frozenset({"dims"}),
    "device": frozenset({"name"}),
    "float": frozenset({"value"}),
    "enum": frozenset({"type", "name"}),
    "object": frozenset({"type", "fields"}),
}
#: Placements a DTensor annotation records, and the fields each has besides ``kind``.
PLACEMENT_KINDS: dict[str, frozenset[str]] = {
    "replicate": frozenset(),
    "shard": frozenset({"dim"}),
    "strided_shard": frozenset({"dim", "split_factor"}),
}
#: Longest list of mesh dims an annotation may hold (torch meshes have a handful).
MAX_MESH_DIMS = 16

_TYPE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z][A-Za-z0-9_]*)*")
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(?::[0-9]{1,6})?")
_NON_FINITE = ("nan", "inf", "-inf")

Fail = Callable[[str, str], Exception]
"""How a parser reports a problem: ``fail(pointer, problem)`` returns the exception to raise."""


# ---------------------------------------------------------------------------------------------
# dumping


def subclass_fields(e: SubclassMeta) -> dict[str, Any]:
    """The ``meta.json`` fields of a subclass entry (``int_key`` aside)."""
    s = e.subclass
    return {
        "key": e.key,
        "kind": SUBCLASS_KIND,
        "dir": e.dir,
        "type": s.type,
        "dtype": s.dtype_name,
        "shape": list(s.shape),
        "stride": list(s.stride),
        "context": s.context,
    }


def layout_dict(layout: DTensorLayout) -> dict[str, Any]:
    """The ``"dtensor"`` annotation of a tensor entry."""
    out: dict[str, Any] = {"mesh": list(layout.mesh), "placements": [_placement_dict(p) for p in layout.placements]}
    if layout.dim_names is not None:
        out["dim_names"] = list(layout.dim_names)
    return out


def _placement_dict(p: Placement) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": p.kind}
    if p.dim is not None:
        out["dim"] = p.dim
    if p.split_factor is not None:
        out["split_factor"] = p.split_factor
    return out


def uses_subclass_fields(entries: Iterable[Entry]) -> bool:
    """Whether a level's ``entries`` hold a subclass entry, a DTensor annotation or a dtype of
    version 3, which need :data:`SUBCLASS_VERSION` (the rule of
    :func:`memtree.format.schema.level_version`).

    Example:
        >>> uses_subclass_fields([LeafMeta("x", "x.memmap", "int4", (2,))])
        True
    """
    return any(
        isinstance(e, SubclassMeta)
        or (isinstance(e, LeafMeta) and (e.layout is not None or e.dtype_name in V3_DTYPE_NAMES))
        for e in entries
    )


# ---------------------------------------------------------------------------------------------
# parsing

_SUBCLASS_FIELDS = frozenset({"key", "kind", "dir", "type", "dtype", "shape", "stride", "context"})
_LAYOUT_FIELDS = frozenset({"mesh", "placements"})


def parse_subclass(
    raw: dict[str, Any], p: str, fail: Fail, key: str, name: str, shape: tuple[int, ...], stride: tuple[int, ...]
) -> SubclassMeta:
    """A subclass entry whose common fields the caller checked (``key``, ``dir`` as ``name``,
    ``shape``, ``stride``: lists of ints); checks ``type``, ``dtype``, ``stride`` and ``context``.

    Raises:
        Exception: what ``fail(pointer, problem)`` returns, for the first problem found.
    """
    if set(raw) != _SUBCLASS_FIELDS:
        missing, extra = _SUBCLASS_FIELDS - set(raw), set(raw) - _SUBCLASS_FIELDS
        raise fail(p, f"lacks field(s) {sorted(missing)}" if missing else f"has unknown field(s) {sorted(extra)}")
    kind = raw["type"]
    if type(kind) is not str or len(kind) > 200 or not _TYPE_NAME.fullmatch(kind):
        raise fail(f"{p}.type", f"must be a registered class name (dotted words), got {kind!r:.80}")
    dtype = raw["dtype"]
    if type(dtype) is not str or dtype not in OUTER_DTYPE_NAMES:
        raise fail(f"{p}.dtype", f"names no dtype memtree knows: {dtype!r:.40}")
    if len(stride) != len(shape):
        raise fail(f"{p}.stride", f"has {len(stride)} dims, the shape {len(shape)}")
    problem = check_context(raw["context"], f"{p}.context")
    if problem is not None:
        raise fail(*problem)
    return SubclassMeta(key, name, Subclass(kind, dtype, shape, stride, raw["context"]))


def parse_layout(raw: Any, p: str, fail: Fail, shape: tuple[int, ...]) -> DTensorLayout:
    """A tensor entry's ``"dtensor"`` annotation (for a leaf of ``shape``).

    Raises:
        Exception: what ``fail(pointer, problem)`` returns, for the first problem found.
    """
    if type(raw) is not dict or not _LAYOUT_FIELDS <= raw.keys() <= _LAYOUT_FIELDS | {"dim_names"}:
        raise fail(p, f"must be an object with mesh, placements and optional dim_names, got {raw!r:.80}")
    mesh, placements = raw["mesh"], raw["placements"]
    if type(mesh) is not list or not 0 < len(mesh) <= MAX_MESH_DIMS or not all(
        type(n) is int and 0 < n < 2**31 for n in mesh
    ):
        raise fail(f"{p}.mesh", f"must be 1 to {MAX_MESH_DIMS} positive ints (the mesh's shape), got {mesh!r:.80}")
    if type(placements) is not list or len(placements) != len(mesh):
        raise fail(f"{p}.placements", f"must list one placement per mesh dim ({len(mesh)}), got {placements!r:.80}")
    parsed = tuple(_parse_placement(x, f"{p}.placements[{i}]", fail, len(shape)) for i, x in enumerate(placements))
    names = raw.get("dim_names")
    if "dim_names" in raw and (
        type(names) is not list
        or len(names) != len(mesh)
        or not all(type(n) is str and n.isidentifier() and len(n) <= 64 for n in names)
        or len(set(names)) != len(names)
    ):
        raise fail(f"{p}.dim_names", f"must be {len(mesh)} distinct identifiers, got {names!r:.80}")
    return DTensorLayout(tuple(mesh), parsed, tuple(names) if names is not None else None)


def _parse_placement(raw: Any, p: str, fail: Fail, ndim: int) -> Placement:
    kind = raw.get("kind") if type(raw) is dict else None
    fields = PLACEMENT_KINDS.get(kind) if type(kind) is str else None
    if fields is None or set(raw) != fields | {"kind"}:
        raise fail(p, f"must be a placement ({', '.join(PLACEMENT_KINDS)} with its fields), got {raw!r:.80}")
    dim, factor = raw.get("dim"), raw.get("split_factor")
    if "dim" in raw and (type(dim) is not int or not 0 <= dim < ndim):
        raise fail(f"{p}.dim", f"must be a dim of the tensor (0 to {ndim - 1}), got {dim!r:.40}")
    if "split_factor" in raw and (type(factor) is not int or not 0 < factor < 2**31):
        raise fail(f"{p}.split_factor", f"must be a positive int, got {factor!r:.40}")
    return Placement(str(kind), dim, factor)


def check_context(value: Any, pointer: str) -> tuple[str, str] | None:
    """The first problem of a flatten context's tagged JSON, as ``(pointer, problem)``; ``None``
    when it follows the grammar (``docs/format.md``, "Tensor subclasses").

    Plain JSON scalars and arrays are themselves (an array is a Python ``list``); every JSON
    object is a tagged node, ``{"kind": K, ...}`` with exactly the fields of :data:`CONTEXT_KINDS`:
    ``tuple`` (``items``: an array), ``dict`` (``items``: an object of str keys), ``dtype``
    (``name``), ``size`` (``dims``: ints), ``device`` (``name``: ``"cpu"``, ``"cuda:0"``),
    ``float`` (``value``: ``"nan"``, ``"inf"`` or ``"-inf"``), ``enum`` (``type``, ``name``)
    and ``object`` (``type``, ``fields``: an object of identifier keys), whose ``type`` is a
    registered name. Walked without recursion.

    Example:
        >>> check_context({"kind": "dtype", "name": "float32"}, "context")
        >>> check_context({"kind": "eval", "code": "1"}, "context")[1]
        "must be a tagged node (kind: tuple, dict, dtype, size, device, float, enum, object), got {'kind': 'eval', 'code': '1'}"
    """
    todo = [(value, pointer)]
    while todo:
        v, p = todo.pop()
        t = type(v)
        if v is None or t in (bool, int, float, str):
            continue
        if t is list:
            todo.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
            continue
        kind = v.get("kind") if t is dict else None
        fields = CONTEXT_KINDS.get(kind) if type(kind) is str else None
        if fields is None or set(v) != fields | {"kind"}:
            return p, f"must be a tagged node (kind: {', '.join(CONTEXT_KINDS)}), got {v!r:.80}"
        problem = _node_problem(str(kind), v)
        if problem is not None:
            return p, problem
        if kind == "tuple":
            todo.extend((x, f"{p}.items[{i}]") for i, x in enumerate(v["items"]))
        elif kind in ("dict", "object"):
            items = v["items"] if kind == "dict" else v["fields"]
            todo.extend((x, f"{p}.{k}") for k, x in items.items())
    return None


def _node_problem(kind: str, v: dict[str, Any]) -> str | None:
    """What is wrong with the fields of one tagged node (``None``: nothing)."""
    if kind == "tuple":
        return None if type(v["items"]) is list else "items must be an array"
    if kind == "dict":
        return None if type(v["items"]) is dict else "items must be an object"
    if kind == "dtype":
        name = v["name"]
        return None if type(name) is str and name in OUTER_DTYPE_NAMES else f"names no dtype: {name!r:.40}"
    if kind == "size":
        dims = v["dims"]
        ok = type(dims) is list and len(dims) <= 64 and all(type(d) is int and 0 <= d < 2**63 for d in dims)
        return None if ok else f"dims must be at most 64 ints >= 0, got {dims!r:.60}"
    if kind == "device":
        name = v["name"]
        return None if type(name) is str and _DEVICE.fullmatch(name) else f"names no device: {name!r:.40}"
    if kind == "float":
        return None if v["value"] in _NON_FINITE else f"value must be one of {_NON_FINITE}, got {v['value']!r:.20}"
    name = v["type"]
    if type(name) is not str or len(name) > 200 or not _TYPE_NAME.fullmatch(name):
        return f"type must be a registered class name (dotted words), got {name!r:.80}"
    if kind == "enum":
        member = v["name"]
        return None if type(member) is str and member.isidentifier() else f"name must be an identifier, got {member!r:.40}"
    fields = v["fields"]
    if type(fields) is not dict or not all(k.isidentifier() for k in fields):
        return f"fields must be an object of identifier keys, got {fields!r:.60}"
    return None


def check_group(entry: SubclassMeta, meta: LevelMeta, where: str) -> str | None:
    """The first problem of a subclass group's own ``meta.json`` (at ``where``), or ``None``.

    A group's level has batch size ``[]`` and type ``"TensorTree"`` and holds only its inner
    tensors: tensor leaves (not growable) and nested groups, keyed by attribute names (Python
    identifiers), at least one; the outer ``shape`` of ``entry`` is checked by the parent.

    Example:
        >>> sub = Subclass("torchao.Int8Tensor", "float32", (4,), (1,), None)
        >>> check_group(SubclassMeta("w", "w", sub), LevelMeta((), ()), "w/meta.json")
        'w/meta.json: a subclass group lists no inner tensor'
    """
    if meta.batch_size or meta.type != TREE_TYPE:
        return f"{where}: a subclass group has batch_size [] and type {TREE_TYPE!r}, got {list(meta.batch_size)} and {meta.type!r}"
    if not meta.entries:
        return f"{where}: a subclass group lists no inner tensor"
    for e in meta.entries:
        if not e.key.isidentifier() or e.int_key:
            return f"{where}: inner tensor name {e.key!r:.60} of a subclass group is not an attribute name"
        if isinstance(e, SubclassMeta):
            continue
        if not isinstance(e, LeafMeta) or e.capacity is not None:
            return f"{where}: entry {e.key!r} of a subclass group is not an inner tensor (a tensor leaf or a group)"
    return None
