"""Reading directories written by tensordict's ``memmap`` (read-only compatibility, SPEC §5).

tensordict's layout, as its ``memmap``/``load_memmap`` write and read it (tensordict is never
imported)::

    prefix/
    ├── meta.json      {"<key>": {"dtype": "torch.float32", "shape": [..], "device": "cpu",
    │                             "is_nested": false},          # a tensor leaf
    │                   "<sub>": {"type": "TensorDict"},          # a sub-directory
    │                   "shape": [batch...], "device": "cpu",
    │                   "_type": "<class 'tensordict._td.TensorDict'>", ...}
    ├── <key>.memmap   raw bytes (key percent-encoded: ``a/b`` -> ``a%2Fb``)
    └── <sub>/meta.json
        A sub-directory's own ``_type`` says what it is: a TensorDict (a level), NonTensorData
        (``"data"``: a JSON value; without it, a pickle sidecar), NonTensorStack (``"data"``: a
        list), a tensorclass (its content in ``<sub>/_tensordict/``), or a kind memtree does not
        read (LazyStackedTensorDict, sub-tensordicts).

A tensorclass level keeps its ``_type`` (as text, in ``Level.foreign_type``): loaded as a tree,
it becomes the memtree ``@tensorclass`` registered under the longest dotted suffix of the class
path (``<class 'pkg.mod.Step'>`` -> ``pkg.mod.Step``, ``mod.Step`` or ``Step``:
:func:`memtree.tree.parts.registry.class_for_foreign`), or a plain tree when none is registered.

What memtree does with it:

* every ``meta.json`` is validated like memtree's own (size limit before reading, JSON,
  duplicate fields, JSON nesting, field types, dtype from memtree's closed table, shapes torch
  can make, batch sizes, nesting depth): a malformed one raises
  :class:`~memtree.errors.MetaFormatError` naming the file and the field. Class names in
  ``_type`` are matched as text, never imported;
* file names are derived from keys with tensordict's encoding (with its fallback to the legacy
  raw name), must be one path component, and are opened relative to their directory without
  following symbolic links, so nothing outside ``prefix`` is ever opened;
* leaves are checked before mapping (regular file, at least ``numel × itemsize`` bytes) and
  mapped like memtree's own. **Only here**, two tensordict quirks are tolerated: a leaf file a
  few bytes longer than needed (its first ``numel × itemsize`` bytes are used), and no file for a
  zero-element leaf;
* non-tensor data comes from the JSON ``"data"`` field; pickle sidecars are **never** executed,
  even with ``allow_pickle=True``: such a key raises
  :class:`~memtree.errors.PickleNotAllowedError` (load the other keys with ``keys=``);
* a torchrl storage dump (``ReplayBuffer.dumps(path)`` writes ``path/storage/`` in this layout,
  with torchrl's ``storage_metadata.json`` next to its ``meta.json``) holds ``capacity`` rows of
  which the first ``len`` were written: its leaves are loaded with only those rows
  (:func:`valid_rows`). The file is read like a ``meta.json`` (no link followed, a regular file
  of at most :data:`MAX_STORAGE_METADATA_BYTES`, JSON without repeated fields); ``len`` must be
  an int >= 0, else :class:`~memtree.errors.MetaFormatError` names the file (delete it to load
  every row). A ``len`` above the capacity is torchrl's count of elements over several
  dimensions (a storage of ``ndim > 1``, which the dump does not record): every row is kept.
  Without the file, every row is loaded;
* :mod:`memtree.store.foreign.tensordict_write` writes this layout (``memtree convert --format
  tensordict``, :func:`memtree.interop.save_tensordict`);
* :func:`check_tensordict_dir` walks a directory the same way without mapping anything and
  reports every problem instead of raising the first (``memtree verify``).

Example:
    >>> import os, tempfile, torch
    >>> from memtree.store.foreign.tensordict import is_tensordict_dir, read_tensordict_dir
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "meta.json"), "w") as f:
    ...     _ = f.write('{"x": {"dtype": "torch.int32", "shape": [2], "device": "cpu", '
    ...                 '"is_nested": false}, "shape": [2], "device": "cpu", '
    ...                 '"_type": "<class \\'tensordict._td.TensorDict\\'>"}')
    >>> torch.tensor([1, 2], dtype=torch.int32).numpy().tofile(os.path.join(d, "x.memmap"))
    >>> is_tensordict_dir(d), read_tensordict_dir(d).entries["x"].tolist()
    (True, [1, 2])
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from math import prod
from typing import Any

import torch

from ...format.dtypes import dtype_from_name, itemsize
from ...errors import (
    check_keywords,
    DtypeError,
    LimitError,
    MemtreeError,
    MemtreeKeyError,
    MetaFormatError,
    MissingLeafError,
    PickleNotAllowedError,
    UnsafePathError,
    UnsupportedVersionError,
)
from ..primitives.files import open_checked, read_fd, storage_error
from ...format.schema import (
    starts_with_batch,
    MAX_DEPTH,
    MAX_DIM,
    MAX_ENTRIES,
    MAX_META_NESTING,
    MAX_NBYTES,
    MAX_NDIM,
    extent_bytes,
)
from ...format.names import META_NAME
from ...format.level import Level
from ..reading.mapped import map_leaf
from ...format.values import MAX_JSON_DEPTH, NonTensor, json_depth
from ..reading.options import KeySelection, ReadOptions
from ..reading.read import open_dir, read_meta_bytes
from ..reading.storage import read_small_file

__all__ = ["check_tensordict_dir", "is_tensordict_dir", "read_tensordict_dir", "valid_rows"]

#: torchrl's record of a storage dump, next to the root ``meta.json``.
STORAGE_METADATA = "storage_metadata.json"
#: Largest ``storage_metadata.json`` read (torchrl writes a few dozen bytes for a TensorDict).
MAX_STORAGE_METADATA_BYTES = 1 << 20

_NAME_MAX = 255
# Characters tensordict percent-encodes in file names (``_FS_UNSAFE_CHARS`` in its
# ``_utils_key_json``): path separators, characters Windows forbids, space, '%' and controls.
_UNSAFE = set('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}
_ENCODE = str.maketrans({c: f"%{ord(c):02X}" for c in _UNSAFE})


def _encode(key: str) -> str:
    if key in (".", ".."):
        return "%2E" * len(key)
    return key.translate(_ENCODE)


def _legacy_ok(key: str) -> bool:
    """tensordict's rule for raw (unencoded) legacy names that stay inside their directory."""
    return not ("/" in key or "\\" in key or "\0" in key or key in (".", "..")) and not (
        len(key) >= 2 and key[0].isalpha() and key[1] == ":"
    )


