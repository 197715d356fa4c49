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

:func:`check_tree_hash` is the one check of a recorded ``tree_hash`` against a tree as it is
stored, over the storage seam (:class:`~memtree.store.reading.storage.Storage`: a local directory or a
URL): ``load_memmap(..., verify=True)`` runs it for a local tree and a remote one, and
``memtree verify`` computes the same hash (:func:`stored_tree_hash`) over what it has read.

A leaf whose bytes no longer match its checksum is *damaged*, unless the file was modified after
its level's ``meta.json`` was written (:func:`changed_after_meta`) and the ``meta.json`` files are
intact (the root's ``tree_hash``, when it records one, matches them: ``load_memmap(verify=True)``
checks it before any leaf, ``verify_tree`` before it classifies a mismatch): then it was written in
place (through a ``mode="r+"`` mapping, say) and its checksum is *stale*: memtree cannot tell an
intended write from damage, and says so instead of calling it corruption. A ``meta.json`` changed
since the save (a tree hash mismatch) makes every mismatching leaf damage, whatever the times.

Example:
    >>> from memtree.format.schema import LevelMeta, JsonMeta
    >>> tree_hash("crc32", {"": LevelMeta((), (JsonMeta("a", 1),))}, {})[:6]
    'crc32:'
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import replace

import orjson

from ...errors import IntegrityError
from ...format.names import META_NAME
from ...format.schema import ChildMeta, LevelMeta, PickleMeta, dump_level
from ..primitives.checksums import new_digest
from .storage import FileInfo, Storage, join_rel
from .walk import WalkedLevel, walk

__all__ = [
    "tree_hash",
    "tree_hash_lines",
    "bytes_checksum",
    "storage_checksum",
    "stored_tree_hash",
    "tree_hash_mismatch",
    "check_tree_hash",
    "changed_after_meta",
]

#: Bytes read at a time to hash a file through a :class:`~memtree.store.reading.storage.Storage`.
HASH_CHUNK = 8 * 1024 * 1024

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
            # an encrypted root's mac covers the hash
            data = dump_level(replace(meta, tree_hash=None, mac=None), META_NAME)
        else:
            data = dumped[rel] if dumped is not None and rel in dumped else dump_level(meta, join_rel(rel, META_NAME))
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


def bytes_checksum(algorithm: str, data: bytes | memoryview) -> str:
    """``"<algorithm>:<hex>"`` of ``data`` (a pickle file's bytes, as the tree hash covers them).

    Example:
        >>> bytes_checksum("crc32", b"abc")
        'crc32:352441c2'
    """
    digest = new_digest(algorithm)
    digest.update(data)
    return f"{algorithm}:{digest.hexdigest()}"


def storage_checksum(
    storage: Storage,
    rel: str,
    algorithm: str,
    *,
    info: FileInfo | None = None,
    nbytes: int | None = None,
    advance: Callable[[int], None] | None = None,
    offset: int = 0,
) -> str:
    """``"<algorithm>:<hex>"`` of the file ``rel`` of ``storage``, read :data:`HASH_CHUNK` bytes at
    a time (a file of any size hashed in bounded memory).

    Args:
        storage: where the file is.
        rel: its path relative to the root.
        algorithm: one of :data:`~memtree.store.primitives.checksums.CHECKSUMS`.
        info: its :meth:`~memtree.store.reading.storage.Storage.stat`, if already taken (else taken here).
        nbytes: hash ``nbytes`` bytes only (default: the whole file from ``offset``).
        advance: called with the number of bytes of each chunk hashed (a progress bar).
        offset: where the bytes start (a packed leaf's range of its pack).

    Raises:
        MemtreeError: the file is missing, not a regular file, shorter than ``nbytes``, or the
            storage fails (as its ``stat``/``read_into`` raise).

    Example:
        >>> import os, tempfile
        >>> from memtree.store.reading.storage import LocalStorage
        >>> d = tempfile.mkdtemp()
        >>> _ = open(os.path.join(d, "p.pickle"), "wb").write(b"abc")
        >>> with LocalStorage(d) as s:
        ...     storage_checksum(s, "p.pickle", "crc32") == bytes_checksum("crc32", b"abc")
        True
    """
    if info is None:
        info = storage.stat(rel)
    size = info.size - offset if nbytes is None else nbytes
    digest = new_digest(algorithm)
    buf = memoryview(bytearray(min(size, HASH_CHUNK)))
    done = 0
    while done < size:
        n = min(len(buf), size - done)
        storage.read_into(rel, offset + done, buf[:n], info)
        digest.update(buf[:n])
        done += n
        if advance is not None:
            advance(n)
    return f"{algorithm}:{digest.hexdigest()}"


