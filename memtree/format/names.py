"""Every name memtree puts on disk, and the escaping of keys into safe, portable file names.

Names (``docs/format.md``): each level's ``meta.json``; leaf files ``<key>.memmap`` (pickled
non-tensor values, opt-in only, ``<key>.pickle``); and the hidden siblings a write of
``<parent>/<name>`` uses: the staging directory ``.<name>.memtree-tmp-<32 hex>/``, the old copy
``.<name>.memtree-old-<32 hex>/`` (fallback overwrite), the writer lock ``.<name>.memtree.lock``
(which holds the journal of a writer that died); inside a tree, a growth's temporary
``.meta.json.memtree-tmp-<32 hex>`` and the name ``.memtree-copy-<32 hex>`` a leaf's own copy
(:mod:`memtree.store.reading.unshare`) has for an instant before it is renamed over the leaf; in a
remote cache directory, the download scratch ``.<entry>.memtree-download-<32 hex>/``; in a
checkpoint root, the step directories ``<step>/`` (:func:`is_step_name`) and the root record
``.memtree-root.json`` of an encrypted root.

A tree key may be any non-empty ``str``. On disk, a key becomes a file or directory name only
through :func:`encode_level`, which escapes everything that is not portable and safe (see
``docs/format.md``, "Escaping keys into file names"). The loader never derives a path from a
key; it checks recorded names with :func:`is_safe_name`.

Example:
    >>> from memtree.format.names import encode_level
    >>> encode_level([("weight", ".memmap"), ("../x", ".memmap"), ("sub", "")])
    ['weight.memmap', '%2E.%2Fx.memmap', 'sub']
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from collections.abc import Sequence

from ..errors import InvalidKeyError, KeyTypeError

__all__ = [
    "META_NAME",
    "LEAF_SUFFIX",
    "PICKLE_SUFFIX",
    "STAGING_MARK",
    "OLD_MARK",
    "LOCK_SUFFIX",
    "SCRATCH_MARK",
    "COPY_MARK",
    "META_TMP",
    "SIBLING",
    "TIED_KEY",
    "staging_path",
    "old_path",
    "lock_path",
    "scratch_path",
    "meta_tmp_name",
    "copy_name",
    "is_uncommitted_name",
    "MAX_STEP",
    "ROOT_RECORD",
    "is_step_name",
    "ROUTED_SUFFIX",
    "ROUTED_ENTRY",
    "routed_entry_name",
    "validate_key",
    "encode_level",
    "is_safe_name",
]

#: Root key of the JSON leaf in which ``TensorTree.from_module`` records tied tensors:
#: ``{alias: stored name}``.
TIED_KEY = "__tied__"
#: The name of each level's metadata file.
META_NAME = "meta.json"
#: Suffix of a leaf's raw data file.
LEAF_SUFFIX = ".memmap"
#: Suffix of a pickled non-tensor value's file (written only with ``allow_pickle=True``).
PICKLE_SUFFIX = ".pickle"
#: Marker in the name of a staging directory (``.<name>.memtree-tmp-<hex>``).
STAGING_MARK = ".memtree-tmp-"
#: Marker in the name of the old copy kept during a fallback overwrite.
OLD_MARK = ".memtree-old-"
#: Suffix of the writer lock file ``.<name>.memtree.lock``.
LOCK_SUFFIX = ".memtree.lock"
#: Marker in the name of a remote download's scratch directory, inside a cache directory.
SCRATCH_MARK = ".memtree-download-"
#: Prefix of the name a leaf's own copy has, inside its level, before it is renamed over the leaf.
COPY_MARK = ".memtree-copy-"

#: Largest step of a checkpoint root (a step is an int64, its directory the decimal number).
MAX_STEP = 2**63 - 1
_STEP_NAME = re.compile(r"0|[1-9][0-9]{0,18}")
#: The record of an encrypted checkpoint root (its identity and key check), in the root.
ROOT_RECORD = ".memtree-root.json"

#: Suffix of the directory ``memtree.saving()`` puts beside a ``torch.save`` file (``ckpt.pt.memtree``).
ROUTED_SUFFIX = ".memtree"
#: One routed save's tree in that directory: ``<12 hex: the target's tag>-<16 random hex>``.
ROUTED_ENTRY = re.compile(r"(?P<tag>[0-9a-f]{12})-[0-9a-f]{16}")

#: A sibling of destination ``name``: its staging directory, old copy or lock file.
SIBLING = re.compile(r"\.(?P<name>.+)\.memtree(?:-(?P<kind>tmp|old)-[0-9a-f]{32}|(?P<lock>\.lock))", re.S)
#: The temporary ``meta.json`` of a growth, inside the tree (journaled as ``meta_tmp``).
META_TMP = re.compile(re.escape(f".{META_NAME}{STAGING_MARK}") + "[0-9a-f]{32}")


def staging_path(parent: str, name: str) -> str:
    """A fresh staging directory path for destination ``name`` in ``parent``."""
    return os.path.join(parent, f".{name}{STAGING_MARK}{uuid.uuid4().hex}")


def old_path(parent: str, name: str) -> str:
    """A fresh old-copy path for destination ``name`` in ``parent``."""
    return os.path.join(parent, f".{name}{OLD_MARK}{uuid.uuid4().hex}")


def lock_path(parent: str, name: str) -> str:
    """The writer lock file of destination ``name`` in ``parent``."""
    return os.path.join(parent, f".{name}{LOCK_SUFFIX}")


def scratch_path(parent: str, name: str) -> str:
    """A fresh download scratch directory for cache entry ``name`` in ``parent``."""
    return os.path.join(parent, f".{name}{SCRATCH_MARK}{uuid.uuid4().hex}")


def meta_tmp_name() -> str:
    """A fresh name for a growth's temporary ``meta.json`` (matches :data:`META_TMP`)."""
    return f".{META_NAME}{STAGING_MARK}{uuid.uuid4().hex}"


