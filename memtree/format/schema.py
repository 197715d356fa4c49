"""The ``meta.json`` schema (format versions 1 to 3): data classes, serialisation, validation.

Pure functions, no I/O. :func:`parse_level` is the only place that turns bytes read from a
``meta.json`` into a :class:`LevelMeta`, and it trusts nothing: every field's type and range is
checked, names must be single safe path components, sizes are computed with Python ints (no
overflow), every shape must be one torch can make (:func:`extent_bytes`, zero-element ones too),
repeated object fields and JSON nested deeper than memtree writes are refused, and any problem
raises :class:`~memtree.errors.MetaFormatError` naming the file and the field. The schema is
documented in ``docs/format.md``.

Example:
    >>> from memtree.format.schema import LevelMeta, LeafMeta, dump_level, parse_level
    >>> meta = LevelMeta((2,), (LeafMeta("w", "w.memmap", "float32", (2, 3)),))
    >>> parse_level(dump_level(meta), "meta.json") == meta
    True
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from math import prod
from typing import TYPE_CHECKING, Any

import orjson

from .chunks import CHECKSUM_DIGITS, CHUNKS_VERSION, ChunksFormatError, ChunkSums, dump_chunks, parse_chunks, uses_chunks
from .dtypes import DTYPE_ITEMSIZES, itemsize
from ..errors import LimitError, MetaFormatError, UnsafePathError, UnsupportedVersionError
from .entries import (
    TAG_BYTES,
    TREE_TYPE,
    ChildMeta,
    EncryptionMeta,
    Entry,
    JsonMeta,
    LeafMeta,
    LevelMeta,
    PackMeta,
    PickleMeta,
    TuplePath,
    sealed_nbytes,
)
from .names import LEAF_SUFFIX, PICKLE_SUFFIX, is_safe_name
from .packs import PACK_ALIGN, PACK_VERSION, is_pack_name, pack_fields, parse_pack_ref, parse_packs, uses_packs
from .subclass import (
    SUBCLASS_KIND,
    SUBCLASS_VERSION,
    SubclassMeta,
    layout_dict,
    parse_layout,
    parse_subclass,
    subclass_fields,
    uses_subclass_fields,
)
from .values import MAX_JSON_DEPTH, MAX_TUPLE_PATHS, json_depth

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT",
    "VERSION",
    "READ_VERSIONS",
    "VERSION_RULES",
    "level_version",
    "version_refusal",
    "CHECKSUM_ALGORITHMS",
    "is_checksum",
    "TREE_TYPE",
    "MAX_META_BYTES",
    "MAX_DEPTH",
    "TYPE_NAME_MAX",
    "MAX_META_NESTING",
    "extent_bytes",
    "is_type_name",
    "LeafMeta",
    "ChildMeta",
    "JsonMeta",
    "PickleMeta",
    "SubclassMeta",
    "Entry",
    "EncryptionMeta",
    "ENCRYPTION_ALGORITHM",
    "TAG_BYTES",
    "sealed_nbytes",
    "encrypted_level",
    "LevelMeta",
    "check_writable",
    "dump_level",
    "parse_level",
    "starts_with_batch",
    "CONTAINER_TYPES",
    "is_int_key",
    "TuplePath",
]

FORMAT = "memtree"
#: The version memtree writes (version 2 adds the ``xxh3``/``crc32c`` checksums and the root's
#: ``tree_hash``; ``docs/format.md``, "Version 2").
VERSION = 2
#: The versions memtree reads (a level is written as version 3 only when it holds what version 3
#: added: tensor subclasses, DTensor annotations, the dtypes of ``V3_DTYPE_NAMES``, per-chunk
#: checksums, packs of small leaves; :func:`level_version`).
READ_VERSIONS = (1, 2, 3)
#: Level types of Python containers (version 2): a level of type ``"list"``/``"tuple"`` holds its
#: items under the keys ``"0"``, ``"1"``...; a ``"dict"`` level may mark int keys (``int_key``).
CONTAINER_TYPES = frozenset({"dict", "list", "tuple"})

MAX_META_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 256
MAX_ENTRIES = 1_000_000
MAX_NDIM = 64
MAX_NBYTES = 2**62
#: Largest dim of a shape or batch size (torch sizes are int64).
MAX_DIM = 2**63 - 1
#: Levels of JSON arrays and objects a ``meta.json`` may nest: a non-tensor value
#: (:data:`~memtree.format.values.MAX_JSON_DEPTH`) sits 3 levels down; 254 is what orjson writes.
MAX_META_NESTING = MAX_JSON_DEPTH + 3
#: Checksum algorithms and the hex digits of their digests (``"<algorithm>:<hex>"``).
CHECKSUM_ALGORITHMS = CHECKSUM_DIGITS
#: Longest ``type`` (registered class name) a level may carry.
TYPE_NAME_MAX = 200
_TYPE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z][A-Za-z0-9_]*)*")

#: The one cipher of encrypted trees (``docs/format.md``, "Version 2", "Encryption").
ENCRYPTION_ALGORITHM = "aes-256-gcm"
#: Bounds of an encrypted tree's ``chunk_bytes`` (plaintext bytes per chunk).
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 256 * 1024 * 1024


if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("memtree's format is little-endian; big-endian hosts are not supported")


def extent_bytes(shape: tuple[int, ...], dtype: torch.dtype | str) -> int:
    """Bytes a tensor of ``shape`` spans with its zero dims counted as 1.

    For a tensor with elements it is its size in bytes; for a zero-element one, torch still
    computes strides from the other dims, and fails (or overflows) beyond int64. Every shape
    memtree reads must keep this at most :data:`MAX_NBYTES`.

    Example:
        >>> import torch
        >>> extent_bytes((2, 3), torch.float32), extent_bytes((4, 0, 2**40), torch.uint8)
        (24, 4398046511104)
    """
    return (prod(shape) or prod(d or 1 for d in shape)) * itemsize(dtype)


def is_type_name(name: object) -> bool:
    """True if ``name`` can be a level's ``type``: dotted ASCII words, each starting with a letter.

    Python paths of private modules or scripts (``__main__.X``, ``pkg._impl.X``) are not names.

    Example:
        >>> is_type_name("TensorTree"), is_type_name("rl.Transition"), is_type_name("__main__.X")
        (True, True, False)
    """
    if type(name) is not str or len(name) > TYPE_NAME_MAX:
        return False
    return _TYPE_NAME.fullmatch(name) is not None


def _entry_dict(e: Entry) -> dict[str, Any]:
    d = _entry_fields(e)
    if e.int_key:
        d["int_key"] = True
    return d


def _entry_fields(e: Entry) -> dict[str, Any]:
    if isinstance(e, SubclassMeta):
        return subclass_fields(e)
    if isinstance(e, LeafMeta):
        d: dict[str, Any] = {"key": e.key, "kind": "tensor"}
        if e.pack is not None:
            d["pack"] = e.pack
            d["offset"] = e.offset
        else:
            d["file"] = e.file
        d["dtype"] = e.dtype_name
        d["shape"] = list(e.shape)
        if e.capacity is not None:
            d["capacity"] = e.capacity
        if e.checksum is not None:
            d["checksum"] = e.checksum
        if e.layout is not None:
            d["dtensor"] = layout_dict(e.layout)
        if e.chunks is not None:
            d["chunks"] = dump_chunks(e.chunks)
        return d
    if isinstance(e, ChildMeta):
        return {"key": e.key, "kind": "tree", "dir": e.dir}
    if isinstance(e, JsonMeta):
        if e.tuples is not None:
            return {"key": e.key, "kind": "json", "value": e.value, "tuples": [list(p) for p in e.tuples]}
        return {"key": e.key, "kind": "json", "value": e.value}
    return {"key": e.key, "kind": "pickle", "file": e.file}


def check_writable(meta: LevelMeta, where: str, depth: int) -> None:
    """Refuse a level that :func:`parse_level` would refuse for its nesting or entry count.

    Writers call it before writing anything, so that every tree written loads back; the
    ``meta.json`` size is checked by :func:`dump_level`, the tuples of a value by
    :func:`memtree.format.values.json_problem`.

    Raises:
        LimitError: ``depth`` exceeds :data:`MAX_DEPTH` or the level has more than
            :data:`MAX_ENTRIES` entries; names ``where``.

    Example:
        >>> check_writable(LevelMeta((), ()), "level ('a',)", 1)
    """
    if depth > MAX_DEPTH:
        raise LimitError(
            f"{where}: nests sub-trees {depth} levels deep, readers refuse more than {MAX_DEPTH}; "
            "flatten the tree (keys may hold dots) before writing it"
        )
    if len(meta.entries) > MAX_ENTRIES:
        raise LimitError(
            f"{where}: holds {len(meta.entries):,} entries, readers refuse more than {MAX_ENTRIES:,} "
            "in one level; split it into sub-trees or stack the values into tensors"
        )


#: The rules of the versions after 2, one per field a later version added:
#: ``(version, uses, refusal)``, ``uses(level)`` saying whether a level holds it and ``refusal``
#: what a reader says of an older level that does (``{version}`` filled in).
#: :func:`level_version` is the one place that decides a level's version from them, so that a
#: level needs no later version than its fields do (a reader of version 2 reads every other level
#: of the tree); a new field of the format adds its rule here. (An older level that lists packs
#: or holds a packed leaf is refused already by :func:`memtree.format.packs.parse_packs` and
#: :func:`~memtree.format.packs.parse_pack_ref`, naming the field.) ``docs/format.md``, "Version 3".
VERSION_RULES: tuple[tuple[int, Callable[[LevelMeta], bool], str], ...] = (
    (
        CHUNKS_VERSION,
        lambda level: uses_chunks(level.entries),
        "record per-chunk checksums (chunks), which only a version {version} level has",
    ),
    (
        SUBCLASS_VERSION,
        lambda level: uses_subclass_fields(level.entries),
        "hold a tensor subclass, a DTensor annotation or a dtype that only a version {version} tree has",
    ),
    (PACK_VERSION, uses_packs, "list packs or hold a packed leaf, which only a version {version} tree has"),
)


def level_version(level: LevelMeta, base: int) -> int:
    """The version a level is written as: ``base``, or the latest version of a rule of
    :data:`VERSION_RULES` whose field it holds.

    Example:
        >>> level_version(LevelMeta((), (LeafMeta("x", "x.memmap", "int4", (2,)),)), 2)
        3
        >>> level_version(LevelMeta((), ()), 2)
        2
    """
    return max([base, *(version for version, uses, _ in VERSION_RULES if uses(level))])


def version_refusal(level: LevelMeta, version: int) -> str | None:
    """What is wrong with a level of ``version``: the first field it holds that only a later
    version has, else ``None``.

    Example:
        >>> version_refusal(LevelMeta((), (LeafMeta("x", "x.memmap", "int4", (2,)),)), 2)
        'hold a tensor subclass, a DTensor annotation or a dtype that only a version 3 tree has'
    """
    for needed, uses, refusal in VERSION_RULES:
        if version < needed and uses(level):
            return refusal.format(version=needed)
    return None


def dump_level(meta: LevelMeta, where: str = "a meta.json") -> bytes:
    """Serialise one level's ``meta.json`` (compact orjson bytes); ``where`` names it in errors.

    JSON values must already have passed :func:`memtree.format.values.check_json`.

    Raises:
        LimitError: the bytes exceed :data:`MAX_META_BYTES`, which readers refuse.
    """
    d: dict[str, Any] = {
        "format": FORMAT,
        "version": level_version(meta, VERSION),
        "type": meta.type,
        "byteorder": "little",
        "batch_size": list(meta.batch_size),
    }
    if meta.save_id is not None:
        d["save_id"] = meta.save_id
    if meta.tree_hash is not None:
        d["tree_hash"] = meta.tree_hash
    if meta.encryption is not None:
        enc = meta.encryption
        d["encryption"] = {
            "algorithm": enc.algorithm,
            "chunk_bytes": enc.chunk_bytes,
            "salt": enc.salt,
            "key_check": enc.key_check,
            "names": enc.names,
        }
    if meta.sealed is not None:
        d["sealed"] = meta.sealed
    if meta.mac is not None:
        d["mac"] = meta.mac
    d["entries"] = [_entry_dict(e) for e in meta.entries]
    if meta.packs:
        d["packs"] = pack_fields(meta.packs)
    data = orjson.dumps(d)
    if len(data) > MAX_META_BYTES:
        raise LimitError(
            f"{where} would take {len(data):,} bytes, readers refuse more than {MAX_META_BYTES:,}: "
            "its non-tensor values are too large; store large values as tensors (or pickle them, "
            "allow_pickle=True)"
        )
    return data


# ---------------------------------------------------------------------------------------------
# validation


class _Checker:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, pointer: str, problem: str) -> MetaFormatError:
        return MetaFormatError(
            f"{self.where}: {pointer} {problem}. The file is damaged or was not written by "
            "memtree; re-save the tree (or restore it from a backup)"
        )

    def obj(
        self, v: Any, pointer: str, required: AbstractSet[str], optional: AbstractSet[str]
    ) -> dict[str, Any]:
        if type(v) is not dict:
            raise self.fail(pointer, f"must be a JSON object, got {type(v).__name__}")
        missing = required - v.keys()
        if missing:
            raise self.fail(pointer, f"lacks field(s) {sorted(missing)}")
        extra = v.keys() - required - optional
        if extra:
            raise self.fail(pointer, f"has unknown field(s) {sorted(extra)}")
        return v

    def string(self, v: Any, pointer: str) -> str:
        if type(v) is not str or not v:
            raise self.fail(pointer, f"must be a non-empty string, got {v!r:.80}")
        return v

    def ints(self, v: Any, pointer: str) -> tuple[int, ...]:
        if type(v) is not list or len(v) > MAX_NDIM:
            raise self.fail(pointer, f"must be a list of at most {MAX_NDIM} ints, got {v!r:.80}")
        for i, x in enumerate(v):
            if type(x) is not int or not 0 <= x <= MAX_DIM:
                raise self.fail(f"{pointer}[{i}]", f"must be an int in [0, 2**63), got {x!r:.40}")
        return tuple(v)

    def name(self, v: Any, pointer: str, suffix: str) -> str:
        if not is_safe_name(v, suffix):
            what = f"a single safe file name ending in {suffix!r}" if suffix else "a single safe directory name"
            if type(v) is not str or not _leaves_directory(v):
                raise self.fail(pointer, f"must be {what}, got {v!r:.80}")
            raise UnsafePathError(
                f"{self.where}: {pointer} must be {what}, got {v!r:.80}; memtree never opens a "
                "path that could leave the tree's directory. The file is damaged or hostile"
            )
        return str(v)


def starts_with_batch(shape: Sequence[int], batch_size: Sequence[int]) -> bool:
    """The batch-prefix rule: a leaf's shape, or a sub-tree's batch size, starts with its level's
    ``batch_size`` (``docs/format.md``). Every writer and reader checks it with this function.

    Example:
        >>> starts_with_batch((4, 3), (4,)), starts_with_batch((3,), (4,)), starts_with_batch((), ())
        (True, False, True)
    """
    prefix = shape[: len(batch_size)]
    return prefix == batch_size or tuple(prefix) == tuple(batch_size)  # no copies in the common case


#: The digits of a digest (lower-case hex): ``s.strip(_HEX)`` is empty when ``s`` has no other.
_HEX = "0123456789abcdef"


def is_checksum(value: object) -> bool:
    """True for ``"<algorithm>:<hex>"`` with a known algorithm and its digest length.

    Example:
        >>> is_checksum("crc32:0a1b2c3d"), is_checksum("xxh3:0a1b"), is_checksum("md5:00")
        (True, False, False)
    """
    if type(value) is not str:
        return False
    algo, _, digest = value.partition(":")
    return CHECKSUM_ALGORITHMS.get(algo) == len(digest) and not digest.strip(_HEX)  # only hex digits


def _leaves_directory(name: str) -> bool:
    """True for names that would resolve outside their directory (or are not one component)."""
    return name in ("", ".", "..") or any(ch in name for ch in "/\\\0") or name.startswith(".")


_LEVEL_FIELDS = frozenset({"format", "version", "type", "byteorder", "batch_size", "entries"})
_LEVEL_OPTIONAL = frozenset({"save_id", "tree_hash", "encryption", "mac", "sealed", "packs"})
_ENCRYPTION_FIELDS = frozenset({"algorithm", "chunk_bytes", "salt", "key_check", "names"})


def parse_level(data: bytes, where: str, *, depth: int = 0) -> LevelMeta:
    """Parse and validate one ``meta.json``.

    Args:
        data: the file's bytes (the caller enforces :data:`MAX_META_BYTES` before reading).
        where: the file's path, for error messages.
        depth: nesting depth of this level (0 for the root), checked against :data:`MAX_DEPTH`.

    Raises:
        MetaFormatError: malformed JSON or schema violation.
        UnsupportedVersionError: another format, or a version this reader does not know.
        LimitError: too deep, too many entries, too large a leaf.
    """
    c = _Checker(where)
    if depth > MAX_DEPTH:
        raise LimitError(f"{where}: tree nesting exceeds {MAX_DEPTH} levels")
    if len(data) > MAX_META_BYTES:
        raise LimitError(f"{where}: meta.json has {len(data)} bytes, limit is {MAX_META_BYTES}")
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as err:
        raise c.fail("content", f"is not valid UTF-8 JSON ({err})") from None
    if type(doc) is not dict:
        raise c.fail("top level", f"must be a JSON object, got {type(doc).__name__}")
    try:
        canonical = orjson.dumps(doc) == data  # memtree's own bytes: no repeated field, shallow
    except TypeError:  # nested deeper than orjson writes
        canonical = False
    if not canonical:
        _check_document(doc, data, c)
    if doc.get("format") != FORMAT or "version" not in doc:
        raise UnsupportedVersionError(
            f"{where}: not a memtree meta.json (format={doc.get('format')!r:.40}, "
            f"version={doc.get('version')!r:.20}); load tensordict directories and other formats "
            "through their own readers"
        )
    if doc["version"] not in READ_VERSIONS or type(doc["version"]) is not int:
        raise UnsupportedVersionError(
            f"{where}: format version {doc['version']!r:.20} is not supported by this memtree "
            f"(it reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade memtree to read this tree"
        )
    doc = c.obj(doc, "top level", _LEVEL_FIELDS, _LEVEL_OPTIONAL)
    if doc["byteorder"] != "little":
        raise c.fail("byteorder", f"must be 'little', got {doc['byteorder']!r:.40}")
    kind_of_tree = c.string(doc["type"], "type")
    if not is_type_name(kind_of_tree):
        raise c.fail(
            "type",
            f"must be {TREE_TYPE!r} or a class name (dotted words of letters, digits and '_', "
            f"each starting with a letter, at most {TYPE_NAME_MAX} characters), got "
            f"{kind_of_tree!r:.60}",
        )
    save_id = c.string(doc["save_id"], "save_id") if "save_id" in doc else None
    tree_hash = doc.get("tree_hash")
    if tree_hash is not None or "tree_hash" in doc:
        if depth != 0 or doc["version"] < 2:
            raise c.fail("tree_hash", "is only allowed in the root meta.json of a version 2 tree")
        if not is_checksum(tree_hash):
            raise c.fail("tree_hash", f"must be '<algorithm>:<hex digest>', got {tree_hash!r:.80}")
    batch_size = c.ints(doc["batch_size"], "batch_size")
    raw_entries = doc["entries"]
    if type(raw_entries) is not list:
        raise c.fail("entries", "must be a list")
    if len(raw_entries) > MAX_ENTRIES:
        raise LimitError(f"{where}: {len(raw_entries)} entries, limit is {MAX_ENTRIES}")

    version = doc["version"]
    packs = parse_packs(doc["packs"], c.fail, depth=depth, version=version) if "packs" in doc else ()
    entries: list[Entry] = []
    keys: set[str] = set()
    names: set[str] = {p.file.lower() for p in packs}
    for i, raw in enumerate(raw_entries):
        entry: Entry | None = _plain_entry(raw, batch_size)
        if entry is None or (version < PACK_VERSION and getattr(entry, "pack", None) is not None):
            # anything unusual: the full checks, and their messages
            entry = _parse_entry(c, raw, f"entries[{i}]", batch_size, version)
        if entry.key in keys:
            raise c.fail(f"entries[{i}].key", f"repeats the key {entry.key!r:.80}")
        keys.add(entry.key)
        name = entry.dir if isinstance(entry, ChildMeta) else getattr(entry, "file", "")
        if name:
            folded = name.lower()
            if folded in names:
                raise c.fail(f"entries[{i}]", f"reuses the file name {name!r} (case-insensitively)")
            names.add(folded)
        entries.append(entry)
    refusal = version_refusal(LevelMeta(batch_size, tuple(entries), packs=packs), doc["version"])
    if refusal is not None:
        raise c.fail("entries", refusal)
    if doc["version"] < 2:  # "dict", "list", "tuple" were only names there (of a @tensorclass)
        if any(e.int_key or getattr(e, "tuples", None) is not None for e in entries):
            raise c.fail("entries", "use int_key or tuples, which only a version 2 tree has")
    elif kind_of_tree in CONTAINER_TYPES or any(e.int_key for e in entries):
        _check_container(c, kind_of_tree, batch_size, entries)
    encryption, mac = _parse_encryption(c, doc)
    if encryption is not None and doc["version"] < 2:
        raise c.fail("encryption", "is only allowed in a version 2 tree")
    meta = LevelMeta(batch_size, tuple(entries), kind_of_tree, save_id, tree_hash, packs=packs)
    sealed = doc.get("sealed")
    if encryption is None:
        if sealed is not None:
            raise c.fail("sealed", "is only in encrypted levels (with encryption and mac)")
        return meta
    if encryption.names:
        if type(sealed) is not str or not _BASE64.fullmatch(sealed) or len(sealed) % 4:
            raise c.fail(
                "sealed", f"must be the base64 ciphertext of the level (names are encrypted), got {sealed!r:.40}"
            )
        if meta != LevelMeta((), (), TREE_TYPE, save_id=save_id, tree_hash=tree_hash):  # (no packs either)
            raise c.fail("entries", "must be empty, with batch_size [] and type TensorTree: the level is sealed")
        return replace(meta, encryption=encryption, mac=mac, sealed=sealed)
    if sealed is not None:
        raise c.fail("sealed", "is only in levels whose names are encrypted")
    return encrypted_level(meta, encryption, mac, where)


_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")


def encrypted_level(meta: LevelMeta, encryption: EncryptionMeta, mac: str | None, where: str) -> LevelMeta:
    """``meta`` as a level of an encrypted tree: its leaves know the chunk size.

    Raises:
        MetaFormatError: a pickle, a growable leaf or a pack, which an encrypted level never holds.

    Example:
        >>> import torch
        >>> enc = EncryptionMeta(ENCRYPTION_ALGORITHM, 4096, "0" * 64, "0" * 32)
        >>> plain = LevelMeta((), (LeafMeta("w", "w.memmap", torch.uint8, (10,)),))
        >>> encrypted_level(plain, enc, None, "meta.json").entries[0].file_nbytes
        26
    """
    c = _Checker(where)
    if meta.packs:
        raise c.fail("packs", "are listed, but an encrypted tree packs no leaf")
    entries: list[Entry] = []
    for i, e in enumerate(meta.entries):
        if isinstance(e, PickleMeta):
            raise c.fail(f"entries[{i}]", "is a pickle, which an encrypted level never holds")
        if isinstance(e, LeafMeta):
            if e.pack is not None:
                raise c.fail(f"entries[{i}].pack", "is set, but an encrypted leaf is never packed")
            if e.capacity is not None:
                raise c.fail(f"entries[{i}].capacity", "is set, but an encrypted leaf cannot grow")
            if e.chunks is not None:
                raise c.fail(f"entries[{i}].chunks", "is set, but an encrypted leaf records one checksum of its file")
            e = replace(e, chunk_bytes=encryption.chunk_bytes)
        entries.append(e)
    return replace(meta, entries=tuple(entries), encryption=encryption, mac=mac)


def _is_hex(v: Any, digits: int) -> bool:
    return type(v) is str and len(v) == digits and not v.strip(_HEX)


def _parse_encryption(c: _Checker, doc: dict[str, Any]) -> tuple[EncryptionMeta | None, str | None]:
    """A level's ``encryption`` object and ``mac`` (both or neither)."""
    if ("encryption" in doc) != ("mac" in doc):
        raise c.fail("encryption", "and mac come together (an encrypted level has both)")
    if "encryption" not in doc:
        return None, None
    raw = c.obj(doc["encryption"], "encryption", _ENCRYPTION_FIELDS, frozenset())
    if raw["algorithm"] != ENCRYPTION_ALGORITHM:
        raise c.fail("encryption.algorithm", f"must be {ENCRYPTION_ALGORITHM!r}, got {raw['algorithm']!r:.40}")
    chunk = raw["chunk_bytes"]
    if type(chunk) is not int or not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
        raise c.fail(
            "encryption.chunk_bytes", f"must be an int in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk!r:.40}"
        )
    for name, digits in (("salt", 64), ("key_check", 32)):
        if not _is_hex(raw[name], digits):
            raise c.fail(f"encryption.{name}", f"must be {digits} lowercase hex digits, got {raw[name]!r:.80}")
    if type(raw["names"]) is not bool:
        raise c.fail("encryption.names", f"must be true or false, got {raw['names']!r:.40}")
    if not _is_hex(doc["mac"], 64):
        raise c.fail("mac", f"must be 64 lowercase hex digits, got {doc['mac']!r:.80}")
    return EncryptionMeta(ENCRYPTION_ALGORITHM, chunk, raw["salt"], raw["key_check"], raw["names"]), doc["mac"]


