"""A framework's checkpoint dict with its exact Python types, in what a memtree tree holds.

Frameworks hand over a dict of tensors and Python values (Lightning's checkpoint, a Trainer's
optimizer, scheduler and RNG states) and expect it back exactly as ``torch.load`` returns it.
:mod:`memtree.training.state` keeps tensors, dicts (``str``/``int`` keys), lists, tuples and what
JSON holds exactly. :func:`encode` maps the rest onto those, and records where, so that
:func:`decode` gives every value back with its type:

=================================  ==============================  ===========================
value                              stored as                       comes back as
=================================  ==============================  ===========================
``float`` NaN, ``inf``, ``-inf``   a 0-dim float64 tensor          the same float (same bits)
``OrderedDict`` (``_metadata``)    a dict                          an ``OrderedDict``, with it
``numpy.ndarray`` (numeric)        a tensor                        an array of its dtype
``torch.dtype``/``device``/``Size``  its name/str/list of ints     the same object
anything else                      refused; with ``allow_pickle``  ``pickle.loads`` of it, only
                                   its pickle as a uint8 tensor    with ``allow_pickle`` again
=================================  ==============================  ===========================

The record is one JSON value at the top-level key :data:`RECORD_KEY` (present only when a value
needed it): ``{"version": 1, "values": [[path, kind], ...]}``, a path being the list of keys
and indices (``str``/``int``) from the top. A record read back is checked like any input: a
kind or path that does not fit the values raises :class:`~memtree.errors.CheckpointFormatError`.

Example:
    >>> import collections, torch
    >>> state = {"best": float("inf"), "sd": collections.OrderedDict(w=torch.ones(1))}
    >>> stored = encode(state, allow_pickle=False)
    >>> stored["best"], stored[RECORD_KEY]["values"]
    (tensor(inf, dtype=torch.float64), [[['best'], 'float'], [['sd'], 'ordered']])
    >>> back = decode(stored, allow_pickle=False)
    >>> back["best"], type(back["sd"]).__name__
    (inf, 'OrderedDict')
"""

from __future__ import annotations

import math
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointFormatError, InvalidArgumentError, NonTensorValueError, PickleNotAllowedError
from ..format.dtypes import DTYPE_NAMES, dtype_from_name, dtype_name
from ..format.schema import MAX_DEPTH
from ..format.values import json_problem

__all__ = ["RECORD_KEY", "encode", "decode"]

#: The top-level key of the record of converted values (a checkpoint holding it is refused).
RECORD_KEY = "__memtree_types__"
_VERSION = 1
_KINDS = ("float", "ordered", "ndarray", "dtype", "device", "size", "pickle")
_Path = tuple[Any, ...]


def _format_dtypes() -> set[torch.dtype]:
    """The torch dtypes the format names (others are objects, pickled or refused)."""
    return {d for d in map(dtype_from_name, DTYPE_NAMES) if d is not None}


def _label(path: _Path) -> str:
    return "checkpoint" + "".join(f"[{p!r}]" for p in path)


