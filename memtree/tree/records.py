"""``@tensorclass``: typed records whose fields are the keys of a :class:`~memtree.TensorTree`.

A class decorated with :func:`tensorclass` is a dataclass *and* a ``TensorTree`` subclass: its
fields are the tree's keys, so everything a tree does works on it and keeps the class —
``batch_size``, indexing (``step[3]``, ``step[2:5]``, ``step[idx]``), ``memmap``/``memmap_like``/
``load_memmap``, :func:`memtree.stack`/:func:`memtree.cat`, ``to``, ``clone``, ``==``.

* A field holding a tensor is a tensor leaf; one holding a ``TensorTree`` (or another
  tensorclass) is a sub-tree; anything else (``str``, numbers, ``None``, lists, dicts) is
  non-tensor data, stored as JSON. A ``dict`` stays one value (it does not become a sub-tree).
* On disk, each level of a tensorclass records its class's *registered name* in its
  ``meta.json`` ``"type"`` (``docs/format.md``, "Typed levels"). The name is the class's
  qualified name without its module (``Step``, ``Outer.Inner``), or ``@tensorclass(name=...)``.
  Loading maps the name back through the registry (:mod:`memtree.tree.parts.registry`): it never imports a
  module named in a file. Names are unique: decorating another class with a name already taken
  raises :class:`~memtree.errors.TensorclassError` (re-running the same class definition, e.g. a
  reloaded module, replaces the entry).
* The generated ``__init__`` takes the fields (positionally or by name, with their defaults)
  and the keywords ``batch_size`` (default ``()``) and ``device``; define ``__post_init__`` for
  more set-up. Field names cannot start with ``_`` or hide a ``TensorTree`` attribute
  (``shape``, ``keys``, ``to``...).

Example:
    >>> import tempfile, torch, memtree
    >>> @memtree.tensorclass(name="docs.Step")
    ... class Step:
    ...     obs: torch.Tensor
    ...     reward: torch.Tensor
    ...     source: str = "sim"
    >>> steps = Step(torch.zeros(4, 3), torch.arange(4.0), batch_size=[4])
    >>> steps[1:3].reward.tolist(), steps.source
    ([1.0, 2.0], 'sim')
    >>> d = tempfile.mkdtemp() + "/steps"
    >>> _ = steps.memmap(d)
    >>> loaded = memtree.load_memmap(d)
    >>> type(loaded).__name__, loaded.reward.tolist()
    ('Step', [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

from ..errors import TensorclassError
from ..format.level import Level
from ..format.values import NonTensor
from .parts.tensor_ops import FIELD_NAMES
from .parts.registry import register
from .tensortree import TensorTree

__all__ = ["tensorclass"]

T = TypeVar("T")


@overload
def tensorclass(cls: type[T], /) -> type[T]: ...


@overload
def tensorclass(*, name: str | None = None) -> Callable[[type[T]], type[T]]: ...


def tensorclass(cls: type[T] | None = None, /, *, name: str | None = None) -> Any:
    """Make ``cls`` a dataclass whose fields are the keys of a ``TensorTree`` (see the module doc).

    Args:
        cls: the class (when used as ``@tensorclass`` without arguments).
        name: the stable name its levels record on disk (default: its qualified name without
            the module, ``<locals>`` parts dropped). A dotted identifier, at most 200
            characters, unique in the process.

    Returns:
        A new class with the same name, methods and fields, subclassing ``TensorTree``.

    Raises:
        TensorclassError: a bad or taken name, a field name that would hide a ``TensorTree``
            attribute, or a class that defines ``__init__`` or ``__slots__``.

    Example:
        >>> import torch
        >>> @tensorclass
        ... class DocPair:
        ...     left: torch.Tensor
        ...     right: torch.Tensor
        >>> p = DocPair(left=torch.zeros(2, 5), right=torch.ones(2), batch_size=[2])
        >>> p[0].left.shape, isinstance(p, TensorTree)
        (torch.Size([5]), True)
    """
    if cls is None:
        return lambda c: _build(c, name)
    return _build(cls, name)


def _default_name(cls: type) -> str:
    return ".".join(part for part in cls.__qualname__.split(".") if part != "<locals>")


def _build(cls: Any, name: str | None) -> Any:
    if not isinstance(cls, type):
        raise TensorclassError(f"@tensorclass decorates a class, got {type(cls).__name__} {cls!r:.60}")
    for attr, hint in (("__init__", "define __post_init__ for extra set-up"), ("__slots__", "remove it")):
        if attr in cls.__dict__:
            raise TensorclassError(
                f"{cls.__qualname__} defines {attr}; a @tensorclass stores its fields in the tree "
                f"and generates __init__ from them: {hint}"
            )
    type_name = _default_name(cls) if name is None else name
    namespace = {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")}
    namespace.update(__init__=_init, _to_level=_to_level, __tensorclass_name__=type_name)
    if issubclass(cls, TensorTree):
        bases = cls.__bases__
    else:
        bases = tuple(b for b in cls.__bases__ if b is not object) + (TensorTree,)
    new = type(cls)(cls.__name__, bases, namespace)
    new.__qualname__ = cls.__qualname__
    _retarget_class_cells(namespace, cls, new)
    dataclasses.dataclass(init=False, repr=False, eq=False)(new)
    reserved = set(dir(TensorTree)) - FIELD_NAMES  # (those a field may shadow: see tensor_ops.py)
    for f in dataclasses.fields(new):
        if f.name.startswith("_") or f.name in reserved:
            raise TensorclassError(
                f"field {f.name!r} of {cls.__qualname__} would hide TensorTree.{f.name} (or a "
                "private attribute); rename the field"
            )
        setattr(new, f.name, _Field(f.name))
    register(type_name, new)
    return new


def _retarget_class_cells(namespace: dict[str, Any], old: type, new: type) -> None:
    """Make zero-argument ``super()`` in the class's methods refer to the new class."""
    for value in namespace.values():
        funcs: list[Any]  # functions, or None for a property's missing accessor
        if isinstance(value, (staticmethod, classmethod)):
            funcs = [value.__func__]
        elif isinstance(value, property):
            funcs = [value.fget, value.fset, value.fdel]
        else:
            funcs = [value]
        for fn in funcs:
            code = getattr(fn, "__code__", None)
            if code is None or "__class__" not in code.co_freevars:
                continue
            cell = fn.__closure__[code.co_freevars.index("__class__")]
            if cell.cell_contents is old:
                cell.cell_contents = new


