"""Options shared by the readers and writers of the store, validated once.

Example:
    >>> check_mode("r")
    'r'
    >>> check_mode("w")
    Traceback (most recent call last):
    ...
    memtree.errors.InvalidArgumentError: mode must be 'r' (read-only) or 'r+' (writes reach the files), got 'w'
"""

from __future__ import annotations

from ..errors import InvalidArgumentError

__all__ = ["MODES", "check_mode"]

#: How a loaded tree's files are mapped: ``"r"`` read-only, ``"r+"`` writes reach the files.
MODES = ("r", "r+")


def check_mode(mode: object) -> str:
    """``mode`` if it is one of :data:`MODES`, else :class:`~memtree.errors.InvalidArgumentError`."""
    if mode not in MODES:
        raise InvalidArgumentError(
            f"mode must be 'r' (read-only) or 'r+' (writes reach the files), got {mode!r:.40}"
        )
    return str(mode)