class _Encoder:
    def __init__(self, allow_pickle: bool, snapshot: bool, pickle_hint: str) -> None:
        self.allow_pickle = allow_pickle
        self.snapshot = snapshot
        self.pickle_hint = pickle_hint
        self.records: list[list[Any]] = []

    def value(self, v: Any, path: _Path) -> Any:
        if len(path) > MAX_DEPTH:
            raise NonTensorValueError(f"{_label(path[:8])}... nests containers more than {MAX_DEPTH} levels deep")
        t = type(v)
        if isinstance(v, torch.Tensor):
            return v.detach().clone() if self.snapshot else v
        if t is dict or t is OrderedDict:
            return self.mapping(v, path)
        if t is list or t is tuple:
            items = [self.value(x, path + (i,)) for i, x in enumerate(v)]
            return items if t is list else tuple(items)
        if t is float and not math.isfinite(v):
            return self.record(path, "float", torch.tensor(v, dtype=torch.float64))
        if v is None or t in (bool, int, float, str):
            if json_problem(v) is None:
                return v
        elif t is torch.dtype and v in _format_dtypes():
            return self.record(path, "dtype", dtype_name(v))
        elif t is torch.device:
            return self.record(path, "device", str(v))
        elif t is torch.Size:
            return self.record(path, "size", list(v))
        elif t is np.ndarray and v.dtype.kind in "biufc":
            try:
                return self.record(path, "ndarray", torch.from_numpy(np.ascontiguousarray(v).copy()))
            except TypeError:
                pass  # a dtype torch has not (e.g. uint16 on old torch): an object below
        return self.other(v, path)

    def mapping(self, v: Mapping[Any, Any], path: _Path) -> Any:
        if any(type(k) not in (str, int) or k == "" for k in v):
            return self.other(v, path)  # keys a tree cannot hold (float, tuple, bool, ''...)
        out = {k: self.value(x, path + (k,)) for k, x in v.items()}
        if type(v) is OrderedDict:
            meta = getattr(v, "_metadata", None)  # torch's state_dict: module versions
            if meta is not None:
                meta = _plain(meta)
                if json_problem(meta) is not None:
                    return self.other(v, path)
            self.records.append([list(path), "ordered"] + ([meta] if meta is not None else []))
        return out

    def record(self, path: _Path, kind: str, stored: Any) -> Any:
        self.records.append([list(path), kind])
        return stored

    def other(self, v: Any, path: _Path) -> Any:
        if not self.allow_pickle:
            raise NonTensorValueError(
                f"{_label(path)} is a {type(v).__name__} ({v!r:.60}), which a memtree checkpoint "
                "keeps only as a pickle: convert it to tensors and plain values (str, int, float, "
                f"bool, None, lists, tuples, dicts), or {self.pickle_hint} (loading it then runs "
                "code from the file: only for files you trust)"
            )
        try:
            data = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - any object's __reduce__ may raise anything
            raise NonTensorValueError(f"{_label(path)} ({type(v).__name__}) cannot be pickled: {err}") from err
        return self.record(path, "pickle", torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _plain(meta: Any) -> Any:
    """torch's ``state_dict._metadata`` (an ``OrderedDict`` of dicts) as plain dicts for JSON."""
    if isinstance(meta, Mapping):
        return {k: _plain(v) for k, v in meta.items()}
    return meta


def encode(
    state: Mapping[str, Any],
    *,
    allow_pickle: bool,
    snapshot: bool = False,
    pickle_hint: str = "pass allow_pickle=True to store it pickled",
) -> dict[str, Any]:
    """``state`` as tensors, dicts, lists, tuples and JSON values, with the record (see above).

    Containers are new objects (the caller's may change afterwards); tensors are the caller's,
    or copies with ``snapshot=True`` (what an asynchronous save writes while training goes on).

    Args:
        state: the checkpoint dict.
        allow_pickle: pickle values no other row of the table above takes; else refuse them.
        snapshot: copy every tensor (``detach().clone()``, on its device).
        pickle_hint: how the caller's user turns ``allow_pickle`` on (ends the refusal message).

    Raises:
        InvalidArgumentError: ``state`` is not a dict, or holds :data:`RECORD_KEY` itself.
        NonTensorValueError: a value that needs pickle without ``allow_pickle``; names its path.

    Example:
        >>> encode({"n": 1, "cfg": {"lr": 0.1}}, allow_pickle=False)
        {'n': 1, 'cfg': {'lr': 0.1}}
    """
    if type(state) not in (dict, OrderedDict):
        raise InvalidArgumentError(f"a checkpoint must be a dict, got {type(state).__name__}")
    if RECORD_KEY in state:
        raise InvalidArgumentError(
            f"the checkpoint holds the key {RECORD_KEY!r}, which memtree keeps for its own record "
            "of value types; rename that key"
        )
    encoder = _Encoder(allow_pickle, snapshot, pickle_hint)
    out = encoder.mapping(state, ())
    if type(out) is not dict:  # the top level itself needed pickle: never a tree
        raise NonTensorValueError("the checkpoint's top-level keys must be str or int")
    if encoder.records:
        out[RECORD_KEY] = {"version": _VERSION, "values": encoder.records}
    return out


def decode(
    state: dict[str, Any],
    *,
    allow_pickle: bool,
    pickle_hint: str = "pass allow_pickle=True",
    partial: bool = False,
) -> dict[str, Any]:
    """The checkpoint :func:`encode` made ``state`` from, each value with its type.

    Args:
        state: what the tree held (its :data:`RECORD_KEY` is removed and applied).
        allow_pickle: unpickle the values stored pickled; else refuse them.
        pickle_hint: how the caller's user turns ``allow_pickle`` on (ends the refusal message).
        partial: ``state`` holds some top-level keys only (a load with ``keys=``): the record's
            entries under the others are left out.

    Raises:
        CheckpointFormatError: a record that does not fit the values (a damaged or edited file).
        PickleNotAllowedError: a value stored pickled, without ``allow_pickle``.

    Example:
        >>> decode({"n": 1}, allow_pickle=False)
        {'n': 1}
    """
    record = state.pop(RECORD_KEY, None)
    if record is None:
        return state
    wanted = _parse_record(record)
    if partial:
        wanted = {p: k for p, k in wanted.items() if p and p[0] in state}
    prefixes = {path[:i] for path in wanted for i in range(len(path))}
    applied: set[_Path] = set()

    def rebuild(v: Any, path: _Path) -> Any:
        if path in prefixes:
            if type(v) is dict:
                v = {k: rebuild(x, path + (k,)) for k, x in v.items()}
            elif type(v) in (list, tuple):
                v = type(v)(rebuild(x, path + (i,)) for i, x in enumerate(v))
            else:
                raise _bad(path, f"the record names values inside a {type(v).__name__}")
        kind = wanted.get(path)
        if kind is not None:
            v = _CONVERT[kind[0]](v, path, kind[1:], allow_pickle, pickle_hint)
            applied.add(path)
        return v

    out = rebuild(state, ())
    missing = [p for p in wanted if p not in applied]
    if missing:
        raise _bad(missing[0], "the record names a value the checkpoint does not hold")
    return out  # type: ignore[no-any-return]


def _bad(path: _Path, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"{_label(path)}: {problem}; the checkpoint's record of value types ({RECORD_KEY!r}) does "
        "not fit its values: the files were damaged or edited. Load another checkpoint"
    )


def _parse_record(record: Any) -> dict[_Path, list[Any]]:
    if type(record) is not dict or record.get("version") != _VERSION or type(record.get("values")) is not list:
        raise _bad((RECORD_KEY,), f"must be {{'version': {_VERSION}, 'values': [...]}}, got {record!r:.80}")
    out: dict[_Path, list[Any]] = {}
    for item in record["values"]:
        if (
            type(item) is not list
            or len(item) not in (2, 3)
            or type(item[0]) is not list
            or any(type(p) not in (str, int) for p in item[0])
            or item[1] not in _KINDS
            or (len(item) == 3 and item[1] != "ordered")
        ):
            raise _bad((RECORD_KEY,), f"has the malformed entry {item!r:.80}")
        path = tuple(item[0])
        if path in out:
            raise _bad(path, "is named twice")
        out[path] = item[1:]
    return out


def _tensor(v: Any, path: _Path, dtype: torch.dtype | None, ndim: int | None) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or (dtype is not None and v.dtype != dtype) or (ndim is not None and v.ndim != ndim):
        raise _bad(path, f"expected a {ndim}-dim {dtype} tensor, found {type(v).__name__} {getattr(v, 'shape', '')}")
    return v


def _to_float(v: Any, path: _Path, extra: list[Any], allow_pickle: bool, hint: str) -> float:
    return float(_tensor(v, path, torch.float64, 0).item())


def _to_ordered(v: Any, path: _Path, extra: list[Any], allow_pickle: bool, hint: str) -> Any:
    if type(v) is not dict:
        raise _bad(path, f"expected a dict for an OrderedDict, found {type(v).__name__}")
    out: Any = OrderedDict(v)
    if extra:
        meta = extra[0]
        if type(meta) is not dict or any(type(x) is not dict for x in meta.values()):
            raise _bad(path, f"has a state_dict _metadata that is not a dict of dicts: {meta!r:.60}")
        out._metadata = OrderedDict(meta)
    return out


def _to_ndarray(v: Any, path: _Path, extra: list[Any], allow_pickle: bool, hint: str) -> np.ndarray:
    return _tensor(v, path, None, None).numpy()


def _to_dtype(v: Any, path: _Path, extra: list[Any], allow_pickle: bool, hint: str) -> torch.dtype:
    dtype = dtype_from_name(v) if type(v) is str else None
    if dtype is None:
        raise _bad(path, f"names no dtype memtree knows: {v!r:.40}")
    return dtype


def _to_device(v: Any, path: _Path, extra: list[Any], allow_pickle: bool, hint: str) -> torch.device:
    if type(v) is not str:
        raise _bad(path, f"names no device: {v!r:.40} (a {type(v).__name__}, not a str)")
    try:
        return torch.device(v)
    except (RuntimeError, TypeError, ValueError) as err:
        raise _bad(path, f"names no device: {v!r:.40} ({err})") from None


def _to_size(v: Any, path: _Path, extra: list[Any], allow_pickle: bool, hint: str) -> torch.Size:
    if type(v) not in (list, tuple) or any(type(x) is not int or x < 0 for x in v):
        raise _bad(path, f"expected a list of ints for a torch.Size, got {v!r:.40}")
    return torch.Size(v)


def _unpickle(v: Any, path: _Path, extra: list[Any], allow_pickle: bool, hint: str) -> Any:
    data = _tensor(v, path, torch.uint8, 1)
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"{_label(path)} was saved pickled ({data.numel()} bytes); unpickling it runs code from the "
            f"file, which memtree does only when asked: {hint} if you trust this checkpoint"
        )
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - the caller opted in


_CONVERT: dict[str, Callable[[Any, _Path, list[Any], bool, str], Any]] = {
    "float": _to_float,
    "ordered": _to_ordered,
    "ndarray": _to_ndarray,
    "dtype": _to_dtype,
    "device": _to_device,
    "size": _to_size,
    "pickle": _unpickle,
}