def _kind(type_name: Any) -> str:
    """Classify a ``_type`` string (``"<class 'tensordict._td.TensorDict'>"``) without importing."""
    if type(type_name) is not str:
        return "invalid"
    name = type_name.removeprefix("<class '").removesuffix("'>").rpartition(".")[2]
    return {
        "TensorDict": "tensordict",
        "NonTensorData": "nontensor",
        "NonTensorStack": "stack",
        "LazyStackedTensorDict": "unsupported",
        "_SubTensorDict": "unsupported",
        "SubTensorDict": "unsupported",
        "PersistentTensorDict": "unsupported",
    }.get(name, "tensorclass")


def _read_json(dir_fd: int, where: str) -> Any:
    """Parse the ``meta.json`` of an open directory, refusing oversized or malformed files."""
    data, path = read_meta_bytes(dir_fd, where, root=False)
    return _parse_json(data, path)


def _parse_json(data: bytes, path: str) -> Any:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise _fail(path, "an object", f"repeats the field {k!r:.80}")
            out[k] = v
        return out

    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=pairs)
    except MetaFormatError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise _fail(path, "content", f"is not valid UTF-8 JSON ({err})") from None
    if json_depth(doc, MAX_META_NESTING) > MAX_META_NESTING:
        raise LimitError(f"{path}: JSON nested more than {MAX_META_NESTING} levels deep")
    return doc


