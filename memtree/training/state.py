"""Training state as training code holds it <-> :class:`~memtree.format.level.Level`, with its types.

A checkpoint's ``state`` is a nested mapping of tensors and plain values: ``model.state_dict()``,
``optimizer.state_dict()`` (int keys under ``"state"``, tuples such as ``betas`` in
``param_groups``), a :class:`~memtree.TensorTree`, scheduler and RNG states. :func:`state_to_level`
turns it into levels of format version 2 (``docs/format.md``, "Version 2", "Python containers"):

* a mapping, list or tuple that holds a tensor, or a mapping with an int key (anywhere below),
  becomes a level of type ``"dict"``, ``"list"`` or ``"tuple"`` (items under ``"0"``, ``"1"``...;
  int keys stored in decimal and marked ``int_key``);
* any other value (scalars, str, None, and lists, tuples and str-keyed dicts of them) is one JSON
  value (the writer records where its tuples are: ``tuples``); numpy scalars (there or in it)
  become the Python ``bool``, ``int``, ``float`` or ``str`` of the same value;
* tensors and numpy arrays are leaves (:func:`array_leaf`: a numpy array is stored as the tensor
  of its values); a ``TensorTree`` keeps its own levels.

The state is walked once before it is converted (:func:`_survey`), without recursion: a container
that holds itself (a cycle) is refused, naming both places, and a container met at several places
is stored at each of them (restored as equal, separate objects, where ``torch.load`` would give one
shared object), within :data:`MAX_STATE_ITEMS` values in all, so that shared containers nesting
exponentially are refused at once instead of being expanded.

:func:`level_to_state` turns a checkpoint back, each container with its Python type (``tuple``
stays ``tuple``, int keys stay ``int``; an ``OrderedDict`` comes back as a ``dict``, a numpy array
as a tensor, a ``TensorTree`` as a ``TensorTree``).

Example:
    >>> import torch
    >>> level = state_to_level({"w": torch.ones(2), "opt": {"state": {0: {"step": 3}}, "betas": (0.9, 0.99)}})
    >>> opt = level.entries["opt"]
    >>> opt.type, opt.entries["state"].int_keys, opt.entries["betas"].data
    ('dict', frozenset({'0'}), (0.9, 0.99))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import (
    DtypeError,
    InvalidArgumentError,
    InvalidKeyError,
    KeyCollisionError,
    KeyTypeError,
    NonTensorValueError,
)
from ..format.level import Level, as_level
from ..format.schema import CONTAINER_TYPES, MAX_DEPTH
from ..format.values import MAX_JSON_DEPTH, NonTensor, json_problem
from ..store.reading.read import PendingLevel
from ..format import subclass_registry as registry
from ..tree.parts.subclasses import dtensor_leaf
from ..tree.tensortree import TensorTree

__all__ = ["MAX_STATE_ITEMS", "state_to_level", "array_leaf", "level_to_state", "tensor_slots", "copy_values"]

#: Most values a state may hold, each container's items counted at every place the container
#: appears. Far above real training state (an optimizer's state for 10,000 parameters holds about
#: 50,000), it refuses at once a state whose shared containers nest exponentially (``a = [b, b]``,
#: ``b = [c, c]``, ...), which would otherwise be expanded for hours.
MAX_STATE_ITEMS = 1 << 24

#: numpy dtypes whose values a tensor of the same size holds exactly, as (kind, item size): bool,
#: signed and unsigned ints, float16/32/64, complex64/128 (not longdouble: no tensor dtype).
_EXACT_ARRAY_DTYPES = frozenset(
    {("b", 1), ("i", 1), ("i", 2), ("i", 4), ("i", 8), ("u", 1), ("u", 2), ("u", 4), ("u", 8),
     ("f", 2), ("f", 4), ("f", 8), ("c", 8), ("c", 16)}
)
#: Most levels of containers a state may nest: levels, then a JSON value in the deepest.
_MAX_NESTING = MAX_DEPTH + MAX_JSON_DEPTH
#: The types of plain values (the walk skips them at once), of str keys, of walked sequences.
_SCALARS = frozenset({int, float, str, bool, type(None)})
_STR = frozenset({str})
_SEQUENCES = frozenset({list, tuple})


def _label(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


def _key_path(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A state path as the key path of its leaf (int keys in decimal)."""
    return tuple(str(p) for p in path)


def _has_surrogate(key: str) -> bool:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _is_tree(v: Any) -> bool:
    """A ``TensorTree`` (or a ``Level``): stored with its own levels, not walked as a container."""
    return isinstance(v, Level) or getattr(type(v), "__memtree_level__", None) is not None


def _walked(v: Any) -> bool:
    """A container the state walk looks into: a mapping, an exact list or tuple."""
    return type(v) in _SEQUENCES or isinstance(v, Mapping)