def _check_container(c: _Checker, kind: str, batch_size: tuple[int, ...], entries: list[Entry]) -> None:
    """The rules of a container level (``docs/format.md``, "Version 2"): no batch size; a list or
    tuple holds its items under the keys ``"0"``...``"n-1"`` in order; only a dict marks int keys."""
    if kind not in CONTAINER_TYPES:
        raise c.fail("entries", f"mark int keys (int_key) in a level of type {kind!r}; only a 'dict' level has them")
    if batch_size:
        raise c.fail("batch_size", f"must be [] in a level of type {kind!r}, got {list(batch_size)}")
    for i, e in enumerate(entries):
        if kind != "dict":
            if e.int_key:
                raise c.fail(f"entries[{i}].int_key", f"is only allowed in a 'dict' level, not in a {kind!r}")
            if e.key != str(i):
                raise c.fail(f"entries[{i}].key", f"must be {str(i)!r} (item {i} of a {kind!r}), got {e.key!r:.40}")


def _too_large(shape: tuple[int, ...], extent: int) -> str:
    if prod(shape):
        return f"{list(shape)} would need {extent} bytes, beyond any file"
    return (
        f"{list(shape)} holds no element, but its other dims span {extent} bytes, beyond any "
        "tensor torch can make"
    )


def _check_document(doc: dict[str, Any], data: bytes, c: _Checker) -> None:
    """What orjson lets pass and memtree never writes: deep nesting, repeated object fields (orjson
    keeps the last one silently), ints beyond 64 bits (orjson reads them as floats, a value JSON
    would change).

    Only for bytes that differ from ``orjson.dumps(doc)`` (a file memtree did not write, or a
    damaged one): bytes equal to it have none of these, as orjson writes no more than
    :data:`MAX_META_NESTING` levels (a test pins that), one field of each name, and only the ints
    it reads back as ints.
    """
    too_deep = LimitError(
        f"{c.where}: JSON nested more than {MAX_META_NESTING} levels deep (a non-tensor value may "
        f"nest {MAX_JSON_DEPTH}); the file is damaged or was not written by memtree"
    )
    if json_depth(doc, MAX_META_NESTING) > MAX_META_NESTING or _bracket_depth(data) > MAX_META_NESTING:
        raise too_deep  # the bytes too: a repeated field hides its value from orjson's doc

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) == len(items):
            return out
        seen: set[str] = set()
        for name, _ in items:
            if name in seen:
                break
            seen.add(name)
        key = out.get("key")
        what = (
            f"the entry of key {key!r:.80}"
            if type(key) is str
            else f"an object with fields {sorted(out)[:8]!r:.120}"
        )
        raise c.fail(what, f"repeats the field {name!r:.80}")

    def int_in_64_bits(text: str) -> int:
        if len(text) <= 20 and -(2**63) <= int(text) < 2**64:  # 20 characters hold any of them
            return int(text)
        raise c.fail("a number", f"{text:.40} is an int beyond 64 bits, which memtree never writes")

    json.loads(data, object_pairs_hook=pairs, parse_int=int_in_64_bits)


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(rb"[\[\]{}]")


