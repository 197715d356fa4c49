"""torchao's safetensors convention for tensor subclasses, read and written without torchao's code.

torchao (``torchao.prototype.safetensors``: ``flatten_tensor_state_dict`` and
``unflatten_tensor_state_dict``, what ``transformers`` and vLLM load) stores a subclass at the
dotted name ``"<module>.<attr>"`` as one tensor per inner tensor, named
``"<module>._<attr>_<inner>"``, and the ``__metadata__`` entry ``"<module>.<attr>"``: the JSON
``{"_type": "Int8Tensor", "_data": {attribute: value}, "_tensor_data_names": [inner, ...]}``,
whose values encode dtypes as ``{"_type": "torch.dtype", "_data": "float32"}``, enums as
``{"_type": class, "_data": member}`` and dataclasses and named tuples as
``{"_type": class, "_data": {field: value}}``; every tensor's name is listed in the JSON list
``"tensor_names"``, a plain tensor's metadata being ``{"_type": "Tensor"}``.

Here that JSON is translated to and from memtree's tagged JSON of a group's context
(:func:`memtree.format.subclass.check_context`), a class name ``X`` being memtree's built-in
``torchao.X``: a memtree tree converts to a file torchao loads, and such a file converts to a
memtree tree whose groups rebuild as the same classes. Only the classes torchao's convention
allows (:data:`TORCHAO_TYPES`) are written; any other subclass is refused, never written as
loose tensors.

Example:
    >>> ctx = {"kind": "dict", "items": {"dtype": {"kind": "dtype", "name": "float32"}, "block_size": [1, 64]}}
    >>> data = context_to_torchao(ctx, "w")
    >>> data, context_from_torchao(data, "w") == ctx
    ({'dtype': {'_type': 'torch.dtype', '_data': 'float32'}, 'block_size': [1, 64]}, True)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import CheckpointFormatError, SubclassError
from ..format.level import Level
from ..format.subclass_registry import BUILTIN, describe

__all__ = [
    "TORCHAO_TYPES",
    "is_torchao_metadata",
    "context_to_torchao",
    "context_from_torchao",
    "flatten_groups",
    "group_torchao_tensors",
]

#: The tensor classes torchao's safetensors convention allows (its ``ALLOWED_TENSORS_SUBCLASSES``).
TORCHAO_TYPES = frozenset(
    {"Float8Tensor", "Int4Tensor", "Int4TilePackedTo4dTensor", "IntxUnpackedToInt8Tensor", "Int8Tensor",
     "Int4PlainInt32Tensor", "MXTensor", "NVFP4Tensor"}
)
_PREFIX = "torchao."
_TENSOR = "Tensor"  # torchao's _type of a plain tensor
_NAMES = "tensor_names"


def is_torchao_metadata(metadata: Mapping[str, str] | None) -> bool:
    """True if a safetensors ``__metadata__`` follows torchao's convention (``"tensor_names"``
    lists names whose metadata is JSON with a ``_type``), as torchao's own check decides.

    Example:
        >>> is_torchao_metadata({"tensor_names": '["w"]', "w": '{"_type": "Tensor"}'}), is_torchao_metadata({"format": "pt"})
        (True, False)
    """
    if not metadata or _NAMES not in metadata:
        return False
    try:
        names = json.loads(metadata[_NAMES])
        return type(names) is list and bool(names) and all(
            type(n) is str and type(json.loads(metadata.get(n, "null"))) is dict for n in names
        )
    except ValueError:
        return False


def context_to_torchao(value: Any, where: str) -> Any:
    """A group's context (tagged JSON) as torchao writes its ``_data`` (tuples become lists,
    as torchao's own encoder makes them).

    Raises:
        SubclassError: a value torchao's JSON does not hold (a device, NaN, a class that is
            not torchao's).
    """
    if type(value) is list:
        return [context_to_torchao(x, where) for x in value]
    if type(value) is not dict:
        return value
    kind = value["kind"]
    if kind in ("tuple",):
        return [context_to_torchao(x, where) for x in value["items"]]
    if kind == "size":
        return list(value["dims"])
    if kind == "dict":
        return {k: context_to_torchao(x, where) for k, x in value["items"].items()}
    if kind == "dtype":
        return {"_type": "torch.dtype", "_data": value["name"]}
    if kind in ("enum", "object") and value["type"].startswith(_PREFIX):
        short = value["type"][len(_PREFIX):]
        if kind == "enum":
            return {"_type": short, "_data": value["name"]}
        return {"_type": short, "_data": {k: context_to_torchao(x, where) for k, x in value["fields"].items()}}
    raise SubclassError(
        f"{where}: its context holds {value!r:.80}, which torchao's safetensors metadata cannot hold; "
        "keep a memtree directory"
    )


def context_from_torchao(value: Any, where: str) -> Any:
    """torchao's ``_data`` JSON as a group's context (tagged JSON): the inverse of
    :func:`context_to_torchao`, a class ``X`` becoming memtree's built-in ``torchao.X``.

    Raises:
        CheckpointFormatError: a class name memtree does not know as torchao's, or a malformed value.
    """
    if type(value) is list:
        return [context_from_torchao(x, where) for x in value]
    if type(value) is not dict:
        return value
    if set(value) != {"_type", "_data"}:
        return {"kind": "dict", "items": {str(k): context_from_torchao(x, where) for k, x in value.items()}}
    kind, data = value["_type"], value["_data"]
    if kind == "torch.dtype" and type(data) is str:
        return {"kind": "dtype", "name": data}
    if type(kind) is not str or _PREFIX + kind not in BUILTIN:
        raise CheckpointFormatError(
            f"{where}: torchao metadata names the class {kind!r:.60}, which memtree does not know as "
            f"torchao's (known: {', '.join(sorted(n[len(_PREFIX):] for n in BUILTIN if n.startswith(_PREFIX)))})"
        )
    if type(data) is str:
        return {"kind": "enum", "type": _PREFIX + kind, "name": data}
    if type(data) is dict:
        return {"kind": "object", "type": _PREFIX + kind,
                "fields": {str(k): context_from_torchao(x, where) for k, x in data.items()}}
    raise CheckpointFormatError(f"{where}: torchao metadata of class {kind!r} holds {data!r:.60}")


def flatten_groups(
    level: Level, join: Callable[[tuple[str, ...]], str], dropped: list[tuple[str, ...]]
) -> tuple[list[tuple[str, Any]], dict[str, str] | None]:
    """``level``'s tensors as safetensors names (``join`` makes a name of a key path), and the
    metadata of torchao's convention when it holds groups (``None`` when it holds none: the file
    is then an ordinary one). The key paths of non-tensor values are added to ``dropped``.

    Raises:
        SubclassError: a group of a class torchao's convention does not allow, or at the top
            level (torchao names inner tensors after a module: ``"<module>._<attr>_<inner>"``).
    """
    tensors: list[tuple[str, Any]] = []
    described: dict[str, str] = {}
    grouped = False

    def walk(lvl: Level, path: tuple[str, ...]) -> None:
        nonlocal grouped
        for key, value in lvl.entries.items():
            at = path + (key,)
            if isinstance(value, Level) and value.subclass is not None:
                grouped = True
                name = join(at)
                _group(value, at, name, tensors, described)
            elif isinstance(value, Level):
                walk(value, at)
            elif isinstance(value, torch.Tensor):
                name = join(at)
                tensors.append((name, value))
                described[name] = json.dumps({"_type": _TENSOR})
            else:
                dropped.append(at)

    walk(level, ())
    if not grouped:
        return tensors, None
    return tensors, {**described, _NAMES: json.dumps(list(described))}


def _group(group: Level, path: tuple[str, ...], name: str, tensors: list[tuple[str, Any]], described: dict[str, str]) -> None:
    sub = group.subclass
    assert sub is not None
    short = sub.type[len(_PREFIX):] if sub.type.startswith(_PREFIX) else None
    if short not in TORCHAO_TYPES:
        raise SubclassError(
            f"{name!r} is a {sub.type}, which torchao's safetensors convention cannot hold (it holds "
            f"{', '.join(sorted(TORCHAO_TYPES))}); keep a memtree directory"
        )
    module, dot, attr = name.rpartition(".")
    if not dot:
        raise SubclassError(
            f"{name!r} is a {sub.type} at the top level; torchao's convention names its inner tensors "
            "after its module ('<module>._<attr>_<inner>'): nest it under a module's key"
        )
    inner = list(group.entries)
    if not all(isinstance(group.entries[k], torch.Tensor) for k in inner):
        raise SubclassError(f"{name!r}: a {sub.type} whose inner tensors are subclasses has no torchao form")
    data = context_to_torchao(sub.context, name)
    if type(data) is not dict:
        raise SubclassError(f"{name!r}: a {sub.type} whose context is not a dict has no torchao form")
    for k in inner:
        tensors.append((f"{module}._{attr}_{k}", group.entries[k]))
    described[name] = json.dumps({"_type": short, "_data": data, "_tensor_data_names": inner})


def group_torchao_tensors(
    metadata: Mapping[str, str], spec: Callable[[str], tuple[torch.Size, torch.dtype] | None]
) -> dict[str, tuple[dict[str, str], Level]]:
    """The groups a torchao file holds: for each subclass name, ``({inner: its tensor's key},
    a Level with ``subclass`` set and no entries yet)``; the caller puts the inner leaves in.
    ``spec(key)`` is a tensor's shape and dtype, ``None`` if the file has no such tensor.

    Rebuilding each class on the meta device (no data read) gives the outer dtype, shape and
    stride its group records; torchao must be installed.

    Raises:
        CheckpointFormatError: malformed torchao metadata, or a listed inner tensor missing.
        SubclassError: a class this process cannot rebuild (torchao missing or too old).
    """
    out: dict[str, tuple[dict[str, str], Level]] = {}
    for name in json.loads(metadata[_NAMES]):
        doc = json.loads(metadata[name])
        kind = doc.get("_type")
        if kind == _TENSOR:
            continue
        if kind not in TORCHAO_TYPES or type(doc.get("_data")) is not dict or type(doc.get("_tensor_data_names")) is not list:
            raise CheckpointFormatError(f"{name!r}: torchao metadata {str(doc)[:120]} is not one memtree reads")
        module, dot, attr = name.rpartition(".")
        keys = {str(k): f"{module}._{attr}_{k}" for k in doc["_tensor_data_names"]}
        meta = {}
        for inner, key in keys.items():
            found = spec(key)
            if found is None or not inner.isidentifier():
                raise CheckpointFormatError(f"{name!r}: torchao metadata lists the inner tensor {key!r}, which the file lacks")
            meta[inner] = torch.empty(found[0], dtype=found[1], device="meta")
        context = context_from_torchao(doc["_data"], name)
        out[name] = (keys, Level((), {}, subclass=describe(_PREFIX + kind, meta, context, name)))
    return out
