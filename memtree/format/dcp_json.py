"""``dcp.json``: DCP's metadata as JSON, next to the root ``meta.json`` of a DCP checkpoint.

The schema (``docs/format.md``, "Distributed checkpoints"): ``format`` ``"memtree-dcp"``,
``version`` 1, DCP's own version string, and for each fully qualified name its kind
(``"tensor"`` with dtype, global size and the chunks ranks saved, or ``"bytes"`` for a JSON
value) and its key path in the tree. Pure: no I/O; :mod:`memtree.dcp` reads and writes the file.

Example:
    >>> import torch
    >>> from torch.distributed.checkpoint.metadata import Metadata, BytesStorageMetadata
    >>> data = dump_dcp(Metadata({"step": BytesStorageMetadata()}), {"step": ("step",)})
    >>> meta, paths = parse_dcp(data, "dcp.json")
    >>> paths
    {'step': ('step',)}
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import orjson
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import MetaFormatError
from .dtypes import dtype_from_name, dtype_name

__all__ = ["DCP_NAME", "DCP_FORMAT", "DCP_VERSION", "MAX_DCP_BYTES", "dump_dcp", "parse_dcp"]

#: The JSON file next to the root ``meta.json`` that holds DCP's metadata.
DCP_NAME = "dcp.json"
#: ``format`` and ``version`` of a ``dcp.json``.
DCP_FORMAT = "memtree-dcp"
DCP_VERSION = 1
#: The largest ``dcp.json`` a reader accepts.
MAX_DCP_BYTES = 256 * 1024 * 1024


def dump_dcp(metadata: Metadata, paths: Mapping[str, tuple[str, ...]]) -> bytes:
    """``dcp.json`` for DCP's ``metadata``; ``paths`` maps each FQN to its key path in the tree."""
    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = list(paths.get(fqn, (fqn,)))
        if isinstance(md, TensorStorageMetadata):
            items[fqn] = {
                "kind": "tensor",
                "path": path,
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
            }
        else:
            items[fqn] = {"kind": "bytes", "path": path}
    planner_data = metadata.planner_data
    mappings = (
        {k: list(v) for k, v in planner_data.items()}
        if isinstance(planner_data, dict) and all(isinstance(v, tuple) for v in planner_data.values())
        else None
    )
    sm = metadata.storage_meta
    return orjson.dumps({
        "format": DCP_FORMAT,
        "version": DCP_VERSION,
        "dcp_version": metadata.version,
        "items": items,
        "mappings": mappings,
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
    })


class _Json:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, pointer: str, problem: str) -> MetaFormatError:
        return MetaFormatError(f"{self.where}: {pointer} {problem}; the checkpoint is damaged or not memtree's")

    def obj(self, v: Any, p: str, required: set[str], optional: AbstractSet[str] = frozenset()) -> dict[str, Any]:
        if type(v) is not dict:
            raise self.fail(p, "must be a JSON object")
        if required - v.keys() or v.keys() - required - optional:
            raise self.fail(p, f"must have the fields {sorted(required)} (optional {sorted(optional)})")
        return v

    def ints(self, v: Any, p: str) -> tuple[int, ...]:
        if type(v) is not list or len(v) > 64 or not all(type(x) is int and x >= 0 for x in v):
            raise self.fail(p, "must be a list of at most 64 ints >= 0")
        return tuple(v)

    def strs(self, v: Any, p: str, *, ints_ok: bool = False) -> list[Any]:
        ok = (str, int) if ints_ok else (str,)
        if type(v) is not list or not v or not all(type(x) in ok for x in v):
            raise self.fail(p, "must be a non-empty list of strings")
        return v


def parse_dcp(data: bytes, where: str) -> tuple[Metadata, dict[str, tuple[str, ...]]]:
    """DCP's ``Metadata`` and each FQN's key path, from ``dcp.json`` bytes, every field checked.

    Raises:
        MetaFormatError: malformed JSON, another format or version, or a field out of place.
    """
    c = _Json(where)
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raise c.fail("content", f"is not valid UTF-8 JSON ({err})") from None
    doc = c.obj(doc, "top level", {"format", "version", "dcp_version", "items", "mappings", "storage_meta"})
    if doc["format"] != DCP_FORMAT or doc["version"] != DCP_VERSION:
        raise c.fail("format/version", f"must be {DCP_FORMAT!r} version {DCP_VERSION}")
    if type(doc["items"]) is not dict:
        raise c.fail("items", "must be a JSON object")
    state: dict[str, Any] = {}
    paths: dict[str, tuple[str, ...]] = {}
    for fqn, raw in doc["items"].items():
        p = f"items[{fqn!r}]"
        kind = raw.get("kind") if type(raw) is dict else None
        if kind == "tensor":
            raw = c.obj(raw, p, {"kind", "path", "dtype", "size", "chunks"})
            dtype = dtype_from_name(raw["dtype"]) if type(raw["dtype"]) is str else None
            if dtype is None:
                raise c.fail(f"{p}.dtype", f"names no dtype memtree can read: {raw['dtype']!r:.40}")
            size = c.ints(raw["size"], f"{p}.size")
            if type(raw["chunks"]) is not list:
                raise c.fail(f"{p}.chunks", "must be a list")
            chunks = []
            for i, ch in enumerate(raw["chunks"]):
                ch = c.obj(ch, f"{p}.chunks[{i}]", {"offsets", "sizes"})
                off, sz = c.ints(ch["offsets"], f"{p}.chunks[{i}].offsets"), c.ints(ch["sizes"], f"{p}.chunks[{i}].sizes")
                if len(off) != len(size) or len(sz) != len(size) or any(o + s > n for o, s, n in zip(off, sz, size)):
                    raise c.fail(f"{p}.chunks[{i}]", f"does not fit in the tensor's size {list(size)}")
                chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sz)))
            state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), chunks)
        elif kind == "bytes":
            raw = c.obj(raw, p, {"kind", "path"})
            state[fqn] = BytesStorageMetadata()
        else:
            raise c.fail(f"{p}.kind", "must be 'tensor' or 'bytes'")
        paths[fqn] = tuple(c.strs(raw["path"], f"{p}.path"))
    mappings = doc["mappings"]
    planner_data = None
    if mappings is not None:
        if type(mappings) is not dict:
            raise c.fail("mappings", "must be a JSON object or null")
        planner_data = {k: tuple(c.strs(v, f"mappings[{k!r}]", ints_ok=True)) for k, v in mappings.items()}
    sm_raw = doc["storage_meta"]
    storage_meta = None
    if sm_raw is not None:
        sm_raw = c.obj(sm_raw, "storage_meta", {"checkpoint_id", "save_id", "modules"})
        if not all(type(sm_raw[k]) in (str, type(None)) for k in ("checkpoint_id", "save_id")):
            raise c.fail("storage_meta", "checkpoint_id and save_id must be strings or null")
        if type(sm_raw["modules"]) is not list or not all(type(m) is str for m in sm_raw["modules"]):
            raise c.fail("storage_meta.modules", "must be a list of strings")
        storage_meta = StorageMeta(sm_raw["checkpoint_id"], sm_raw["save_id"], None, sm_raw["modules"])
    version = doc["dcp_version"] if type(doc["dcp_version"]) is str else None
    return Metadata(state, planner_data, None, storage_meta, version), paths
