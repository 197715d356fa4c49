"""The whole-tree hash of format version 2, and how a checksum mismatch is classified.

``tree_hash`` (root ``meta.json`` only, ``docs/format.md`` "Version 2") is one checksum over every
``meta.json`` of the tree, framed and sorted by key path:

* first the header line ``["memtree-tree-hash",1]``;
* then, for each level (the root too: key path ``[]``, dir ``""``), sorted by key path (a list
  of str, compared element by element by code point), the line ``[<key path>,<dir>]``
  followed by the level's ``meta.json`` bytes as memtree writes them
  (:func:`~memtree.format.schema.dump_level`; the root's without its ``tree_hash`` field, and
  without its ``mac`` when the tree is encrypted);
* and for each pickled value, among the levels in key path order, the line
  ``["pickle",<key path>,<checksum of the pickle file's bytes>]``;

each line and each ``meta.json`` followed by ``"\n"`` (compact JSON never holds a raw newline).
The hash is ``"<algorithm>:<hex>"`` of all of it, with the algorithm of the leaves' checksums. It
covers every field of every level (the root's ``save_id`` too, and any field later additions
define), so any change of a key, dtype, shape, value, file name or leaf checksum (so of any
leaf's bytes) changes it. The writer hashes the bytes it has just written: no extra work per
leaf.

A leaf whose bytes no longer match its checksum is *damaged*, unless the file was modified after
its level's ``meta.json`` was written (:func:`changed_after_meta`): then it was written in place
(through a ``mode="r+"`` mapping, say) and its checksum is *stale*: memtree cannot tell an
intended write from damage, and says so instead of calling it corruption.

Example:
    >>> from memtree.format.schema import LevelMeta, JsonMeta
    >>> tree_hash("crc32", {"": LevelMeta((), (JsonMeta("a", 1),))}, {})[:6]
    'crc32:'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

import orjson

from ..format.names import META_NAME
from ..format.schema import ChildMeta, LevelMeta, PickleMeta, dump_level
from .files import new_digest

__all__ = ["tree_hash", "tree_hash_lines", "bytes_checksum", "changed_after_meta"]

_HEADER = "memtree-tree-hash"


def tree_hash_lines(
    metas: Mapping[str, LevelMeta], pickle_sums: Mapping[str, str], dumped: Mapping[str, bytes] | None = None
) -> list[bytes]:
    """The canonical lines of a tree (see the module docstring).

    Args:
        metas: every level's metadata by directory relative to the root (``""``: the root).
        pickle_sums: the checksum of each pickle file's bytes, by path relative to the root.
        dumped: ``dump_level`` of some levels already at hand (a writer's), by directory.

    Raises:
        KeyError: a level or pickle file of the tree is not in ``metas``/``pickle_sums``.
    """
    rows: list[tuple[list[str], int, list[bytes]]] = []
    todo: list[tuple[str, list[str], str]] = [("", [], "")]
    while todo:
        rel, path, name = todo.pop()
        meta = metas[rel]
        if rel == "":
            data = dump_level(replace(meta, tree_hash=None, mac=None))  # an encrypted root's mac covers the hash
        else:
            data = dumped[rel] if dumped is not None and rel in dumped else dump_level(meta)
        rows.append((path, 0, [orjson.dumps([path, name]), data]))
        for e in meta.entries:
            if isinstance(e, ChildMeta):
                todo.append((f"{rel}/{e.dir}" if rel else e.dir, path + [e.key], e.dir))
            elif isinstance(e, PickleMeta):
                digest = pickle_sums[f"{rel}/{e.file}" if rel else e.file]
                rows.append((path + [e.key], 1, [orjson.dumps(["pickle", path + [e.key], digest])]))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [orjson.dumps([_HEADER, 1])] + [line for _, _, lines in rows for line in lines]


def tree_hash(
    algorithm: str,
    metas: Mapping[str, LevelMeta],
    pickle_sums: Mapping[str, str],
    dumped: Mapping[str, bytes] | None = None,
) -> str:
    """``"<algorithm>:<hex>"`` over :func:`tree_hash_lines`, each followed by a newline.

    Example:
        >>> from memtree.format.schema import LevelMeta
        >>> a = tree_hash("sha256", {"": LevelMeta((), ())}, {})
        >>> b = tree_hash("sha256", {"": LevelMeta((2,), ())}, {})
        >>> a != b
        True
    """
    digest = new_digest(algorithm)
    for line in tree_hash_lines(metas, pickle_sums, dumped):
        digest.update(line + b"\n")
    return f"{algorithm}:{digest.hexdigest()}"


def bytes_checksum(algorithm: str, data: bytes) -> str:
    """``"<algorithm>:<hex>"`` of ``data`` (a pickle file's bytes, as the tree hash covers them).

    Example:
        >>> bytes_checksum("crc32", b"abc")
        'crc32:352441c2'
    """
    digest = new_digest(algorithm)
    digest.update(data)
    return f"{algorithm}:{digest.hexdigest()}"


def changed_after_meta(fd: int, dir_fd: int) -> bool:
    """True when the open leaf file ``fd`` was modified after its level's ``meta.json`` (in the
    directory ``dir_fd``) was written: its recorded checksum is stale, not evidence of damage.

    A write commits leaf files before their ``meta.json``, so an untouched leaf is never newer.
    Modification times have the filesystem's granularity (a write within the same clock tick as
    the ``meta.json`` counts as damage), and a process that resets the time can hide a change:
    a mismatch is reported either way; only its wording differs.
    """
    try:
        return os.fstat(fd).st_mtime_ns > os.stat(META_NAME, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
    except OSError:
        return False
