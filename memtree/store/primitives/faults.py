"""Private fault-injection hook for crash tests: die at a named point of a write.

Not public API. The writer calls :func:`point` at each step of the commit protocol
(``docs/format.md``, "How a write is committed"). When the environment variable
``MEMTREE_FAULT`` is ``<name>`` or ``<name>:<n>``, the process calls ``os._exit(137)`` (what a
``kill -9`` looks like to the files: no cleanup, no ``finally``, no flush) the ``n``-th time
(default: first) it reaches point ``<name>``. When the variable is unset, :func:`point` is one
global lookup and a comparison.

The variable is read at import; a process that changes it afterwards (a forked test child) calls
:func:`reload`.

Example:
    >>> import os
    >>> from memtree.store.primitives import faults as _faults
    >>> os.environ["MEMTREE_FAULT"] = "after_leaf:3"
    >>> _faults.reload()
    >>> _faults.armed()
    ('after_leaf', 3)
    >>> del os.environ["MEMTREE_FAULT"]; _faults.reload()
"""

from __future__ import annotations

import os
import threading

__all__ = ["ENV", "POINTS", "EXIT_CODE", "point", "reload", "armed"]

ENV = "MEMTREE_FAULT"
EXIT_CODE = 137
#: Every point the writer calls, in the order a write reaches them.
POINTS = (
    "after_lock",  # the lock is held, recovery of a previous crash done
    "staging_created",  # the staging directory (one file's temporary file) exists, named in the journal
    "before_leaves",  # sub-directories made, no leaf written yet
    "after_leaf",  # after each complete leaf file (a safetensors file: each tensor; after_leaf:<k>)
    "before_meta",  # before each level's meta.json, deepest first (before_meta:<k>)
    "before_root_meta",  # every leaf and child meta.json written, root meta.json not yet
    "after_root_meta",  # the staging tree is complete, not yet published
    "before_publish",  # fsynced (if asked), about to rename
    "after_publish",  # renamed/exchanged onto the destination, parent not yet fsynced (a single
    # file written without existsok: linked, its temporary name not yet removed)
    "before_old_removed",  # overwrite: the old tree sits in the staging name, not yet deleted
    "between_renames",  # fallback overwrite: destination moved to the old copy, new not yet in
)

_target: str | None = None
_count = 1
_hits = 0
_mutex = threading.Lock()


def reload() -> None:
    """Re-read ``MEMTREE_FAULT`` (and reset the hit counter)."""
    global _target, _count, _hits
    spec = os.environ.get(ENV) or None
    _hits = 0
    if spec is None:
        _target = None
        return
    name, _, n = spec.partition(":")
    if name not in POINTS or (n and not n.isdigit()):
        raise ValueError(f"{ENV}={spec!r}: expected <point>[:<n>] with a point from {POINTS}")
    _count = int(n) if n else 1
    _target = name


def armed() -> tuple[str, int] | None:
    """The armed ``(point, n)``, or None."""
    return None if _target is None else (_target, _count)


def point(name: str) -> None:
    """Die with ``os._exit(137)`` if ``name`` is the armed point and this is its ``n``-th hit."""
    global _hits
    if _target is None or name != _target:
        return
    with _mutex:
        _hits += 1
        if _hits >= _count:
            os._exit(EXIT_CODE)


reload()