class _Field:
    """A dataclass field stored as the tree key of the same name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: TensorTree | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            value = obj._data[self.name]
        except KeyError:
            raise AttributeError(
                f"{type(obj).__name__}.{self.name} is not set: the key was deleted, or the tree "
                "was loaded or selected without it"
            ) from None
        return value.data if isinstance(value, NonTensor) else value

    def __set__(self, obj: TensorTree, value: Any) -> None:
        if isinstance(value, Mapping):  # a dict field stays one value, not a sub-tree
            value = NonTensor(value)
        obj._set_one(self.name, value)

    def __delete__(self, obj: TensorTree) -> None:
        del obj[self.name]


def _init(self: TensorTree, *args: Any, batch_size: Any = None, device: Any = None, **kwargs: Any) -> None:
    cls = type(self)
    TensorTree.__init__(self, None, batch_size, device)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    init_fields = [f for f in fields if f.init]
    if len(args) > len(init_fields):
        raise TensorclassError(
            f"{cls.__name__}() takes {len(init_fields)} field values by position, got {len(args)}"
        )
    given = {f.name: a for f, a in zip(init_fields, args)}
    for key, value in kwargs.items():
        if key in given or not any(f.name == key for f in init_fields):
            problem = "got two values for" if key in given else "has no init field"
            raise TensorclassError(
                f"{cls.__name__}() {problem} {key!r} (fields: {[f.name for f in init_fields]})"
            )
        given[key] = value
    for f in fields:  # in field order: the tree's keys (and files on disk) follow it
        if f.init and f.name in given:
            value = given[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        elif f.init:
            raise TensorclassError(f"{cls.__name__}() missing a value for field {f.name!r}")
        else:
            continue
        setattr(self, f.name, value)
    post_init = getattr(self, "__post_init__", None)
    if post_init is not None:
        post_init()


def _to_level(self: TensorTree, path: tuple[str, ...] = (), keep_dtensors: bool = False) -> Level:
    level = TensorTree._to_level(self, path, keep_dtensors)
    level.type = type(self).__tensorclass_name__  # type: ignore[attr-defined]
    return level