def copy_name() -> str:
    """A fresh name for a leaf's own copy in the leaf's directory (``.memtree-copy-<32 hex>``).

    Example:
        >>> copy_name().startswith(COPY_MARK), len(copy_name())
        (True, 46)
    """
    return f"{COPY_MARK}{uuid.uuid4().hex}"


def routed_entry_name(tag: str) -> str:
    """A fresh name for one routed save's tree (matches :data:`ROUTED_ENTRY`).

    Example:
        >>> bool(ROUTED_ENTRY.fullmatch(routed_entry_name("0" * 12)))
        True
    """
    return f"{tag}-{uuid.uuid4().hex[:16]}"


def is_step_name(name: str) -> bool:
    """True for the name of a checkpoint root's step directory: the decimal step, from ``0`` to
    :data:`MAX_STEP`, with no sign and no padding.

    Example:
        >>> [is_step_name(n) for n in ("1200", "0", "007", "best", str(2**63))]
        [True, True, False, False, False]
    """
    return _STEP_NAME.fullmatch(name) is not None and int(name) <= MAX_STEP


def is_uncommitted_name(basename: str) -> bool:
    """True for the name of a staging directory or old copy (never a committed tree).

    Lenient on purpose (any hidden name containing either marker): the loader refuses such
    roots, while :func:`memtree.recover` deletes only exact sibling names.

    Example:
        >>> is_uncommitted_name(".t.memtree-tmp-" + "ab" * 16), is_uncommitted_name("t")
        (True, False)
    """
    return basename.startswith(".") and (STAGING_MARK in basename or OLD_MARK in basename)

NAME_MAX = 255
_CUT = 200
_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")
_WINDOWS_DEVICES = frozenset(
    ["con", "prn", "aux", "nul"]
    + [f"com{i}" for i in range(1, 10)]
    + [f"lpt{i}" for i in range(1, 10)]
)
_SAFE_NAME = re.compile(r"[A-Za-z0-9_\-%~][A-Za-z0-9_.\-%~]*")


def validate_key(key: object) -> str:
    """Return ``key`` if it is a valid tree key, else raise.

    Raises:
        KeyTypeError: ``key`` is not a ``str``.
        InvalidKeyError: ``key`` is the empty string.
    """
    if type(key) is not str:
        if isinstance(key, str):  # a str subclass: store the plain string
            key = str(key)
        else:
            raise KeyTypeError(
                f"tree keys must be str, got {type(key).__name__} {key!r}; "
                "use a tuple of str to reach nested keys"
            )
    if not key:
        raise InvalidKeyError("tree keys must be non-empty strings, got ''")
    return key


def _percent(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


def _escape(key: str) -> str:
    out = [c if c in _SAFE_CHARS else _percent(c) for c in key]
    if out[0] == ".":
        out[0] = "%2E"
    if out[-1] == ".":
        out[-1] = "%2E"
    if key.split(".", 1)[0].lower() in _WINDOWS_DEVICES:
        out[0] = _percent(key[0])
    return "".join(out)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def encode_level(items: Sequence[tuple[str, str]]) -> list[str]:
    """File names for the entries of one level.

    Args:
        items: ``(key, suffix)`` pairs of one level, e.g. ``("w", ".memmap")`` for a leaf and
            ``("sub", "")`` for a sub-tree directory. Keys must be distinct.

    Returns:
        One name per item, in order: safe, unique within the level case-insensitively (also
        against ``meta.json``), at most 255 bytes.
    """
    names = []
    for key, suffix in items:
        base = _escape(key)
        if len(base) + len(suffix) > NAME_MAX:
            base = base[:_CUT] + "~" + _digest(key)
        names.append(base + suffix)
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name.lower(), []).append(i)
    reserved = META_NAME.lower()
    for folded, members in groups.items():
        if len(members) > 1 or folded == reserved:
            for i in members:
                key, suffix = items[i]
                base = names[i][: len(names[i]) - len(suffix)] if suffix else names[i]
                names[i] = base[:_CUT] + "~" + _digest(key) + suffix
    return names


def is_safe_name(name: object, suffix: str = "") -> bool:
    """True if ``name`` is one safe path component as :func:`encode_level` makes them.

    Example:
        >>> is_safe_name("a.memmap", ".memmap"), is_safe_name("../a.memmap", ".memmap")
        (True, False)
    """
    return (
        type(name) is str
        and len(name.encode("utf-8", "surrogatepass")) <= NAME_MAX
        and _SAFE_NAME.fullmatch(name) is not None
        and name.endswith(suffix)
        and name.lower() != META_NAME
        and len(name) > len(suffix)
    )
