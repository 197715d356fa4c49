"""Shape operations and elementwise maps of a tree: ``expand``, ``reshape``, ``apply``, ``to``...

A mixin of :class:`~memtree.TensorTree`: each operation maps every tensor leaf and keeps the tree's
structure; batch sizes follow the leaves.

Example:
    >>> import torch, memtree
    >>> t = memtree.TensorTree({"x": torch.zeros(3)}, batch_size=[3])
    >>> t.unsqueeze(0).batch_size, t.to(torch.float16)["x"].dtype
    (torch.Size([1, 3]), torch.float16)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from typing_extensions import Self

import torch

from ...errors import InvalidArgumentError, InvalidIndexError
from ...format.values import NonTensor
from ...store.reading.options import check_device
from .args import as_size
from .core import TreeCore
from .numpy_view import tree_numpy

__all__ = ["ShapeOps"]


class ShapeOps(TreeCore):
    """Shape operations and elementwise maps (mixed into :class:`~memtree.TensorTree`)."""

    def _map(self, fn: Callable[[torch.Tensor, TreeCore], torch.Tensor], batch_size: torch.Size) -> Self:
        nd = self.ndim
        out = self._new_like(batch_size)
        for k, v in self._data.items():
            if isinstance(v, ShapeOps):
                out._data[k] = v._map(fn, batch_size + v._batch_size[nd:])
            elif isinstance(v, torch.Tensor):
                out._data[k] = fn(v, self)
            else:
                out._data[k] = v
        return out

    def expand(self, *shape: Any) -> Self:
        """Expand the batch dims like ``torch.Tensor.expand`` (new dims on the left; no copy).

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"img": torch.zeros(3, 8, 8)}).expand(1000)["img"].shape
            torch.Size([1000, 3, 8, 8])
        """
        target = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        new_bs = torch.empty(self._batch_size, device="meta").expand(*target).shape
        nd = self.ndim
        return self._map(lambda t, _: t.expand(*new_bs, *t.shape[nd:]), new_bs)

    def unsqueeze(self, dim: int) -> Self:
        """Insert a batch dim of size 1 at ``dim`` (in ``[-ndim-1, ndim]``)."""
        if not -self.ndim - 1 <= dim <= self.ndim:
            raise InvalidIndexError(f"unsqueeze dim {dim} out of range for batch ndim {self.ndim}")
        d = dim % (self.ndim + 1)
        new_bs = torch.Size(list(self._batch_size[:d]) + [1] + list(self._batch_size[d:]))
        return self._map(lambda t, _: t.unsqueeze(d), new_bs)

    def squeeze(self, dim: int | None = None) -> Self:
        """Remove batch dims of size 1 (all of them, or only ``dim``)."""
        if dim is None:
            dims = [i for i, s in enumerate(self._batch_size) if s == 1]
        else:
            if not -self.ndim <= dim < self.ndim:
                raise InvalidIndexError(f"squeeze dim {dim} out of range for batch ndim {self.ndim}")
            d = dim % self.ndim
            dims = [d] if self._batch_size[d] == 1 else []
        new_bs = torch.Size([s for i, s in enumerate(self._batch_size) if i not in dims])
        nd = self.ndim

        def fn(t: torch.Tensor, _: TreeCore) -> torch.Tensor:
            return t.reshape(*new_bs, *t.shape[nd:])

        return self._map(fn, new_bs)

    def reshape(self, *shape: Any) -> Self:
        """Reshape the batch dims like ``torch.Tensor.reshape`` (``-1`` allowed)."""
        target = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        new_bs = torch.empty(self._batch_size, device="meta").reshape(*target).shape
        nd = self.ndim
        return self._map(lambda t, _: t.reshape(*new_bs, *t.shape[nd:]), new_bs)

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor | None], batch_size: Any = None) -> Self:
        """A new tree with ``fn`` applied to every tensor leaf (a ``None`` result drops the key).

        Args:
            batch_size: the result's batch size (needed when ``fn`` changes batch dims).

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"a": torch.ones(2)}).apply(lambda t: t * 2)["a"].tolist()
            [2.0, 2.0]
        """
        bs = self._batch_size if batch_size is None else as_size(batch_size)
        out = self._new_like(bs)
        for k, v in self._data.items():
            if isinstance(v, ShapeOps):
                out._data[k] = v.apply(fn, bs if batch_size is not None else None)
            elif isinstance(v, torch.Tensor):
                r = fn(v)
                if r is not None:
                    out._data[k] = out._convert(k, r)
            else:
                out._data[k] = v
        return out

    def to(
        self,
        *args: torch.device | str | int | torch.dtype | bool,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> Self:
        """A new tree with every tensor moved to a device and/or cast to a dtype, as
        ``torch.Tensor.to``: ``to("cuda")``, ``to(torch.float16)``, ``to("cuda", torch.float16)``,
        ``to(device="cuda", dtype=torch.bfloat16, non_blocking=True)``. A leaf already there
        with that dtype is kept as it is (no copy).

        Raises:
            InvalidArgumentError: an argument that is neither a device nor a dtype, a device or a
                dtype given twice, or a device this process does not have (nothing is copied).

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"a": torch.ones(2)})
            >>> t.to(torch.float16)["a"].dtype, t.to(device="cpu", dtype=torch.int8)["a"].dtype
            (torch.float16, torch.int8)
        """
        for arg in args:
            if isinstance(arg, bool):  # torch.Tensor.to(device, dtype, non_blocking) positionally
                non_blocking = arg
            elif isinstance(arg, torch.dtype):
                if dtype is not None:
                    raise InvalidArgumentError(f"to(): two dtypes, {dtype} and {arg}; pass one")
                dtype = arg
            elif isinstance(arg, (torch.device, str, int)):
                if device is not None:
                    raise InvalidArgumentError(f"to(): two devices, {device!r} and {arg!r}; pass one")
                device = arg
            else:
                raise InvalidArgumentError(
                    f"to() takes a device (torch.device, str or int) and/or a dtype, got {type(arg).__name__} {arg!r:.40}"
                )
        if device is None:
            if dtype is None:
                raise InvalidArgumentError("to() needs a device or a dtype: to('cuda'), to(torch.float16), to(device=, dtype=)")
            return self.apply(lambda t: t.to(dtype))
        dev = check_device(f"cuda:{device}" if type(device) is int else device)
        assert dev is not None
        out = self.apply(lambda t: t.to(dev, dtype, non_blocking=non_blocking))
        out._set_device(dev)
        return out

    def _set_device(self, device: torch.device | None) -> None:
        self._device = device
        for v in self._data.values():
            if isinstance(v, ShapeOps):
                v._set_device(device)

    def cpu(self) -> Self:
        """Same as ``to("cpu")``."""
        return self.to("cpu")

    def clone(self) -> Self:
        """A deep copy in ordinary memory (memory-mapped leaves are copied into RAM)."""
        out = self.apply(lambda t: t.clone())
        out._copy_non_tensors()
        return out

    def _copy_non_tensors(self) -> None:
        for k, v in self._data.items():
            if isinstance(v, ShapeOps):
                v._copy_non_tensors()
            elif isinstance(v, NonTensor):
                self._data[k] = NonTensor(copy.deepcopy(v.data))

    def numpy(self) -> dict[str, Any]:
        """A nested ``dict`` of numpy arrays: views of CPU and memory-mapped leaves (no copy).

        Arrays of a tree loaded with ``mode="r"`` are read-only; leaves on another device are
        copied to the host; non-tensor leaves are their values. ``bfloat16``, ``float8_*`` and
        ``complex32`` leaves raise :class:`~memtree.errors.DtypeError` (numpy has no such
        dtype): convert them first. See :mod:`memtree.tree.parts.numpy_view`.

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"a": torch.arange(3), "b": {"c": torch.ones(3)}, "n": "x"},
            ...                        batch_size=[3])
            >>> d = t.numpy()
            >>> d["a"][0] = 7                   # shares the leaf's memory
            >>> t["a"].tolist(), d["b"]["c"].dtype, d["n"]
            ([7, 1, 2], dtype('float32'), 'x')
        """
        return tree_numpy(self._data)

    def contiguous(self) -> Self:
        """A new tree whose leaves are contiguous (expanded leaves are materialised)."""
        return self.apply(lambda t: t.contiguous())
