"""Arguments of tree methods: keys, key paths, batch sizes and batch indices, normalised.

Example:
    >>> key_tuple("a"), as_size(3), fmt_key(("a", "b"))
    (('a',), torch.Size([3]), "('a', 'b')")
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch

from ...errors import BatchSizeError, KeyTypeError
from ...format.level import fmt_key
from ...format.schema import MAX_DIM, MAX_NDIM

__all__ = ["Key", "is_str_key", "key_tuple", "fmt_key", "as_size", "check_batch_index", "expand_ellipsis"]

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
