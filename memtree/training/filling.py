"""``Checkpointer.restore(into=...)``: live objects filled from a restored state, and the
:class:`RestoreReport` of what each received.

``into`` is an ``nn.Module``, an object with ``load_state_dict`` (an optimizer, a scheduler), or
a mapping of them that mirrors the state (``{"model": model, "optim": optimizer}``). A module is
filled by :func:`memtree.load_into_module` from the tensors of the state at its place, as dotted
names (``{"model": {"0.weight": w}}`` seen from the root is ``"model.0.weight"``), with the
``strict``, ``prefix`` and ``ignore_mismatched`` of ``restore``; its
:class:`~memtree.LoadResult` goes into the report. Any other object gets
``load_state_dict(state at its place)``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(2, 2)
    >>> state = {"model": {k: v + 1 for k, v in model.state_dict().items()}, "epoch": 3}
    >>> out, filled = fill_into({"model": model, "sched": nn.Linear(1, 1)}, state, strict=False,
    ...                         prefix=None, ignore_mismatched=False)
    >>> out["model"] is model, out["epoch"], filled.loaded, filled.missing
    (True, 3, ['model'], ['sched'])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidArgumentError, MemtreeError, MemtreeKeyError, SourceError
from ..nn.loading import LoadResult, load_into_module
from ..tree.tensortree import TensorTree

__all__ = ["RestoreReport", "Filled", "fill_into", "flat_tensors"]


@dataclass
class Filled:
    """What :func:`fill_into` filled (see :class:`RestoreReport`)."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    modules: dict[str, LoadResult] = field(default_factory=dict)


@dataclass(frozen=True)
class RestoreReport:
    """What the last :meth:`memtree.Checkpointer.restore` read and filled
    (``ckpt.last_restore``).

    Places in ``into`` are named by their keys joined with dots (``"model"``, ``"optim"``,
    ``"a.b"`` for ``into={"a": {"b": ...}}``); ``""`` is ``into`` itself.

    Attributes:
        step: the step restored (the newest, with ``step=None``).
        path: its directory.
        verified: its checksums and tree hash were checked (``verify=True``, and the step
            records them: a tree written with ``checksum=None`` has nothing to check).
        loaded: the places of ``into`` that were filled (modules and ``load_state_dict`` objects).
        missing: the places of ``into`` that the restored state does not hold (skipped with
            ``strict=False``; with ``strict=True`` they raise before anything is filled).
        modules: each module's :class:`~memtree.LoadResult`, by place: the module's tensors the
            checkpoint lacks (``missing``), the checkpoint's tensors no slot took
            (``unexpected``) and those skipped for their shape (``mismatched``, with
            ``ignore_mismatched=True``).

    Example:
        >>> import tempfile, torch, memtree
        >>> ckpt = memtree.Checkpointer(tempfile.mkdtemp())
        >>> _ = ckpt.save(5, {"model": torch.nn.Linear(2, 2).state_dict()})
        >>> _ = ckpt.restore(into={"model": torch.nn.Linear(2, 2)})
        >>> ckpt.last_restore.step, ckpt.last_restore.modules["model"]
        (5, LoadResult(missing=[], unexpected=[]))
    """

    step: int
    path: str
    verified: bool
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    modules: dict[str, LoadResult] = field(default_factory=dict)


