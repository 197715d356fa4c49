"""DCP planners that keep non-tensor values as JSON bytes, never pickles.

Example:
    >>> from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    >>> isinstance(SavePlanner(), DefaultSavePlanner)  # dcp.save(..., planner=SavePlanner())
    True
"""

from __future__ import annotations

import io
from typing import Any

import orjson
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ..errors import MetaFormatError, NonTensorValueError
from ..format.schema import TuplePath
from ..format.values import json_problem, tuples_to_lists

__all__ = ["SavePlanner", "LoadPlanner", "object_bytes", "deliver_value"]


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


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, but non-tensor values become JSON bytes instead of pickles.

    Example:
        >>> planner = SavePlanner()   # dcp.save(state, storage_writer=Writer(d), planner=planner)
    """

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
