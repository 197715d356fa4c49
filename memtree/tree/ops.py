"""Functions over several trees: :func:`stack` and :func:`cat`.

Example:
    >>> import torch, memtree
    >>> a = memtree.TensorTree({"x": torch.zeros(3)})
    >>> memtree.stack([a, a]).batch_size
    torch.Size([2])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..errors import BatchSizeError, InvalidArgumentError, InvalidIndexError, MemtreeKeyError, ShapeMismatchError, check_keywords
from ..format.values import NonTensor
from .parts.gather import PLAIN, output_tensors
from .tensortree import TensorTree

__all__ = ["stack", "stack_into", "cat"]


def _combine(
    trees: Sequence[TensorTree],
    batch_size: torch.Size,
    fn: Callable[[list[torch.Tensor]], torch.Tensor],
    what: str,
    along: int | None,
    path: tuple[str, ...] = (),
) -> TensorTree:
    """Combine leaf by leaf; ``along`` is the dim ``cat`` joins (``None``: ``stack``, shapes equal)."""
    first = trees[0]
    for other in trees[1:]:
        if list(other._data) != list(first._data) and set(other._data) != set(first._data):
            raise MemtreeKeyError(
                f"cannot {what} trees with different keys at {path or 'the root'}: "
                f"{sorted(first._data)} vs {sorted(other._data)}"
            )
    out = first._new_like(batch_size)
    nd = first.ndim
    for key, value in first._data.items():
        values = [t._data[key] for t in trees]
        if isinstance(value, TensorTree):
            if not all(isinstance(v, TensorTree) for v in values):
                raise MemtreeKeyError(f"cannot {what}: {path + (key,)!r} is a sub-tree in some trees only")
            sub_bs = batch_size + value._batch_size[nd:]
            out._data[key] = _combine(values, sub_bs, fn, what, along, path + (key,))
        elif isinstance(value, torch.Tensor):
            if not all(isinstance(v, torch.Tensor) for v in values):
                raise MemtreeKeyError(f"cannot {what}: {path + (key,)!r} is a tensor in some trees only")
            _check_leaves(values, what, along, path + (key,))
            out._data[key] = fn(values)
        else:
            if not all(isinstance(v, NonTensor) and v == value for v in values):
                raise ShapeMismatchError(
                    f"cannot {what}: non-tensor leaf {path + (key,)!r} differs between trees "
                    f"({[v.data if isinstance(v, NonTensor) else v for v in values][:4]}...)"
                )
            out._data[key] = value
    return out


def _check_leaves(values: list[torch.Tensor], what: str, along: int | None, key: tuple[str, ...]) -> None:
    """Same shape (but along ``along``) and device for every tree's leaf, or a clear error."""
    first = values[0]
    for v in values[1:]:
        same = len(v.shape) == len(first.shape) and all(
            a == b for i, (a, b) in enumerate(zip(v.shape, first.shape)) if i != along
        )
        if not same:
            raise ShapeMismatchError(
                f"cannot {what}: leaf {key!r} has shape {list(first.shape)} in one tree and "
                f"{list(v.shape)} in another" + ("" if along is None else f" (they may differ in dim {along} only)")
            )
        if v.device != first.device:
            raise ShapeMismatchError(
                f"cannot {what}: leaf {key!r} is on {first.device} in one tree and on {v.device} in "
                "another; move the trees to one device first (tree.to(device))"
            )


@check_keywords
def stack(trees: Sequence[TensorTree], dim: int = 0) -> TensorTree:
    """Stack trees of equal batch size along a new batch dim ``dim``.

    Example:
        >>> import torch, memtree
        >>> t = memtree.TensorTree({"x": torch.ones(2, 5)}, batch_size=[2])
        >>> memtree.stack([t, t, t], dim=1)["x"].shape
        torch.Size([2, 3, 5])
    """
    return _stack(trees, dim, lambda vs, d: torch.stack(vs, d))


def stack_into(trees: Sequence[TensorTree], memory: str) -> TensorTree:
    """:func:`stack` along dim 0, each leaf stacked with one call into a new tensor of ``memory``
    (:func:`~memtree.tree.parts.gather.output_tensors`: shared memory in a DataLoader worker).

    Leaves of several dtypes, or not plain CPU tensors, are stacked as :func:`stack` does.

    Example:
        >>> import torch, memtree
        >>> t = memtree.TensorTree({"x": torch.ones(5)})
        >>> stack_into([t, t], "shared")["x"].is_shared()
        True
    """
    return _stack(trees, 0, lambda vs, d: _stacked_into(vs, memory))


def _stacked_into(values: list[torch.Tensor], memory: str) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():  # MemoryMappedTensor's hook: not needed to read
        first = values[0]
        dtype = first.dtype
        if all(type(v) in PLAIN and v.dtype == dtype and v.is_cpu and not v.requires_grad for v in values):
            [out] = output_tensors([((len(values),) + first.shape, dtype)], memory)
            return torch.stack(values, 0, out=out)
    return torch.stack(values)  # type promotion, autograd, subclasses, devices: torch's rules


def _stack(trees: Sequence[TensorTree], dim: int, fn: Callable[[list[torch.Tensor], int], torch.Tensor]) -> TensorTree:
    trees = list(trees)
    if not trees:
        raise InvalidArgumentError("stack() needs at least one tree")
    bs = trees[0].batch_size
    for t in trees[1:]:
        if t.batch_size != bs:
            raise BatchSizeError(f"stack() needs equal batch sizes, got {list(bs)} and {list(t.batch_size)}")
    nd = len(bs)
    if not -nd - 1 <= dim <= nd:
        raise InvalidIndexError(f"stack dim {dim} out of range for batch ndim {nd}")
    d = dim % (nd + 1)
    new_bs = torch.Size(list(bs[:d]) + [len(trees)] + list(bs[d:]))
    return _combine(trees, new_bs, lambda vs: fn(vs, d), "stack", None)


@check_keywords
def cat(trees: Sequence[TensorTree], dim: int = 0) -> TensorTree:
    """Concatenate trees along the existing batch dim ``dim``.

    Example:
        >>> import torch, memtree
        >>> t = memtree.TensorTree({"x": torch.ones(2, 5)}, batch_size=[2])
        >>> memtree.cat([t, t]).batch_size
        torch.Size([4])
    """
    trees = list(trees)
    if not trees:
        raise InvalidArgumentError("cat() needs at least one tree")
    nd = trees[0].ndim
    if nd == 0:
        raise BatchSizeError("cat() needs trees with at least one batch dim")
    if not -nd <= dim < nd:
        raise InvalidIndexError(f"cat dim {dim} out of range for batch ndim {nd}")
    d = dim % nd
    bs0 = trees[0].batch_size
    for t in trees[1:]:
        bs = t.batch_size
        if len(bs) != nd or any(bs[i] != bs0[i] for i in range(nd) if i != d):
            raise BatchSizeError(f"cat() along dim {d} needs matching batch sizes, got {list(bs0)} and {list(bs)}")
    new_bs = torch.Size(list(bs0[:d]) + [sum(t.batch_size[d] for t in trees)] + list(bs0[d + 1 :]))
    return _combine(trees, new_bs, lambda vs: torch.cat(vs, d), "cat", d)
