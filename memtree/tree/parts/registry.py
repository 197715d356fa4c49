"""The registry of ``@tensorclass`` names: which class a level's ``"type"`` stands for.

Every level's ``meta.json`` records a ``"type"``: ``"TensorTree"`` for a plain tree, or the
registered name of a :func:`memtree.tensorclass` (``docs/format.md``, "Typed levels"). Loading
looks the name up here and nowhere else: memtree never imports a module named in a file, so a
class is known only once the module that defines it has been imported in this process. An
unknown name is an :class:`~memtree.errors.UnknownClassError`, unless the caller asks for
``unknown_classes="tree"``.

This module sits below :mod:`memtree.tree.tensortree` (which resolves names while loading) and
:mod:`memtree.tree.records` (which registers classes); it holds no tree logic.

Example:
    >>> from memtree.tree.parts.registry import class_for, register
    >>> class Point: ...
    >>> register("docs.Point", Point)
    >>> class_for("docs.Point", "error", ()) is Point, class_for("TensorTree", "error", ())
    (True, None)
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidArgumentError, TensorclassError, UnknownClassError
from ...format.schema import CONTAINER_TYPES, TREE_TYPE, TYPE_NAME_MAX, is_type_name

__all__ = ["RESERVED_PREFIX", "UNKNOWN_CLASSES", "register", "class_for", "class_for_foreign"]

#: Names starting with this prefix are reserved for memtree's own container types.
RESERVED_PREFIX = "memtree."
#: Accepted values of ``load_memmap(..., unknown_classes=...)``.
UNKNOWN_CLASSES = ("error", "tree")

_CLASSES: dict[str, type[Any]] = {}


def register(name: str, cls: type[Any]) -> None:
    """Register ``cls`` under ``name`` (what its levels record as ``"type"`` on disk).

    Registering the same class again, or a class with the same module and qualified name (a
    module reloaded, a notebook cell run twice), replaces the entry; any other class already
    registered under ``name`` is refused.

    Raises:
        TensorclassError: ``name`` is not a valid type name (see
            :func:`memtree.format.is_type_name`), is reserved (``"TensorTree"``, ``"dict"``, ``"list"``, ``"tuple"``, ``"memtree.*"``),
            or names another class.
    """
    if not is_type_name(name):
        raise TensorclassError(
            f"@tensorclass name {name!r:.80} for {cls.__qualname__} is not a name memtree can "
            "store: dotted words of ASCII letters, digits and '_', each starting with a letter, "
            f"at most {TYPE_NAME_MAX} characters; pass name='...' to @tensorclass"
        )
    if name == TREE_TYPE or name in CONTAINER_TYPES or name.startswith(RESERVED_PREFIX):
        raise TensorclassError(
            f"@tensorclass name {name!r} is reserved for memtree's own types; choose another "
            "name with @tensorclass(name='...')"
        )
    current = _CLASSES.get(name)
    same = current is not None and (current.__module__, current.__qualname__) == (
        cls.__module__,
        cls.__qualname__,
    )
    if current is not None and not same:
        raise TensorclassError(
            f"@tensorclass name {name!r} is already registered to {current.__module__}."
            f"{current.__qualname__}; give {cls.__module__}.{cls.__qualname__} another name with "
            "@tensorclass(name='...'): names identify classes on disk and must be unique"
        )
    _CLASSES[name] = cls


def class_for(type_name: str, unknown_classes: str, path: tuple[str, ...]) -> type[Any] | None:
    """The class a level of type ``type_name`` loads as.

    Args:
        type_name: the level's ``"type"`` (already validated by :func:`memtree.format.parse_level`).
        unknown_classes: ``"error"`` (raise for an unregistered name) or ``"tree"`` (load it as
            a plain tree).
        path: the level's key path, for messages (``()`` for the root).

    Returns:
        The registered class, or ``None`` for a plain tree (``"TensorTree"``, or an unknown
        name with ``unknown_classes="tree"``).

    Raises:
        UnknownClassError: the name is not registered and ``unknown_classes="error"``.
        ValueError: ``unknown_classes`` is not one of :data:`UNKNOWN_CLASSES`.
    """
    if unknown_classes not in UNKNOWN_CLASSES:
        raise InvalidArgumentError(f"unknown_classes must be 'error' or 'tree', got {unknown_classes!r}")
    if type_name == TREE_TYPE or type_name in CONTAINER_TYPES:  # a dict/list/tuple: a plain tree
        return None
    cls = _CLASSES.get(type_name)
    if cls is not None or unknown_classes == "tree":
        return cls
    where = "the tree's root"
    if path:
        where = f"the sub-tree at key {path[0] if len(path) == 1 else path!r}"
    raise UnknownClassError(
        f"{where} is stored as class {type_name!r} (its meta.json \"type\"), which no "
        f"@tensorclass registered in this process (registered: {sorted(_CLASSES)[:10]}). Import "
        "the module that defines it before loading (memtree never imports modules named in a "
        "file), or pass unknown_classes='tree' to load it as a plain TensorTree"
    )


def class_for_foreign(foreign_type: str) -> type[Any] | None:
    """The registered class for a class another library recorded (tensordict's ``_type``).

    ``"<class 'pkg.mod.Step'>"`` is matched, as text (nothing is imported), against the names
    ``pkg.mod.Step``, ``mod.Step`` and ``Step`` in that order: the longest one registered wins,
    so a memtree class named like the tensordict class (its default name is the class's
    qualified name) or registered under its full path (``@tensorclass(name="pkg.mod.Step")``)
    is found. ``None`` when none is registered: the level loads as a plain tree.

    Example:
        >>> class Pair: ...
        >>> register("docs.Pair", Pair)
        >>> class_for_foreign("<class 'docs.Pair'>") is Pair, class_for_foreign("<class 'x.Nope'>")
        (True, None)
    """
    dotted = foreign_type.removeprefix("<class '").removesuffix("'>")
    parts = dotted.split(".")
    for start in range(len(parts)):
        name = ".".join(parts[start:])
        if is_type_name(name) and name != TREE_TYPE and name in _CLASSES:
            return _CLASSES[name]
    return None
