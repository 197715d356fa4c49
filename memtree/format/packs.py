"""Packs of small leaves (format version 3): the fields, their checks and the layout (no I/O).

A tree written with packs (``docs/format.md``, "Version 3", "Packs of small leaves") stores its
small tensor leaves in a few *pack files* at its root instead of one file each: every pack is a
``~pack-<n>.memmap`` file listed by the root ``meta.json`` (``"packs": [{"file", "nbytes"}]``),
and a packed leaf's entry names its pack and the offset of its bytes there (``"pack"``,
``"offset"``) instead of a ``file``. The leaf's bytes are exactly what its own file would hold
(C order, little-endian); offsets and pack sizes are multiples of :data:`PACK_ALIGN`, so a
packed leaf of any dtype is a view of one mapping of its pack.

This module is pure: the names, the limits, the layout a writer gives the leaves
(:func:`layout_packs`), what a ``meta.json`` must say (:func:`parse_packs`,
:func:`parse_pack_ref`), the checks a reader makes across levels (:class:`PackRanges`: every
packed leaf inside its pack, no two overlapping), and where a leaf's bytes are
(:func:`leaf_location`).

Example:
    >>> layout = layout_packs([10, 3, 0, 100])
    >>> [(name, offset) for name, offset in layout.places], layout.sizes
    ([('~pack-0.memmap', 0), ('~pack-0.memmap', 64), ('~pack-0.memmap', 128), ('~pack-0.memmap', 128)], [('~pack-0.memmap', 256)])
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import MetaFormatError
from .entries import ChildMeta, LeafMeta, LevelMeta, PackMeta, PickleMeta
from .names import LEAF_SUFFIX, PICKLE_SUFFIX, encode_level

__all__ = [
    "PACK_VERSION",
    "PACK_ALIGN",
    "PACK_MAX_BYTES",
    "PACK_BELOW",
    "PACK_MIN_LEAVES",
    "MAX_PACKS",
    "PackMeta",
    "pack_name",
    "is_pack_name",
    "packs_threshold",
    "PackLayout",
    "layout_packs",
    "uses_packs",
    "pack_fields",
    "parse_packs",
    "parse_pack_ref",
    "leaf_location",
    "unpacked_name",
    "PackRanges",
]

#: The format version that added packs: a level that lists packs or holds a packed leaf is
#: written as version 3, any other level as before.
PACK_VERSION = 3
#: Every offset in a pack and every pack's size is a multiple of this (a cache line; more than
#: any dtype's item size, so a packed leaf is a view of its pack's mapping whatever its dtype).
PACK_ALIGN = 64
#: A writer starts a new pack rather than let one grow past this many bytes.
PACK_MAX_BYTES = 64 * 1024 * 1024
#: Leaves smaller than this many bytes are packed by default (``pack_below=None``): below it, a
#: file of its own costs more than the bytes (``docs/format.md``, "Packs of small leaves").
PACK_BELOW = 64 * 1024
#: ``pack_below=None`` packs only when a write has at least this many leaves under
#: :data:`PACK_BELOW`: fewer save at most a few milliseconds of file creation, and keep the
#: version 2 layout that every memtree reads.
PACK_MIN_LEAVES = 64
#: Most packs a root ``meta.json`` may list.
MAX_PACKS = 1_000_000
#: Largest offset or pack size a ``meta.json`` may record (as the format's leaf limit, 2^62).
_MAX_BYTES = 2**62
_PACK_NAME = re.compile(r"~pack-(?:0|[1-9][0-9]{0,8})\.memmap")
_Fail = Callable[[str, str], MetaFormatError]


def pack_name(index: int) -> str:
    """The file name of the ``index``-th pack of a tree (``~pack-<index>.memmap``).

    No key can be escaped into a name that starts with ``~`` (``docs/format.md``, "Escaping keys
    into file names"), so a pack never collides with a leaf or a sub-tree.

    Example:
        >>> pack_name(0), is_pack_name(pack_name(12)), is_pack_name("w.memmap")
        ('~pack-0.memmap', True, False)
    """
    return f"~pack-{index}.memmap"


def is_pack_name(name: object) -> bool:
    """True for a pack's file name (what :func:`pack_name` makes)."""
    return type(name) is str and _PACK_NAME.fullmatch(name) is not None


def packs_threshold(pack_below: int | None, candidates: int) -> int:
    """The size under which a write packs its leaves: ``pack_below``, or for ``None`` (the
    default) :data:`PACK_BELOW` when ``candidates`` (the write's leaves under it) are at least
    :data:`PACK_MIN_LEAVES`, else 0 (no pack).

    Example:
        >>> packs_threshold(None, 5_000), packs_threshold(None, 3), packs_threshold(4096, 3), packs_threshold(0, 9)
        (65536, 0, 4096, 0)
    """
    if pack_below is not None:
        return pack_below
    return PACK_BELOW if candidates >= PACK_MIN_LEAVES else 0


def _aligned(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


@dataclass
class PackLayout:
    """Where a writer puts packed leaves: ``places[i]`` is the (pack, offset) of the ``i``-th leaf
    given to :func:`layout_packs`; ``sizes`` each pack's name and size, in order."""

    places: list[tuple[str, int]]
    sizes: list[tuple[str, int]]


def layout_packs(sizes: Sequence[int], max_bytes: int = PACK_MAX_BYTES) -> PackLayout:
    """Lay leaves of ``sizes`` bytes out in packs, in the order given: each at the next offset
    that is a multiple of :data:`PACK_ALIGN`, a new pack when one would pass ``max_bytes``.

    A pack's size is its last leaf's end, rounded up to :data:`PACK_ALIGN`. The same sizes in
    the same order always give the same layout (an incremental save's unchanged pack is the old
    one byte for byte).
    """
    places: list[tuple[str, int]] = []
    packs: list[tuple[str, int]] = []
    name, end = pack_name(0), 0
    for n in sizes:
        start = _aligned(end)
        if start + n > max_bytes and end:  # a new pack (never an empty one)
            packs.append((name, _aligned(end)))
            name, start = pack_name(len(packs)), 0
        places.append((name, start))
        end = start + n
    if places:
        packs.append((name, _aligned(end)))
    return PackLayout(places, packs)


def uses_packs(meta: LevelMeta) -> bool:
    """True if a level lists packs or holds a packed leaf: it is then a version
    :data:`PACK_VERSION` level (the rule of :func:`memtree.format.schema.level_version`)."""
    return bool(meta.packs) or any(getattr(e, "pack", None) is not None for e in meta.entries)


def pack_fields(packs: Sequence[PackMeta]) -> list[dict[str, Any]]:
    """The root ``meta.json``'s ``packs`` value."""
    return [{"file": p.file, "nbytes": p.nbytes} for p in packs]


def _offset_ok(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _MAX_BYTES and v % PACK_ALIGN == 0


def parse_packs(raw: Any, fail: _Fail, *, depth: int, version: int) -> tuple[PackMeta, ...]:
    """The root's ``packs`` list, checked (names, sizes, no name twice).

    Raises:
        MetaFormatError: (from ``fail(pointer, problem)``) anything else.
    """
    if depth != 0 or version < PACK_VERSION:
        raise fail("packs", f"is only allowed in the root meta.json of a version {PACK_VERSION} tree")
    if type(raw) is not list or not 0 < len(raw) <= MAX_PACKS:
        raise fail("packs", f"must be a non-empty list of at most {MAX_PACKS} packs, got {raw!r:.80}")
    out: list[PackMeta] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        p = f"packs[{i}]"
        if type(item) is not dict or item.keys() != {"file", "nbytes"}:
            raise fail(p, f"must be an object with exactly the fields file and nbytes, got {item!r:.80}")
        name, nbytes = item["file"], item["nbytes"]
        if not is_pack_name(name):
            raise fail(f"{p}.file", f"must be a pack name ~pack-<n>.memmap, got {name!r:.80}")
        if name in seen:
            raise fail(f"{p}.file", f"repeats the pack {name!r}")
        if not _offset_ok(nbytes):
            raise fail(f"{p}.nbytes", f"must be an int in [0, 2**62], a multiple of {PACK_ALIGN}, got {nbytes!r:.40}")
        seen.add(name)
        out.append(PackMeta(name, nbytes))
    return tuple(out)


def parse_pack_ref(raw: dict[str, Any], p: str, fail: _Fail, version: int) -> tuple[str, int]:
    """A packed leaf's ``pack`` and ``offset`` (its range is checked against the root's packs by
    :class:`PackRanges`, when its level is loaded)."""
    if version < PACK_VERSION:
        raise fail(p, f"is a packed leaf (pack, offset), which only a version {PACK_VERSION} tree has")
    name, offset = raw["pack"], raw["offset"]
    if not is_pack_name(name):
        raise fail(f"{p}.pack", f"must be a pack name ~pack-<n>.memmap, got {name!r:.80}")
    if not _offset_ok(offset):
        raise fail(f"{p}.offset", f"must be an int in [0, 2**62], a multiple of {PACK_ALIGN}, got {offset!r:.40}")
    return name, offset


def leaf_location(level_rel: str, entry: LeafMeta) -> tuple[str, int]:
    """Where a leaf's bytes are: the file's path from the tree's root and the offset in it.

    Example:
        >>> from memtree.format.entries import LeafMeta
        >>> leaf_location("a/b", LeafMeta("w", "w.memmap", "float32", (2,)))
        ('a/b/w.memmap', 0)
        >>> leaf_location("a/b", LeafMeta("w", "", "float32", (2,), pack="~pack-0.memmap", offset=128))
        ('~pack-0.memmap', 128)
    """
    if entry.pack is not None:
        return entry.pack, entry.offset or 0
    return (f"{level_rel}/{entry.file}" if level_rel else entry.file), 0


def unpacked_name(meta: LevelMeta, key: str) -> str:
    """The file name a packed leaf of the level ``meta`` gets when it moves out of its pack into
    a file of its own (a growth): the name the writer gave it (:func:`~memtree.format.names.encode_level`
    over the level's keys), or, if a file or directory of the level has that name already (a
    tree written otherwise), a free one.

    Example:
        >>> from memtree.format.entries import LeafMeta, LevelMeta
        >>> meta = LevelMeta((), (LeafMeta("w", "", "float32", (2,), pack="~pack-0.memmap", offset=0),
        ...                       LeafMeta("W", "W~6c39a9cfd4ea0fca.memmap", "float32", (2,))))
        >>> unpacked_name(meta, "w")
        'w~50e721e49c013f00.memmap'
    """
    items = []
    for e in meta.entries:
        suffix = "" if isinstance(e, ChildMeta) else PICKLE_SUFFIX if isinstance(e, PickleMeta) else LEAF_SUFFIX
        if not isinstance(e, (ChildMeta, PickleMeta, LeafMeta)):
            continue  # a JSON value has no name
        items.append((e.key, suffix))
    names = dict(zip((k for k, _ in items), encode_level(items)))
    taken = {p.file.lower() for p in meta.packs}
    for e in meta.entries:
        name = e.dir if isinstance(e, ChildMeta) else getattr(e, "file", "")
        if name:
            taken.add(name.lower())
    name = names[key]
    n = 0
    while name.lower() in taken:  # only in a tree memtree did not write: a name of its own
        n += 1
        name = encode_level([(f"{key}\0{n}", LEAF_SUFFIX)])[0]
    return name


class PackRanges:
    """The packed leaves a reader has accepted so far: each must lie inside its pack, and no
    two may share a byte (else a write into one would change another). Levels load one at a
    time, so the check spans levels: :meth:`add_level` is called for each loaded level.

    Example:
        >>> from memtree.format.entries import LeafMeta, LevelMeta
        >>> ranges = PackRanges({"~pack-0.memmap": 128})
        >>> leaf = lambda k, off: LeafMeta(k, "", "uint8", (64,), pack="~pack-0.memmap", offset=off)
        >>> ranges.add_level(LevelMeta((), (leaf("a", 0), leaf("b", 64))), "t/meta.json")
        >>> ranges.add_level(LevelMeta((), (leaf("c", 64),)), "t/sub/meta.json")
        Traceback (most recent call last):
        ...
        memtree.errors.MetaFormatError: t/sub/meta.json: entries[0] (key 'c'): bytes [64, 128) of pack ~pack-0.memmap are another leaf's too (overlapping leaves); the file is damaged or hostile
    """

    def __init__(self, packs: dict[str, int]) -> None:
        self.packs = packs
        #: per pack: sorted, disjoint ``[start, end)`` intervals accepted so far
        self.taken: dict[str, list[tuple[int, int]]] = {}

    def add_level(self, meta: LevelMeta, where: str) -> None:
        """Accept the packed leaves of one level (each level once).

        Raises:
            MetaFormatError: a pack the root does not list, a range past its pack's end, or
                two leaves sharing bytes; nothing of the level is then accepted.
        """
        spans: dict[str, list[tuple[int, int, int]]] = {}
        for i, e in enumerate(meta.entries):
            if not isinstance(e, LeafMeta) or e.pack is None:
                continue
            name = e.pack
            size = self.packs.get(name)
            offset, nbytes = e.offset or 0, e.nbytes
            if size is None:
                raise _bad(where, i, e.key, f"names the pack {name}, which the root meta.json does not list")
            if offset + nbytes > size:
                raise _bad(where, i, e.key, f"spans bytes [{offset}, {offset + nbytes}) of pack {name}, which has {size}")
            if nbytes:
                spans.setdefault(name, []).append((offset, offset + nbytes, i))
        merged: dict[str, list[tuple[int, int]]] = {}
        for name, items in spans.items():
            items.sort()
            out: list[tuple[int, int]] = []
            for start, end, i in items:
                if out and start < out[-1][1]:
                    raise self._overlap(where, i, meta, name, start, end)
                if out and start - out[-1][1] < PACK_ALIGN:  # no leaf can start in the gap: one span
                    out[-1] = (out[-1][0], end)
                else:
                    out.append((start, end))
            taken = self.taken.get(name, [])
            for start, end in out:
                k = bisect.bisect_right(taken, (start, end))
                if (k and taken[k - 1][1] > start) or (k < len(taken) and taken[k][0] < end):
                    first = next(j for a, _, j in items if start <= a < end)
                    raise self._overlap(where, first, meta, name, start, end)
            merged[name] = out
        for name, out in merged.items():
            taken = self.taken.setdefault(name, [])
            for span in out:
                bisect.insort(taken, span)

    @staticmethod
    def _overlap(where: str, i: int, meta: LevelMeta, name: str, start: int, end: int) -> MetaFormatError:
        e = meta.entries[i]
        assert isinstance(e, LeafMeta)
        first = e.offset or 0
        return _bad(where, i, e.key, f"bytes [{first}, {first + e.nbytes}) of pack {name} are another leaf's too (overlapping leaves)")


def _bad(where: str, i: int, key: str, problem: str) -> MetaFormatError:
    return MetaFormatError(f"{where}: entries[{i}] (key {key!r:.80}): {problem}; the file is damaged or hostile")