def _bracket_depth(data: bytes) -> int:
    """How deep the arrays and objects of JSON ``data`` nest, counted on the bytes (strings
    skipped), so that no parser recursion depends on it: ``json.loads`` recurses in C and may
    overflow the stack, or not fail at all, where something raised the recursion limit."""
    depth = deepest = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub(b'""', data)):
        if m.group() in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


_PLAIN_LEAF_FIELDS = frozenset({"key", "kind", "file", "dtype", "shape"})  # required of a leaf
_LEAF_OPTIONAL = frozenset({"checksum", "capacity", "dtensor", "chunks"})
_CHECKSUM_LEAF_FIELDS = _PLAIN_LEAF_FIELDS | {"checksum"}
#: A packed leaf (version 3): ``pack`` and ``offset`` in place of ``file``; never a capacity.
_PACKED_LEAF_FIELDS = frozenset({"key", "kind", "pack", "offset", "dtype", "shape"})
_CHECKSUM_PACKED_FIELDS = _PACKED_LEAF_FIELDS | {"checksum"}
_CHILD_FIELDS = frozenset({"key", "kind", "dir"})


def _parse_entry(c: _Checker, raw: Any, p: str, batch_size: tuple[int, ...], version: int) -> Entry:
    """One entry of ``entries``, with every check and its precise message."""
    if type(raw) is not dict:
        raise c.fail(p, "must be a JSON object")
    if "int_key" not in raw:
        return _parse_kind(c, raw, p, batch_size, version)
    flag = raw["int_key"]
    entry = _parse_kind(c, {k: v for k, v in raw.items() if k != "int_key"}, p, batch_size, version)
    if flag is not True:
        raise c.fail(f"{p}.int_key", f"must be true when present, got {flag!r:.40}")
    if not is_int_key(entry.key):
        raise c.fail(f"{p}.key", f"must be the decimal form of an int (int_key), got {entry.key!r:.40}")
    return replace(entry, int_key=True)


