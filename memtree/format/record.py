"""``Record``: the base of memtree's immutable dataclasses, cheap to define at import.

``@dataclass(frozen=True)`` compiles six methods (``__init__``, ``__repr__``, ``__eq__``,
``__hash__``, ``__setattr__``, ``__delattr__``) from source text for every class when its module
is imported: about 0.6 ms a class, which made the classes of ``meta.json`` and the read options
a third of what ``memtree.load_memmap`` cost to import in a fresh process. A :class:`Record`
subclass is a dataclass all the same (``dataclasses.fields``, ``replace`` and ``asdict`` work)
with those methods written once here and its ``__init__`` written in its source.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any, ClassVar

__all__ = ["Record"]


class Record:
    """Base of the immutable metadata classes: what ``@dataclass(frozen=True)`` would generate.

    A subclass is decorated ``@dataclass(init=False, repr=False, eq=False)`` and writes its own
    ``__init__`` (setting its fields with ``object.__setattr__``). Instances are equal when
    they are of the same class with equal fields, hash as the tuple of their fields, print as
    ``Class(field=value, ...)``, and refuse every assignment or deletion of an attribute
    (:class:`dataclasses.FrozenInstanceError`).

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(init=False, repr=False, eq=False)
        ... class Point(Record):
        ...     x: int
        ...     y: int = 0
        ...     def __init__(self, x: int, y: int = 0) -> None:
        ...         object.__setattr__(self, "x", x)
        ...         object.__setattr__(self, "y", y)
        >>> Point(1) == Point(1, 0), Point(1), hash(Point(1)) == hash((1, 0))
        (True, Point(x=1, y=0), True)
    """

    __slots__ = ()
    #: The field names in order (``@dataclass`` sets it).
    __match_args__: ClassVar[tuple[str, ...]]

    def _fields(self) -> tuple[Any, ...]:
        d = self.__dict__
        return tuple([d[name] for name in self.__match_args__])

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        d = self.__dict__
        args = ", ".join(f"{name}={d[name]!r}" for name in self.__match_args__)
        return f"{type(self).__qualname__}({args})"

    def evolve(self, **changes: Any) -> Any:
        """A copy with ``changes`` (field names to values): ``dataclasses.replace`` without its
        ``__init__`` call, for the hot paths that make one per leaf (a tenth of its cost). The
        values are taken as given: pass what the field holds (a dtype's name, not a dtype).

        Example:
            >>> from memtree.format.entries import LeafMeta
            >>> LeafMeta("w", "w.memmap", "float32", (2,)).evolve(checksum="crc32:00000000").checksum
            'crc32:00000000'
        """
        new = object.__new__(type(self))
        d = new.__dict__
        d.update(self.__dict__)
        for name, value in changes.items():
            if name not in d:
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            d[name] = value
        return new

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")
