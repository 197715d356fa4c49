"""``memtree diff A B``: which leaves of two trees differ, and how.

Every level of both trees is read (validated as a load validates it); leaves are matched by key
path (a tensor subclass by its class, dtype, shape and flatten context, and by its inner tensors
as leaves). Two tensor leaves with the same dtype and shape are compared by their recorded checksums
when both record one of the same algorithm (and, for per-chunk checksums, the same chunks): no
leaf data is read. Otherwise (no checksum, another algorithm or chunk size, a growable leaf)
their bytes are hashed: one side as the other records it when it does, both with the fastest
installed algorithm otherwise; two names of the same file (hard
links, e.g. made by ``link_from``) are equal without reading. JSON values are compared as values,
pickled ones by their bytes (never unpickled). Exit code :data:`~memtree.cli.output.EXIT_OK`
(0) when the trees hold the same keys and values, :data:`~memtree.cli.output.EXIT_FAILED` (1) when they differ;
an error (a side missing or damaged) exits 1 too, as in every command (with ``--json`` its
document is ``{"error": ...}``, :mod:`memtree.cli.output`).

Example:
    $ memtree diff ckpt/100 ckpt/200
    changed  model/w   data (xxh3:1a2b3c4d5e6f7a8b -> xxh3:0f1e2d3c4b5a6978)
    only in B  optim/step
    3 leaves compared: 2 same, 1 changed, 0 only in A, 1 only in B (0 bytes read)
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from ..format.chunks import ChunkSums, chunk_count
from ..format.packs import leaf_location
from ..format.schema import ChildMeta, Entry, JsonMeta, LeafMeta, PickleMeta
from ..format.subclass import Subclass, SubclassMeta
from ..store.primitives.checksums import default_checksum
from ..store.primitives.chunk_check import hash_chunks
from ..store.reading.storage import LocalStorage, join_rel
from ..store.reading.walk import walk
from .output import EXIT_FAILED, EXIT_OK, add_json_flag, emit_json, emit_text

__all__ = ["NAME", "HELP", "add_arguments", "run", "DiffReport", "diff_trees"]

NAME = "diff"
HELP = "list the leaves that differ between two trees (from checksums where both have them)"


@dataclass
class DiffReport:
    """The result of :func:`diff_trees`.

    Attributes:
        a, b: the two trees' directories.
        same: leaves (and levels) equal in both.
        changed: one dict per differing key: ``key`` (list of str), ``what`` (some of
            ``"kind"``, ``"dtype"``, ``"shape"``, ``"data"``, ``"value"``, ``"batch_size"``,
            ``"type"``), and ``a``/``b``: a short description of each side.
        only_in_a, only_in_b: key paths present in one tree only (a sub-tree counts once).
        bytes_read: leaf bytes hashed to compare (0 when checksums decided everything).
    """

    a: str
    b: str
    same: int = 0
    changed: list[dict[str, Any]] = field(default_factory=list)
    only_in_a: list[list[str]] = field(default_factory=list)
    only_in_b: list[list[str]] = field(default_factory=list)
    bytes_read: int = 0

    @property
    def identical(self) -> bool:
        """True when nothing differs."""
        return not (self.changed or self.only_in_a or self.only_in_b)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``memtree diff --json`` prints)."""
        return {
            "a": self.a, "b": self.b, "identical": self.identical, "same": self.same,
            "changed": self.changed, "only_in_a": self.only_in_a, "only_in_b": self.only_in_b,
            "bytes_read": self.bytes_read,
        }


class _Side:
    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self.entries: dict[tuple[str, ...], tuple[str, Entry]] = {}  # key path -> (level rel, entry)
        self.levels: dict[tuple[str, ...], Any] = {}
        self.subclasses: dict[tuple[str, ...], Subclass] = {}  # the levels that are subclass groups
        for level in walk(storage):
            self.levels[level.keys] = level.meta
            for e in level.meta.entries:
                if isinstance(e, SubclassMeta):
                    self.subclasses[level.keys + (e.key,)] = e.subclass
                elif not isinstance(e, ChildMeta):
                    self.entries[level.keys + (e.key,)] = (level.rel, e)

    def identity(self, rel: str) -> tuple[tuple[str, str], ...]:
        return self.storage.stat(rel).identity

    def sums(self, rel: str, nbytes: int, like: ChunkSums, offset: int = 0) -> ChunkSums:
        """The checksums of ``nbytes`` of file ``rel`` from ``offset``, in the algorithm and
        chunks of ``like``."""
        count = chunk_count(nbytes, like.chunk_bytes)
        found = hash_chunks(lambda at, view: self.storage.read_into(rel, offset + at, view), like, nbytes, range(count))
        return ChunkSums(like.algorithm, like.chunk_bytes, "".join(found[k] for k in range(count)))


