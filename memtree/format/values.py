"""Non-tensor leaves: small values kept next to the tensors and stored as JSON.

A tree keeps ``str``, ``int``, ``float``, ``bool``, ``None`` and lists of these as non-tensor
leaves. A ``Mapping`` assigned to a tree becomes a sub-tree; to keep a dict (or any value) as one
leaf, wrap it in :class:`NonTensor`.

On disk, values are JSON. :func:`check_json` refuses any value JSON would change (NaN, ±inf,
ints beyond 64 bits, lone surrogates, tuples, non-str dict keys, arbitrary objects) instead of
silently altering it.

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

__all__ = ["NonTensor", "UnloadedPickle", "check_json", "json_problem"]

_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1


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


def json_problem(value: Any, path: str = "value") -> str | None:
    """Why ``value`` cannot round-trip exactly through JSON, or ``None`` if it can."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, where = stack.pop()
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
        elif t is list:
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
        elif t is dict:
            for k, x in v.items():
                if type(k) is not str:
                    return f"{where} has a non-str dict key {k!r}"
                stack.append((k, f"{where} key"))
                stack.append((x, f"{where}[{k!r}]"))
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
            f"non-tensor leaf {where}: {problem}. Store it as a tensor, convert it (e.g. a tuple "
            "to a list), or pass allow_pickle=True to pickle it (loading then needs "
            "allow_pickle=True too)"
        )
