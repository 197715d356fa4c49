"""Non-tensor leaves: small values kept next to the tensors and stored as JSON.

A tree keeps ``str``, ``int``, ``float``, ``bool``, ``None`` and lists of these as non-tensor
leaves. A ``Mapping`` assigned to a tree becomes a sub-tree; to keep a dict (or any value) as one
leaf, wrap it in :class:`NonTensor`.

On disk, values are JSON. :func:`check_json` refuses any value JSON would change (NaN, ±inf,
ints beyond 64 bits, lone surrogates, non-str dict keys, arbitrary objects) or nest deeper than
:data:`MAX_JSON_DEPTH` instead of silently altering it. Tuples are kept (format version 2): they
are written as arrays and their paths recorded (:func:`tuples_to_lists`), so they load as tuples.

Example:
    >>> import memtree
    >>> tree = memtree.TensorTree()
    >>> tree["cfg"] = memtree.NonTensor({"lr": 0.1})
    >>> tree["cfg"]
    {'lr': 0.1}
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import NonTensorValueError

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_TUPLE_PATHS",
    "NonTensor",
    "UnloadedPickle",
    "check_json",
    "check_nesting",
    "json_depth",
    "json_problem",
    "tuples_to_lists",
    "lists_to_tuples",
]

#: The Python types stored as JSON arrays (a tuple's path is recorded, so it comes back a tuple).
_ARRAYS = (list, tuple)
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1

#: Levels of lists and dicts one non-tensor value may nest. orjson writes at most 254 levels,
#: and a ``meta.json`` holds each value 3 levels down (level object, ``entries``, entry object),
#: so this is the most that can be written; values nested deeper are refused when assigned to a
#: tree, when written, and when read.
MAX_JSON_DEPTH = 251
#: Most tuples one non-tensor value may hold: a ``json`` entry lists each tuple's path
#: (``tuples``), and readers refuse a longer list; values holding more are refused when assigned
#: to a tree and when written (or pickled, with ``allow_pickle=True``).
MAX_TUPLE_PATHS = 100_000


class NonTensor:
    """Wraps one value so that a tree keeps it as a single non-tensor leaf.

    Args:
        data: any value; it is stored as JSON when the tree is written (or pickled, with
            ``allow_pickle=True``).
    """

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data: Any = data.data if isinstance(data, NonTensor) else data

    def __repr__(self) -> str:
        return f"NonTensor({self.data!r})"

    def __eq__(self, other: object) -> bool:
        other_data = other.data if isinstance(other, NonTensor) else other
        try:
            return bool(self.data == other_data)
        except Exception:
            return self.data is other_data

    __hash__ = None  # type: ignore[assignment]


class UnloadedPickle:
    """Stands for a pickled non-tensor leaf that ``load_memmap(..., device="meta")`` did not open."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"<pickled leaf {self.path} (not loaded: device='meta')>"


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How many levels of lists and dicts ``value`` nests (0 for a scalar), counted up to
    ``limit + 1`` (iteratively: any depth is safe to measure, and the count stops early).

    Only exact ``list``, ``tuple`` and ``dict`` count, the containers JSON has (a tuple is stored
    as an array, its path recorded: :func:`tuples_to_lists`).

    Example:
        >>> json_depth("x"), json_depth([1, {"a": [2]}]), json_depth([[[[[]]]]], limit=2)
        (0, 3, 3)
    """
    level: list[Any] = [value] if type(value) in _ARRAYS or type(value) is dict else []
    depth = 0
    while level and depth <= limit:
        depth += 1
        level = [
            child
            for v in level
            for child in (v if type(v) is not dict else list(v.values()))
            if type(child) in _ARRAYS or type(child) is dict
        ]
    return depth


def check_nesting(value: Any, where: str) -> None:
    """Raise unless ``value`` nests lists and dicts at most :data:`MAX_JSON_DEPTH` levels deep.

    The check a tree makes when a non-tensor value is assigned (any value: also one that will
    be pickled), so that a value too deep to store fails there, not at ``memmap`` time.

    Example:
        >>> check_nesting({"lr": [0.1]}, "'cfg'")

    Raises:
        NonTensorValueError: names ``where`` and the limit.
    """
    if json_depth(value) > MAX_JSON_DEPTH:
        raise NonTensorValueError(
            f"non-tensor leaf {where}: the value nests lists and dicts more than {MAX_JSON_DEPTH} "
            "levels deep, more than a meta.json can hold; flatten it, or store it as a string "
            "(json.dumps) or as a tensor"
        )


def json_problem(value: Any, path: str = "value") -> str | None:
    """Why ``value`` cannot round-trip exactly through JSON, or ``None`` if it can.

    Example:
        >>> json_problem({"lr": 0.1}) is None, json_problem([float("nan")])
        (True, 'value[0] is nan, which JSON cannot hold')
    """
    stack: list[tuple[Any, str, int]] = [(value, path, 1)]  # depth of v if it is a container
    tuples = 0
    while stack:
        v, where, depth = stack.pop()
        t = type(v)
        if v is None or t is bool:
            continue
        if t is int:
            if not _INT_MIN <= v <= _INT_MAX:
                return f"{where} is an int outside 64 bits ({v})"
        elif t is float:
            if not math.isfinite(v):
                return f"{where} is {v}, which JSON cannot hold"
        elif t is str:
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return f"{where} is a str with a lone surrogate"
        elif t is list or t is tuple or t is dict:
            if depth > MAX_JSON_DEPTH:
                return f"{path} nests lists and dicts more than {MAX_JSON_DEPTH} levels deep"
            if t is tuple:
                tuples += 1
                if tuples > MAX_TUPLE_PATHS:
                    return f"{path} holds more than {MAX_TUPLE_PATHS:,} tuples (make some of them lists)"
            if t is not dict:
                stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
                continue
            for k, x in v.items():
                if type(k) is not str:
                    return f"{where} has a non-str dict key {k!r}"
                stack.append((k, f"{where} key", depth + 1))
                stack.append((x, f"{where}[{k!r}]", depth + 1))
        else:
            return f"{where} is a {t.__name__}, which JSON would change or cannot hold"
    return None


def check_json(value: Any, where: str) -> None:
    """Raise unless ``value`` round-trips exactly through JSON.

    Raises:
        NonTensorValueError: the value would be changed or cannot be encoded; names ``where``.
    """
    problem = json_problem(value)
    if problem is not None:
        raise NonTensorValueError(
            f"non-tensor leaf {where}: {problem}. Store it as a tensor, convert it (e.g. a set "
            "to a list), or pass allow_pickle=True to pickle it (loading then needs "
            "allow_pickle=True too)"
        )


def tuples_to_lists(value: Any) -> tuple[Any, list[tuple[int | str, ...]]]:
    """``value`` with every tuple made a list, and the paths of those tuples (format version 2:
    a ``json`` entry's ``tuples``), outermost first; :func:`lists_to_tuples` undoes it.

    Only exact ``tuple``, ``list`` and ``dict`` are looked into; the result still has to pass
    :func:`check_json` (a named tuple, for instance, is not a tuple here and is refused there).

    Example:
        >>> tuples_to_lists({"betas": (0.9, 0.999), "params": [0, 1]})
        ({'betas': [0.9, 0.999], 'params': [0, 1]}, [('betas',)])
    """
    paths: list[tuple[int | str, ...]] = []

    def convert(v: Any, path: tuple[int | str, ...], depth: int) -> Any:
        t = type(v)
        if (t is not tuple and t is not list and t is not dict) or depth > MAX_JSON_DEPTH:
            return v  # scalars; too deep a value is refused by check_json
        if t is dict:
            return {k: convert(x, path + (k,), depth + 1) for k, x in v.items()}
        if t is tuple:
            paths.append(path)
        return [convert(x, path + (i,), depth + 1) for i, x in enumerate(v)]

    return convert(value, (), 1), paths


def lists_to_tuples(value: Any, paths: Any) -> Any:
    """A copy of ``value`` (as read from JSON) with the arrays at ``paths`` made tuples again.

    ``paths`` come from a parsed ``meta.json`` (:func:`memtree.format.schema.parse_level` checked
    that each leads to an array). ``value`` itself is left as it is.

    Example:
        >>> lists_to_tuples({"betas": [0.9, 0.999], "x": [[1], 2]}, [("betas",), ("x",), ("x", 0)])
        {'betas': (0.9, 0.999), 'x': ((1,), 2)}
    """
    if not paths:
        return value
    wanted = set(map(tuple, paths))
    below = {p[:n] for p in wanted for n in range(len(p))}  # where a tuple lies further down

    def rebuild(v: Any, path: tuple[int | str, ...]) -> Any:
        if path not in below:
            return tuple(v) if path in wanted else v
        if type(v) is dict:
            return {k: rebuild(x, path + (k,)) for k, x in v.items()}
        items = [rebuild(x, path + (i,)) for i, x in enumerate(v)]
        return tuple(items) if path in wanted else items

    return rebuild(value, ())