def _same_inode(a: tuple[tuple[str, str], ...], b: tuple[tuple[str, str], ...]) -> bool:
    da, db = dict(a), dict(b)
    return da.get("dev") == db.get("dev") and da.get("ino") == db.get("ino") and "ino" in da


def _describe(e: Entry) -> str:
    if isinstance(e, LeafMeta):
        return f"{e.dtype_name}{list(e.shape)}"
    if isinstance(e, JsonMeta):
        return json.dumps(e.value)[:80]
    return "pickle"


def _describe_group(sub: Subclass | None) -> str:
    return "tree" if sub is None else f"{sub.type} {sub.dtype_name}{list(sub.shape)}"


def diff_trees(a: str, b: str) -> DiffReport:
    """Compare the trees at ``a`` and ``b`` (see the module docstring).

    Raises:
        MemtreeError: a tree is missing, damaged or hostile.

    Example:
        >>> import tempfile, torch, memtree
        >>> d = tempfile.mkdtemp()
        >>> _ = memtree.TensorTree({"w": torch.ones(2), "s": 1}).memmap(d + "/a")
        >>> _ = memtree.TensorTree({"w": torch.zeros(2), "t": 1}).memmap(d + "/b")
        >>> r = diff_trees(d + "/a", d + "/b")
        >>> [c["key"] for c in r.changed], r.only_in_a, r.only_in_b, r.bytes_read
        ([['w']], [['s']], [['t']], 0)
    """
    with LocalStorage(a) as sa, LocalStorage(b) as sb:
        left, right = _Side(sa), _Side(sb)
        report = DiffReport(sa.root, sb.root)
        whole = _compare_levels(left, right, report)
        for key in sorted(left.entries.keys() | right.entries.keys()):
            if _under(key, whole):
                continue
            if key not in right.entries:
                report.only_in_a.append(list(key))
            elif key not in left.entries:
                report.only_in_b.append(list(key))
            else:
                _compare(key, left, right, report)
    return report


def _under(key: tuple[str, ...], whole: set[tuple[str, ...]]) -> bool:
    """True when ``key`` or one of its ancestors is in ``whole`` (one set lookup per level)."""
    return any(key[:depth] in whole for depth in range(1, len(key) + 1))


def _compare_levels(left: _Side, right: _Side, report: DiffReport) -> set[tuple[str, ...]]:
    """Compare the levels; returns the keys reported as a whole, nothing below them compared:
    a sub-tree on one side and a leaf on the other (a ``kind`` change), and a sub-tree present
    on one side only (listed once, in ``only_in_a`` or ``only_in_b``)."""
    whole: set[tuple[str, ...]] = set()
    for key in sorted((left.levels.keys() & right.entries.keys()) | (right.levels.keys() & left.entries.keys())):
        side_a = "tree" if key in left.levels else _describe(left.entries[key][1])
        side_b = "tree" if key in right.levels else _describe(right.entries[key][1])
        report.changed.append({"key": list(key), "what": ["kind"], "a": side_a, "b": side_b})
        whole.add(key)
    for key in sorted(left.levels.keys() | right.levels.keys()):  # parents before their children
        if _under(key, whole):
            continue
        la, lb = left.levels.get(key), right.levels.get(key)
        if la is None or lb is None:
            (report.only_in_a if lb is None else report.only_in_b).append(list(key))
            whole.add(key)
            continue
        what = [w for w, x, y in (("batch_size", la.batch_size, lb.batch_size), ("type", la.type, lb.type)) if x != y]
        sa, sb = left.subclasses.get(key), right.subclasses.get(key)
        if sa is not None or sb is not None:  # a tensor subclass (its inner tensors are compared as leaves)
            what = ["kind"] if sa is None or sb is None else [
                w for w, x, y in (("type", sa.type, sb.type), ("dtype", sa.dtype_name, sb.dtype_name),
                                  ("shape", sa.shape, sb.shape), ("context", sa.context, sb.context)) if x != y
            ]
            if what:
                report.changed.append({"key": list(key), "what": what, "a": _describe_group(sa), "b": _describe_group(sb)})
                continue
        if what:
            report.changed.append({"key": list(key), "what": what, "a": f"{la.type}{list(la.batch_size)}",
                                   "b": f"{lb.type}{list(lb.batch_size)}"})
        elif key:
            report.same += 1
    return whole