def _items(v: Any) -> Iterator[tuple[Any, Any]]:
    return enumerate(v) if type(v) in _SEQUENCES else iter(v.items())


class _Shape:
    """What the walk found below one container: whether it needs a level, how many values it
    holds (shared containers counted at every place), how deep lists and dicts nest in it."""

    __slots__ = ("container", "needs_level", "items", "height")

    def __init__(self, container: Any) -> None:
        self.container = container  # held: no id of the survey is reused while it is looked up
        # a mapping that is not a plain dict, or has a key JSON cannot hold, is a level
        self.needs_level = type(container) not in _SEQUENCES and (
            type(container) is not dict or not set(map(type, container)) <= _STR
        )
        self.items = len(container)
        self.height = 1

    def add(self, child: _Shape) -> None:
        self.needs_level = self.needs_level or child.needs_level
        self.items += child.items
        self.height = max(self.height, child.height + 1)


def _survey(state: Any, path: tuple[Any, ...] = ()) -> dict[int, _Shape]:
    """The :class:`_Shape` of every container of ``state`` by ``id`` (each walked once, depth-first
    without recursion).

    Raises:
        NonTensorValueError: a container holds itself (a cycle), or the state holds more than
            :data:`MAX_STATE_ITEMS` values.
    """
    done: dict[int, _Shape] = {}
    on_path: dict[int, tuple[Any, ...]] = {id(state): path}  # the containers being walked
    stack: list[tuple[Any, tuple[Any, ...], Iterator[tuple[Any, Any]], _Shape]] = [
        (state, path, _items(state), _Shape(state))
    ]
    while stack:
        container, path, children, shape = stack[-1]
        for key, child in children:
            kind = type(child)
            if kind in _SCALARS:
                continue
            if kind is not dict and (isinstance(child, (torch.Tensor, np.ndarray)) or _is_tree(child)):
                shape.needs_level = True
            elif kind is dict or _walked(child):
                known = done.get(id(child))
                if known is not None:
                    shape.add(known)
                    continue
                where = path + (key,)
                if id(child) in on_path:
                    raise NonTensorValueError(
                        f"{_label(where)} is the container {_label(on_path[id(child)])} again, "
                        "which holds it: a cycle, which a checkpoint cannot store; break it (store "
                        "an index or a name instead of the container)"
                    )
                if len(where) > _MAX_NESTING:
                    raise NonTensorValueError(
                        f"{_label(where)} nests containers more than {_MAX_NESTING} levels deep "
                        f"({MAX_DEPTH} levels of containers holding tensors, {MAX_JSON_DEPTH} of "
                        "plain values below them); flatten it"
                    )
                on_path[id(child)] = where
                stack.append((child, where, _items(child), _Shape(child)))
                break
        else:
            stack.pop()
            del on_path[id(container)]
            if shape.items > MAX_STATE_ITEMS:
                raise NonTensorValueError(
                    f"{_label(path)} holds more than {MAX_STATE_ITEMS:,} values ({shape.items:,}) "
                    "when the containers it holds at several places are counted at each: a "
                    "checkpoint stores a shared container at every place it appears; store it once "
                    "and refer to it by name"
                )
            done[id(container)] = shape
            if stack:
                stack[-1][3].add(shape)
    return done


def state_to_level(state: Any, keep_dtensors: bool = False) -> Level:
    """The levels of a training ``state`` (a mapping, or a ``TensorTree``), tensors not copied
    (numpy arrays are where torch cannot share their memory: :func:`array_leaf`); a ``DTensor``
    as its full tensor and layout, or itself with ``keep_dtensors`` (a collective write).

    Raises:
        InvalidArgumentError: ``state`` is not a mapping.
        KeyTypeError: a mapping key that is neither ``str`` nor ``int`` (``bool`` included).
        KeyCollisionError: an int key and a str key with the same decimal form (``1`` and ``"1"``).
        InvalidKeyError: a str key with a lone surrogate (UTF-8 cannot encode it).
        NonTensorValueError: a value JSON would change (NaN, an object...), a cycle, a numpy
            masked array; names its path.
        DtypeError: a numpy array of a dtype no tensor holds (str, object, datetime64, structured,
            longdouble); names its path.

    Example:
        >>> state_to_level({"step": 7}).entries["step"].data
        7
    """
    tree = as_level(state, keep_dtensors)
    if tree is not None:
        return tree
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"a checkpoint's state must be a mapping (e.g. {{'model': model.state_dict(), "
            f"'optim': optimizer.state_dict()}}) or a TensorTree, got {type(state).__name__}"
        )
    return _Converter(_survey(state), keep_dtensors).container(state, (), 0)


