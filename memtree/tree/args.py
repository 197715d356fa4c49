"""Arguments of tree methods: keys, key paths, batch sizes and batch indices, normalised.

Example:
    >>> key_tuple("a"), as_size(3), fmt_key(("a", "b"))
    (('a',), torch.Size([3]), "('a', 'b')")
"""

from __future__ import annotations

from typing import Any, Union

import torch

from ..errors import BatchSizeError, KeyTypeError

__all__ = ["Key", "is_str_key", "key_tuple", "fmt_key", "as_size", "expand_ellipsis"]

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


def fmt_key(path: tuple[str, ...]) -> str:
    """A key path as messages show it: ``'a'`` or ``('a', 'b')``."""
    return repr(path[0]) if len(path) == 1 else repr(path)


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