def _compare(key: tuple[str, ...], left: _Side, right: _Side, report: DiffReport) -> None:
    (ra, ea), (rb, eb) = left.entries[key], right.entries[key]
    what: list[str] = []
    desc_a, desc_b = _describe(ea), _describe(eb)
    if type(ea) is not type(eb):
        what.append("kind")
    elif isinstance(ea, JsonMeta) and isinstance(eb, JsonMeta):
        if json.dumps(ea.value, sort_keys=True) != json.dumps(eb.value, sort_keys=True):
            what.append("value")
    elif isinstance(ea, LeafMeta) and isinstance(eb, LeafMeta):
        if ea.dtype_name != eb.dtype_name:
            what.append("dtype")
        if ea.shape != eb.shape:
            what.append("shape")
        if not what:
            sa, sb = _leaf_sums(left, leaf_location(ra, ea), ea, right, leaf_location(rb, eb), eb, report)
            if sa != sb:
                what.append("data")
                desc_a, desc_b = _texts(sa, sb)
    else:
        assert isinstance(ea, PickleMeta) and isinstance(eb, PickleMeta)
        fa, fb = join_rel(ra, ea.file), join_rel(rb, eb.file)
        ia, ib = left.identity(fa), right.identity(fb)
        if not _same_inode(ia, ib):
            size_a, size_b = left.storage.stat(fa).size, right.storage.stat(fb).size
            like = ChunkSums(default_checksum(), max(size_a, 1), "")
            report.bytes_read += size_a + size_b
            if size_a != size_b or left.sums(fa, size_a, like) != right.sums(fb, size_b, like):
                what.append("value")
    if what:
        report.changed.append({"key": list(key), "what": what, "a": desc_a, "b": desc_b})
    else:
        report.same += 1


def _leaf_sums(
    left: _Side, la: tuple[str, int], ea: LeafMeta, right: _Side, lb: tuple[str, int], eb: LeafMeta,
    report: DiffReport,
) -> tuple[ChunkSums | str, ChunkSums | str]:
    """Checksums of two same-shaped leaves in one algorithm and chunk size, reading as little as
    possible (``"same file"`` for two names of one file); ``la``/``lb``: where each one's bytes
    are (file, offset: a packed leaf's range of its pack)."""
    ca = ea.sums if ea.capacity is None else None
    cb = eb.sums if eb.capacity is None else None
    if ca and cb and (ca.algorithm, ca.chunk_bytes) == (cb.algorithm, cb.chunk_bytes):
        return ca, cb
    (fa, oa), (fb, ob) = la, lb
    if oa == ob and _same_inode(left.identity(fa), right.identity(fb)):
        return "same file", "same file"
    nbytes = ea.nbytes
    if ca:
        report.bytes_read += nbytes
        return ca, right.sums(fb, nbytes, ca, ob)
    if cb:
        report.bytes_read += nbytes
        return left.sums(fa, nbytes, cb, oa), cb
    like = ChunkSums(default_checksum(), max(nbytes, 1), "")
    report.bytes_read += 2 * nbytes
    return left.sums(fa, nbytes, like, oa), right.sums(fb, nbytes, like, ob)


def _texts(a: ChunkSums | str, b: ChunkSums | str) -> tuple[str, str]:
    """Two different leaves' checksums for the report: ``"<algorithm>:<hex>"``; for per-chunk
    checksums, the first chunk that differs."""
    if isinstance(a, str) or isinstance(b, str):  # never both "same file" here
        return str(a), str(b)
    if a.count == 1 and b.count == 1:
        return a.digest(0), b.digest(0)
    first = next((k for k in range(min(a.count, b.count)) if a.digest(k) != b.digest(k)), 0)
    return f"{a.digest(first)} (chunk {first} of {a.count})", f"{b.digest(first)} (chunk {first} of {b.count})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree diff``."""
    parser.add_argument("a", metavar="A", help="a tree's directory")
    parser.add_argument("b", metavar="B", help="another tree's directory")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    """Diff the trees; print the differences (or JSON); 0 if identical, 1 otherwise."""
    report = diff_trees(args.a, args.b)
    if args.json:
        emit_json(report.to_dict())
        return EXIT_OK if report.identical else EXIT_FAILED
    for c in report.changed:
        emit_text(f"changed    {'/'.join(c['key'])}  {', '.join(c['what'])} ({c['a']} -> {c['b']})")
    for key in report.only_in_a:
        emit_text(f"only in A  {'/'.join(key)}")
    for key in report.only_in_b:
        emit_text(f"only in B  {'/'.join(key)}")
    emit_text(
        f"{report.same} same, {len(report.changed)} changed, {len(report.only_in_a)} only in A, "
        f"{len(report.only_in_b)} only in B ({report.bytes_read:,} bytes read)"
    )
    return EXIT_OK if report.identical else EXIT_FAILED
