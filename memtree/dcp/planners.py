"""DCP planners that keep non-tensor values as JSON bytes, never pickles, and tensor subclasses
as their inner tensors.

A tensor subclass (a torchao quantized weight: DCP's own planner fails on it, lacking
``aten.is_pinned``) is saved as a sub-dict of its inner tensors by attribute name, plus its
record (:data:`SUBCLASS_RECORD`: the class's registered name and its flatten context, as
JSON); a load fills the inner tensors of the target's subclass in place, DCP's own way, and then
refuses a target of another class or context than the record's (:func:`check_subclasses`).

Example:
    >>> from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    >>> isinstance(SavePlanner(), DefaultSavePlanner)  # dcp.save(..., planner=SavePlanner())
    True
"""

from __future__ import annotations

import io
from typing import Any

import orjson
import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ..errors import MetaFormatError, NonTensorValueError, SubclassError
from ..format.schema import TuplePath
from ..format.subclass_registry import is_dtensor, is_plain, to_group
from ..format.values import json_problem, tuples_to_lists

__all__ = ["SUBCLASS_RECORD", "SavePlanner", "LoadPlanner", "object_bytes", "deliver_value", "check_subclasses"]

#: The key, next to a subclass's inner tensors, of its record: the JSON text
#: ``{"type": registered name, "context": tagged JSON}`` (one non-tensor value).
SUBCLASS_RECORD = "__memtree_subclass__"


def _record(t: torch.Tensor, path: tuple[str, ...]) -> str:
    sub = to_group(t, path).subclass
    assert sub is not None
    return orjson.dumps({"type": sub.type, "context": sub.context}).decode()


def _flatten_subclasses(obj: Any, path: tuple[str, ...], records: dict[tuple[str, ...], Any]) -> Any:
    """``obj`` (a state dict) with each tensor subclass replaced by a dict of its inner tensors
    (the same tensor objects: a load fills them) and its record; the records by key path."""
    if isinstance(obj, dict):
        return {k: _flatten_subclasses(v, path + (str(k),), records) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten_subclasses(v, path + (str(i),), records) for i, v in enumerate(obj)]
    if isinstance(obj, torch.Tensor) and not is_plain(obj) and not is_dtensor(obj):
        if obj.is_quantized:
            raise SubclassError(f"{'.'.join(path)!r}: DCP cannot hold torch's quantized tensors; dequantize it")
        record = records[path] = _record(obj, path)
        names = obj.__tensor_flatten__()[0]  # type: ignore[attr-defined]
        inner = {n: _flatten_subclasses(getattr(obj, n), path + (n,), records) for n in names}
        return {**inner, SUBCLASS_RECORD: record}
    return obj


def check_subclasses(records: dict[tuple[str, ...], str], loaded: Any) -> None:
    """Refuse a load whose target subclasses differ from what was saved (after the fill: DCP
    fills before memtree can look at the saved records).

    Raises:
        SubclassError: a target subclass of another class or flatten context than saved.
    """
    for path, mine in records.items():
        node = loaded
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        saved = node[SUBCLASS_RECORD]
        if saved != mine:
            raise SubclassError(
                f"{'.'.join(path)!r} was saved as {saved:.300}, and the state to load into holds "
                f"{mine:.300}; its inner tensors were loaded but do not mean the same: load into a "
                "model quantized the same way"
            )


def _json_bytes(value: Any, fqn: str) -> bytes:
    problem = json_problem(value)
    if problem is not None:
        raise NonTensorValueError(
            f"non-tensor value {fqn!r}: {problem}. memtree's DCP storage keeps non-tensor values "
            "as JSON and never pickles: store it as a tensor, or convert it (e.g. a set to a list)"
        )
    return orjson.dumps(value)


def _set_value(planner: Any, read_item: ReadItem, obj: Any) -> None:
    fqn = read_item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], obj)
    else:
        planner.state_dict[fqn] = obj
    user = getattr(planner, "user_state_dict", None)
    if user is not None and planner.flatten_state_dict:  # the caller's dict, not the copy DCP fills
        _set_in_containers(user, planner.mappings[fqn], obj)


