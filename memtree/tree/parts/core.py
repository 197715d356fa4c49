"""The core of a tree: entries, batch size, key access, batch indexing, equality, locking.

:class:`TreeCore` is the base of :class:`~memtree.TensorTree` (see :mod:`memtree.tree.tensortree`).

Example:
    >>> import torch, memtree
    >>> tree = memtree.TensorTree({"x": torch.arange(4)}, batch_size=[4])
    >>> isinstance(tree, TreeCore), tree[1:3]["x"].tolist()
    (True, [1, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from math import prod
from typing import Any

from typing_extensions import Self

import numpy as np
import torch

from ...errors import (
    BatchSizeError,
    KeyCollisionError,
    LockedError,
    MemtreeKeyError,
    ShapeMismatchError,
    NonTensorValueError,
    SourceError,
    UnsizedTreeError,
    AmbiguousTruthError,
    InvalidIndexError,
)
from ...format.names import validate_key
from ...format.schema import starts_with_batch
from ...format.level import Level
from ...format.values import NonTensor, check_nesting
from ...store.reading.mapped import MemoryMappedTensor
from ...store.reading.read import PendingLevel, loading_lock
from . import bind
from ...format import subclass_registry as registry
from .subclasses import dtensor_leaf
from .args import (
    Key,
    as_size,
    batch_rows,
    check_batch_index,
    check_rows,
    expand_ellipsis,
    fmt_key,
    is_str_key,
    key_tuple,
)
from .gather import batch_memory, gather
from .numpy_view import numpy_value
from .registry import class_for, class_for_foreign

__all__ = ["TreeCore", "Key"]

_MISSING: Any = object()


class TreeCore:
    """The core of :class:`~memtree.TensorTree`: entries, batch size, keys, indexing, locking.

    Sub-trees of any tree are plain trees: the class :meth:`_base` names (``TensorTree``).
    """

    #: A level opened lazily (``load_memmap``): its entries load on first access of ``_data``.
    _pending: tuple[PendingLevel, str] | None = None

    @property
    def _data(self) -> dict[str, Any]:
        """The entries (loading them first if this level was opened lazily)."""
        if self._pending is not None:
            self._load_pending()
        return self._entries

    @_data.setter
    def _data(self, entries: dict[str, Any]) -> None:
        self._entries = entries
        self._pending = None

    def _load_pending(self) -> None:
        with loading_lock():
            if self._pending is None:  # another thread loaded it meanwhile
                return
            level, unknown_classes = self._pending
            entries: dict[str, Any] = {}
            for k, v in level.load().items():
                if isinstance(v, PendingLevel):
                    entries[k] = self._base()._lazy(v, self._device, unknown_classes)
                elif isinstance(v, Level):  # a tensor subclass's group
                    entries[k] = self._base()._subclass_value(v, unknown_classes, level.keys + (k,))
                else:
                    entries[k] = v
            self._data = entries

    @classmethod
    def _lazy(cls, level: PendingLevel, device: torch.device | None, unknown_classes: str) -> Self:
        """A tree of a lazily opened level: its class and batch size now, its entries on use."""
        target = class_for(level.type, unknown_classes, level.keys) or cls
        out = target._empty(torch.Size(level.batch_size), device)
        out._pending = (level, unknown_classes)
        return out

    def _load_selected(self, selection: dict[str, Any] | None) -> None:
        """Load the levels on the paths a ``keys=`` selection names (raising for absent keys)."""
        if selection is None:
            return
        for key, sub in selection.items():
            child = self._data.get(key)
            if isinstance(child, TreeCore):
                child._load_selected(sub)

    def __getstate__(self) -> dict[str, Any]:  # pickle/copy: every lazy level loaded first
        for _ in self._walk():
            pass
        return self.__dict__

    def __init__(
        self,
        source: Mapping[str, Any] | TreeCore | None = None,
        batch_size: Any = None,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size is None:
            batch_size = source.batch_size if isinstance(source, TreeCore) else ()
        if device is None and isinstance(source, TreeCore):
            device = source.device
        self._data: dict[str, Any] = {}
        self._batch_size = as_size(batch_size)
        self._device = torch.device(device) if device is not None else None
        self._locked = False
        if source is not None:
            items = source._data.items() if isinstance(source, TreeCore) else source.items()
            for key, value in items:
                self._set_one(key, value)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def _empty(cls, batch_size: torch.Size, device: torch.device | None) -> Self:
        out = cls.__new__(cls)
        out._data = {}
        out._batch_size = batch_size
        out._device = device
        out._locked = False
        return out

    def _new_like(self, batch_size: torch.Size | None = None) -> Self:
        return type(self)._empty(self._batch_size if batch_size is None else batch_size, self._device)

    def _convert(self, key: str, value: Any) -> Any:
        kind = type(value)
        if kind is torch.Tensor or kind is MemoryMappedTensor or kind is torch.nn.Parameter:
            return self._tensor(key, value)  # the common case first; any other tensor below
        if isinstance(value, NonTensor):
            check_nesting(value.data, repr(key))
            return value
        if isinstance(value, TreeCore):
            if not starts_with_batch(value._batch_size, self._batch_size):
                raise BatchSizeError(
                    f"sub-tree {key!r} has batch_size {list(value._batch_size)}, which does not "
                    f"start with this tree's {list(self._batch_size)}"
                )
            if self._device is not None and value._device != self._device:
                value = value.to(self._device)  # type: ignore[attr-defined]  # every tree has ShapeOps.to
            return value
        if isinstance(value, Mapping):
            return self._base()(value, batch_size=self._batch_size, device=self._device)
        if isinstance(value, np.generic):  # numpy scalars are the JSON numbers/bools they hold
            if not isinstance(value, (np.bool_, np.integer, np.floating)):
                raise NonTensorValueError(
                    f"value for key {key!r} is a numpy {type(value).__name__}, which memtree cannot "
                    "store as a non-tensor value; store it as a tensor (torch.tensor(...)) instead"
                )
            value = value.item()
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            return self._tensor(key, value)
        check_nesting(value, repr(key))
        return NonTensor(value)

    def _tensor(self, key: str, value: torch.Tensor) -> torch.Tensor:
        if type(value) is MemoryMappedTensor:  # its shape and device without its __torch_function__
            with torch._C.DisableTorchFunctionSubclass():
                shape, device = value.shape, value.device
        else:
            shape, device = value.shape, value.device
        if not starts_with_batch(shape, self._batch_size):
            raise BatchSizeError(
                f"tensor for key {key!r} has shape {list(shape)}, which does not start "
                f"with the tree's batch_size {list(self._batch_size)}; reshape it or change "
                "the tree's batch_size"
            )
        if self._device is not None and device != self._device:
            value = value.to(self._device)
        return value

    def _set_one(self, key: Any, value: Any) -> None:
        key = validate_key(key)
        if self._locked:
            raise LockedError(
                f"cannot set key {key!r}: the tree is locked (no key added, removed or replaced); "
                "call unlock_() first, or write in place with tree[key][...] = value"
            )
        self._data[key] = self._convert(key, value)

    # ------------------------------------------------------------------------- properties
    @property
    def batch_size(self) -> torch.Size:
        """The leading dims shared by every leaf."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        size = as_size(value)
        for key, leaf in self.items(include_nested=True, leaves_only=True):
            if isinstance(leaf, torch.Tensor) and leaf.shape[: len(size)] != size:
                raise BatchSizeError(
                    f"cannot set batch_size {list(size)}: leaf {key!r} has shape {list(leaf.shape)}"
                )
        self._set_batch_size(size)

    def _set_batch_size(self, size: torch.Size) -> None:
        for v in self._data.values():
            if isinstance(v, TreeCore) and not starts_with_batch(v._batch_size, size):
                v._set_batch_size(size)
        self._batch_size = size

    @property
    def shape(self) -> torch.Size:
        """Same as :attr:`batch_size`."""
        return self._batch_size

    @property
    def ndim(self) -> int:
        """Number of batch dims."""
        return len(self._batch_size)

    @property
    def device(self) -> torch.device | None:
        """The device every leaf is moved to, or ``None`` when unset (leaves may differ)."""
        return self._device

    @property
    def is_locked(self) -> bool:
        """True after :meth:`lock_`: keys cannot be added, removed or replaced."""
        return self._locked

    def numel(self) -> int:
        """Number of elements of the batch (product of ``batch_size``)."""
        return prod(self._batch_size)

    def __len__(self) -> int:
        if not self._batch_size:
            raise UnsizedTreeError("len() of a TensorTree with batch_size () is undefined (like a 0-dim tensor)")
        return self._batch_size[0]

    def __iter__(self) -> Iterator[Self]:
        """Iterate over the first batch dim (like a tensor); use :meth:`keys` for keys."""
        for i in range(len(self)):
            yield self[i]

    # ------------------------------------------------------------------------ key access
    def _lookup(self, path: tuple[str, ...]) -> Any:
        node: Any = self
        for depth, part in enumerate(path):
            if not isinstance(node, TreeCore):
                raise MemtreeKeyError(
                    f"key {fmt_key(path)}: {fmt_key(path[:depth])} is a leaf, not a sub-tree"
                )
            try:
                node = node._data[part]
            except KeyError:
                raise MemtreeKeyError(
                    f"key {fmt_key(path)} not found (keys at that level: "
                    f"{list(node._data)[:20]})"
                ) from None
        return node

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str) or (isinstance(key, tuple) and key and is_str_key(key)):
            value = self._lookup(key_tuple(key))
            return value.data if isinstance(value, NonTensor) else value
        if self._batch_size:
            batch = self._gather(key, batch_memory())
            if batch is not None:
                return batch
        check_batch_index(key)
        return self._index(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if type(key) is int:  # data[i] = item: the hot loop of filling a dataset
            self._assign(key, value)
            return
        if isinstance(key, str) or (isinstance(key, tuple) and key and is_str_key(key)):
            path = key_tuple(key)
            node = self
            created: list[tuple[TreeCore, str]] = []
            try:
                for part in path[:-1]:
                    nxt = node._data.get(part)
                    if nxt is None:
                        nxt = node._base()._empty(node._batch_size, node._device)
                        node._set_one(part, nxt)
                        created.append((node, part))
                    elif not isinstance(nxt, TreeCore):
                        raise MemtreeKeyError(f"cannot set {fmt_key(path)}: {part!r} is a leaf, not a sub-tree")
                    node = nxt
                node._set_one(path[-1], value)
            except BaseException:
                for parent, part in reversed(created):  # leave no empty sub-tree behind
                    del parent._data[part]
                raise
            return
        check_batch_index(key)
        self._assign(key, value)

    def __delitem__(self, key: Key) -> None:
        path = key_tuple(key)
        parent = self._lookup(path[:-1]) if len(path) > 1 else self
        if not isinstance(parent, TreeCore) or path[-1] not in parent._data:
            raise MemtreeKeyError(f"key {fmt_key(path)} not found")
        if parent._locked:
            raise LockedError(f"cannot delete key {fmt_key(path)}: the tree is locked; unlock_() first")
        del parent._data[path[-1]]

    def __contains__(self, key: object) -> bool:
        if not is_str_key(key):
            return False
        try:
            self._lookup(key_tuple(key))  # type: ignore[arg-type]
        except MemtreeKeyError:
            return False
        return True

    def get(self, key: Key, default: Any = None) -> Any:
        """The value at ``key`` (str or tuple), or ``default`` if absent.

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"a": torch.ones(1)}).get("b", 0)
            0
        """
        key_tuple(key)  # a non-str key is an error, never a batch index here
        try:
            return self[key]
        except MemtreeKeyError:
            return default

    def pop(self, key: Key, default: Any = _MISSING) -> Any:
        """Remove ``key`` and return its value (or ``default`` if given and absent)."""
        try:
            value = self[key]
        except MemtreeKeyError:
            if default is _MISSING:
                raise
            return default
        del self[key]
        return value

    def _walk(self, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
        for k, v in self._data.items():
            yield prefix + (k,), v
            if isinstance(v, TreeCore):
                yield from v._walk(prefix + (k,))

    def keys(self, include_nested: bool = False, leaves_only: bool = False) -> Any:
        """Keys of the tree: top-level str keys, or with ``include_nested`` tuples for nested ones.

        Args:
            include_nested: also list keys inside sub-trees, as tuples.
            leaves_only: omit sub-trees (keep tensors and non-tensor leaves).

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"a": torch.ones(1), "b": {"c": torch.ones(1)}})
            >>> t.keys(include_nested=True, leaves_only=True)
            ['a', ('b', 'c')]
        """
        if not include_nested:
            if not leaves_only:
                return self._data.keys()
            return [k for k, v in self._data.items() if not isinstance(v, TreeCore)]
        return [
            p[0] if len(p) == 1 else p
            for p, v in self._walk()
            if not (leaves_only and isinstance(v, TreeCore))
        ]

    def items(self, include_nested: bool = False, leaves_only: bool = False) -> list[tuple[Key, Any]]:
        """``(key, value)`` pairs, with the same options as :meth:`keys`."""
        if not include_nested:
            return [(k, self[k]) for k in self.keys(False, leaves_only)]
        return [
            (p[0] if len(p) == 1 else p, v.data if isinstance(v, NonTensor) else v)
            for p, v in self._walk()
            if not (leaves_only and isinstance(v, TreeCore))
        ]

    def values(self, include_nested: bool = False, leaves_only: bool = False) -> list[Any]:
        """Values, with the same options as :meth:`keys`."""
        return [v for _, v in self.items(include_nested, leaves_only)]

    def update(self, other: Mapping[str, Any] | TreeCore) -> Self:
        """Set every key of ``other`` into this tree (merging sub-trees); returns ``self``."""
        items = other._data.items() if isinstance(other, TreeCore) else other.items()
        for key, value in items:
            current = self._data.get(key)
            if isinstance(current, TreeCore) and isinstance(value, (Mapping, TreeCore)) and not isinstance(value, NonTensor):
                current.update(value)
            else:
                self._set_one(key, value)
        return self

    def select(self, *keys: Key, strict: bool = True) -> Self:
        """A new tree with only ``keys`` (str or tuples); tensors are shared, not copied.

        Args:
            strict: raise :class:`MemtreeKeyError` for a missing key (else skip it).
        """
        out = self._new_like()
        for key in keys:
            path = key_tuple(key)
            try:
                value = self._lookup(path)
            except MemtreeKeyError:
                if strict:
                    raise
                continue
            node = out
            src = self
            for part in path[:-1]:
                src = src._data[part]
                if part not in node._data:
                    node._data[part] = src._new_like()
                node = node._data[part]
            node._data[path[-1]] = value
        return out

    def exclude(self, *keys: Key) -> Self:
        """A new tree without ``keys``; missing keys are ignored."""
        drop = {key_tuple(k) for k in keys}
        return self._filtered(lambda p: p not in drop)

    def _filtered(self, keep: Callable[[tuple[str, ...]], bool], prefix: tuple[str, ...] = ()) -> Self:
        out = self._new_like()
        for k, v in self._data.items():
            path = prefix + (k,)
            if not keep(path):
                continue
            out._data[k] = v._filtered(keep, path) if isinstance(v, TreeCore) else v
        return out

    def rename_key(self, old: Key, new: Key) -> Self:
        """A new tree with ``old`` renamed to ``new`` (tensors shared).

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"a": torch.ones(1)}).rename_key("a", "b").keys()
            dict_keys(['b'])
        """
        old_path, new_path = key_tuple(old), key_tuple(new)
        value = self._lookup(old_path)
        if new_path in {key_tuple(k) for k in self.keys(include_nested=True)} and new_path != old_path:
            raise KeyCollisionError(f"cannot rename {fmt_key(old_path)} to {fmt_key(new_path)}: it exists")
        out = self._filtered(lambda p: p != old_path)
        out[new_path] = value
        return out

    def flatten_keys(self, sep: str = ".") -> Self:
        """A new one-level tree whose keys join nested keys with ``sep``.

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"a": {"b": torch.ones(1)}}).flatten_keys().keys()
            dict_keys(['a.b'])
        """
        out = self._new_like()
        for path, value in self._walk():
            if isinstance(value, TreeCore):
                continue
            flat = sep.join(path)
            if flat in out._data:
                raise KeyCollisionError(f"flattening gives the key {flat!r} twice; use another sep")
            out._data[flat] = value
        return out

    def unflatten_keys(self, sep: str = ".") -> Self:
        """The inverse of :meth:`flatten_keys`: split keys on ``sep`` into nested sub-trees."""
        out = self._new_like()
        for key, value in self._data.items():
            if isinstance(value, TreeCore):
                value = value.unflatten_keys(sep)
            path = tuple(key.split(sep))
            if any(not p for p in path):
                raise KeyCollisionError(f"key {key!r} has an empty part when split on {sep!r}")
            node: TreeCore = out
            for part in path[:-1]:
                nxt = node._data.setdefault(part, node._new_like())
                if not isinstance(nxt, TreeCore):
                    raise KeyCollisionError(f"unflattening {key!r}: {part!r} is both a leaf and a sub-tree")
                node = nxt
            if path[-1] in node._data:
                raise KeyCollisionError(f"unflattening gives the key {path!r} twice")
            node._data[path[-1]] = value
        return out

    # --------------------------------------------------------------------- batch indexing
    def _indexed(self) -> str:
        """What a batch index indexes, for messages: the batch size and the first leaves."""
        leaves = [fmt_key(p) for p, v in self._walk() if isinstance(v, torch.Tensor)]
        more = f" and {len(leaves) - 4} more" if len(leaves) > 4 else ""
        return f"a tree of batch_size {list(self._batch_size)} with leaves {', '.join(leaves[:4])}{more}"

    def _gather(self, idx: Any, memory: str) -> Self | None:
        """``self[idx]`` when ``idx`` selects rows of the first batch dim (a batch: one gather per
        leaf into new tensors of ``memory``, see :mod:`memtree.tree.parts.gather`), else None."""
        rows = batch_rows(idx, self._batch_size[0], self._indexed)
        if rows is None:
            return None
        batch: Self = gather(self, rows, memory, self._indexed)
        return batch

    def _index(self, idx: Any) -> Self:
        idx = expand_ellipsis(idx, self.ndim)
        dummy = torch.zeros((), dtype=torch.uint8).expand(self._batch_size)
        try:
            new_bs = dummy[idx].shape
        except IndexError as err:
            raise InvalidIndexError(f"index {idx!r:.80} does not fit {self._indexed()}: {err}") from None
        return self._index_with(idx, new_bs, ())

    def _index_with(self, idx: Any, new_bs: torch.Size, path: tuple[str, ...]) -> Self:
        out = self._new_like(new_bs)
        for k, v in self._data.items():
            if isinstance(v, TreeCore):
                out._data[k] = v._index_with(idx, new_bs + v._batch_size[self.ndim :], path + (k,))
            elif isinstance(v, torch.Tensor):
                try:
                    out._data[k] = v[idx]
                except IndexError as err:
                    raise InvalidIndexError(
                        f"cannot index leaf {fmt_key(path + (k,))} of shape {list(v.shape)} with {idx!r:.80}: {err}"
                    ) from None
            else:
                out._data[k] = v
        return out

    def _assign(self, idx: Any, value: Any) -> None:
        if type(idx) is not int:  # an int holds no Ellipsis
            rows = batch_rows(idx, self._batch_size[0], self._indexed) if self._batch_size else None
            if rows is not None:  # checked once for every leaf, before any is written
                idx = check_rows(rows, self._batch_size[0], self._indexed)
            elif isinstance(idx, np.ndarray):  # other index arrays and masks: the rows' pwrite path
                idx = torch.tensor(idx)  # a copy: index arrays are small, and may be read-only
            idx = expand_ellipsis(idx, self.ndim)
        data = self._data  # a property (lazy levels): read it once
        if isinstance(value, (TreeCore, Mapping)):
            items = value._data.items() if isinstance(value, TreeCore) else value.items()
            for k, v in items:
                mine = data.get(k)
                if mine is None:
                    raise MemtreeKeyError(f"cannot assign key {k!r} at {idx!r}: the tree has no such key")
                if isinstance(mine, TreeCore):
                    mine._assign(idx, v)
                elif isinstance(mine, torch.Tensor):
                    if isinstance(v, (np.ndarray, np.generic)):
                        v = numpy_value(v, mine, k)
                    mine[idx] = v.data if isinstance(v, NonTensor) else v
        else:
            for k, v in data.items():
                if isinstance(v, TreeCore):
                    v._assign(idx, value)
                elif isinstance(v, torch.Tensor):
                    v[idx] = numpy_value(value, v, k) if isinstance(value, (np.ndarray, np.generic)) else value

    # --------------------------------------------------------------------------- equality
    def _compare(self, other: Any, op: Callable[[Any, Any], torch.Tensor]) -> Self:
        out = self._new_like()
        for k, v in self._data.items():
            if isinstance(other, (TreeCore, Mapping)):
                if k not in other:
                    raise MemtreeKeyError(f"cannot compare: key {k!r} is missing from the other tree")
                o = other._data[k] if isinstance(other, TreeCore) else other[k]
            else:
                o = other
            if isinstance(v, TreeCore):
                out._data[k] = v._compare(o, op)
            elif isinstance(v, torch.Tensor):
                out._data[k] = op(v, o.data if isinstance(o, NonTensor) else o)
            else:
                o_data = o.data if isinstance(o, NonTensor) else o
                same = v.data == o_data
                out._data[k] = torch.full(self._batch_size, bool(op(same, True)), dtype=torch.bool)
        return out

    def __eq__(self, other: object) -> Self:  # type: ignore[override]
        return self._compare(other, lambda a, b: a == b)

    def __ne__(self, other: object) -> Self:  # type: ignore[override]
        return self._compare(other, lambda a, b: a != b)

    __hash__ = None  # type: ignore[assignment]

    def all(self) -> bool:
        """True if every element of every tensor leaf is true (``(a == b).all()``)."""
        return all(bool(v.all()) for v in self.values(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor))

    def any(self) -> bool:
        """True if any element of any tensor leaf is true."""
        return any(bool(v.any()) for v in self.values(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor))

    def __bool__(self) -> bool:
        raise AmbiguousTruthError("the truth value of a TensorTree is ambiguous; use .all() or .any()")

    # ----------------------------------------------------------------------- conversions
    def to_dict(self) -> dict[str, Any]:
        """A nested ``dict`` of tensors and raw non-tensor values."""
        return {
            k: v.to_dict() if isinstance(v, TreeCore) else v.data if isinstance(v, NonTensor) else v
            for k, v in self._data.items()
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], batch_size: Any = (), device: Any = None) -> Self:
        """Build a tree from a nested mapping (same as the constructor)."""
        return cls(d, batch_size=batch_size, device=device)

    def state_dict(self) -> dict[str, Any]:
        """A flat ``OrderedDict`` of dotted keys (``"b.c"``) to tensors and non-tensor values."""
        from collections import OrderedDict

        out: OrderedDict[str, Any] = OrderedDict()
        for path, v in self._walk():
            if isinstance(v, TreeCore):
                continue
            key = ".".join(path)
            if key in out:
                raise KeyCollisionError(f"state_dict key {key!r} is ambiguous (keys contain '.')")
            out[key] = v.data if isinstance(v, NonTensor) else v.detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Self:
        """Copy a :meth:`state_dict` into this tree's existing leaves, in place; returns ``self``."""
        mine = {".".join(p): p for p, v in self._walk() if not isinstance(v, TreeCore)}
        if strict:
            missing = sorted(set(mine) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(mine))
            if missing or unexpected:
                raise MemtreeKeyError(
                    f"load_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}"
                )
        for key, value in state_dict.items():
            if key not in mine:
                continue
            path = mine[key]
            current = self._lookup(path)
            if isinstance(current, torch.Tensor):
                shape = getattr(value, "shape", None)
                if shape != current.shape:
                    raise ShapeMismatchError(
                        f"load_state_dict: {key!r} has shape {list(current.shape)} in the tree but "
                        f"{list(shape) if shape is not None else type(value).__name__} in the state_dict"
                    )
                current.copy_(value)
            else:
                parent = self._lookup(path[:-1]) if len(path) > 1 else self
                if parent._locked:
                    raise LockedError(f"load_state_dict: cannot replace non-tensor leaf {key!r} of a locked tree")
                parent._data[path[-1]] = NonTensor(value)
        return self

    # ---------------------------------------------------------------------------- locking
    def lock_(self) -> Self:
        """Forbid adding, removing or replacing keys (at every depth); returns ``self``."""
        self._locked = True
        for v in self._data.values():
            if isinstance(v, TreeCore):
                v.lock_()
        return self

    def unlock_(self) -> Self:
        """Undo :meth:`lock_`; returns ``self``."""
        self._locked = False
        for v in self._data.values():
            if isinstance(v, TreeCore):
                v.unlock_()
        return self

    # ------------------------------------------------------------------------------ disk
    def _to_level(self, path: tuple[str, ...] = (), keep_dtensors: bool = False) -> Level:
        """This tree as a :class:`Level`: a tensor subclass as its group, a ``DTensor`` as its
        full tensor and layout, or itself with ``keep_dtensors`` (a collective write,
        :mod:`memtree.dist.write`, writes each rank's shards)."""
        level = Level(tuple(self._batch_size))
        for k, v in self._data.items():
            if isinstance(v, TreeCore):
                v = v._to_level(path + (k,), keep_dtensors)
            elif isinstance(v, torch.Tensor) and not registry.is_plain(v):
                if registry.is_dtensor(v) and keep_dtensors:
                    pass
                elif registry.is_dtensor(v):  # its full tensor, with its layout
                    v, level.layouts[k] = dtensor_leaf(v, path + (k,))
                else:
                    v = registry.to_group(v, path + (k,))
            level.entries[k] = v
        return level

    __memtree_level__ = _to_level  # the protocol of memtree.format.level.as_level

    @classmethod
    def _from_level(
        cls,
        level: Level | PendingLevel,
        device: torch.device | None = None,
        unknown_classes: str = "error",
        path: tuple[str, ...] = (),
    ) -> Self:
        if isinstance(level, PendingLevel):
            return cls._lazy(level, device, unknown_classes)
        target = class_for(level.type, unknown_classes, path) or cls  # a registered @tensorclass
        if level.foreign_type is not None:  # a tensordict @tensorclass: a memtree one of its name
            target = class_for_foreign(level.foreign_type) or target
        out = target._empty(torch.Size(level.batch_size), device)
        for k, v in level.entries.items():
            if isinstance(v, Level) and v.subclass is not None:
                out._data[k] = cls._base()._subclass_value(v, unknown_classes, path + (k,))
            elif isinstance(v, Level):
                out._data[k] = cls._base()._from_level(v, device, unknown_classes, path + (k,))
            else:
                out._data[k] = v
        return out

    @classmethod
    def _subclass_value(cls, level: Level, unknown_classes: str, path: tuple[str, ...]) -> Any:
        """The tensor subclass a group stands for; with ``unknown_classes="tree"``, a group of a
        class this process cannot rebuild is a plain tree of its inner tensors instead."""
        assert level.subclass is not None
        if unknown_classes == "tree" and not registry.is_known(level.subclass.type):
            return cls._from_level(replace(level, subclass=None), None, unknown_classes, path)
        return registry.rebuild(level, path)

    def _adopt(self, level: Level | PendingLevel) -> None:
        if isinstance(level, PendingLevel):  # the sub-trees this tree holds map their files now
            level = level.load_all()
        for k, v in level.entries.items():
            if isinstance(v, Level) and v.subclass is not None:
                self._data[k] = registry.rebuild(v, (k,))  # its inner tensors: the mapped files
            elif isinstance(v, Level):
                self._data[k]._adopt(v)
            else:
                self._data[k] = v

    @classmethod
    def _base(cls) -> type[TreeCore]:
        """The plain tree class (``TensorTree``): sub-trees, swaps and rows to append are plain trees."""
        raise NotImplementedError  # memtree.tree.tensortree.TensorTree names itself

    @classmethod
    def _nest(cls, flat: list[tuple[str, Any]], aliases: Mapping[str, str]) -> TreeCore:
        tree = cls._base()()
        for name, value in flat:  # tree[tuple(name.split("."))] = value, without its checks of the key's type
            *parents, last = name.split(".")
            node = tree
            for part in parents:
                nxt = node._data.get(part)
                if nxt is None:
                    nxt = node._base()._empty(node._batch_size, node._device)
                    node._set_one(part, nxt)
                elif not isinstance(nxt, TreeCore):
                    raise MemtreeKeyError(f"cannot set {name!r}: {part!r} is a leaf, not a sub-tree")
                node = nxt
            node._set_one(last, value if isinstance(value, torch.Tensor) else NonTensor(value))
        if aliases:
            if bind.TIED_KEY in tree:
                raise SourceError(
                    f"the module has a tensor or sub-module named {bind.TIED_KEY!r}, the key memtree "
                    "reserves for the record of tied tensors; rename it"
                )
            tree[bind.TIED_KEY] = NonTensor(dict(aliases))
        return tree