def _value(value: Any, meta: str, pointer: str) -> NonTensor:
    """A non-tensor value, refused (like memtree's own) if it nests too deep to be stored."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise LimitError(
            f"{meta}: {pointer} nests lists and objects more than {MAX_JSON_DEPTH} levels deep, "
            "more than memtree can store; flatten it with tensordict first"
        )
    return NonTensor(value)


def _fail(path: str, pointer: str, problem: str) -> MetaFormatError:
    return MetaFormatError(
        f"{path}: {pointer} {problem}. The tensordict directory is damaged or was not written by "
        "tensordict's memmap; re-save it with tensordict (or restore it from a backup)"
    )


def is_tensordict_dir(prefix: str | os.PathLike[str]) -> bool:
    """True if ``prefix/meta.json`` looks like tensordict's (a ``_type`` field, no memtree format).

    Never raises: anything unreadable is left to memtree's own loader to report. The file is
    opened as the loaders open it (:func:`~memtree.store.reading.read.read_meta_bytes`: no symbolic
    link followed, a regular file of at most 16 MiB, checked before reading).
    """
    try:
        root = os.fspath(prefix)
        fd = open_dir(root, root, None)
        try:
            data, _ = read_meta_bytes(fd, root, root=True)
        finally:
            os.close(fd)
        if data.startswith(b'{"format":"memtree"'):  # how memtree writes it: no need to parse
            return False
        doc = json.loads(data)
    except (MemtreeError, OSError, ValueError, RecursionError):
        return False
    return type(doc) is dict and "_type" in doc and "format" not in doc


@check_keywords
def read_tensordict_dir(
    prefix: str | os.PathLike[str],
    *,
    keys: Iterable[KeySelection] | None = None,
    mode: str = "r+",
    mmap: bool = True,
    device: torch.device | str | None = None,
) -> Level:
    """Load a directory written by tensordict's ``memmap`` as a :class:`~memtree.format.level.Level`.

    Args:
        prefix: the directory (its root ``meta.json`` has tensordict's ``_type`` field).
        keys: load only these keys (str or tuples of str); other sub-directories are not opened.
        mode: ``"r+"`` maps leaves writable (writes reach tensordict's files), ``"r"``
            read-only.
        mmap: ``False`` reads leaves into memory instead of mapping them.
        device: ``"meta"`` opens no leaf file; another device copies the leaves there.

    Raises:
        MetaFormatError: a malformed ``meta.json``.
        UnsupportedVersionError: a container kind memtree does not read (lazy stacks...).
        PickleNotAllowedError: a key whose value only exists as a pickle sidecar.
        MissingLeafError, LeafSizeError, UnsafePathError: damaged or hostile files.
    """
    return read_tensordict_level(prefix, ReadOptions.of(keys=keys, mode=mode, mmap=mmap, device=device))


def read_tensordict_level(prefix: str | os.PathLike[str], options: ReadOptions) -> Level:
    """:func:`read_tensordict_dir` with its options already checked (``allow_pickle`` and
    ``verify`` do not apply: sidecars are never unpickled, and tensordict records no checksums)."""
    root = os.path.realpath(os.fspath(prefix))
    fd = open_dir(root, root, None)
    try:
        reader = _TensordictReader(
            readonly=options.readonly, mmap=options.mmap, device=options.target, length=_storage_len(fd, root)
        )
        doc = _read_json(fd, root)
        return reader.container(fd, root, doc, options.selection, (), 0, ())
    finally:
        os.close(fd)


def valid_rows(prefix: str | os.PathLike[str]) -> int | None:
    """The ``len`` of a torchrl storage dump (``storage_metadata.json``), or ``None`` without one.

    The rows :func:`read_tensordict_dir` loads are the first ``min(len, capacity)``.

    Raises:
        MetaFormatError: a malformed ``storage_metadata.json`` (names the file and the field).
        UnsafePathError: it is a link or not a regular file.

    Example:
        >>> import tempfile
        >>> valid_rows(tempfile.mkdtemp()) is None
        True
    """
    root = os.path.realpath(os.fspath(prefix))
    fd = open_dir(root, root, None)
    try:
        return _storage_len(fd, root)
    finally:
        os.close(fd)


def _storage_len(dir_fd: int, where: str) -> int | None:
    """``len`` from the ``storage_metadata.json`` in an open directory (``None``: no such file)."""
    path = os.path.join(where, STORAGE_METADATA)
    data = read_small_file(
        STORAGE_METADATA, path, MAX_STORAGE_METADATA_BYTES,
        "a torchrl storage_metadata.json; delete it to load every row of the storage", dir_fd=dir_fd,
    )
    if data is None:
        return None
    doc = _parse_json(data, path)
    length = doc.get("len") if type(doc) is dict else None
    if type(length) is not int or not 0 <= length <= MAX_DIM:
        raise MetaFormatError(
            f"{path}: len must be an int >= 0 (the rows torchrl wrote), got {length!r:.40}; the file is "
            "damaged or was not written by torchrl: delete it to load every row of the storage"
        )
    return length


class _TensordictReader:
    map_leaves = True  # False: check each leaf file, map or read none (the checker)

    def __init__(self, *, readonly: bool, mmap: bool, device: torch.device, length: int | None = None) -> None:
        self.readonly = readonly
        self.mmap = mmap
        self.device = device
        self.length = length  # a torchrl dump's valid length: only the first rows are loaded

    def rows(self, shape: tuple[int, ...], meta: str) -> tuple[int, ...]:
        """``shape`` cut to the valid rows of a torchrl dump (unchanged without one)."""
        if self.length is None:
            return shape
        if not shape:
            raise _fail(meta, "shape", f"is [] but {STORAGE_METADATA} gives a length: a storage has rows")
        return (min(self.length, shape[0]),) + shape[1:]

    def container(
        self,
        dir_fd: int,
        where: str,
        doc: Any,
        selection: dict[str, Any] | None,
        path: tuple[str, ...],
        depth: int,
        parent_batch: tuple[int, ...],
    ) -> Level:
        """A TensorDict level, or a tensorclass (whose content is its ``_tensordict`` level)."""
        meta = os.path.join(where, META_NAME)
        if depth > MAX_DEPTH:
            raise LimitError(f"{meta}: nesting exceeds {MAX_DEPTH} levels")
        if type(doc) is not dict:
            raise _fail(meta, "top level", f"must be a JSON object, got {type(doc).__name__}")
        kind = _kind(doc.get("_type"))
        if kind == "tensorclass":
            return self.tensorclass(dir_fd, where, doc, selection, path, depth, parent_batch)
        if kind == "unsupported":
            raise self.unsupported(meta, doc["_type"])
        if kind != "tensordict":
            raise _fail(meta, "_type", f"must name a TensorDict here, got {doc.get('_type')!r:.80}")
        batch = self.ints(doc.get("shape"), meta, "shape")
        if not starts_with_batch(batch, parent_batch):
            raise _fail(
                meta,
                "shape",
                f"{list(batch)} does not start with the parent's batch size {list(parent_batch)}",
            )
        entries = {k: v for k, v in doc.items() if type(v) is dict}
        if len(entries) > MAX_ENTRIES:
            raise LimitError(f"{meta}: {len(entries)} entries, limit is {MAX_ENTRIES}")
        if selection is not None:
            missing = [k for k in selection if k not in entries]
            if missing:
                full = path + (missing[0],)
                raise MemtreeKeyError(
                    f"key {full if len(full) > 1 else full[0]!r} is not in the tensordict "
                    "directory "
                    f"{where} (keys there: {sorted(entries)[:20]})"
                )
            entries = {k: entries[k] for k in selection}
        out = Level(self.rows(batch, meta), {})
        for key, entry in entries.items():
            if not key:
                raise _fail(meta, "a key", "is empty, which memtree keys cannot be")
            sub = selection.get(key) if selection is not None else None
            pointer = f"[{key!r:.80}]"
            if "type" in entry:
                if type(entry["type"]) is not str:
                    raise _fail(meta, f"{pointer}.type", "must be a string")
                out.entries[key] = self.child(dir_fd, where, key, sub, path + (key,), depth, batch)
                continue
            if sub is not None:
                raise MemtreeKeyError(
                    f"key {path + (key,)!r} is a tensor leaf in {where}; it has no sub-keys"
                )
            out.entries[key] = self.leaf(dir_fd, where, meta, key, entry, batch)
        return out

    def tensorclass(
        self,
        dir_fd: int,
        where: str,
        doc: dict[str, Any],
        selection: dict[str, Any] | None,
        path: tuple[str, ...],
        depth: int,
        parent_batch: tuple[int, ...],
    ) -> Level:
        meta = os.path.join(where, META_NAME)
        if not self.exists(dir_fd, "_tensordict"):
            raise self.unsupported(meta, doc["_type"])
        extra = doc.get("_non_tensordict", {})
        if type(extra) is not dict:
            raise _fail(meta, "_non_tensordict", "must be a JSON object")
        inner_selection = None
        if selection is not None:
            inner_selection = {k: v for k, v in selection.items() if k not in extra}
        child_where = os.path.join(where, "_tensordict")
        child_fd = open_dir("_tensordict", child_where, dir_fd)
        try:
            level = self.container(
                child_fd,
                child_where,
                _read_json(child_fd, child_where),
                inner_selection,
                path,
                depth + 1,
                parent_batch,
            )
        finally:
            os.close(child_fd)
        for key, value in extra.items():
            if key and (selection is None or key in selection):
                level.entries[key] = _value(value, meta, f"_non_tensordict[{key!r:.80}]")
        level.foreign_type = doc["_type"]  # matched to a registered @tensorclass by the tree layer
        return level

    def child(
        self,
        dir_fd: int,
        where: str,
        key: str,
        selection: dict[str, Any] | None,
        path: tuple[str, ...],
        depth: int,
        batch: tuple[int, ...],
    ) -> Level | NonTensor:
        name = self.name(dir_fd, where, key, "")
        child_where = os.path.join(where, name)
        child_fd = open_dir(name, child_where, dir_fd)
        try:
            doc = _read_json(child_fd, child_where)
            meta = os.path.join(child_where, META_NAME)
            kind = _kind(doc.get("_type")) if type(doc) is dict else "invalid"
            if kind in ("nontensor", "stack"):
                if selection is not None:
                    raise MemtreeKeyError(
                        f"key {path!r} is non-tensor data in {where}; it has no sub-keys"
                    )
                if "data" not in doc:
                    raise PickleNotAllowedError(
                        f"key {path if len(path) > 1 else path[0]!r} of the tensordict "
                        "directory is "
                        f"stored as a pickle in {child_where}; memtree never executes tensordict's "
                        "pickle sidecars (not even with allow_pickle=True). Load the other "
                        "keys with "
                        "keys=[...], or re-save the value as JSON-serialisable data with tensordict"
                    )
                if kind == "stack":
                    if type(doc["data"]) is not list:
                        raise _fail(meta, "data", "of a NonTensorStack must be a list")
                    if self.length is not None:  # one item a row: the valid ones
                        return _value(doc["data"][: self.length], meta, "data")
                return _value(doc["data"], meta, "data")
            if kind == "invalid" and type(doc) is dict:
                raise _fail(
                    meta, "_type", f"must be a class name string, got {doc.get('_type')!r:.80}"
                )
            return self.container(child_fd, child_where, doc, selection, path, depth + 1, batch)
        finally:
            os.close(child_fd)

    def leaf(
        self,
        dir_fd: int,
        where: str,
        meta: str,
        key: str,
        entry: dict[str, Any],
        batch: tuple[int, ...],
    ) -> torch.Tensor:
        pointer = f"[{key!r:.80}]"
        dtype_str = entry.get("dtype")
        dtype = None
        if type(dtype_str) is str and dtype_str.startswith("torch."):
            dtype = dtype_from_name(dtype_str[len("torch.") :])
        if dtype is None:
            raise _fail(
                meta, f"{pointer}.dtype", f"names no dtype memtree can read: {dtype_str!r:.40}"
            )
        shape = self.ints(entry.get("shape"), meta, f"{pointer}.shape")
        if not starts_with_batch(shape, batch):
            raise _fail(
                meta,
                f"{pointer}.shape",
                f"{list(shape)} does not start with the batch size {list(batch)}",
            )
        nested = entry.get("is_nested", False)
        if type(nested) is not bool:
            raise _fail(meta, f"{pointer}.is_nested", "must be true or false")
        if nested:
            raise DtypeError(
                f"leaf {key!r} of {where} is a nested (jagged) tensor; memtree stores only "
                "strided tensors: convert it with tensordict first (e.g. to a padded tensor)"
            )
        nbytes = prod(shape) * itemsize(dtype)
        if extent_bytes(shape, dtype) > MAX_NBYTES:
            raise _fail(
                meta,
                f"{pointer}.shape",
                f"{list(shape)} would need {extent_bytes(shape, dtype)} bytes (zero dims counted "
                "as 1), beyond any tensor torch can make",
            )
        kept = self.rows(shape, meta)  # a torchrl dump: the valid rows (its first ones) only
        if self.device.type == "meta":
            return torch.empty(kept, dtype=dtype, device="meta")
        name = self.name(dir_fd, where, key, ".memmap", missing_ok=nbytes == 0)
        if name is None:  # tensordict writes no file for a zero-element leaf
            return torch.empty(kept, dtype=dtype, device=self.device)
        path = os.path.join(where, name)
        fd = open_checked(name, nbytes, path, dir_fd=dir_fd, strict_size=False)
        if not self.map_leaves:  # checking (verify): the file is right, nothing to map
            os.close(fd)
            return torch.empty(shape, dtype=dtype, device="meta")
        try:
            if self.mmap:
                tensor: torch.Tensor = map_leaf(fd, path, dtype, kept, readonly=self.readonly)
            else:
                tensor = torch.empty(kept, dtype=dtype)
                read_fd(fd, tensor)
        except OSError as err:
            if isinstance(err, MemtreeError):
                raise
            raise storage_error(err, f"reading leaf {path}") from err
        finally:
            os.close(fd)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def name(
        self, dir_fd: int, where: str, key: str, suffix: str, *, missing_ok: bool = False
    ) -> Any:
        """The file name of ``key`` in ``dir_fd``: tensordict's encoded name, or the legacy one."""
        candidates = [_encode(key) + suffix]
        if _legacy_ok(key) and key + suffix != candidates[0]:
            candidates.append(key + suffix)
        for name in candidates:
            if len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX:
                raise UnsafePathError(
                    f"key {key!r:.80} in {where} maps to a file name longer than {_NAME_MAX} bytes"
                )
            if self.exists(dir_fd, name):
                return name
        if missing_ok:
            return None
        what = "sub-directory" if not suffix else "leaf file"
        raise MissingLeafError(
            f"{what} {os.path.join(where, candidates[0])} of key {key!r:.80} is missing; the "
            "tensordict directory is damaged: re-save it, or load the other keys with keys=[...]"
        )

    @staticmethod
    def unsupported(meta: str, type_name: str) -> UnsupportedVersionError:
        return UnsupportedVersionError(
            f"{meta}: _type {type_name!r:.80} is a tensordict container memtree does not read "
            "(lazy stacks and sub-tensordicts are not supported); densify it with tensordict "
            "first, e.g. td.contiguous().memmap(new_prefix)"
        )

    @staticmethod
    def exists(dir_fd: int, name: str) -> bool:
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as err:
            raise storage_error(err, f"checking {name}") from err
        return True

    @staticmethod
    def ints(v: Any, meta: str, pointer: str) -> tuple[int, ...]:
        if type(v) is not list or len(v) > MAX_NDIM:
            raise _fail(meta, pointer, f"must be a list of at most {MAX_NDIM} ints, got {v!r:.80}")
        for i, x in enumerate(v):
            if type(x) is not int or not 0 <= x <= MAX_DIM:
                raise _fail(meta, f"{pointer}[{i}]", f"must be an int in [0, 2**63), got {x!r:.40}")
        return tuple(v)


#: ``on_problem(path, key_path, error)``: one problem :func:`check_tensordict_dir` found.
ProblemSink = Callable[[str, tuple[str, ...], MemtreeError], None]


def check_tensordict_dir(
    prefix: str | os.PathLike[str], on_problem: ProblemSink, on_leaf: Callable[[], None]
) -> None:
    """Check a tensordict directory as :func:`read_tensordict_dir` loads it, reporting every problem.

    Every ``meta.json`` (and torchrl's ``storage_metadata.json``) is validated and every leaf file
    checked (regular file, no link, at least ``numel × itemsize`` bytes) exactly as a load does, but nothing is mapped or read, no pickle
    is opened, and a problem is passed to ``on_problem`` instead of raised: the walk goes on with
    the next entry (a level whose ``meta.json`` is unusable is reported once, for its key).
    ``on_leaf()`` is called for each tensor leaf listed.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> with open(os.path.join(d, "meta.json"), "w") as f:
        ...     _ = f.write('{"x": {"dtype": "torch.int32", "shape": [2], "device": "cpu", '
        ...                 '"is_nested": false}, "shape": [2], "device": "cpu", '
        ...                 '"_type": "<class \\'tensordict._td.TensorDict\\'>"}')
        >>> found = []
        >>> check_tensordict_dir(d, lambda path, key, err: found.append(key), lambda: None)
        >>> found
        [('x',)]
    """
    root = os.path.realpath(os.fspath(prefix))
    checker = _TensordictChecker(on_problem, on_leaf)
    try:
        fd = open_dir(root, root, None)
    except MemtreeError as err:
        on_problem(root, (), err)
        return
    try:
        try:
            _storage_len(fd, root)
        except MemtreeError as err:
            on_problem(os.path.join(root, STORAGE_METADATA), (), err)
        checker.container(fd, root, _read_json(fd, root), None, (), 0, ())
    except MemtreeError as err:
        on_problem(os.path.join(root, META_NAME), (), err)
    finally:
        os.close(fd)


class _TensordictChecker(_TensordictReader):
    """The reader, reporting each entry's problem and going on (see :func:`check_tensordict_dir`)."""

    map_leaves = False

    def __init__(self, on_problem: ProblemSink, on_leaf: Callable[[], None]) -> None:
        super().__init__(readonly=True, mmap=True, device=torch.device("cpu"))
        self.on_problem = on_problem
        self.on_leaf = on_leaf
        self.paths: list[tuple[str, ...]] = []  # key path of each level being walked

    def container(self, dir_fd: int, where: str, doc: Any, selection: dict[str, Any] | None,
                  path: tuple[str, ...], depth: int, parent_batch: tuple[int, ...]) -> Level:
        self.paths.append(path)
        try:
            return super().container(dir_fd, where, doc, selection, path, depth, parent_batch)
        finally:
            self.paths.pop()

    def child(self, dir_fd: int, where: str, key: str, selection: dict[str, Any] | None,
              path: tuple[str, ...], depth: int, batch: tuple[int, ...]) -> Any:
        try:
            return super().child(dir_fd, where, key, selection, path, depth, batch)
        except MemtreeError as err:
            self.on_problem(os.path.join(where, _encode(key)), path, err)
            return None

    def leaf(self, dir_fd: int, where: str, meta: str, key: str, entry: dict[str, Any],
             batch: tuple[int, ...]) -> Any:
        self.on_leaf()
        try:
            return super().leaf(dir_fd, where, meta, key, entry, batch)
        except MemtreeError as err:
            self.on_problem(os.path.join(where, _encode(key) + ".memmap"), self.paths[-1] + (key,), err)
            return None