class _Converter:
    """Turns a surveyed state into levels (containers needing no level become JSON values)."""

    def __init__(self, shapes: dict[int, _Shape], keep_dtensors: bool) -> None:
        self.shapes = shapes
        self.keep_dtensors = keep_dtensors

    def container(self, obj: Any, path: tuple[Any, ...], depth: int) -> Level:
        if depth >= MAX_DEPTH:
            raise NonTensorValueError(f"{_label(path)} nests containers more than {MAX_DEPTH} levels deep")
        kind = "dict" if isinstance(obj, Mapping) else "tuple" if type(obj) is tuple else "list"
        level = Level((), {}, kind)
        int_keys = set()
        for k, v in _items(obj):
            if kind != "dict":
                key = str(k)
            elif type(k) is str:
                if not k:
                    raise KeyTypeError(f"{_label(path)} has the key '', which memtree cannot store; rename it")
                if not k.isascii() and _has_surrogate(k):
                    raise InvalidKeyError(
                        f"{_label(path)} has the key {k!r:.60}, which holds a lone surrogate and "
                        "cannot be written to meta.json (UTF-8); rename it"
                    )
                key = k
            elif isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
                key = str(int(k))
                int_keys.add(key)
            else:
                raise KeyTypeError(
                    f"{_label(path)} has the key {k!r:.60} of type {type(k).__name__}; a checkpoint keeps "
                    "str and int keys only: convert it (e.g. str(key))"
                )
            if key in level.entries:
                raise KeyCollisionError(
                    f"{_label(path)} has both the int key {key} and the str key {key!r}; they would be "
                    "stored under the same name: rename one"
                )
            if isinstance(v, torch.Tensor) and registry.is_dtensor(v):  # its full tensor and layout
                if self.keep_dtensors:
                    level.entries[key] = v
                else:
                    level.entries[key], level.layouts[key] = dtensor_leaf(v, _key_path(path + (k,)))
                continue
            level.entries[key] = self.value(v, path + (k,), depth + 1)
        level.int_keys = frozenset(int_keys)
        return level

    def value(self, v: Any, path: tuple[Any, ...], depth: int) -> Any:
        if isinstance(v, torch.Tensor):  # a tensor subclass (a low-bit optimizer state): its group
            return v if registry.is_plain(v) else registry.to_group(v, _key_path(path))
        if type(v) in _SCALARS:
            return self.json(v, path)
        if isinstance(v, np.ndarray):
            return array_leaf(v, _label(path))
        tree = as_level(v, self.keep_dtensors)
        if tree is not None:
            return tree
        if isinstance(v, (list, tuple)) and type(v) not in (list, tuple):
            raise NonTensorValueError(
                f"{_label(path)} is a {type(v).__name__}, which a checkpoint cannot keep with its "
                "type; convert it to a tuple, list or dict"
            )
        if _walked(v):
            shape = self.shapes.get(id(v))
            if shape is None:  # a mapping that makes its values anew on each access
                self.shapes.update(_survey(v, path))
                shape = self.shapes[id(v)]
            if shape.needs_level:
                return self.container(v, path, depth)
            if shape.height > MAX_JSON_DEPTH:
                raise NonTensorValueError(
                    f"{_label(path)} nests lists and dicts more than {MAX_JSON_DEPTH} levels deep, "
                    "more than a meta.json can hold; flatten it, or store it as a tensor"
                )
        return self.json(_copy_json(v), path)  # numpy scalars made Python's; its depth checked

    def json(self, data: Any, path: tuple[Any, ...]) -> NonTensor:
        """``data`` as a JSON value, or the error naming where in it JSON fails."""
        if json_problem(data) is not None:  # the path only in the message: built on failure
            problem = json_problem(data, _label(path))
            raise NonTensorValueError(  # the Checkpointer never pickles: no allow_pickle advice
                f"{problem}; "
                "a checkpoint keeps tensors and what JSON holds exactly: store it as a tensor "
                "(torch.tensor(x) keeps NaN, inf and any dtype) or convert it (a set to a list, an "
                "object to its state_dict())"
            )
        return NonTensor(data)


