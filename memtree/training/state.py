"""Training state as training code holds it <-> :class:`~memtree.format.level.Level`, with its types.

A checkpoint's ``state`` is a nested mapping of tensors and plain values: ``model.state_dict()``,
``optimizer.state_dict()`` (int keys under ``"state"``, tuples such as ``betas`` in
``param_groups``), a :class:`~memtree.TensorTree`, scheduler and RNG states. :func:`state_to_level`
turns it into levels of format version 2 (``docs/format.md``, "Version 2", "Python containers"):

* a mapping, list or tuple that holds a tensor, or a mapping with an int key (anywhere below),
  becomes a level of type ``"dict"``, ``"list"`` or ``"tuple"`` (items under ``"0"``, ``"1"``...;
  int keys stored in decimal and marked ``int_key``);
* any other value (scalars, str, None, and lists, tuples and str-keyed dicts of them) is one JSON
  value (the writer records where its tuples are: ``tuples``);
* tensors (and numpy arrays, stored as tensors) are leaves; a ``TensorTree`` keeps its own levels.

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

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, KeyCollisionError, KeyTypeError, NonTensorValueError
from ..format.level import Level, as_level
from ..format.schema import CONTAINER_TYPES, MAX_DEPTH
from ..format.values import NonTensor, json_problem
from ..store.read import PendingLevel
from ..tree.tensortree import TensorTree

__all__ = ["state_to_level", "level_to_state", "tensor_slots", "copy_values"]


def _label(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


def _is_tensor(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def _needs_level(v: Any) -> bool:
    """True if ``v`` (a container) holds a tensor, a tree or a non-str mapping key anywhere below."""
    stack = [v]
    while stack:
        x = stack.pop()
        if _is_tensor(x) or as_level(x) is not None:
            return True
        if isinstance(x, Mapping):
            if type(x) is not dict or any(type(k) is not str for k in x):
                return True
            stack.extend(x.values())
        elif type(x) is list or type(x) is tuple:
            stack.extend(x)
    return False


def state_to_level(state: Any) -> Level:
    """The levels of a training ``state`` (a mapping, or a ``TensorTree``), leaves not copied.

    Raises:
        InvalidArgumentError: ``state`` is not a mapping.
        KeyTypeError: a mapping key that is neither ``str`` nor ``int`` (``bool`` included).
        KeyCollisionError: an int key and a str key with the same decimal form (``1`` and ``"1"``).
        NonTensorValueError: a value JSON would change (NaN, an object...); names its path.

    Example:
        >>> state_to_level({"step": 7}).entries["step"].data
        7
    """
    if as_level(state) is None and not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"a checkpoint's state must be a mapping (e.g. {{'model': model.state_dict(), "
            f"'optim': optimizer.state_dict()}}) or a TensorTree, got {type(state).__name__}"
        )
    return _container(state, (), 0)


def _container(obj: Any, path: tuple[Any, ...], depth: int) -> Level:
    tree = as_level(obj)
    if tree is not None:
        return tree
    if depth >= MAX_DEPTH:
        raise NonTensorValueError(f"{_label(path)} nests containers more than {MAX_DEPTH} levels deep")
    if isinstance(obj, Mapping):
        kind = "dict"
        items = list(obj.items())
    else:
        kind = "tuple" if type(obj) is tuple else "list"
        items = list(enumerate(obj))
    level = Level((), {}, kind)
    int_keys = set()
    for k, v in items:
        if kind != "dict":
            key = str(k)
        elif type(k) is str:
            if not k:
                raise KeyTypeError(f"{_label(path)} has the key '', which memtree cannot store; rename it")
            key = k
        elif isinstance(k, int) and not isinstance(k, bool):
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
        level.entries[key] = _value(v, path + (k,), depth + 1)
    level.int_keys = frozenset(int_keys)
    return level


def _value(v: Any, path: tuple[Any, ...], depth: int) -> Any:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v if v.flags.writeable else v.copy())
    if isinstance(v, np.generic) and isinstance(v, (np.bool_, np.integer, np.floating)):
        v = v.item()
    if (isinstance(v, (Mapping, list, tuple)) and _needs_level(v)) or as_level(v) is not None:
        if isinstance(v, (list, tuple)) and type(v) not in (list, tuple):
            raise NonTensorValueError(
                f"{_label(path)} is a {type(v).__name__}, which a checkpoint cannot keep with its "
                "type; convert it to a tuple, list or dict"
            )
        return _container(v, path, depth)
    problem = json_problem(v, _label(path))
    if problem is not None:  # the Checkpointer never pickles: no allow_pickle advice here
        raise NonTensorValueError(
            f"{problem}; "
            "a checkpoint keeps tensors and what JSON holds exactly: store it as a tensor "
            "(torch.tensor(x) keeps NaN, inf and any dtype) or convert it (a set to a list, an "
            "object to its state_dict())"
        )
    return NonTensor(v)


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


def _copy_json(v: Any) -> Any:
    t = type(v)
    if t is list:
        return [_copy_json(x) for x in v]
    if t is tuple:
        return tuple(_copy_json(x) for x in v)
    if t is dict:
        return {k: _copy_json(x) for k, x in v.items()}
    return v  # scalars and str: immutable


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
        elif isinstance(v, NonTensor):
            v = v.data  # tuples in it already made tuples again by the reader
        items.append((int(key) if entry.int_key else key, v))
    if level.type == "dict":
        return dict(items)
    values = [v for _, v in items]
    return tuple(values) if level.type == "tuple" else values
