"""``TensorTree``: a nested mapping of str keys to tensors that behaves like one tensor along its
leading ``batch_size`` dims, and writes itself to disk as one raw file per leaf.

Example:
    >>> import torch, memtree
    >>> tree = memtree.TensorTree({"obs": torch.zeros(4, 3), "info": {"step": torch.arange(4)}},
    ...                           batch_size=[4])
    >>> tree[1:3]["info", "step"].tolist()
    [1, 2]
    >>> tree["name"] = "run-1"           # non-tensor leaves are kept (as JSON on disk)
    >>> tree.keys(include_nested=True)
    ['obs', 'info', ('info', 'step'), 'name']
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from math import prod
from typing import Any, Union

import numpy as np
import torch

from ..errors import (
    BatchSizeError,
    KeyCollisionError,
    KeyTypeError,
    LockedError,
    MemtreeKeyError,
    ShapeMismatchError,
    SourceError,
)
from ..format.names import validate_key
from ..format.level import Level
from ..store.mapped import MemoryMappedTensor
from ..format.values import NonTensor, check_nesting
from ..store.open import open_prefix
from ..store.read import KeySelection, PendingLevel, loading_lock, normalize_keys
from .registry import class_for
from ..store.write import share_tree, write_tree
from . import bind, growth

__all__ = ["TensorTree", "load_memmap", "Key"]

Key = Union[str, tuple[str, ...]]
_MISSING: Any = object()
_REPR_MAX_LINES = 60


def _is_str_key(key: object) -> bool:
    return isinstance(key, str) or (
        isinstance(key, tuple) and len(key) > 0 and all(isinstance(k, str) for k in key)
    )


def _key_tuple(key: Key) -> tuple[str, ...]:
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple) and key:
        for k in key:
            if not isinstance(k, str):
                raise KeyTypeError(f"nested keys are tuples of str; {key!r} holds a {type(k).__name__}")
        return key
    raise KeyTypeError(f"tree keys must be str or non-empty tuples of str, got {key!r}")


def _fmt_key(path: tuple[str, ...]) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


def _as_size(batch_size: Any) -> torch.Size:
    if isinstance(batch_size, int):
        batch_size = (batch_size,)
    try:
        size = torch.Size([int(b) for b in batch_size])
    except (TypeError, ValueError):
        raise BatchSizeError(f"batch_size must be a sequence of ints, got {batch_size!r}") from None
    if any(b < 0 for b in size):
        raise BatchSizeError(f"batch_size must not have negative sizes, got {list(size)}")
    return size


def _expand_ellipsis(idx: Any, ndim: int) -> Any:
    """Replace ``...`` in a batch index by full slices over the *batch* dims only."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if not any(i is Ellipsis for i in items):
        return idx
    used = 0
    for i in items:
        if i is None or i is Ellipsis:
            continue
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            used += max(i.ndim, 1)
        else:
            used += 1
    pos = next(n for n, i in enumerate(items) if i is Ellipsis)
    fill = (slice(None),) * max(ndim - used, 0)
    return items[:pos] + fill + items[pos + 1 :]


