"""Arguments of tree methods: keys, key paths, batch sizes and batch indices, normalised.

Example:
    >>> key_tuple("a"), as_size(3), fmt_key(("a", "b"))
    (('a',), torch.Size([3]), "('a', 'b')")
"""

from __future__ import annotations

from typing import Any, Callable, Union

import numpy as np
import torch

from ...errors import BatchSizeError, InvalidIndexError, KeyTypeError
from ...format.level import fmt_key
from ...format.schema import MAX_DIM, MAX_NDIM

__all__ = [
    "Key", "is_str_key", "key_tuple", "fmt_key", "as_size", "check_batch_index", "expand_ellipsis", "batch_rows", "check_rows",
]

Key = Union[str, tuple[str, ...]]
"""A tree key: a str, or a tuple of str for a nested key."""


def is_str_key(key: object) -> bool:
    """True for a key of a tree: a str, or a non-empty tuple of str."""
    return isinstance(key, str) or (
        isinstance(key, tuple) and len(key) > 0 and all(isinstance(k, str) for k in key)
    )


def key_tuple(key: Key) -> tuple[str, ...]:
    """A key as a tuple path (``"a"`` -> ``("a",)``); raises ``KeyTypeError`` for other types."""
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple) and key:
        for k in key:
            if not isinstance(k, str):
                raise KeyTypeError(f"nested keys are tuples of str; {key!r} holds a {type(k).__name__}")
        return key
    raise KeyTypeError(f"tree keys must be str or non-empty tuples of str, got {key!r}")


def as_size(batch_size: Any) -> torch.Size:
    """A ``batch_size`` argument (an int or a sequence of ints >= 0) as a ``torch.Size``."""
    if isinstance(batch_size, int):
        batch_size = (batch_size,)
    try:
        size = torch.Size([int(b) for b in batch_size])
    except (TypeError, ValueError):
        raise BatchSizeError(f"batch_size must be a sequence of ints, got {batch_size!r}") from None
    if any(b < 0 for b in size):
        raise BatchSizeError(f"batch_size must not have negative sizes, got {list(size)}")
    if len(size) > MAX_NDIM or any(b > MAX_DIM for b in size):
        raise BatchSizeError(
            f"batch_size must have at most {MAX_NDIM} dims, each below 2**63 (what torch and the"
            f" on-disk format can hold), got {list(size)!s:.200}"
        )
    return size


def expand_ellipsis(idx: Any, ndim: int) -> Any:
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


_INDEX_SCALARS = (int, slice, type(None), type(Ellipsis), torch.Tensor, np.ndarray, np.integer, np.bool_)


def check_batch_index(idx: Any) -> None:
    """Raise ``KeyTypeError`` unless ``idx`` can index batch dims (like a tensor's first dims).

    A batch index is an int, a slice, ``None``, ``...``, an int or bool tensor or numpy array, a
    list or ``range`` of ints or bools, or a tuple of these. Anything else (bytes, floats, str
    mixed with indices...) is refused here, before any leaf is touched.

    Example:
        >>> check_batch_index((0, slice(1, 3)))
        >>> check_batch_index(b"x")
        Traceback (most recent call last):
        ...
        memtree.errors.KeyTypeError: b'x' is neither a key (str, or a tuple of str) nor a batch index (int, slice, None, ..., an int or bool tensor/array, a list of ints); got a bytes
    """
    for part in idx if type(idx) is tuple else (idx,):
        if isinstance(part, _INDEX_SCALARS) or (
            isinstance(part, (list, range)) and all(isinstance(i, (int, np.integer, np.bool_)) for i in part)
        ):
            continue
        if isinstance(part, str):
            raise KeyTypeError(f"cannot mix str keys and batch indices in {idx!r}")
        raise KeyTypeError(
            f"{idx!r:.80} is neither a key (str, or a tuple of str) nor a batch index (int, slice, "
            f"None, ..., an int or bool tensor/array, a list of ints); got a {type(part).__name__}"
        )


#: Integer dtypes of row-index tensors (``uint8`` index tensors are masks to torch, and stay so).
_SIGNED_ROWS = (torch.int64, torch.int32, torch.int16, torch.int8)
_UNSIGNED_ROWS = (torch.uint16, torch.uint32, torch.uint64)