def _place(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _label(path: tuple[Any, ...]) -> str:
    return "into" + "".join(f"[{p!r}]" for p in path)


def flat_tensors(state: Any, where: str) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` (nested dicts, lists, tuples, ``TensorTree``\\ s) by dotted name,
    in order, as ``state_dict()`` names them; other values are left out.

    Raises:
        SourceError: two paths give one dotted name (``{"a.b": x, "a": {"b": y}}``).

    Example:
        >>> list(flat_tensors({"model": {"0.weight": torch.ones(1)}, "opt": [torch.ones(1), 3]}, "state"))
        ['model.0.weight', 'opt.0']
    """
    out: dict[str, torch.Tensor] = {}

    def visit(name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if name in out:
                raise SourceError(
                    f"{where}: two tensors have the dotted name {name!r} (keys that contain dots "
                    "and nested keys meet); a module cannot be filled from it: restore without "
                    "into= and load the parts yourself"
                )
            out[name] = value
            return
        if isinstance(value, TensorTree):
            items: Any = (
                (".".join(k) if isinstance(k, tuple) else k, v)
                for k, v in value.items(include_nested=True, leaves_only=True)
            )
        elif isinstance(value, Mapping):
            items = value.items()
        elif isinstance(value, (list, tuple)):
            items = enumerate(value)
        else:
            return
        for key, v in items:
            visit(f"{name}.{key}" if name else str(key), v)

    visit("", state)
    return out


def _check_into(into: Any, path: tuple[Any, ...]) -> bool:
    """Refuse an ``into`` that holds anything but modules, ``load_state_dict`` objects and
    mappings of them (before anything is filled); whether it holds a module."""
    if isinstance(into, torch.nn.Module):
        return True
    if hasattr(into, "load_state_dict"):
        return False
    if isinstance(into, Mapping):
        return any([_check_into(v, path + (k,)) for k, v in into.items()])
    raise InvalidArgumentError(
        f"{_label(path)} must be an nn.Module, an object with load_state_dict, or a mapping of "
        f"them, got {type(into).__name__}"
    )


def _check_keys(into: Any, state: Any, path: tuple[Any, ...]) -> None:
    """``strict=True``: every key of ``into`` (nested mappings too) is in ``state``, checked
    before anything is filled."""
    if isinstance(into, torch.nn.Module) or not isinstance(into, Mapping) or not isinstance(state, Mapping):
        return
    for key, target in into.items():
        if key not in state:
            raise MemtreeKeyError(
                f"{_label(path + (key,))}: the restored state has no key {key!r} there (keys "
                f"there: {list(state)[:20]}); nothing was filled. Pass strict=False to fill what "
                "the checkpoint holds and skip it (restore's keys= reads only the keys it names)"
            )
        _check_keys(target, state[key], path + (key,))


def fill_into(
    into: Any, state: Any, *, strict: bool, prefix: str | None, ignore_mismatched: bool
) -> tuple[Any, Filled]:
    """Fill ``into`` from ``state`` (see the module docstring); returns the state with the
    filled objects at their places, and what was filled.

    Raises:
        InvalidArgumentError: ``into`` is not a module, an object with ``load_state_dict`` or a
            mapping of them, or does not mirror the state; ``prefix``/``ignore_mismatched``
            without a module in ``into``.
        MemtreeKeyError: ``strict=True`` and a key of ``into`` is not in the state (before
            anything is filled), or a module's names do not match (``load_into_module``).
        SourceError: a ``load_state_dict`` raised (its error chained).
    """
    if not _check_into(into, ()) and (prefix is not None or ignore_mismatched):
        raise InvalidArgumentError(
            "restore: prefix= and ignore_mismatched= say how the nn.Modules of into= are filled, "
            f"and into= holds none (got {type(into).__name__}); leave them out"
        )
    if strict:
        _check_keys(into, state, ())
    filled = Filled()
    return _fill(into, state, (), filled, strict, prefix, ignore_mismatched), filled


def _fill(
    into: Any, state: Any, path: tuple[Any, ...], filled: Filled, strict: bool, prefix: str | None, ignore: bool
) -> Any:
    if isinstance(into, torch.nn.Module):
        if not isinstance(state, (Mapping, TensorTree)):
            raise InvalidArgumentError(
                f"{_label(path)} is an nn.Module, but the checkpoint holds a {type(state).__name__} "
                "there, not a state_dict"
            )
        source = flat_tensors(state, f"the state at {_label(path)}")
        result = load_into_module(into, source, strict=strict, prefix=prefix, ignore_mismatched=ignore)
        filled.modules[_place(path)] = result
        filled.loaded.append(_place(path))
        return into
    if hasattr(into, "load_state_dict"):
        try:
            into.load_state_dict(state)
        except MemtreeError:
            raise
        except Exception as err:  # the object's own error (torch's ValueError, KeyError...)
            raise SourceError(
                f"{_label(path)}.load_state_dict(...) refused the checkpoint's state there: "
                f"{type(err).__name__}: {err}"
            ) from err
        filled.loaded.append(_place(path))
        return into
    if not isinstance(state, Mapping):  # into is a mapping (_check_into)
        raise InvalidArgumentError(
            f"{_label(path)} is a mapping, but the checkpoint holds a {type(state).__name__} there"
        )
    out = dict(state)
    for key, target in into.items():
        if key not in state:  # strict=False (strict checked every key before)
            filled.missing.append(_place(path + (key,)))
            continue
        out[key] = _fill(target, state[key], path + (key,), filled, strict, prefix, ignore)
    return out