def stored_tree_hash(
    storage: Storage,
    root: LevelMeta,
    *,
    levels: Sequence[WalkedLevel] | None = None,
    pickle_sums: Mapping[str, str] | None = None,
    pool: Executor | None = None,
) -> str:
    """The tree hash of the tree in ``storage`` as it is stored now, with the algorithm of
    ``root.tree_hash``: every level's ``meta.json`` and every pickle file's bytes, no leaf byte.

    Args:
        storage: where the tree is.
        root: the root's ``meta.json`` as already read (it records the ``tree_hash``).
        levels: every level of the tree, as :func:`~memtree.store.reading.walk.walk` yields them (read
            here when not given: the whole tree, whatever a load selects).
        pickle_sums: each pickle file's checksum in that algorithm, by path relative to the
            root (computed here when not given).
        pool: reads each generation of sub-levels concurrently.

    Raises:
        KeyError: ``levels``/``pickle_sums`` lack a level or pickle file of the tree.
        MemtreeError: a level or pickle file is missing, damaged or hostile, or the algorithm
            is not available.

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> from memtree.store.reading.storage import LocalStorage
        >>> from memtree.store.reading.options import WriteOptions
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"x": torch.ones(2)}), WriteOptions.of(checksum="crc32"))
        >>> with LocalStorage(d) as s:
        ...     root = next(iter(walk(s))).meta
        ...     stored_tree_hash(s, root) == root.tree_hash
        True
    """
    assert root.tree_hash is not None, "stored_tree_hash() needs a root that records a tree_hash"
    algorithm = root.tree_hash.partition(":")[0]
    if levels is None:
        levels = list(walk(storage, pool=pool, root=root))
    if pickle_sums is None:
        pickle_sums = {
            lvl.file(e.file): storage_checksum(storage, lvl.file(e.file), algorithm)
            for lvl in levels for e in lvl.meta.entries if isinstance(e, PickleMeta)
        }
    return tree_hash(algorithm, {lvl.rel: lvl.meta for lvl in levels}, pickle_sums)


def tree_hash_mismatch(where: str, recorded: str, found: str, *, after: str = "written", fix: str) -> str:
    """The message of a ``tree_hash`` that differs from the tree's (one wording for every check).

    Example:
        >>> tree_hash_mismatch("/t", "crc32:0", "crc32:1", fix="re-save it")[:46]
        '/t: the root meta.json records tree_hash crc32'
    """
    return (
        f"{where}: the root meta.json records tree_hash {recorded}, the tree's meta.json files hash "
        f"to {found}: a key, dtype, shape, value or checksum changed after the tree was {after}, "
        f"or a meta.json is damaged; {fix}"
    )


def check_tree_hash(
    storage: Storage,
    root: LevelMeta,
    *,
    pool: Executor | None = None,
    after: str = "written",
    fix: str = "restore it or re-save the tree (`memtree verify DIR` lists every problem)",
) -> None:
    """Compare ``root.tree_hash`` with the hash of every ``meta.json`` (and pickle file) of the
    tree in ``storage`` (:func:`stored_tree_hash`): what ``load_memmap(..., verify=True)``
    checks before anything is loaded, for a local directory and a URL alike.

    Args:
        storage: where the tree is.
        root: the root's ``meta.json`` as already read (with a ``tree_hash``).
        pool: reads each generation of sub-levels concurrently (a remote tree).
        after, fix: the wording of the error ("the tree was <after>"; what to do).

    Raises:
        IntegrityError: the hash differs.
        MemtreeError: a level is missing, damaged or hostile.

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> from memtree.store.reading.storage import LocalStorage
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"x": torch.ones(2)}))
        >>> with LocalStorage(d) as s:
        ...     root = next(iter(walk(s))).meta
        ...     check_tree_hash(s, root)  # as written: no error
        ...     try:
        ...         check_tree_hash(s, replace(root, tree_hash="crc32:00000000"))
        ...     except IntegrityError as err:
        ...         print(str(err).startswith(f"{d}: the root meta.json records tree_hash crc32:00000000"))
        True
    """
    assert root.tree_hash is not None, "check_tree_hash() needs a root that records a tree_hash"
    found = stored_tree_hash(storage, root, pool=pool)
    if found != root.tree_hash:
        raise IntegrityError(tree_hash_mismatch(storage.describe(""), root.tree_hash, found, after=after, fix=fix))


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