def batch_rows(idx: Any, size: int, where: Callable[[], str]) -> torch.Tensor | None:
    """The rows of dim 0 that ``idx`` selects, as an int64 or int32 CPU tensor, when it is a gather.

    A gather is an integer tensor or numpy array of any shape and any integer dtype but
    ``uint8`` (torch reads ``uint8`` index tensors as masks), a list or ``range`` of ints, or a
    1-D bool mask of length ``size`` (its true rows); alone or as the only item of a tuple.
    Anything else (ints, slices, tuples of indices, multi-dim masks) returns None: torch's
    indexing takes it. The rows are not checked against ``size`` here (see :func:`check_rows`),
    except those that no int64 holds.

    Args:
        idx: the batch index.
        size: the length of dim 0.
        where: what is indexed, for messages (called only to raise).

    Raises:
        InvalidIndexError: a mask of another length than ``size``, or a row beyond 2**63.

    Example:
        >>> batch_rows([3, -1], 5, lambda: "x").tolist(), batch_rows(slice(2), 5, lambda: "x")
        ([3, -1], None)
    """
    if type(idx) is tuple and len(idx) == 1:
        idx = idx[0]
    if isinstance(idx, (list, range)):
        idx = _list_rows(idx, size, where)
    elif isinstance(idx, np.ndarray):
        if idx.dtype == np.bool_:
            idx = torch.tensor(idx)  # a copy: the array may be read-only
        elif idx.dtype.kind in "iu" and idx.dtype != np.uint8:
            return _from_array(idx, size, where)
        else:
            return None
    if not isinstance(idx, torch.Tensor) or not idx.is_cpu or idx.ndim == 0:
        return None
    dtype = idx.dtype
    if dtype == torch.bool:
        if idx.ndim != 1:
            return None  # a mask over several batch dims: torch's indexing
        if idx.numel() != size:
            raise InvalidIndexError(
                f"a mask of length {idx.numel()} cannot select rows of dim 0 of size {size} ({where()}): "
                "a boolean mask has one value per row"
            )
        return idx.nonzero().view(-1)
    if dtype == torch.int64 or dtype == torch.int32:
        return idx
    if dtype in _SIGNED_ROWS:
        return idx.to(torch.int64)
    if dtype in _UNSIGNED_ROWS:
        return _from_array(idx.numpy(), size, where)
    return None


def check_rows(rows: torch.Tensor, size: int, where: Callable[[], str]) -> torch.Tensor:
    """``rows`` (from :func:`batch_rows`) as int64 rows in ``[0, size)``, negative ones wrapped.

    Raises:
        InvalidIndexError: a row out of ``[-size, size)``, naming it, the bound and ``where()``.

    Example:
        >>> check_rows(torch.tensor([3, -1]), 5, lambda: "x").tolist()
        [3, 4]
        >>> check_rows(torch.tensor([7]), 5, lambda: "leaf 'x'")
        Traceback (most recent call last):
        ...
        memtree.errors.InvalidIndexError: index 7 is out of range for dim 0 of size 5 (leaf 'x'): rows go from -5 to 4
    """
    rows = rows.to(torch.int64)
    if not rows.numel():
        return rows
    low_t, high_t = torch.aminmax(rows)
    low, high = int(low_t), int(high_t)
    if low < -size or high >= size:
        _out_of_range(low if low < -size else high, size, where)
    return torch.where(rows < 0, rows + size, rows) if low < 0 else rows


def _out_of_range(bad: object, size: int, where: Callable[[], str]) -> None:
    raise InvalidIndexError(
        f"index {bad} is out of range for dim 0 of size {size} ({where()}): "
        + (f"rows go from {-size} to {size - 1}" if size else "it has no rows")
    )


def _list_rows(idx: list[Any] | range, size: int, where: Callable[[], str]) -> Any:
    """A list or range of rows as a tensor (as torch converts it), or ``idx`` as it is."""
    if not idx:
        return torch.zeros(0, dtype=torch.int64)
    try:
        rows = torch.tensor(idx)
    except (OverflowError, TypeError, ValueError, RuntimeError) as err:  # not all ints: not a gather
        if "verflow" in str(err):  # ints beyond int64
            _out_of_range(f"in {list(idx)!r:.80}", size, where)
        return idx
    return rows if rows.dtype in (torch.int64, torch.bool) else idx


def _from_array(array: np.ndarray[Any, Any], size: int, where: Callable[[], str]) -> torch.Tensor:
    """An integer array's rows as int64, refusing unsigned rows that int64 would wrap."""
    if array.size and array.dtype.kind == "u" and int(array.max()) >= size:
        _out_of_range(int(array.max()), size, where)
    return torch.from_numpy(array.astype(np.int64))