def is_int_key(key: str) -> bool:
    """True if ``key`` is how an int dict key is stored: its decimal form (``str(int)``).

    Example:
        >>> is_int_key("12"), is_int_key("-3"), is_int_key("012"), is_int_key("+1")
        (True, True, False, False)
    """
    if not 0 < len(key) <= 40 or not key.lstrip("-").isdigit() or not key.isascii():
        return False
    return str(int(key)) == key


def _tuple_paths(c: _Checker, raw: Any, value: Any, p: str) -> tuple[TuplePath, ...]:
    if type(raw) is not list or len(raw) > MAX_TUPLE_PATHS:
        raise c.fail(p, f"must be a list of at most {MAX_TUPLE_PATHS} paths, got {raw!r:.80}")
    out: list[TuplePath] = []
    for i, path in enumerate(raw):
        if type(path) is not list:
            raise c.fail(f"{p}[{i}]", f"must be a list of array indices and object keys, got {path!r:.80}")
        node = value
        for step in path:
            if type(step) is int and type(node) is list and 0 <= step < len(node):
                node = node[step]
            elif type(step) is str and type(node) is dict and step in node:
                node = node[step]
            else:
                raise c.fail(f"{p}[{i}]", f"{path!r:.80} is not a path into the value")
        if type(node) is not list:
            raise c.fail(f"{p}[{i}]", f"{path!r:.80} leads to a {type(node).__name__}, not an array")
        out.append(tuple(path))
    if len(set(out)) != len(out):
        raise c.fail(p, "lists a path twice")
    return tuple(out)


