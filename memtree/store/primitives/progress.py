"""Progress bars for long operations: shown on a terminal, silent everywhere else.

Long operations (memory-mapping many leaves, converting checkpoints, remote fetches, ``verify``)
take a ``progress=`` argument with one meaning everywhere:

* ``None`` (default, "auto"): show a bar only when standard error is a terminal and the ``CI``
  environment variable is not set (or is ``0``/``false``); bars that would finish within half a
  second never appear;
* ``True``: always show it (even in a log file), as long as tqdm is installed;
* ``False``: never show it.

The bars come from `tqdm <https://tqdm.github.io>`_, an optional dependency
(``pip install "memtree[progress]"``). Without tqdm nothing is printed and nothing fails.

Example:
    >>> from memtree.store.primitives.progress import Progress, track
    >>> total = 0
    >>> for n in track(range(3), desc="adding", progress=False):
    ...     total += n
    >>> with Progress(total=100, desc="copying", unit="B", progress=False) as bar:
    ...     bar.update(100)
    >>> total, bar.active
    (3, False)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["Progress", "track", "progress_enabled"]

T = TypeVar("T")

#: In auto mode, a bar appears only once its operation has run this long (seconds).
AUTO_DELAY = 0.5


def progress_enabled(progress: bool | None = None) -> bool:
    """Whether a bar should be shown for this ``progress=`` argument (tqdm aside).

    Args:
        progress: ``True``/``False`` force the answer; ``None`` means "only on a terminal, and
            not in CI" (standard error is a TTY and ``CI`` is unset, empty, ``0`` or ``false``).

    Example:
        >>> progress_enabled(False), progress_enabled(True)
        (False, True)
    """
    if progress is not None:
        return bool(progress)
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def _tqdm_class() -> Any:
    try:
        from tqdm.std import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """A progress bar on standard error, or nothing (see the module docstring for when).

    Use it as a context manager and call :meth:`update` as work completes; it is safe to call
    from one thread at a time (update it from the thread that collects results).

    Args:
        total: the amount of work (items or bytes), or ``None`` if unknown.
        desc: a short label shown before the bar.
        unit: what is counted: ``"it"``, ``"leaf"``, ``"B"`` (bytes are shown as KiB/MiB/...).
        progress: ``None`` auto, ``True`` force on, ``False`` off.

    Example:
        >>> with Progress(total=2, desc="writing", unit="leaf", progress=False) as bar:
        ...     bar.update()
        ...     bar.update()
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "",
        unit: str = "it",
        progress: bool | None = None,
    ) -> None:
        self._bar: Any = None
        if not progress_enabled(progress):
            return
        tqdm = _tqdm_class()
        if tqdm is None:
            return
        self._bar = tqdm(
            total=total,
            desc=desc or None,
            unit=unit,
            unit_scale=unit == "B",
            unit_divisor=1024 if unit == "B" else 1000,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            delay=AUTO_DELAY if progress is None else 0.0,
        )

    @property
    def active(self) -> bool:
        """True if a bar is being drawn (or will be, once its delay has passed)."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        """Record ``n`` more units of completed work."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar from the terminal (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def track(
    iterable: Iterable[T],
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    progress: bool | None = None,
) -> Iterator[T]:
    """Yield the items of ``iterable`` while advancing a :class:`Progress` bar by one per item.

    Args:
        iterable: the items.
        total: number of items; taken from ``len(iterable)`` when it has one.
        desc: label of the bar.
        unit: what one item is (``"leaf"``, ``"file"``...).
        progress: ``None`` auto, ``True`` force on, ``False`` off.

    Example:
        >>> [x * 2 for x in track([1, 2, 3], desc="doubling", progress=False)]
        [2, 4, 6]
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total=total, desc=desc, unit=unit, progress=progress) as bar:
        for item in iterable:
            yield item
            bar.update()
