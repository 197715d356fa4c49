"""The whole-tree hash of format version 2, and how a checksum mismatch is classified.

``tree_hash`` (root ``meta.json`` only, ``docs/format.md`` "Version 2") is one checksum over a
canonical listing of the tree: a header line, then one line per level and per entry, sorted by key
path. Each line is the compact JSON array (orjson) of:

* the header, first: ``["memtree-tree-hash", 1, <root save_id or null>]``;
* a level (the root too, with key path ``[]`` and dir ``""``):
  ``["tree", <key path>, <dir>, <type>, <batch_size>]``;
* a tensor leaf: ``["tensor", <key path>, <file>, <dtype>, <shape>, <capacity or null>,
  <checksum or null>]``;
* a JSON value: ``["json", <key path>, <value>]``;
* a pickled value: ``["pickle", <key path>, <file>, <checksum of the file's bytes>]``;

followed by ``"\\n"``; the lines after the header are sorted by key path (a list of str,
compared element by element by code point; a level and its entries never share a key path).
The hash is ``"<algorithm>:<hex>"`` of the concatenated lines, with the algorithm of the leaves'
checksums. Any change of a key, a dtype, a shape, a value, a file name or a leaf checksum (so of
any leaf's bytes) changes it.

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

import orjson

from ..format.dtypes import dtype_name
from ..format.names import META_NAME
from ..format.schema import ChildMeta, JsonMeta, LeafMeta, LevelMeta, PickleMeta
from .files import new_digest

__all__ = ["tree_hash", "tree_hash_lines", "changed_after_meta"]

_HEADER = "memtree-tree-hash"


def tree_hash_lines(metas: Mapping[str, LevelMeta], pickle_sums: Mapping[str, str]) -> list[bytes]:
    """The canonical lines of a tree (see the module docstring).

    Args:
        metas: every level's metadata by directory relative to the root (``""``: the root).
        pickle_sums: the checksum of each pickle file's bytes, by path relative to the root.

    Raises:
        KeyError: a level or pickle file of the tree is not in ``metas``/``pickle_sums``.
    """
    root = metas[""]
    rows: list[tuple[list[str], bytes]] = []
    todo: list[tuple[str, list[str], str, LevelMeta]] = [("", [], "", root)]
    while todo:
        rel, path, name, meta = todo.pop()
        rows.append((path, orjson.dumps(["tree", path, name, meta.type, list(meta.batch_size)])))
        for e in meta.entries:
            p = path + [e.key]
            if isinstance(e, LeafMeta):
                line = ["tensor", p, e.file, dtype_name(e.dtype), list(e.shape), e.capacity, e.checksum]
            elif isinstance(e, ChildMeta):
                child = f"{rel}/{e.dir}" if rel else e.dir
                todo.append((child, p, e.dir, metas[child]))
                continue
            elif isinstance(e, JsonMeta):
                line = ["json", p, e.value]
            else:
                assert isinstance(e, PickleMeta)
                line = ["pickle", p, e.file, pickle_sums[f"{rel}/{e.file}" if rel else e.file]]
            rows.append((p, orjson.dumps(line)))
    rows.sort(key=lambda r: r[0])
    return [orjson.dumps([_HEADER, 1, root.save_id])] + [line for _, line in rows]


def tree_hash(algorithm: str, metas: Mapping[str, LevelMeta], pickle_sums: Mapping[str, str]) -> str:
    """``"<algorithm>:<hex>"`` over :func:`tree_hash_lines`, each followed by a newline.

    Example:
        >>> from memtree.format.schema import LevelMeta
        >>> a = tree_hash("sha256", {"": LevelMeta((), ())}, {})
        >>> b = tree_hash("sha256", {"": LevelMeta((2,), ())}, {})
        >>> a != b
        True
    """
    digest = new_digest(algorithm)
    for line in tree_hash_lines(metas, pickle_sums):
        digest.update(line + b"\n")
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
