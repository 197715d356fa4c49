"""Loading any source into a module: :func:`load_into_module` and its :class:`LoadResult`.

A source is a :class:`~memtree.TensorTree`, a memtree directory, a flat ``state_dict`` or a
checkpoint file (``torch.save``, ``.safetensors``, read lazily through :mod:`memtree.interop`);
it is seen as flat dotted names (:class:`memtree.tree.tensortree.bind.Source`), matched to the module's
slots and bound (see :mod:`memtree.tree.bind` for what binding means and how ties are kept).

Example:
    >>> import tempfile, torch, memtree
    >>> from torch import nn
    >>> d = tempfile.mkdtemp() + "/m"
    >>> _ = memtree.TensorTree.from_module(nn.Linear(2, 2)).memmap(d)
    >>> memtree.load_into_module(nn.Linear(2, 2), d)
    LoadResult(missing=[], unexpected=[])
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import MemtreeKeyError, SourceError
from ..interop import open_checkpoint
from ..tree.bind import (
    TIED_KEY,
    KeyPrefix,
    Source,
    bind,
    module_groups,
    names_list,
    plan,
    prefixes,
    source_from_leaves,
    unmatched_prefixes,
)
from ..tree.tensortree import TensorTree, load_memmap

__all__ = ["LoadResult", "as_source", "load_into_module"]


class LoadResult(NamedTuple):
    """What :func:`load_into_module` could not match, as dotted ``state_dict()`` names.

    Attributes:
        missing: the module's tensors that the source does not provide (they keep their
            current value; meta tensors are initialised, see :func:`load_into_module`).
        unexpected: the source's tensors that match no tensor of the module.
    """

    missing: list[str]
    unexpected: list[str]


def _tree_source(tree: TensorTree) -> Source:
    return source_from_leaves(
        ((k,) if isinstance(k, str) else k, v) for k, v in tree.items(include_nested=True, leaves_only=True)
    )


def _source_from_mapping(source: Mapping[Any, Any]) -> Source:
    if any(isinstance(v, Mapping) and k != TIED_KEY for k, v in source.items()):
        return _tree_source(TensorTree(source))
    leaves: list[tuple[tuple[str, ...], Any]] = []
    for key, value in source.items():
        name = ".".join(key) if isinstance(key, tuple) else key
        if not isinstance(name, str):
            raise SourceError(f"state_dict keys must be str, got {key!r}")
        leaves.append(((name,), value))
    return source_from_leaves(leaves, "state_dict")


def _source_from_file(path: str) -> Source:
    mapping = open_checkpoint(path)
    return Source({k: k for k in mapping.keys() if k != TIED_KEY}, {}, lazy=mapping)


def as_source(source: Any, *, mode: str = "r") -> Source:
    """Any source :func:`load_into_module` takes, as a :class:`~memtree.tree.tensortree.bind.Source`."""
    if isinstance(source, Source):
        return source
    if isinstance(source, TensorTree):
        return _tree_source(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isfile(path):
            return _source_from_file(path)
        return _tree_source(load_memmap(path, mode=mode))
    if isinstance(source, Mapping):
        if callable(getattr(source, "tensor_spec", None)):
            return Source({k: k for k in source.keys() if k != TIED_KEY}, {}, lazy=source)
        return _source_from_mapping(source)
    raise SourceError(
        f"cannot load from a {type(source).__name__}: pass a TensorTree, a memtree directory, "
        "a checkpoint file path, or a state_dict (a mapping of dotted names to tensors)"
    )


def load_into_module(
    module: nn.Module,
    source: Any,
    *,
    strict: bool = True,
    keys: Iterable[KeyPrefix] | KeyPrefix | None = None,
    device: torch.device | str | None = None,
) -> LoadResult:
    """Load ``source`` into ``module``'s parameters and buffers, binding (not copying) tensors.

    Tensors are bound as in :func:`to_module`: with a memtree directory, the module's weights
    become read-only copy-on-write mappings of the files (no data is read until used, and the
    files never change). Names are the dotted ``state_dict()`` names of the module.

    Module tensors the source does not provide are reported in ``missing`` and keep their
    current value. In a module built under :func:`empty_init` they stay on the meta device, so
    that a checkpoint in several parts (shards) can be loaded by several calls without
    allocating the parts still to come; call :func:`init_missing` once every part is loaded to
    allocate and initialise what no source provided (a new head, for example).

    Args:
        module: the module to load into.
        source: a :class:`~memtree.TensorTree`, a memtree directory, a flat ``state_dict``
            (``{"encoder.0.weight": tensor, ...}``), or a checkpoint file (``torch.save``,
            ``.safetensors``; read through ``memtree.interop``, lazily: only the tensors that
            are bound are read).
        strict: raise :class:`~memtree.MemtreeKeyError` if anything is missing or unexpected,
            before changing anything.
        keys: load only names under these dotted prefixes or tuples (``"encoder"``,
            ``("encoder", "0")``); ``missing``/``unexpected`` are then computed within them.
        device: move the tensors there (a copy) before binding; ``None`` binds them where the
            source has them.

    Returns:
        :class:`LoadResult` ``(missing, unexpected)``, lists of dotted names.

    Raises:
        ShapeMismatchError: a source tensor's shape or dtype differs from the module's (named
            with both sides); raised before anything changes, even with ``strict=False``.
        MemtreeKeyError: ``strict=True`` and names are missing or unexpected; or a ``keys=``
            entry names no tensor or sub-module of the module and nothing in the source.
        SourceError: the source is of an unknown kind or cannot be read.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> from memtree import TensorTree, empty_init, init_missing
        >>> d = tempfile.mkdtemp() + "/m"
        >>> _ = TensorTree.from_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))).memmap(d)
        >>> with empty_init():
        ...     new = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))   # a new head
        >>> load_into_module(new, d, keys=["0"])      # "1" differs in shape: load only "0"
        LoadResult(missing=[], unexpected=[])
        >>> init_missing(new)                         # allocate and initialise the new head
        ['1.weight', '1.bias']
        >>> new(torch.ones(1, 4)).shape
        torch.Size([1, 3])
    """
    src = as_source(source, mode="r")
    selected = prefixes(keys)
    unmatched = unmatched_prefixes(selected, module, src) if selected is not None else []
    if unmatched:
        raise MemtreeKeyError(
            f"load_into_module: keys= entries {unmatched[:10]} name no tensor or sub-module of "
            f"{type(module).__name__} and no tensor of the source; nothing was loaded. keys= takes "
            "dotted prefixes of state_dict() names, such as 'encoder' or 'encoder.0'"
        )
    found = plan(module_groups(module), src, selected)
    if strict and (found.missing_names or found.unexpected):
        parts = []
        if found.missing_names:
            parts.append(f"missing from the source: {names_list(found.missing_names)}")
        if found.unexpected:
            parts.append(f"unexpected in the source: {names_list(found.unexpected)}")
        raise MemtreeKeyError(
            f"load_into_module(strict=True) into {type(module).__name__}: "
            + "; ".join(parts)
            + ". Nothing was changed: pass strict=False to load what matches, or keys= to "
            "load only a sub-tree"
        )
    dev = torch.device(device) if device is not None else None

    def convert(_kind: str, _name: str, value: Any) -> Any:
        if dev is not None and isinstance(value, torch.Tensor) and value.device != dev:
            return value.to(dev)
        return value

    bind(found, src, convert)
    return LoadResult(found.missing_names, found.unexpected)


