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
from ..format.values import json_problem

__all__ = ["SavePlanner", "LoadPlanner", "object_bytes", "deliver_bytes"]


def _json_bytes(value: Any, fqn: str) -> bytes:
    problem = json_problem(value)
    if problem is not None:
        raise NonTensorValueError(
            f"non-tensor value {fqn!r}: {problem}. memtree's DCP storage keeps non-tensor values "
            "as JSON and never pickles: store it as a tensor, or convert it (e.g. a tuple to a list)"
        )
    return orjson.dumps(value)


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
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def object_bytes(planner: Any, item: WriteItem) -> bytes:
    """A non-tensor value's JSON bytes, without ever letting a stock planner ``torch.save`` it."""
    if isinstance(planner, DefaultSavePlanner) and type(planner).transform_object is DefaultSavePlanner.transform_object:
        return _json_bytes(planner.lookup_object(item.index), item.index.fqn)
    data = planner.resolve_data(item)
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    try:
        orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError):
        raise NonTensorValueError(
            f"the save planner turned {item.index.fqn!r} into bytes that are not JSON (a pickle?); "
            "memtree's DCP storage stores only JSON: use memtree.dcp.SavePlanner"
        ) from None
    return bytes(raw)


def deliver_bytes(planner: Any, item: ReadItem, data: bytes) -> None:
    """Hand a JSON value to the load planner without ever letting a stock planner unpickle it."""
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        LoadPlanner.load_bytes(planner, item, io.BytesIO(data))  # type: ignore[arg-type]
    else:
        planner.load_bytes(item, io.BytesIO(data))  # a custom planner receives JSON text