class TensorTree:
    """A nested mapping of str keys to tensors, sub-trees and small non-tensor values.

    Every tensor leaf's shape starts with ``batch_size``; indexing the tree indexes every leaf
    along those dims. Written with :meth:`memmap`, each leaf becomes one raw ``.memmap`` file.

    Args:
        source: a mapping (nested mappings become sub-trees) or another tree.
        batch_size: the leading dims shared by every leaf (default ``()``, or the source
            tree's).
        device: if given, every tensor set into the tree is moved to this device.

    Example:
        >>> t = TensorTree({"a": torch.zeros(2, 5)}, batch_size=[2])
        >>> t.shape, len(t)
        (torch.Size([2]), 2)
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
                entries[k] = TensorTree._lazy(v, self._device, unknown_classes) if isinstance(v, PendingLevel) else v
            self._data = entries

    @classmethod
    def _lazy(cls, level: PendingLevel, device: torch.device | None, unknown_classes: str) -> TensorTree:
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
            if isinstance(child, TensorTree):
                child._load_selected(sub)

    def __getstate__(self) -> dict[str, Any]:  # pickle/copy: every lazy level loaded first
        for _ in self._walk():
            pass
        return self.__dict__

    def __init__(
        self,
        source: Mapping[str, Any] | TensorTree | None = None,
        batch_size: Any = None,
        device: torch.device | str | None = None,
    ) -> None:
        if batch_size is None:
            batch_size = source.batch_size if isinstance(source, TensorTree) else ()
        if device is None and isinstance(source, TensorTree):
            device = source.device
        self._data: dict[str, Any] = {}
        self._batch_size = _as_size(batch_size)
        self._device = torch.device(device) if device is not None else None
        self._locked = False
        if source is not None:
            items = source._data.items() if isinstance(source, TensorTree) else source.items()
            for key, value in items:
                self._set_one(key, value)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def _empty(cls, batch_size: torch.Size, device: torch.device | None) -> TensorTree:
        out = cls.__new__(cls)
        out._data = {}
        out._batch_size = batch_size
        out._device = device
        out._locked = False
        return out

    def _new_like(self, batch_size: torch.Size | None = None) -> TensorTree:
        return type(self)._empty(self._batch_size if batch_size is None else batch_size, self._device)

    def _convert(self, key: str, value: Any) -> Any:
        if isinstance(value, NonTensor):
            check_nesting(value.data, repr(key))
            return value
        if isinstance(value, TensorTree):
            if value._batch_size[: len(self._batch_size)] != self._batch_size:
                raise BatchSizeError(
                    f"sub-tree {key!r} has batch_size {list(value._batch_size)}, which does not "
                    f"start with this tree's {list(self._batch_size)}"
                )
            if self._device is not None and value._device != self._device:
                value = value.to(self._device)
            return value
        if isinstance(value, Mapping):
            return TensorTree(value, batch_size=self._batch_size, device=self._device)
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if isinstance(value, torch.Tensor):
            nd = len(self._batch_size)
            if value.shape[:nd] != self._batch_size:
                raise BatchSizeError(
                    f"tensor for key {key!r} has shape {list(value.shape)}, which does not start "
                    f"with the tree's batch_size {list(self._batch_size)}; reshape it or change "
                    "the tree's batch_size"
                )
            if self._device is not None and value.device != self._device:
                value = value.to(self._device)
            return value
        check_nesting(value, repr(key))
        return NonTensor(value)

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
        size = _as_size(value)
        for key, leaf in self.items(include_nested=True, leaves_only=True):
            if isinstance(leaf, torch.Tensor) and leaf.shape[: len(size)] != size:
                raise BatchSizeError(
                    f"cannot set batch_size {list(size)}: leaf {key!r} has shape {list(leaf.shape)}"
                )
        self._set_batch_size(size)

    def _set_batch_size(self, size: torch.Size) -> None:
        for v in self._data.values():
            if isinstance(v, TensorTree) and v._batch_size[: len(size)] != size:
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
            raise TypeError("len() of a TensorTree with batch_size () is undefined (like a 0-dim tensor)")
        return self._batch_size[0]

    def __iter__(self) -> Iterator[TensorTree]:
        """Iterate over the first batch dim (like a tensor); use :meth:`keys` for keys."""
        for i in range(len(self)):
            yield self[i]

    # ------------------------------------------------------------------------ key access
    def _lookup(self, path: tuple[str, ...]) -> Any:
        node: Any = self
        for depth, part in enumerate(path):
            if not isinstance(node, TensorTree):
                raise MemtreeKeyError(
                    f"key {_fmt_key(path)}: {_fmt_key(path[:depth])} is a leaf, not a sub-tree"
                )
            try:
                node = node._data[part]
            except KeyError:
                raise MemtreeKeyError(
                    f"key {_fmt_key(path)} not found (keys at that level: "
                    f"{list(node._data)[:20]})"
                ) from None
        return node

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str) or (isinstance(key, tuple) and key and _is_str_key(key)):
            value = self._lookup(_key_tuple(key))
            return value.data if isinstance(value, NonTensor) else value
        if isinstance(key, tuple) and any(isinstance(k, str) for k in key):
            raise KeyTypeError(f"cannot mix str keys and batch indices in {key!r}")
        return self._index(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if type(key) is int:  # data[i] = item: the hot loop of filling a dataset
            self._assign(key, value)
            return
        if isinstance(key, str) or (isinstance(key, tuple) and key and _is_str_key(key)):
            path = _key_tuple(key)
            node = self
            created: list[tuple[TensorTree, str]] = []
            try:
                for part in path[:-1]:
                    nxt = node._data.get(part)
                    if nxt is None:
                        nxt = TensorTree._empty(node._batch_size, node._device)
                        node._set_one(part, nxt)
                        created.append((node, part))
                    elif not isinstance(nxt, TensorTree):
                        raise MemtreeKeyError(f"cannot set {_fmt_key(path)}: {part!r} is a leaf, not a sub-tree")
                    node = nxt
                node._set_one(path[-1], value)
            except BaseException:
                for parent, part in reversed(created):  # leave no empty sub-tree behind
                    del parent._data[part]
                raise
            return
        if isinstance(key, tuple) and any(isinstance(k, str) for k in key):
            raise KeyTypeError(f"cannot mix str keys and batch indices in {key!r}")
        self._assign(key, value)

    def __delitem__(self, key: Key) -> None:
        path = _key_tuple(key)
        parent = self._lookup(path[:-1]) if len(path) > 1 else self
        if not isinstance(parent, TensorTree) or path[-1] not in parent._data:
            raise MemtreeKeyError(f"key {_fmt_key(path)} not found")
        if parent._locked:
            raise LockedError(f"cannot delete key {_fmt_key(path)}: the tree is locked; unlock_() first")
        del parent._data[path[-1]]

    def __contains__(self, key: object) -> bool:
        if not _is_str_key(key):
            return False
        try:
            self._lookup(_key_tuple(key))  # type: ignore[arg-type]
        except MemtreeKeyError:
            return False
        return True

    def get(self, key: Key, default: Any = None) -> Any:
        """The value at ``key`` (str or tuple), or ``default`` if absent.

        Example:
            >>> TensorTree({"a": torch.ones(1)}).get("b", 0)
            0
        """
        _key_tuple(key)  # a non-str key is an error, never a batch index here
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
            if isinstance(v, TensorTree):
                yield from v._walk(prefix + (k,))

    def keys(self, include_nested: bool = False, leaves_only: bool = False) -> Any:
        """Keys of the tree: top-level str keys, or with ``include_nested`` tuples for nested ones.

        Args:
            include_nested: also list keys inside sub-trees, as tuples.
            leaves_only: omit sub-trees (keep tensors and non-tensor leaves).

        Example:
            >>> t = TensorTree({"a": torch.ones(1), "b": {"c": torch.ones(1)}})
            >>> t.keys(include_nested=True, leaves_only=True)
            ['a', ('b', 'c')]
        """
        if not include_nested:
            if not leaves_only:
                return self._data.keys()
            return [k for k, v in self._data.items() if not isinstance(v, TensorTree)]
        return [
            p[0] if len(p) == 1 else p
            for p, v in self._walk()
            if not (leaves_only and isinstance(v, TensorTree))
        ]

    def items(self, include_nested: bool = False, leaves_only: bool = False) -> list[tuple[Key, Any]]:
        """``(key, value)`` pairs, with the same options as :meth:`keys`."""
        if not include_nested:
            return [(k, self[k]) for k in self.keys(False, leaves_only)]
        return [
            (p[0] if len(p) == 1 else p, v.data if isinstance(v, NonTensor) else v)
            for p, v in self._walk()
            if not (leaves_only and isinstance(v, TensorTree))
        ]

    def values(self, include_nested: bool = False, leaves_only: bool = False) -> list[Any]:
        """Values, with the same options as :meth:`keys`."""
        return [v for _, v in self.items(include_nested, leaves_only)]

    def update(self, other: Mapping[str, Any] | TensorTree) -> TensorTree:
        """Set every key of ``other`` into this tree (merging sub-trees); returns ``self``."""
        items = other._data.items() if isinstance(other, TensorTree) else other.items()
        for key, value in items:
            current = self._data.get(key)
            if isinstance(current, TensorTree) and isinstance(value, (Mapping, TensorTree)) and not isinstance(value, NonTensor):
                current.update(value)
            else:
                self._set_one(key, value)
        return self

    def select(self, *keys: Key, strict: bool = True) -> TensorTree:
        """A new tree with only ``keys`` (str or tuples); tensors are shared, not copied.

        Args:
            strict: raise :class:`MemtreeKeyError` for a missing key (else skip it).
        """
        out = self._new_like()
        for key in keys:
            path = _key_tuple(key)
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

    def exclude(self, *keys: Key) -> TensorTree:
        """A new tree without ``keys``; missing keys are ignored."""
        drop = {_key_tuple(k) for k in keys}
        return self._filtered(lambda p: p not in drop)

    def _filtered(self, keep: Callable[[tuple[str, ...]], bool], prefix: tuple[str, ...] = ()) -> TensorTree:
        out = self._new_like()
        for k, v in self._data.items():
            path = prefix + (k,)
            if not keep(path):
                continue
            out._data[k] = v._filtered(keep, path) if isinstance(v, TensorTree) else v
        return out

    def rename_key(self, old: Key, new: Key) -> TensorTree:
        """A new tree with ``old`` renamed to ``new`` (tensors shared).

        Example:
            >>> TensorTree({"a": torch.ones(1)}).rename_key("a", "b").keys()
            dict_keys(['b'])
        """
        old_path, new_path = _key_tuple(old), _key_tuple(new)
        value = self._lookup(old_path)
        if new_path in {_key_tuple(k) for k in self.keys(include_nested=True)} and new_path != old_path:
            raise KeyCollisionError(f"cannot rename {_fmt_key(old_path)} to {_fmt_key(new_path)}: it exists")
        out = self._filtered(lambda p: p != old_path)
        out[new_path] = value
        return out

    def flatten_keys(self, sep: str = ".") -> TensorTree:
        """A new one-level tree whose keys join nested keys with ``sep``.

        Example:
            >>> TensorTree({"a": {"b": torch.ones(1)}}).flatten_keys().keys()
            dict_keys(['a.b'])
        """
        out = self._new_like()
        for path, value in self._walk():
            if isinstance(value, TensorTree):
                continue
            flat = sep.join(path)
            if flat in out._data:
                raise KeyCollisionError(f"flattening gives the key {flat!r} twice; use another sep")
            out._data[flat] = value
        return out

    def unflatten_keys(self, sep: str = ".") -> TensorTree:
        """The inverse of :meth:`flatten_keys`: split keys on ``sep`` into nested sub-trees."""
        out = self._new_like()
        for key, value in self._data.items():
            if isinstance(value, TensorTree):
                value = value.unflatten_keys(sep)
            path = tuple(key.split(sep))
            if any(not p for p in path):
                raise KeyCollisionError(f"key {key!r} has an empty part when split on {sep!r}")
            node = out
            for part in path[:-1]:
                nxt = node._data.setdefault(part, node._new_like())
                if not isinstance(nxt, TensorTree):
                    raise KeyCollisionError(f"unflattening {key!r}: {part!r} is both a leaf and a sub-tree")
                node = nxt
            if path[-1] in node._data:
                raise KeyCollisionError(f"unflattening gives the key {path!r} twice")
            node._data[path[-1]] = value
        return out

    # --------------------------------------------------------------------- batch indexing
    def _index(self, idx: Any) -> TensorTree:
        idx = _expand_ellipsis(idx, self.ndim)
        dummy = torch.zeros((), dtype=torch.uint8).expand(self._batch_size)
        new_bs = dummy[idx].shape
        return self._index_with(idx, new_bs)

    def _index_with(self, idx: Any, new_bs: torch.Size) -> TensorTree:
        out = self._new_like(new_bs)
        for k, v in self._data.items():
            if isinstance(v, TensorTree):
                out._data[k] = v._index_with(idx, new_bs + v._batch_size[self.ndim :])
            elif isinstance(v, torch.Tensor):
                out._data[k] = v[idx]
            else:
                out._data[k] = v
        return out

    def _assign(self, idx: Any, value: Any) -> None:
        if type(idx) is not int:  # an int holds no Ellipsis
            idx = _expand_ellipsis(idx, self.ndim)
        data = self._data  # a property (lazy levels): read it once
        if isinstance(value, (TensorTree, Mapping)):
            items = value._data.items() if isinstance(value, TensorTree) else value.items()
            for k, v in items:
                mine = data.get(k)
                if mine is None:
                    raise MemtreeKeyError(f"cannot assign key {k!r} at {idx!r}: the tree has no such key")
                if isinstance(mine, TensorTree):
                    mine._assign(idx, v)
                elif isinstance(mine, torch.Tensor):
                    mine[idx] = v.data if isinstance(v, NonTensor) else v
        else:
            for v in data.values():
                if isinstance(v, TensorTree):
                    v._assign(idx, value)
                elif isinstance(v, torch.Tensor):
                    v[idx] = value

    # ------------------------------------------------------------------ shape operations
    def _map(self, fn: Callable[[torch.Tensor, TensorTree], torch.Tensor], batch_size: torch.Size) -> TensorTree:
        nd = self.ndim
        out = self._new_like(batch_size)
        for k, v in self._data.items():
            if isinstance(v, TensorTree):
                out._data[k] = v._map(fn, batch_size + v._batch_size[nd:])
            elif isinstance(v, torch.Tensor):
                out._data[k] = fn(v, self)
            else:
                out._data[k] = v
        return out

    def expand(self, *shape: Any) -> TensorTree:
        """Expand the batch dims like ``torch.Tensor.expand`` (new dims on the left; no copy).

        Example:
            >>> TensorTree({"img": torch.zeros(3, 8, 8)}).expand(1000)["img"].shape
            torch.Size([1000, 3, 8, 8])
        """
        target = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        new_bs = torch.empty(self._batch_size, device="meta").expand(*target).shape
        nd = self.ndim
        return self._map(lambda t, _: t.expand(*new_bs, *t.shape[nd:]), new_bs)

    def unsqueeze(self, dim: int) -> TensorTree:
        """Insert a batch dim of size 1 at ``dim`` (in ``[-ndim-1, ndim]``)."""
        if not -self.ndim - 1 <= dim <= self.ndim:
            raise IndexError(f"unsqueeze dim {dim} out of range for batch ndim {self.ndim}")
        d = dim % (self.ndim + 1)
        new_bs = torch.Size(list(self._batch_size[:d]) + [1] + list(self._batch_size[d:]))
        return self._map(lambda t, _: t.unsqueeze(d), new_bs)

    def squeeze(self, dim: int | None = None) -> TensorTree:
        """Remove batch dims of size 1 (all of them, or only ``dim``)."""
        if dim is None:
            dims = [i for i, s in enumerate(self._batch_size) if s == 1]
        else:
            if not -self.ndim <= dim < self.ndim:
                raise IndexError(f"squeeze dim {dim} out of range for batch ndim {self.ndim}")
            d = dim % self.ndim
            dims = [d] if self._batch_size[d] == 1 else []
        new_bs = torch.Size([s for i, s in enumerate(self._batch_size) if i not in dims])
        nd = self.ndim

        def fn(t: torch.Tensor, _: TensorTree) -> torch.Tensor:
            return t.reshape(*new_bs, *t.shape[nd:])

        return self._map(fn, new_bs)

    def reshape(self, *shape: Any) -> TensorTree:
        """Reshape the batch dims like ``torch.Tensor.reshape`` (``-1`` allowed)."""
        target = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        new_bs = torch.empty(self._batch_size, device="meta").reshape(*target).shape
        nd = self.ndim
        return self._map(lambda t, _: t.reshape(*new_bs, *t.shape[nd:]), new_bs)

    # --------------------------------------------------------------- elementwise, copies
    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor | None], batch_size: Any = None) -> TensorTree:
        """A new tree with ``fn`` applied to every tensor leaf (a ``None`` result drops the key).

        Args:
            batch_size: the result's batch size (needed when ``fn`` changes batch dims).

        Example:
            >>> TensorTree({"a": torch.ones(2)}).apply(lambda t: t * 2)["a"].tolist()
            [2.0, 2.0]
        """
        bs = self._batch_size if batch_size is None else _as_size(batch_size)
        out = self._new_like(bs)
        for k, v in self._data.items():
            if isinstance(v, TensorTree):
                out._data[k] = v.apply(fn, bs if batch_size is not None else None)
            elif isinstance(v, torch.Tensor):
                r = fn(v)
                if r is not None:
                    out._data[k] = out._convert(k, r)
            else:
                out._data[k] = v
        return out

    def to(self, dest: torch.device | str | torch.dtype, non_blocking: bool = False) -> TensorTree:
        """A new tree with every tensor moved to a device or cast to a dtype.

        Example:
            >>> TensorTree({"a": torch.ones(2)}).to(torch.float16)["a"].dtype
            torch.float16
        """
        if isinstance(dest, torch.dtype):
            return self.apply(lambda t: t.to(dest))
        device = torch.device(dest)
        out = self.apply(lambda t: t.to(device, non_blocking=non_blocking))
        out._set_device(device)
        return out

    def _set_device(self, device: torch.device | None) -> None:
        self._device = device
        for v in self._data.values():
            if isinstance(v, TensorTree):
                v._set_device(device)

    def cpu(self) -> TensorTree:
        """Same as ``to("cpu")``."""
        return self.to("cpu")

    def clone(self) -> TensorTree:
        """A deep copy in ordinary memory (memory-mapped leaves are copied into RAM)."""
        out = self.apply(lambda t: t.clone())
        out._copy_non_tensors()
        return out

    def _copy_non_tensors(self) -> None:
        for k, v in self._data.items():
            if isinstance(v, TensorTree):
                v._copy_non_tensors()
            elif isinstance(v, NonTensor):
                self._data[k] = NonTensor(copy.deepcopy(v.data))

    def contiguous(self) -> TensorTree:
        """A new tree whose leaves are contiguous (expanded leaves are materialised)."""
        return self.apply(lambda t: t.contiguous())

    # --------------------------------------------------------------------------- equality
    def _compare(self, other: Any, op: Callable[[Any, Any], torch.Tensor]) -> TensorTree:
        out = self._new_like()
        for k, v in self._data.items():
            if isinstance(other, (TensorTree, Mapping)):
                if k not in other:
                    raise MemtreeKeyError(f"cannot compare: key {k!r} is missing from the other tree")
                o = other._data[k] if isinstance(other, TensorTree) else other[k]
            else:
                o = other
            if isinstance(v, TensorTree):
                out._data[k] = v._compare(o, op)
            elif isinstance(v, torch.Tensor):
                out._data[k] = op(v, o.data if isinstance(o, NonTensor) else o)
            else:
                o_data = o.data if isinstance(o, NonTensor) else o
                same = v.data == o_data
                out._data[k] = torch.full(self._batch_size, bool(op(same, True)), dtype=torch.bool)
        return out

    def __eq__(self, other: object) -> TensorTree:  # type: ignore[override]
        return self._compare(other, lambda a, b: a == b)

    def __ne__(self, other: object) -> TensorTree:  # type: ignore[override]
        return self._compare(other, lambda a, b: a != b)

    __hash__ = None  # type: ignore[assignment]

    def all(self) -> bool:
        """True if every element of every tensor leaf is true (``(a == b).all()``)."""
        return all(bool(v.all()) for v in self.values(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor))

    def any(self) -> bool:
        """True if any element of any tensor leaf is true."""
        return any(bool(v.any()) for v in self.values(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor))

    def __bool__(self) -> bool:
        raise ValueError("the truth value of a TensorTree is ambiguous; use .all() or .any()")

    # ----------------------------------------------------------------------- conversions
    def to_dict(self) -> dict[str, Any]:
        """A nested ``dict`` of tensors and raw non-tensor values."""
        return {
            k: v.to_dict() if isinstance(v, TensorTree) else v.data if isinstance(v, NonTensor) else v
            for k, v in self._data.items()
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], batch_size: Any = (), device: Any = None) -> TensorTree:
        """Build a tree from a nested mapping (same as the constructor)."""
        return cls(d, batch_size=batch_size, device=device)

    def state_dict(self) -> dict[str, Any]:
        """A flat ``OrderedDict`` of dotted keys (``"b.c"``) to tensors and non-tensor values."""
        from collections import OrderedDict

        out: OrderedDict[str, Any] = OrderedDict()
        for path, v in self._walk():
            if isinstance(v, TensorTree):
                continue
            key = ".".join(path)
            if key in out:
                raise KeyCollisionError(f"state_dict key {key!r} is ambiguous (keys contain '.')")
            out[key] = v.data if isinstance(v, NonTensor) else v.detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> TensorTree:
        """Copy a :meth:`state_dict` into this tree's existing leaves, in place; returns ``self``."""
        mine = {".".join(p): p for p, v in self._walk() if not isinstance(v, TensorTree)}
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
    def lock_(self) -> TensorTree:
        """Forbid adding, removing or replacing keys (at every depth); returns ``self``."""
        self._locked = True
        for v in self._data.values():
            if isinstance(v, TensorTree):
                v.lock_()
        return self

    def unlock_(self) -> TensorTree:
        """Undo :meth:`lock_`; returns ``self``."""
        self._locked = False
        for v in self._data.values():
            if isinstance(v, TensorTree):
                v.unlock_()
        return self

    # ------------------------------------------------------------------------------ disk
    def _to_level(self) -> Level:
        return Level(
            tuple(self._batch_size),
            {k: v._to_level() if isinstance(v, TensorTree) else v for k, v in self._data.items()},
        )

    __memtree_level__ = _to_level  # the protocol of memtree.format.level.as_level

    @classmethod
    def _from_level(
        cls,
        level: Level | PendingLevel,
        device: torch.device | None = None,
        unknown_classes: str = "error",
        path: tuple[str, ...] = (),
    ) -> TensorTree:
        if isinstance(level, PendingLevel):
            return cls._lazy(level, device, unknown_classes)
        target = class_for(level.type, unknown_classes, path) or cls  # a registered @tensorclass
        out = target._empty(torch.Size(level.batch_size), device)
        for k, v in level.entries.items():
            if isinstance(v, Level):
                out._data[k] = TensorTree._from_level(v, device, unknown_classes, path + (k,))
            else:
                out._data[k] = v
        return out

    def _adopt(self, level: Level | PendingLevel) -> None:
        if isinstance(level, PendingLevel):  # the sub-trees this tree holds map their files now
            level = level.load_all()
        for k, v in level.entries.items():
            if isinstance(v, Level):
                self._data[k]._adopt(v)
            else:
                self._data[k] = v

    def is_memmap(self) -> bool:
        """True if every tensor leaf is a :class:`MemoryMappedTensor`."""
        return all(
            isinstance(v, MemoryMappedTensor)
            for v in self.values(include_nested=True, leaves_only=True)
            if isinstance(v, torch.Tensor)
        )

    def memmap_(
        self,
        prefix: str | os.PathLike[str] | None = None,
        *,
        copy_existing: bool = False,
        num_threads: int = 0,
        existsok: bool = True,
        fsync: bool = False,
        allow_pickle: bool = False,
        checksum: str | None = None,
        progress: bool | None = None,
    ) -> TensorTree:
        """Write the tree under ``prefix`` and replace its leaves by the mapped files; returns ``self``.

        The write is atomic: until it commits, ``prefix`` keeps its old content (if any).

        Args:
            prefix: destination directory; ``None`` moves leaves to anonymous shared memory.
            copy_existing: copy leaves already memory-mapped from another prefix (else raise).
            num_threads: write leaves with this many threads (0: in the calling thread).
            existsok: allow replacing an existing memtree directory at ``prefix``.
            fsync: also make the commit durable across power loss.
            allow_pickle: pickle non-tensor values that JSON cannot hold exactly.
            checksum: ``"crc32"`` (fast, catches accidental damage) or ``"sha256"`` (also
                detects deliberate changes, given a trusted ``meta.json``) records each leaf's
                checksum in ``meta.json``, computed in the same pass as the write; checked by
                ``load_memmap(..., verify=True)`` and ``memtree verify``. ``None``: no checksum.
            progress: a progress bar of the bytes written: ``None`` (default) only on a
                terminal outside CI, ``True``/``False`` forced (tqdm optional).

        Example:
            >>> import tempfile
            >>> t = TensorTree({"w": torch.ones(3)}).memmap_(tempfile.mkdtemp() + "/m")
            >>> t.is_memmap()
            True
        """
        self._adopt(
            self._write(
                prefix, copy_existing=copy_existing, num_threads=num_threads, existsok=existsok,
                fsync=fsync, allow_pickle=allow_pickle, checksum=checksum, progress=progress,
            )
        )
        return self

    def memmap(
        self,
        prefix: str | os.PathLike[str] | None = None,
        *,
        copy_existing: bool = False,
        num_threads: int = 0,
        existsok: bool = True,
        fsync: bool = False,
        allow_pickle: bool = False,
        checksum: str | None = None,
        progress: bool | None = None,
    ) -> TensorTree:
        """Like :meth:`memmap_`, but return a new memory-mapped tree and leave ``self`` as it is.

        Example:
            >>> import tempfile
            >>> t = TensorTree({"w": torch.ones(3)})
            >>> m = t.memmap(tempfile.mkdtemp() + "/m", num_threads=2)
            >>> m.is_memmap(), t.is_memmap()
            (True, False)
        """
        level = self._write(
            prefix, copy_existing=copy_existing, num_threads=num_threads, existsok=existsok,
            fsync=fsync, allow_pickle=allow_pickle, checksum=checksum, progress=progress,
        )
        return type(self)._from_level(level, self._device)

    def memmap_like(
        self,
        prefix: str | os.PathLike[str] | None = None,
        *,
        num_threads: int = 0,
        existsok: bool = True,
        reserve: bool = False,
        progress: bool | None = None,
    ) -> TensorTree:
        """A new memory-mapped tree of zeros with this tree's keys, shapes and dtypes.

        No data is read or written: files are sparse (``reserve=True`` allocates their blocks),
        so ``datum.expand(1_000_000).memmap_like(d)`` takes milliseconds. The free space is
        checked first. Non-tensor leaves are kept.

        Example:
            >>> import tempfile
            >>> datum = TensorTree({"img": torch.zeros(3, 64, 64, dtype=torch.uint8)})
            >>> data = datum.expand(1000).memmap_like(tempfile.mkdtemp() + "/ds")
            >>> data.batch_size, data["img"].shape
            (torch.Size([1000]), torch.Size([1000, 3, 64, 64]))
        """
        level = self._write(
            prefix, like=True, num_threads=num_threads, existsok=existsok, reserve=reserve, progress=progress
        )
        return type(self)._from_level(level, self._device)

    def _write(self, prefix: str | os.PathLike[str] | None, **options: Any) -> Level | PendingLevel:
        """Write through :func:`memtree.write.write_tree` (or share memory when no prefix)."""
        if prefix is None:
            return share_tree(self._to_level(), like=options.get("like", False))
        return write_tree(prefix, self._to_level(), **options)

    @classmethod
    def load_memmap(
        cls,
        prefix: str | os.PathLike[str],
        *,
        device: torch.device | str | None = None,
        keys: Iterable[KeySelection] | None = None,
        mode: str = "r+",
        mmap: bool = True,
        allow_pickle: bool = False,
        verify: bool = False,
        unknown_classes: str = "error",
        lazy: bool = True,
        **remote: Any,
    ) -> TensorTree:
        """Load a tree written by :meth:`memmap`: O(metadata) now, each level when first used.

        Returns after validating the root ``meta.json`` only. A level (a sub-tree) is loaded
        the first time its entries are used (``tree["a"]``, ``keys()``, ``to_module``...): its
        leaf files are checked (regular file of exactly the right size, no symbolic link) and
        mapped, and its sub-levels' ``meta.json`` files validated. No leaf data is read. Files
        are opened relative to the tree's directory as it was when loaded: re-saving the prefix
        meanwhile never mixes two versions (the old levels raise instead, if deleted).

        Args:
            prefix: the tree's directory, or an fsspec URL (``"s3://bucket/tree"``,
                ``"https://host/tree"``; not ``file://``) to load with :func:`memtree.remote.load`.
            device: ``None``/``"cpu"``: leaves are mapped files; ``"meta"``: structure only (no
                leaf file opened); another device: leaves are copied there.
            keys: load only these keys (str or tuples); only the ``meta.json`` files on their
                paths are opened.
            mode: ``"r+"`` writes reach the files; ``"r"`` read-only (writes raise).
            mmap: ``False`` reads leaves into ordinary memory with large reads (network
                filesystems).
            allow_pickle: unpickle non-tensor leaves that were saved with ``allow_pickle=True``
                (trusted files only).
            verify: hash every loaded leaf that records a checksum (``memmap(...,
                checksum=...)``) and raise :class:`~memtree.IntegrityError` on a mismatch; reads
                those files once. Leaves without a checksum are size-checked only, as always.
            unknown_classes: a level stored as a ``@tensorclass`` comes back as that class when
                it is registered (its module imported); otherwise ``"error"`` raises
                :class:`~memtree.UnknownClassError` and ``"tree"`` loads it as a plain tree.
            lazy: ``False`` loads every level before returning, so that a damaged or missing
                file raises here rather than on first use. ``verify=True``, ``mmap=False``,
                ``device`` other than CPU/meta, and remote URLs always load everything at once.
            **remote: URLs only: ``storage_options``, ``cache_dir``, ``num_threads``,
                ``chunk_bytes``, ``retries``, ``fsync`` (see :func:`memtree.remote.load`).

        Example:
            >>> import tempfile
            >>> d = tempfile.mkdtemp() + "/m"
            >>> _ = TensorTree({"a": torch.ones(2), "b": {"c": torch.zeros(1)}}).memmap(d)
            >>> TensorTree.load_memmap(d, keys=[("b", "c")]).keys(include_nested=True)
            ['b', ('b', 'c')]
        """
        dev = torch.device(device) if device is not None else None
        root = open_prefix(prefix, keys=keys, mode=mode, mmap=mmap, device=device, allow_pickle=allow_pickle,
                           verify=verify, **remote)
        if isinstance(root, Level):  # a remote tree or tensordict's layout: loaded whole
            return cls._from_level(root, dev, unknown_classes)
        lazy = lazy and not verify and mmap and (dev is None or dev.type in ("cpu", "meta"))
        if not lazy:
            return cls._from_level(root.load_all(), dev, unknown_classes)
        tree = cls._lazy(root, dev, unknown_classes)
        tree._load_selected(normalize_keys(keys) if keys is not None else None)
        return tree

    # --------------------------------------------------------------------------- modules
    @classmethod
    def from_module(cls, module: Any, *, use_state_dict: bool = False) -> TensorTree:
        """A tree of ``module``'s parameters and persistent buffers, nested by module path.

        The leaves are the module's own tensors (parameters stay ``nn.Parameter``): nothing is
        copied until the tree is written with ``memmap``. Tied tensors are stored once; the other
        names are recorded in ``tree["__tied__"]`` (see :mod:`memtree.tree.bind`). A module on
        the meta device gives a tree of meta tensors, which ``memmap_like`` can allocate on disk.

        Args:
            module: any ``nn.Module``.
            use_state_dict: build the tree from ``module.state_dict(keep_vars=True)`` instead
                of the module's attributes, so that custom ``state_dict`` hooks and extra states
                (``get_extra_state``) are honoured.

        Example:
            >>> from torch import nn
            >>> TensorTree.from_module(nn.Linear(2, 3))["weight"].shape
            torch.Size([3, 2])
        """
        tree = TensorTree._nest(*bind.module_flat(module, use_state_dict=use_state_dict))
        return tree if cls is TensorTree else cls(tree)

    @staticmethod
    def _nest(flat: list[tuple[str, Any]], aliases: Mapping[str, str]) -> TensorTree:
        tree = TensorTree()
        for name, value in flat:
            tree[tuple(name.split("."))] = value if isinstance(value, torch.Tensor) else NonTensor(value)
        if aliases:
            if bind.TIED_KEY in tree:
                raise SourceError(
                    f"the module has a tensor or sub-module named {bind.TIED_KEY!r}, the key memtree "
                    "reserves for the record of tied tensors; rename it"
                )
            tree[bind.TIED_KEY] = NonTensor(dict(aliases))
        return tree

    def to_module(self, module: Any, *, return_swap: bool = True) -> TensorTree | None:
        """Bind this tree's tensors as ``module``'s parameters and buffers, without copying.

        Every tensor leaf must match a parameter, persistent buffer or extra state of the module
        by its path (shapes and dtypes must agree); module tensors the tree does not hold are
        left as they are. Everything is checked before anything changes. Works on modules built
        under :func:`memtree.empty_init` (meta device).

        Args:
            module: the module to bind into.
            return_swap: return the tensors that were replaced, as a tree (binding it back with
                ``swap.to_module(module)`` restores the module).

        Returns:
            The swapped-out tensors as a tree, or ``None``.

        Raises:
            MemtreeKeyError: a tree leaf matches nothing in the module.
            ShapeMismatchError: a leaf's shape or dtype differs from the module's tensor.

        Example:
            >>> from torch import nn
            >>> a, b = nn.Linear(2, 3), nn.Linear(2, 3)
            >>> _ = TensorTree.from_module(a).to_module(b)
            >>> b.weight.data_ptr() == a.weight.data_ptr()
            True
        """
        leaves = self.items(include_nested=True, leaves_only=True)
        src = bind.source_from_leaves(((k,) if isinstance(k, str) else k, v) for k, v in leaves)
        flat, aliases = bind.to_module(src, module)
        return TensorTree._nest(flat, aliases) if return_swap else None

    # ------------------------------------------------------------------ growing, datasets
    def append_(self, item: Any, *, fsync: bool = False) -> TensorTree:
        """Append one item along the first batch dim, on disk and in this tree; returns ``self``.

        The tree must be mapped from a prefix (``memmap(prefix)``, ``memmap_like(prefix)`` or
        ``load_memmap``). Files grow in place, their capacity at least doubling (amortised O(1)
        per item), existing rows are never rewritten, and the new length is committed like a
        write; see :mod:`memtree.store.grow`.

        Args:
            item: a tree (or nested mapping) of batch size ``batch_size[1:]``.
            fsync: also make the growth durable across power loss.

        Example:
            >>> import tempfile
            >>> buf = TensorTree({"x": torch.zeros(0, 2)}, batch_size=[0]).memmap(tempfile.mkdtemp() + "/b")
            >>> buf.append_({"x": torch.ones(2)}).batch_size
            torch.Size([1])
        """
        self._adopt_grown(growth.extend(self, item, single=True, fsync=fsync, base=TensorTree))
        return self

    def extend_(self, rows: Any, *, fsync: bool = False) -> TensorTree:
        """Append rows (a tree or mapping of batch size ``[k] + batch_size[1:]``); returns ``self``.

        Like :meth:`append_` for ``k`` items at once (one commit).

        Example:
            >>> import tempfile
            >>> buf = TensorTree({"x": torch.zeros(1)}, batch_size=[1]).memmap(tempfile.mkdtemp() + "/b")
            >>> buf.extend_({"x": torch.arange(3.0)})["x"].tolist()
            [0.0, 0.0, 1.0, 2.0]
        """
        self._adopt_grown(growth.extend(self, rows, single=False, fsync=fsync, base=TensorTree))
        return self

    def resize_(self, length: int, *, fsync: bool = False) -> TensorTree:
        """Set the first batch dim to ``length`` on disk and in this tree; returns ``self``.

        New rows are zeros (sparse: no data written past the old capacity). A smaller length
        keeps the files as they are (never truncated: other processes may map them).

        Example:
            >>> import tempfile
            >>> data = TensorTree({"x": torch.ones(2)}, batch_size=[2]).memmap(tempfile.mkdtemp() + "/d")
            >>> data.resize_(4)["x"].tolist()
            [1.0, 1.0, 0.0, 0.0]
        """
        self._adopt_grown(growth.resize(self, length, fsync=fsync))
        return self

    def _adopt_grown(self, level: Level) -> None:
        self._batch_size = torch.Size(level.batch_size)
        for k, v in level.entries.items():
            if isinstance(v, Level):
                self._data[k]._adopt_grown(v)
            else:
                self._data[k] = v

    def __getitems__(self, indices: list[int]) -> TensorTree:
        """A batch for ``torch.utils.data.DataLoader``: ``self[indices]``, one gather per leaf.

        The DataLoader passes this batch to its ``collate_fn``: use :func:`memtree.collate`
        (default collation does not know trees; see :mod:`memtree.dataset`).

        Example:
            >>> TensorTree({"x": torch.arange(5)}, batch_size=[5]).__getitems__([4, 0])["x"].tolist()
            [4, 0]
        """
        return self[torch.as_tensor(indices, dtype=torch.long)]

    def pin_memory(self) -> TensorTree:
        """A copy in page-locked memory, for fast copies to the GPU (``DataLoader(pin_memory=True)``).

        Example:
            >>> t = TensorTree({"x": torch.zeros(2)})
            >>> t.pin_memory()["x"].is_pinned() if torch.cuda.is_available() else True
            True
        """
        return self.apply(lambda t: t.pin_memory())

    # ------------------------------------------------------------------------------ repr
    #: ``repr`` shows at most this many lines of entries, then one summary line.
    _repr_max_lines: int = _REPR_MAX_LINES
    #: ``_repr_html_`` (notebooks) shows at most this many entries, then one summary line.
    _repr_html_max_rows: int = 1000

    def _repr_walk(self, depth: int = 0) -> Iterator[tuple[int, str, Any]]:
        """Every entry depth-first as ``(depth, key, value)``, each sub-tree before its content."""
        for k, v in self._data.items():
            yield depth, k, v
            if isinstance(v, TensorTree):
                yield from v._repr_walk(depth + 1)

    @staticmethod
    def _repr_key(key: str) -> str:
        return key if key.isprintable() else repr(key)

    @staticmethod
    def _repr_size(nbytes: int) -> str:
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if nbytes >= scale:
                return f"{nbytes / scale:,.1f} {unit}"
        return f"{nbytes} B"

    @staticmethod
    def _repr_nbytes(tensors: list[torch.Tensor]) -> int:
        with torch._C.DisableTorchFunctionSubclass():  # no MemoryMappedTensor dispatch: fast
            return sum(prod(t.shape) * t.element_size() for t in tensors)

    @staticmethod
    def _repr_leaf(v: Any) -> tuple[str, str]:
        """``(what, where)`` of a leaf: ``("float32[4, 3]", "memmap")`` or ``("'hello'", "")``."""
        if isinstance(v, torch.Tensor):
            what = f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
            if isinstance(v, MemoryMappedTensor):
                where = "shared memory" if v.filename is None else "memmap"
                return what, where + (", read-only" if v.readonly else "")
            if type(v) not in (torch.Tensor, torch.nn.Parameter):  # e.g. OffloadedTensor: name it
                return what, f"{type(v).__name__}, {v.device}"
            return what, str(v.device)
        import reprlib

        short = reprlib.Repr()
        short.maxstring = short.maxother = 56
        short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
        return short.repr(v.data if isinstance(v, NonTensor) else v), ""

    @staticmethod
    def _repr_file(v: Any) -> str | None:
        """The file behind a file-backed tensor leaf (memory-mapped or offloaded), else None."""
        filename = getattr(v, "filename", None) if isinstance(v, torch.Tensor) else None
        return filename if isinstance(filename, str) else None

    @staticmethod
    def _repr_hidden(rest: Iterator[tuple[int, str, Any]]) -> str:
        """Summary of the entries a truncated repr does not show."""
        trees = others = 0
        leaves: list[torch.Tensor] = []
        for _, _, v in rest:
            if isinstance(v, TensorTree):
                trees += 1
            elif isinstance(v, torch.Tensor):
                leaves.append(v)
            else:
                others += 1
        tensors, nbytes = len(leaves), TensorTree._repr_nbytes(leaves)
        parts = [f"{n:,} {word}{'' if n == 1 else 's'}"
                 for n, word in ((tensors, "tensor"), (trees, "sub-tree"), (others, "non-tensor value")) if n]
        return (f"… and {', '.join(parts)} ({TensorTree._repr_size(nbytes)} of tensors) not shown; "
                "tree.keys(include_nested=True) lists every key")

    def __repr__(self) -> str:
        """Keys, dtypes, shapes and where each leaf lives, one line each, truncated when large.

        Example:
            >>> print(TensorTree({"obs": torch.zeros(4, 3), "info": {"step": torch.arange(4)}},
            ...                  batch_size=[4]))
            TensorTree(batch_size=[4])
              obs: float32[4, 3] cpu
              info: TensorTree(batch_size=[4])
                step: int64[4] cpu
        """
        lines = [f"{type(self).__name__}(batch_size={list(self._batch_size)}"
                 + (f", device={self._device}" if self._device is not None else "")
                 + (", locked" if self._locked else "") + ")"]
        entries = self._repr_walk()
        for depth, k, v in entries:
            key = self._repr_key(k)
            indent = "  " * (depth + 1)
            if isinstance(v, TensorTree):
                lines.append(f"{indent}{key}: {type(v).__name__}(batch_size={list(v._batch_size)})")
            else:
                what, where = self._repr_leaf(v)
                lines.append(f"{indent}{key}: {what} {where}".rstrip())
            if len(lines) > self._repr_max_lines:
                rest = list(entries)
                if rest:
                    lines.append("  " + self._repr_hidden(iter(rest)))
                break
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """HTML for notebooks: a collapsible tree of keys with dtypes, shapes and leaf files.

        Keys and values are HTML-escaped. Memory-mapped leaves show their file's path relative to
        the directory that holds them all (the full path is in the tooltip). Sub-trees start
        expanded when the whole tree has at most 50 entries.

        Example:
            >>> html = TensorTree({"a<b>": torch.zeros(2)})._repr_html_()
            >>> "a&lt;b&gt;" in html and "<details" in html
            True
        """
        import html

        esc = html.escape
        entries = list(self._repr_walk())
        tensors = [v for _, _, v in entries if isinstance(v, torch.Tensor)]
        n_tensors = len(tensors)
        size = self._repr_size(self._repr_nbytes(tensors))
        files = [f for _, _, v in entries[: self._repr_html_max_rows] if (f := self._repr_file(v))]
        base = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0]) if files else ""
        opened = " open" if len(entries) <= 50 else ""
        head = (f"<b>{esc(type(self).__name__)}</b> batch_size={list(self._batch_size)}"
                + (f", device={esc(str(self._device))}" if self._device is not None else "")
                + (", locked" if self._locked else "")
                + f" · {n_tensors:,} tensor{'' if n_tensors == 1 else 's'}, {size}"
                + (f" · files in <code>{esc(base)}</code>" if base else ""))
        out = ['<div class="memtree-repr" style="font-family:monospace;line-height:1.5">',
               f"<details open><summary>{head}</summary>",
               '<ul style="list-style:none;margin:0;padding-left:1.5em">']
        depth_now = 0
        for i, (depth, k, v) in enumerate(entries):
            while depth_now > depth:  # close the sub-trees that ended
                out.append("</ul></details></li>")
                depth_now -= 1
            if i == self._repr_html_max_rows:
                out.append(f"<li><i>{esc(self._repr_hidden(iter(entries[i:])))}</i></li>")
                break
            key = f"<code>{esc(self._repr_key(k))}</code>"
            if isinstance(v, TensorTree):
                out.append(f"<li><details{opened}><summary>{key}: {esc(type(v).__name__)} "
                           f"batch_size={list(v._batch_size)} ({len(v._data):,} key{'' if len(v._data) == 1 else 's'})</summary>"
                           '<ul style="list-style:none;margin:0;padding-left:1.5em">')
                depth_now += 1
                continue
            what, where = self._repr_leaf(v)
            where = esc(where)
            filename = self._repr_file(v)
            if filename is not None:
                rel = os.path.relpath(filename, base) if base else filename
                where += f' <span title="{esc(filename)}" style="opacity:0.7">{esc(rel)}</span>'
            out.append(f"<li>{key}: {esc(what)}{' ' + where if where else ''}</li>")
        out.append("</ul></details></li>" * depth_now + "</ul></details></div>")
        return "\n".join(out)


def load_memmap(prefix: str | os.PathLike[str], **kwargs: Any) -> TensorTree:
    """Load a tree written by :meth:`TensorTree.memmap` (see :meth:`TensorTree.load_memmap`).

    Example:
        >>> import tempfile, memtree
        >>> d = tempfile.mkdtemp() + "/m"
        >>> _ = memtree.TensorTree({"a": torch.arange(3)}).memmap(d)
        >>> memtree.load_memmap(d, mode="r")["a"].tolist()
        [0, 1, 2]
    """
    return TensorTree.load_memmap(prefix, **kwargs)