def _set_in_containers(root: Any, path: tuple[Any, ...], obj: Any) -> None:
    """``set_element`` into the caller's state where the path runs through its dicts and lists
    only (a subclass's record lives in the flattened copy alone)."""
    node = root
    for part in path[:-1]:
        if not isinstance(node, (dict, list)):
            return
        node = node[part]
    if isinstance(node, (dict, list)):
        node[path[-1]] = obj


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, but non-tensor values become JSON bytes instead of pickles.

    Example:
        >>> planner = SavePlanner()   # dcp.save(state, storage_writer=Writer(d), planner=planner)
    """

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """DCP's setup, of the state dict with each tensor subclass as its inner tensors."""
        super().set_up_planner(_flatten_subclasses(state_dict, (), {}), *args, **kwargs)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        """JSON bytes for a non-tensor value (refused if JSON would change it); tensors as is."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(_json_bytes(object, write_item.index.fqn))
        return object


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values are read as JSON, never unpickled.

    Example:
        >>> planner = LoadPlanner()   # dcp.load(state, storage_reader=Reader(d), planner=planner)
    """

    #: The records of the target's tensor subclasses (by key path), for :func:`check_subclasses`.
    subclass_records: dict[tuple[str, ...], str]
    #: The state dict DCP fills: the target's, each subclass as its inner tensors.
    flattened: Any = None
    #: The caller's state dict, which gets the non-tensor values too when ``flattened`` is a copy.
    user_state_dict: Any = None

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        """DCP's setup, of the state dict with each tensor subclass as its inner tensors (the
        target's own: DCP fills them in place; non-tensor values go to the caller's dicts)."""
        self.subclass_records = {}
        flattened = _flatten_subclasses(state_dict, (), self.subclass_records)
        self.flattened = flattened if self.subclass_records else state_dict
        self.user_state_dict = state_dict if self.subclass_records else None
        super().set_up_planner(self.flattened, *args, **kwargs)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode a JSON value and put it where the state dict expects it."""
        try:
            obj = orjson.loads(value.getvalue())
        except orjson.JSONDecodeError as err:
            raise MetaFormatError(f"non-tensor value {read_item.dest_index.fqn!r} is not JSON ({err})") from None
        _set_value(self, read_item, obj)


def _encodes_itself(planner: Any) -> bool:
    """True for DCP's default save planner and :class:`SavePlanner`: memtree encodes their
    non-tensor values itself (keeping where the tuples are), never through ``transform_object``."""
    return isinstance(planner, DefaultSavePlanner) and type(planner).transform_object in (
        DefaultSavePlanner.transform_object,
        SavePlanner.transform_object,
    )


def object_bytes(planner: Any, item: WriteItem) -> tuple[bytes, list[TuplePath]]:
    """A non-tensor value's JSON bytes and the paths of its tuples (format version 2), without ever
    letting a stock planner ``torch.save`` it. A custom planner's bytes have no tuples."""
    if _encodes_itself(planner):
        value, tuples = tuples_to_lists(planner.lookup_object(item.index))
        return _json_bytes(value, item.index.fqn), tuples
    data = planner.resolve_data(item)
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    try:
        orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        raise NonTensorValueError(
            f"the save planner turned {item.index.fqn!r} into bytes that are not JSON (a pickle?); "
            "memtree's DCP storage stores only JSON: use memtree.dcp.SavePlanner"
        ) from None
    return bytes(raw), []


def deliver_value(planner: Any, item: ReadItem, value: Any) -> None:
    """Hand a non-tensor value to the load planner without ever letting a stock planner unpickle
    it: DCP's default load planner and :class:`LoadPlanner` get the value itself (tuples kept), a
    custom planner its JSON text."""
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes in (
        DefaultLoadPlanner.load_bytes,
        LoadPlanner.load_bytes,
    ):
        _set_value(planner, item, value)
    else:
        planner.load_bytes(item, io.BytesIO(orjson.dumps(value)))