def _parse_kind(c: _Checker, raw: dict[str, Any], p: str, batch_size: tuple[int, ...], version: int) -> Entry:
    kind = raw.get("kind")
    if kind == "tensor":
        if "pack" in raw or "offset" in raw:
            raw = c.obj(raw, p, _PACKED_LEAF_FIELDS, {"checksum", "dtensor"})
            pack, offset = parse_pack_ref(raw, p, c.fail, version)
            return replace(_parse_leaf(c, raw, p, batch_size, file=""), pack=pack, offset=offset)
        raw = c.obj(raw, p, _PLAIN_LEAF_FIELDS, _LEAF_OPTIONAL)
        return _parse_leaf(c, raw, p, batch_size)
    if kind == "tree":
        raw = c.obj(raw, p, _CHILD_FIELDS, frozenset())
        return ChildMeta(c.string(raw["key"], f"{p}.key"), c.name(raw["dir"], f"{p}.dir", ""))
    if kind == "json":
        raw = c.obj(raw, p, {"key", "kind", "value"}, {"tuples"})
        key = c.string(raw["key"], f"{p}.key")
        if "tuples" not in raw:
            return JsonMeta(key, raw["value"])
        return JsonMeta(key, raw["value"], tuples=_tuple_paths(c, raw["tuples"], raw["value"], f"{p}.tuples"))
    if kind == "pickle":
        raw = c.obj(raw, p, {"key", "kind", "file"}, set())
        return PickleMeta(c.string(raw["key"], f"{p}.key"), c.name(raw["file"], f"{p}.file", PICKLE_SUFFIX))
    if kind == SUBCLASS_KIND:
        return _parse_subclass(c, raw, p, batch_size)
    raise c.fail(f"{p}.kind", f"must be tensor, tree, json, pickle or subclass, got {kind!r:.40}")


