"""The tensor methods that PyTorch and tensordict users reach for, on a whole tree.

A mixin of :class:`~memtree.TensorTree`. Each method does to every tensor leaf what the
``torch.Tensor`` method of the same name does, with the tree's batch dims as the dims it names
(``split``, ``chunk``, ``unbind``, ``view``, ``permute``, ``transpose``, ``masked_fill``);
non-tensor leaves are kept as they are. Methods ending in ``_`` work in place: on a memory-mapped
tree they write into the files (and raise :class:`~memtree.errors.ReadOnlyError` on a tree
loaded with ``mode="r"``); the others return new trees, whose leaves are views where torch's
would be (``split``, ``unbind``, ``view``...) and copies where torch copies (a cast to another
dtype).

The names and signatures follow tensordict's where it has them (``fill_(key, value)``,
``named_apply(fn, nested_keys=False)``, ``split(split_size, dim=0)``...); what memtree leaves out,
and why, is listed in ``docs/getting-started.md`` ("tensordict methods that are not there").

Example:
    >>> import torch, memtree
    >>> t = memtree.TensorTree({"obs": torch.arange(6.0).reshape(3, 2), "done": torch.zeros(3, dtype=torch.bool)},
    ...                        batch_size=[3])
    >>> [part.batch_size[0] for part in t.split(2)]
    [2, 1]
    >>> t.half()["obs"].dtype, t.masked_fill(t["done"].logical_not(), -1)["obs"][0].tolist()
    (torch.float16, [-1.0, -1.0])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from typing_extensions import Self

import torch

from ...errors import (
    InvalidArgumentError,
    InvalidIndexError,
    MemtreeKeyError,
    MissingDependencyError,
    ShapeMismatchError,
    check_keywords,
)
from .args import Key
from .core import TreeCore
from .shape_ops import ShapeOps

__all__ = ["TensorCasts", "TensorOps", "FIELD_NAMES"]


class TensorCasts(ShapeOps):
    """``float()``, ``half()``, ``long()``...: casts of every leaf. A class of their own: their
    names (``int``, ``float``, ``bool``) would shadow the builtins in the annotations of the
    class body that defines them."""

    def _cast(self, dtype: torch.dtype) -> Self:
        return self.to(dtype=dtype)


    def float(self) -> Self:
        """Every tensor leaf as ``float32`` (``tensor.float()``; integer leaves too, as in torch
        and tensordict: ``apply(lambda t: t.float() if t.is_floating_point() else t)`` keeps them)."""
        return self._cast(torch.float32)

    def double(self) -> Self:
        """Every tensor leaf as ``float64`` (``tensor.double()``)."""
        return self._cast(torch.float64)

    def half(self) -> Self:
        """Every tensor leaf as ``float16`` (``tensor.half()``)."""
        return self._cast(torch.float16)

    def bfloat16(self) -> Self:
        """Every tensor leaf as ``bfloat16`` (``tensor.bfloat16()``)."""
        return self._cast(torch.bfloat16)

    def int(self) -> Self:
        """Every tensor leaf as ``int32`` (``tensor.int()``)."""
        return self._cast(torch.int32)

    def long(self) -> Self:
        """Every tensor leaf as ``int64`` (``tensor.long()``)."""
        return self._cast(torch.int64)

    def bool(self) -> Self:
        """Every tensor leaf as ``bool`` (``tensor.bool()``)."""
        return self._cast(torch.bool)


class TensorOps(TensorCasts):
    """The other tensor methods on every leaf (mixed into :class:`~memtree.TensorTree`)."""

    # ------------------------------------------------------------------------ devices, autograd
    def cuda(self, device: torch.device | str | int | None = None, non_blocking: bool = False) -> Self:
        """A new tree with every tensor on a CUDA device (``to("cuda")``; an int is ``cuda:<int>``).

        Raises:
            InvalidArgumentError: this process has no such CUDA device (nothing is copied).
        """
        target = f"cuda:{device}" if isinstance(device, int) else (device if device is not None else "cuda")
        return self.to(device=target, non_blocking=non_blocking)

    def detach(self) -> Self:
        """A new tree of the leaves detached from autograd (same memory, no copy).

        Example:
            >>> import torch, memtree
            >>> w = torch.ones(2, requires_grad=True)
            >>> memtree.TensorTree({"w": w * 2}).detach()["w"].requires_grad
            False
        """
        return self.apply(lambda t: t.detach())

    # ------------------------------------------------------------------------------ batch dims
    def _dim(self, dim: int, what: str) -> int:
        if type(dim) is not int or not -self.ndim <= dim < self.ndim:
            raise InvalidIndexError(
                f"{what}: dim {dim!r} is out of range for the tree's batch dims {list(self._batch_size)}"
                f" (it takes a batch dim in [{-self.ndim}, {self.ndim - 1}])"
            )
        return dim % self.ndim

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple[Self, ...]:
        """Split the tree along batch dim ``dim`` into trees of ``split_size`` items (the last
        may be smaller), or of the sizes listed, as ``torch.split``; the leaves are views.

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"x": torch.arange(5)}, batch_size=[5])
            >>> [p["x"].tolist() for p in t.split([1, 4])]
            [[0], [1, 2, 3, 4]]
        """
        d = self._dim(dim, "split")
        sizes = torch.empty(self._batch_size[d], device="meta").split(split_size)  # torch's own checks
        out = []
        start = 0
        for part in sizes:
            idx = (slice(None),) * d + (slice(start, start + len(part)),)
            out.append(self._index(idx))
            start += len(part)
        return tuple(out)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[Self, ...]:
        """Split the tree into ``chunks`` trees along batch dim ``dim``, as ``torch.chunk``.

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"x": torch.arange(5)}, batch_size=[5])
            >>> [len(p) for p in t.chunk(2)]
            [3, 2]
        """
        d = self._dim(dim, "chunk")
        if type(chunks) is not int or chunks < 1:
            raise InvalidArgumentError(f"chunk: chunks must be an int >= 1, got {chunks!r}")
        size = -(-self._batch_size[d] // chunks) if self._batch_size[d] else 1
        return TensorOps.split(self, size, d)  # (a @tensorclass field may be named split)

    def unbind(self, dim: int = 0) -> tuple[Self, ...]:
        """The trees along batch dim ``dim``, that dim removed (``tree[i]`` for ``dim=0``), as
        ``torch.unbind``; the leaves are views.

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"x": torch.arange(6).reshape(2, 3)}, batch_size=[2, 3])
            >>> [p["x"].tolist() for p in t.unbind(1)]
            [[0, 3], [1, 4], [2, 5]]
        """
        d = self._dim(dim, "unbind")
        return tuple(self._index((slice(None),) * d + (i,)) for i in range(self._batch_size[d]))

    def _leafwise(self, what: str, fn: Callable[[torch.Tensor, int], torch.Tensor], batch: torch.Size) -> Self:
        """``fn(leaf, batch ndim of the level)`` on every leaf, torch's errors named by key."""
        try:
            return self._map(lambda t, level: fn(t, level.ndim), batch)
        except RuntimeError as err:
            raise ShapeMismatchError(f"{what} on the tree's batch dims {list(self._batch_size)}: {err}") from None

    def view(self, *shape: int | Sequence[int]) -> Self:
        """The batch dims viewed as ``shape`` (``-1`` allowed), as ``torch.Tensor.view``: no copy,
        and an error where a leaf's memory cannot be viewed so (``reshape`` copies instead).

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"x": torch.zeros(6, 2)}, batch_size=[6]).view(2, 3)["x"].shape
            torch.Size([2, 3, 2])
        """
        target = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        try:
            new_bs = torch.empty(self._batch_size, device="meta").view(*target).shape
        except RuntimeError as err:
            raise ShapeMismatchError(f"view: batch dims {list(self._batch_size)} cannot be viewed as {list(target)}: {err}") from None
        nd = self.ndim
        return self._leafwise("view", lambda t, _: t.view(*new_bs, *t.shape[nd:]), new_bs)

    def permute(self, *dims: int | Sequence[int]) -> Self:
        """The batch dims reordered, as ``torch.Tensor.permute`` over them (each leaf's own dims
        stay last, in order); views, no copy.

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"x": torch.zeros(2, 3, 5)}, batch_size=[2, 3])
            >>> t.permute(1, 0)["x"].shape
            torch.Size([3, 2, 5])
        """
        first = dims[0] if len(dims) == 1 else None
        order: list[int] = list(first) if first is not None and not isinstance(first, int) else list(dims)  # type: ignore[arg-type]
        if sorted(self._dim(d, "permute") for d in order) != list(range(self.ndim)):
            raise InvalidIndexError(f"permute: {order} is not a permutation of the batch dims 0..{self.ndim - 1}")
        norm = [d % self.ndim for d in order]
        new_bs = torch.Size(self._batch_size[d] for d in norm)
        return self._leafwise("permute", lambda t, nd: t.permute(*norm, *range(len(norm), t.ndim)), new_bs)

    def transpose(self, dim0: int, dim1: int) -> Self:
        """Two batch dims swapped, as ``torch.transpose`` over the batch dims (views).

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"x": torch.zeros(2, 3)}, batch_size=[2, 3]).transpose(0, 1).batch_size
            torch.Size([3, 2])
        """
        a, b = self._dim(dim0, "transpose"), self._dim(dim1, "transpose")
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return TensorOps.permute(self, order)

    # ------------------------------------------------------------------------------ in place
    def _leaves(self) -> list[tuple[Key, torch.Tensor]]:
        return [(k, v) for k, v in self.items(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor)]

    def zero_(self) -> Self:
        """Every tensor leaf filled with zeros, in place (into the files of a memory-mapped tree);
        returns ``self``.

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"x": torch.ones(2)}).zero_()["x"].tolist()
            [0.0, 0.0]
        """
        for _, t in self._leaves():
            t.zero_()
        return self

    def fill_(self, key: Key, value: float | int | bool) -> Self:
        """The leaf at ``key`` filled with ``value``, in place, as tensordict's ``fill_(key,
        value)`` (``zero_()`` fills every leaf); returns ``self``.

        Raises:
            MemtreeKeyError: ``key`` is not a tensor leaf of the tree.

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"a": {"b": torch.zeros(2)}})
            >>> t.fill_(("a", "b"), 3)["a", "b"].tolist()
            [3.0, 3.0]
        """
        leaf = self.get(key)
        if not isinstance(leaf, torch.Tensor):
            raise MemtreeKeyError(
                f"fill_: {key!r} is not a tensor leaf of the tree (tensor leaves: {[k for k, _ in self._leaves()][:20]})"
            )
        leaf.fill_(value)
        return self

    def _mask_for(self, mask: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor) or mask.dtype is not torch.bool:
            raise InvalidArgumentError(f"{what}: the mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.ndim > self.ndim or tuple(mask.shape) != tuple(self._batch_size[: mask.ndim]):
            raise ShapeMismatchError(
                f"{what}: a mask of shape {list(mask.shape)} does not match the tree's leading batch dims "
                f"{list(self._batch_size)}; pass a bool tensor of the batch shape (or of its first dims)"
            )
        return mask

    @staticmethod
    def _widened(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return mask.reshape(*mask.shape, *(1,) * (t.ndim - mask.ndim)).to(t.device)

    def masked_fill_(self, mask: torch.Tensor, value: float | int | bool) -> Self:
        """Set ``value`` where ``mask`` (a bool tensor of the batch shape, or of its first dims)
        is true, in every tensor leaf, in place; returns ``self``.

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"r": torch.ones(3, 2)}, batch_size=[3])
            >>> t.masked_fill_(torch.tensor([True, False, True]), 0)["r"][:, 0].tolist()
            [0.0, 1.0, 0.0]
        """
        mask = self._mask_for(mask, "masked_fill_")
        for _, t in self._leaves():
            t.masked_fill_(self._widened(mask, t), value)
        return self

    def masked_fill(self, mask: torch.Tensor, value: float | int | bool) -> Self:
        """A new tree: :meth:`masked_fill_` on copies of the leaves (``self`` unchanged)."""
        mask = self._mask_for(mask, "masked_fill")
        return self.apply(lambda t: t.masked_fill(self._widened(mask, t), value))

    def apply_(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """Write ``fn(leaf)`` into every tensor leaf, in place (``leaf.copy_(fn(leaf))``, so a
        memory-mapped tree's files get the result); returns ``self``. ``fn`` must keep each
        leaf's shape (its dtype is cast back).

        Raises:
            ShapeMismatchError: ``fn`` gave a leaf a result of another shape (leaves before it in
                :meth:`keys` order are already written).

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"x": torch.arange(3.0)}).apply_(lambda t: t * 10)["x"].tolist()
            [0.0, 10.0, 20.0]
        """
        for key, t in self._leaves():
            result = fn(t)
            if not isinstance(result, torch.Tensor) or result.shape != t.shape:
                raise ShapeMismatchError(
                    f"apply_: fn returned {getattr(result, 'shape', type(result).__name__)} for {key!r}, "
                    f"whose shape is {list(t.shape)}; apply_ writes in place (use apply() for a new tree)"
                )
            t.copy_(result)
        return self

    @check_keywords
    def named_apply(
        self, fn: Callable[[Key, torch.Tensor], torch.Tensor | None], *, nested_keys: bool = False
    ) -> Self:
        """A new tree of ``fn(key, leaf)`` for every tensor leaf (a ``None`` result drops the key),
        as tensordict's ``named_apply``: ``key`` is the leaf's own name, or with
        ``nested_keys=True`` its whole key (a ``str`` at the top level, a tuple below).

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"w": torch.ones(2), "sub": {"b": torch.ones(2)}})
            >>> t.named_apply(lambda k, v: v * 0 if k == "b" else v)["sub", "b"].tolist()
            [0.0, 0.0]
            >>> t.named_apply(lambda k, v: None if k == ("sub", "b") else v, nested_keys=True).keys(include_nested=True)
            ['w', 'sub']
        """

        def walk(tree: TreeCore, path: tuple[str, ...]) -> TreeCore:
            out = tree._new_like()
            for k, v in tree._data.items():
                if isinstance(v, TreeCore):
                    out._data[k] = walk(v, path + (k,))
                elif isinstance(v, torch.Tensor):
                    full: Key = (path + (k,)) if path else k
                    r = fn(full if nested_keys else k, v)
                    if r is not None:
                        out._data[k] = out._convert(k, r)
                else:
                    out._data[k] = v
            return out

        return cast(Self, walk(self, ()))

    def to_tensordict(self) -> Any:
        """The tree as a ``tensordict.TensorDict`` (optional package ``tensordict``): the same
        tensors (no copy), sub-trees as sub-``TensorDict``\\ s, non-tensor values as
        ``NonTensorData``, the same batch size.

        Raises:
            MissingDependencyError: tensordict is not installed.
        """
        try:
            from tensordict import NonTensorData, TensorDict
        except ImportError as err:
            raise MissingDependencyError(f"to_tensordict() needs the tensordict package (pip install tensordict): {err}") from None

        def convert(tree: TreeCore) -> Any:
            td = TensorDict({}, batch_size=tree._batch_size, device=tree._device)
            for k, v in tree._data.items():
                if isinstance(v, TreeCore):
                    td[k] = convert(v)
                elif isinstance(v, torch.Tensor):
                    td[k] = v
                else:
                    td[k] = NonTensorData(v.data, batch_size=tree._batch_size)
            return td

        return convert(self)


#: The names of these methods, which a ``@tensorclass`` field may take (a record with a field
#: ``split: str`` or ``view: torch.Tensor`` predates them): the field wins on that class, and the
#: method is reached as ``memtree.TensorTree.split(record, ...)``. The methods above call each
#: other through their class for that reason.
FIELD_NAMES = frozenset(n for cls in (TensorCasts, TensorOps) for n in vars(cls) if not n.startswith("_"))
