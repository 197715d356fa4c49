"""numpy interop: :func:`tree_numpy` (``tree.numpy()``) and numpy values assigned into rows.

* ``tree.numpy()`` gives a nested ``dict`` of numpy arrays. CPU leaves (memory-mapped or not)
  become arrays that *share* their memory: no copy, and writes through a writable array change
  the leaf (and, for a memory-mapped leaf, its file). Leaves of a tree loaded with ``mode="r"``
  become read-only arrays. Leaves on another device are copied to the host. Non-tensor leaves
  are their values.
* ``bfloat16``, ``float8_*`` and ``complex32`` have no numpy dtype: ``numpy()`` raises
  :class:`~memtree.errors.DtypeError` naming the leaf, rather than hand back arrays that look
  like integers. Convert the leaf first (``tree[key] = tree[key].to(torch.float32)``, a copy), or
  view its bits (``tree[key].view(torch.uint16).numpy()``, no copy).
* numpy arrays and scalars assigned into rows (``tree[i] = {"x": array}``, ``tree[0:2] = ...``)
  are converted to tensors of the leaf's dtype (no copy when the dtypes match), so a
  memory-mapped tree is filled with its fast ``pwrite`` path.

Example:
    >>> import numpy as np, torch, memtree
    >>> tree = memtree.TensorTree({"x": torch.zeros(3, 2), "info": {"id": torch.arange(3)}},
    ...                           batch_size=[3])
    >>> tree[0] = {"x": np.ones(2, dtype=np.float64)}     # cast to the leaf's float32
    >>> arrays = tree.numpy()
    >>> arrays["x"][0].tolist(), arrays["info"]["id"].dtype
    ([1.0, 1.0], dtype('int64'))
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ...errors import DtypeError
from ...format.values import NonTensor

__all__ = ["tree_numpy", "leaf_numpy", "numpy_value"]


@lru_cache(maxsize=None)
def _has_numpy_dtype(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()
    except TypeError:
        return False
    return True


def leaf_numpy(leaf: torch.Tensor, key: Any) -> np.ndarray:
    """A numpy array of one tensor leaf: a view of a CPU leaf, a host copy of another one.

    Example:
        >>> leaf_numpy(torch.arange(3), "x").tolist()
        [0, 1, 2]
    """
    if not _has_numpy_dtype(leaf.dtype):
        raise DtypeError(
            f"leaf {key!r} has dtype {leaf.dtype}, which has no numpy dtype; convert it first "
            f"(tree[{key!r}] = tree[{key!r}].to(torch.float32), a copy) or view its bits "
            f"(tree[{key!r}].view(torch.uint{leaf.itemsize * 8}).numpy(), no copy)"
        )
    if leaf.device.type != "cpu":
        leaf = leaf.cpu()
    # .numpy() refuses tensors that require grad or carry conj/neg bits (a no-op otherwise)
    return leaf.detach().resolve_conj().resolve_neg().numpy()


def tree_numpy(data: dict[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """The nested ``dict`` of :meth:`TensorTree.numpy` for a tree's entries (``tree._data``).

    Example:
        >>> tree_numpy({"a": torch.ones(2), "s": NonTensor("hi")})
        {'a': array([1., 1.], dtype=float32), 's': 'hi'}
    """
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = path + (k,)
        if isinstance(v, torch.Tensor):
            out[k] = leaf_numpy(v, key[0] if len(key) == 1 else key)
        elif isinstance(v, NonTensor):
            out[k] = v.data
        else:  # a sub-tree
            out[k] = tree_numpy(v._data, key)
    return out


def numpy_value(value: np.ndarray | np.generic, leaf: torch.Tensor, key: Any) -> torch.Tensor:
    """A numpy array or scalar as a tensor of ``leaf``'s dtype, to assign into ``leaf``.

    No copy when the dtypes match and the array is writable and in native byte order.

    Example:
        >>> numpy_value(np.arange(2), torch.zeros(2), "x")
        tensor([0., 1.])
    """
    arr = np.asarray(value)
    if not arr.flags.writeable or not arr.dtype.isnative:  # torch maps neither
        arr = np.array(arr, dtype=arr.dtype.newbyteorder("="))
    try:
        tensor = torch.from_numpy(arr)
    except TypeError as err:
        raise DtypeError(
            f"cannot assign a numpy array of dtype {arr.dtype} to leaf {key!r} ({leaf.dtype}): "
            f"{err}; convert it to a numeric dtype first"
        ) from None
    return tensor if tensor.dtype == leaf.dtype else tensor.to(leaf.dtype)