def _parse_subclass(c: _Checker, raw: dict[str, Any], p: str, batch_size: tuple[int, ...]) -> SubclassMeta:
    """A subclass entry (:mod:`memtree.format.subclass`): its outer shape follows a tensor's rules."""
    shape = c.ints(raw.get("shape"), f"{p}.shape")
    if not starts_with_batch(shape, batch_size):
        raise c.fail(f"{p}.shape", f"{list(shape)} does not start with batch_size {list(batch_size)}")
    if extent_bytes(shape, "uint8") > MAX_NBYTES:
        raise c.fail(f"{p}.shape", _too_large(shape, extent_bytes(shape, "uint8")))
    return parse_subclass(
        raw, p, c.fail, c.string(raw.get("key"), f"{p}.key"), c.name(raw.get("dir"), f"{p}.dir", ""), shape,
        c.ints(raw.get("stride"), f"{p}.stride"),
    )


def _plain_entry(raw: Any, batch_size: tuple[int, ...]) -> LeafMeta | ChildMeta | None:
    """The common entries (a tensor without capacity, packed or not, a sub-tree), checked
    inline; ``None`` otherwise.

    Accepts exactly what :func:`_parse_entry` accepts for such an entry, faster (a level of a
    20,000-leaf tree, or the ~90 small levels of a model, are parsed in a fraction of the
    time); anything it does not accept goes through :func:`_parse_entry`, which raises the
    precise error.
    """
    if type(raw) is not dict:
        return None
    fields = raw.keys()
    if fields == _CHILD_FIELDS:
        key, name = raw["key"], raw["dir"]
        if raw["kind"] != "tree" or type(key) is not str or not key or not is_safe_name(name, ""):
            return None
        return ChildMeta(key, name)
    if fields == _PLAIN_LEAF_FIELDS or fields == _CHECKSUM_LEAF_FIELDS:
        pack = offset = None
        file = raw["file"]
        if not is_safe_name(file, LEAF_SUFFIX):
            return None
    elif fields == _PACKED_LEAF_FIELDS or fields == _CHECKSUM_PACKED_FIELDS:  # (version 3 only: the caller)
        pack, offset, file = raw["pack"], raw["offset"], ""
        if not is_pack_name(pack) or type(offset) is not int or not 0 <= offset <= MAX_NBYTES or offset % PACK_ALIGN:
            return None
    else:
        return None
    if raw["kind"] != "tensor":
        return None
    checksum = raw.get("checksum")
    if checksum is not None and not is_checksum(checksum):
        return None
    key, dtype_str, shape = raw["key"], raw["dtype"], raw["shape"]
    if type(key) is not str or not key or type(dtype_str) is not str or type(shape) is not list:
        return None
    size = DTYPE_ITEMSIZES.get(dtype_str)
    if size is None or len(shape) > MAX_NDIM:
        return None
    for x in shape:
        if type(x) is not int or x < 0:
            return None
    dims = tuple(shape)
    if not starts_with_batch(dims, batch_size) or (
        (prod(dims) or prod(d or 1 for d in dims)) * size > MAX_NBYTES  # extent_bytes
    ):
        return None
    return LeafMeta(key, file, dtype_str, dims, checksum, pack=pack, offset=offset)