def array_leaf(array: np.ndarray[Any, Any], where: str) -> torch.Tensor:
    """The tensor a checkpoint stores for a numpy ``array``: the same values and shape.

    Sharing the array's memory where ``torch.from_numpy`` can (native byte order, writable,
    strides that are non-negative multiples of the item size); otherwise a copy of it: a
    reversed or field view is copied, a big-endian array converted to this machine's byte order
    (a tensor has none: the values are kept, the byte order is not).

    Raises:
        DtypeError: a dtype no tensor holds exactly (str, bytes, object, datetime64,
            timedelta64, structured, longdouble); names ``where``.
        NonTensorValueError: a masked array (its mask would be lost); names ``where``.

    Example:
        >>> import numpy as np
        >>> array_leaf(np.arange(3, dtype=">i2")[::-1], "state['x']")
        tensor([2, 1, 0], dtype=torch.int16)
    """
    if isinstance(array, np.ma.MaskedArray):
        raise NonTensorValueError(
            f"{where} is a numpy masked array, whose mask a tensor cannot keep; store its data and "
            "mask as two entries (np.ma.getdata(x), np.ma.getmaskarray(x)), or fill it (x.filled())"
        )
    dtype = array.dtype
    if (dtype.kind, dtype.itemsize) not in _EXACT_ARRAY_DTYPES or dtype.fields is not None:
        raise DtypeError(
            f"{where} is a numpy array of dtype {dtype}, which no tensor dtype holds "
            "exactly; convert it (datetime64 to int64 with x.astype('int64'), strings to a list, "
            "longdouble to float64) or store it as a value (x.tolist())"
        )
    native = np.dtype(bool) if dtype.kind == "b" else np.dtype(f"={dtype.kind}{dtype.itemsize}")
    if not dtype.isnative or dtype.type in (np.longdouble, np.clongdouble):
        array = array.astype(native)  # a copy: the same values, in the byte order of this machine
    elif not array.flags.writeable or any(s < 0 or s % dtype.itemsize for s in array.strides):
        array = array.copy()  # torch.from_numpy shares neither read-only memory nor such strides
    return torch.from_numpy(np.asarray(array))


def _copy_json(v: Any) -> Any:
    """A copy of a JSON value's lists, tuples and dicts, numpy scalars made Python's."""
    t = type(v)
    if t is list:
        return [_copy_json(x) for x in v]
    if t is tuple:
        return tuple(_copy_json(x) for x in v)
    if t is dict:
        return {k: _copy_json(x) for k, x in v.items()}
    if isinstance(v, (np.bool_, np.integer, np.str_)) or (isinstance(v, np.floating) and v.itemsize <= 8):
        return v.item()  # the same value (float16 and float32 are exact as float)
    return v  # scalars and str: immutable


def tensor_slots(level: Level) -> list[tuple[Level, tuple[str, ...], torch.Tensor]]:
    """Every tensor leaf of ``level`` (and the levels below), as (its level, its key path,
    tensor), in order; the key is the path's last item.

    Example:
        >>> [p for _, p, _ in tensor_slots(state_to_level({"a": torch.ones(1), "b": [torch.ones(1)]}))]
        [('a',), ('b', '0')]
    """
    out: list[tuple[Level, tuple[str, ...], torch.Tensor]] = []
    stack: list[tuple[Level, tuple[str, ...]]] = [(level, ())]
    while stack:
        lvl, path = stack.pop()
        subs = []
        for key, v in lvl.entries.items():
            if isinstance(v, torch.Tensor):
                out.append((lvl, path + (key,), v))
            elif isinstance(v, Level):
                subs.append((v, path + (key,)))
        stack.extend(reversed(subs))
    return out


def copy_values(level: Level) -> None:
    """Replace every non-tensor value of ``level`` (and below) by a copy, so that the caller may
    change its lists and dicts (a scheduler setting ``param_groups[0]["lr"]``) while a background
    save writes the values as they were.

    Example:
        >>> groups = [{"lr": 0.1}]
        >>> level = state_to_level({"g": groups})
        >>> copy_values(level); groups[0]["lr"] = 0.2
        >>> level.entries["g"].data
        [{'lr': 0.1}]
    """
    stack = [level]
    while stack:
        lvl = stack.pop()
        for key, v in lvl.entries.items():
            if isinstance(v, Level):
                stack.append(v)
            elif isinstance(v, NonTensor):
                lvl.entries[key] = NonTensor(_copy_json(v.data))


def level_to_state(level: PendingLevel) -> Any:
    """A checkpoint's levels back as the state that was saved, each container with its type.

    Levels of type ``"dict"``, ``"list"`` or ``"tuple"`` become those; any other level (a saved
    ``TensorTree`` or ``@tensorclass``) becomes a ``TensorTree`` (or its class).
    """
    if level.type not in CONTAINER_TYPES:
        return TensorTree._from_level(level.load_all())
    metas = {e.key: e for e in level.meta.entries}
    items = []
    for key, v in level.load().items():
        entry = metas[key]
        if isinstance(v, PendingLevel):
            v = level_to_state(v)
        elif isinstance(v, Level):  # a tensor subclass's group
            v = registry.rebuild(v, level.keys + (key,))
        elif isinstance(v, NonTensor):
            v = v.data  # tuples in it already made tuples again by the reader
        items.append((int(key) if entry.int_key else key, v))
    if level.type == "dict":
        return dict(items)
    values = [v for _, v in items]
    return tuple(values) if level.type == "tuple" else values