def _parse_leaf(c: _Checker, raw: dict[str, Any], p: str, batch_size: tuple[int, ...], file: str | None = None) -> LeafMeta:
    """A tensor entry's common fields (``file`` given: a packed leaf, which has none)."""
    key = c.string(raw["key"], f"{p}.key")
    file = c.name(raw["file"], f"{p}.file", LEAF_SUFFIX) if file is None else file
    dtype = raw["dtype"]
    if type(dtype) is not str or dtype not in DTYPE_ITEMSIZES:
        raise c.fail(
            f"{p}.dtype",
            f"names no dtype of the memtree format: {dtype!r:.40} (see docs/format.md for the list)",
        )
    shape = c.ints(raw["shape"], f"{p}.shape")
    if not starts_with_batch(shape, batch_size):
        raise c.fail(f"{p}.shape", f"{list(shape)} does not start with batch_size {list(batch_size)}")
    extent = extent_bytes(shape, dtype)
    if extent > MAX_NBYTES:
        raise c.fail(f"{p}.shape", _too_large(shape, extent))
    capacity = raw.get("capacity")
    if "capacity" in raw:
        if type(capacity) is not int or not shape or capacity < shape[0]:
            raise c.fail(
                f"{p}.capacity",
                f"must be an int >= shape[0] on a leaf with at least one dim, got {capacity!r:.40} "
                f"for shape {list(shape)}",
            )
        if extent_bytes((capacity, *shape[1:]), dtype) > MAX_NBYTES:
            raise c.fail(f"{p}.capacity", f"{capacity} rows of {list(shape[1:])} exceed any file")
    checksum = raw.get("checksum")
    if checksum is not None and not is_checksum(checksum):
        raise c.fail(
            f"{p}.checksum",
            "must be '<algorithm>:<hex>' (crc32, crc32c: 8 hex digits; xxh3: 16; sha256: 64), "
            f"got {checksum!r:.80}",
        )
    layout = parse_layout(raw["dtensor"], f"{p}.dtensor", c.fail, shape) if "dtensor" in raw else None
    chunks = _parse_chunks(c, raw, p, prod(shape) * DTYPE_ITEMSIZES[dtype]) if "chunks" in raw else None
    return LeafMeta(key, file, dtype, shape, checksum, capacity, layout=layout, chunks=chunks)


def _parse_chunks(c: _Checker, raw: dict[str, Any], p: str, nbytes: int) -> ChunkSums:
    """A leaf's ``chunks`` (version 3): :func:`~memtree.format.chunks.parse_chunks`, and never
    next to a ``checksum`` (a leaf records one or the other)."""
    if "checksum" in raw:
        raise c.fail(f"{p}", "records both checksum and chunks; a leaf records one or the other")
    try:
        return parse_chunks(raw["chunks"], nbytes)
    except ChunksFormatError as err:
        raise c.fail(f"{p}.chunks" + (f".{err.field}" if err.field else ""), err.problem) from None
