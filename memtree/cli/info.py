"""``memtree info SOURCE``: what a tree or checkpoint holds, from its metadata only.

SOURCE may be:

* a memtree directory, or a URL of one (``https://``, ``s3://``, any fsspec URL; the optional
  ``memtree[remote]`` extra), read through the storage seam (:mod:`memtree.store.reading.storage`) by
  the level walker (:mod:`memtree.store.reading.walk`): every ``meta.json`` validated by the same
  parser as ``load_memmap``, no leaf file opened, no torch imported (``memtree info DIR`` answers
  in well under a second);
* a directory written by tensordict's ``memmap`` (which ``load_memmap`` reads too);
* a checkpoint root of :class:`memtree.Checkpointer` (sub-directories named by decimal step
  numbers, each a memtree tree): its steps by the one rule of :mod:`memtree.store.reading.steps` (the
  rule of ``Checkpointer.steps()``), their sizes, which is the latest, and the entries named like
  steps that are not (ignored, with the reason);
* a ``torch.save`` file, a ``.safetensors`` file, a shard index
  (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) or a Hugging Face model
  directory, read by :func:`memtree.interop.open_checkpoint`: a safetensors header is parsed
  with its limits, a ``torch.save`` pickle only by memtree's guarded reader (nothing outside
  tensors and plain data is ever built: a pickle asking for more is refused, never run).

An encrypted tree is marked as such (its structure is plain JSON unless its names are sealed;
then what is hidden is said, and the files on disk are counted, instead of an empty tree).
Prints a tree of keys with dtypes, shapes and sizes, then totals; ``--json`` prints the same as
one JSON object (schema in ``docs/guide/cli.md``).

Example:
    $ memtree info ckpt
    ckpt: memtree format v2, batch_size []
    ├── weight   float32  [1024, 1024]  4.0 MiB
    └── opt/
        └── step   int64  []              8 B
    2 tensors (4.0 MiB) in 2 levels
    $ memtree info ckpt --json | jq '.entries[] | select(.kind == "tensor") | .nbytes'
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import MemtreeError, NotAMemtreeError
from ..format.names import META_NAME, is_step_name
from ..format.schema import FORMAT, TREE_TYPE, ChildMeta, JsonMeta, LeafMeta, LevelMeta, level_version, parse_level
from ..format.subclass import SubclassMeta
from ..store.reading.steps import list_steps
from ..store.reading.storage import LocalStorage, Storage, is_url, local_path
from ..store.reading.walk import WalkedLevel, walk
from .du import disk_usage
from .output import EXIT_OK, add_json_flag, emit_json, emit_text, format_bytes, to_json

if TYPE_CHECKING:
    from ..format.level import Level

__all__ = ["NAME", "HELP", "add_arguments", "run", "describe", "describe_root", "render_text",
           "render_root"]

NAME = "info"
HELP = (
    "show the keys, dtypes, shapes and sizes of a memtree directory or URL, a tensordict "
    "directory, a checkpoint root, a torch.save / .safetensors file or a Hugging Face model "
    "(reads metadata only, never runs a pickle)"
)

_VALUE_WIDTH = 48
_KEY_WIDTH = 60
#: Concurrent meta.json reads for a URL (one round trip per generation of levels).
_REMOTE_THREADS = 8


@dataclass
class _Totals:
    tensors: int = 0
    nbytes: int = 0
    levels: int = 0
    json_values: int = 0
    python_values: int = 0  # a torch.save file's non-JSON values (a set, a torch.device...)
    pickled_values: int = 0
    checksummed: int = 0
    dtypes: dict[str, list[int]] = field(default_factory=dict)  # name -> [leaves, bytes]

    def as_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "levels": self.levels,
            "json_values": self.json_values,
            "python_values": self.python_values,
            "pickled_values": self.pickled_values,
            "checksummed": self.checksummed,
            "dtypes": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(self.dtypes.items())},
        }

    def tensor(self, dtype: str, nbytes: int, checksum: object) -> None:
        self.tensors += 1
        self.nbytes += nbytes
        self.checksummed += checksum is not None
        per = self.dtypes.setdefault(dtype, [0, 0])
        per[0] += 1
        per[1] += nbytes


def _entries(levels: dict[tuple[str, ...], WalkedLevel], dirs: tuple[str, ...], path: list[str],
             rel: str, entries: list[dict[str, Any]], totals: _Totals) -> None:
    meta = levels[dirs].meta
    totals.levels += 1
    for e in meta.entries:
        item: dict[str, Any] = {"key": path + [e.key]}
        entries.append(item)
        if isinstance(e, LeafMeta):
            item.update(kind="tensor", dtype=e.dtype_name, shape=list(e.shape), nbytes=e.nbytes,
                        file=rel + e.file if e.pack is None else e.pack, checksum=e.checksum)
            if e.pack is not None:  # a packed leaf: its range of a pack at the root
                item.update(offset=e.offset)
            if e.capacity is not None:  # a growable leaf: its file holds `capacity` rows
                item.update(capacity=e.capacity, file_nbytes=e.file_nbytes)
            if e.chunks is not None:  # per-chunk checksums (format version 3)
                item.update(chunks={"algorithm": e.chunks.algorithm, "chunk_bytes": e.chunks.chunk_bytes,
                                    "count": e.chunks.count})
            totals.tensor(e.dtype_name, e.nbytes, e.checksum or e.chunks)
        elif isinstance(e, SubclassMeta):  # a tensor subclass: its class, then its inner tensors
            sub = e.subclass
            item.update(kind="subclass", type=sub.type, dtype=sub.dtype_name, shape=list(sub.shape),
                        dir=rel + e.dir + "/")
            _entries(levels, dirs + (e.dir,), path + [e.key], rel + e.dir + "/", entries, totals)
        elif isinstance(e, ChildMeta):
            child = levels[dirs + (e.dir,)].meta
            item.update(kind="tree", dir=rel + e.dir + "/", batch_size=list(child.batch_size),
                        type=child.type)
            _entries(levels, dirs + (e.dir,), path + [e.key], rel + e.dir + "/", entries, totals)
        elif isinstance(e, JsonMeta):
            item.update(kind="json", value=e.value)
            totals.json_values += 1
        else:
            item.update(kind="pickle", file=rel + e.file)
            totals.pickled_values += 1


def _describe_storage(storage: Storage, path: str, pool: ThreadPoolExecutor | None = None,
                      data: bytes | None = None) -> dict[str, Any]:
    """Every level through the walker; ``data``: the root ``meta.json``, if already read."""
    data = storage.read_meta("") if data is None else data
    root: LevelMeta = parse_level(data, storage.describe(META_NAME))
    levels = {lvl.dirs: lvl for lvl in walk(storage, pool=pool, root=root)}
    # the root's version (parse_level accepted it), or 3 where a level holds what version 3 added
    version = max([orjson.loads(data)["version"]] + [level_version(lvl.meta, 0) for lvl in levels.values()])
    entries: list[dict[str, Any]] = []
    totals = _Totals()
    _entries(levels, (), [], "", entries, totals)
    return {"kind": "memtree", "path": path, "format": FORMAT, "version": version, "type": root.type,
            "batch_size": list(root.batch_size), "save_id": root.save_id,
            "encryption": _encryption(root, storage), "totals": totals.as_dict(), "entries": entries,
            "packs": [{"file": p.file, "nbytes": p.nbytes} for p in root.packs]}


def _encryption(root: LevelMeta, storage: Storage) -> dict[str, Any] | None:
    """What ``info`` can say of an encrypted tree without its key (``None``: not encrypted).
    With sealed names no level shows an entry: the files on disk are counted instead (local
    trees; ``None`` for a URL)."""
    enc = root.encryption
    if enc is None:
        return None
    hidden = None
    if enc.names and isinstance(storage, LocalStorage):
        usage = disk_usage(storage.root)
        hidden = {"files": usage.files, "bytes": usage.apparent_bytes}
    return {"algorithm": enc.algorithm, "chunk_bytes": enc.chunk_bytes, "names_sealed": enc.names,
            "hidden": hidden}


def _walk_level(level: Level, path: list[str], entries: list[dict[str, Any]], totals: _Totals) -> None:
    """The same walk over a structure-only ``Level`` (tensordict directories: no file names)."""
    import torch

    from ..format.dtypes import dtype_name
    from ..format.level import Level
    from ..format.values import NonTensor

    totals.levels += 1
    for key, value in level.entries.items():
        item: dict[str, Any] = {"key": path + [key]}
        entries.append(item)
        if isinstance(value, Level):
            item.update(kind="tree", dir=None, batch_size=list(value.batch_size), type=value.type)
            _walk_level(value, path + [key], entries, totals)
        elif isinstance(value, torch.Tensor):
            dtype = dtype_name(value.dtype)
            nbytes = value.numel() * value.element_size()
            item.update(kind="tensor", dtype=dtype, shape=list(value.shape), nbytes=nbytes,
                        file=None, checksum=None)
            totals.tensor(dtype, nbytes, None)
        else:
            item.update(kind="json", value=value.data if isinstance(value, NonTensor) else value)
            totals.json_values += 1


def _describe_tensordict(root: str) -> dict[str, Any]:
    from ..store.foreign.tensordict import read_tensordict_dir

    level = read_tensordict_dir(root, device="meta")
    entries: list[dict[str, Any]] = []
    totals = _Totals()
    _walk_level(level, [], entries, totals)
    return {"kind": "tensordict", "path": root, "format": "tensordict", "version": None,
            "type": level.type, "batch_size": list(level.batch_size), "save_id": None,
            "encryption": None, "totals": totals.as_dict(), "entries": entries}


def _describe_checkpoint(path: str, allow_pickle: bool) -> dict[str, Any]:
    """A torch.save / safetensors file, a shard index or a model directory: flat dotted keys."""
    from ..format.dtypes import dtype_name
    from ..format.values import json_problem
    from ..interop.checkpoint import open_checkpoint

    entries: list[dict[str, Any]] = []
    totals = _Totals()
    totals.levels = 1
    with open_checkpoint(path, allow_pickle=allow_pickle) as ckpt:
        for key in ckpt:
            shape, dtype = ckpt.tensor_spec(key)
            name = dtype_name(dtype)
            nbytes = shape.numel() * dtype.itemsize
            entries.append({"key": [key], "kind": "tensor", "dtype": name, "shape": list(shape),
                            "nbytes": nbytes, "file": None, "checksum": None})
            totals.tensor(name, nbytes, None)
        for key, value in ckpt.non_tensors.items():
            if json_problem(value) is None:
                entries.append({"key": [key], "kind": "json", "value": value})
                totals.json_values += 1
            else:  # a set, a torch.device...: labelled by its type, shown by its repr
                entries.append({"key": [key], "kind": "value", "type": _type_name(value), "value": repr(value)})
                totals.python_values += 1
        files = [os.path.relpath(f, os.path.dirname(ckpt.path)) for f in ckpt.files]
        return {"kind": "checkpoint", "path": ckpt.path, "format": ckpt.format, "version": None,
                "type": TREE_TYPE, "batch_size": [], "save_id": None, "encryption": None, "files": files,
                "metadata": ckpt.metadata, "totals": totals.as_dict(), "entries": entries}


def _type_name(value: object) -> str:
    """``set``, ``torch.device``: a value's type as its module spells it (builtins bare)."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def describe(
    source: str | os.PathLike[str],
    *,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Describe a tree or checkpoint from its metadata (no tensor data is read).

    Args:
        source: a memtree directory or URL, a tensordict directory, a checkpoint root, a
            ``torch.save``/``.safetensors`` file, a shard index or a Hugging Face model directory
            (see the module docstring).
        allow_pickle: ``torch.save`` files only: let the pickle build objects outside memtree's
            safe allowlist. Only for files you trust; ``memtree info`` never sets it.
        storage_options: URLs only: passed to fsspec (credentials, endpoint...).
        timeout: URLs only: seconds one request may take (default: the remote reader's).

    Returns:
        A JSON-ready dict. Every kind has ``kind`` (``"memtree"``, ``"tensordict"``,
        ``"checkpoint"``, ``"checkpoint-root"``) and ``path``. A checkpoint root: see
        :func:`describe_root`. The others: ``format`` (``"memtree"``, ``"tensordict"``,
        ``"torch"``, ``"safetensors"``), ``version`` (memtree's format version, else ``None``),
        ``type``, ``batch_size``, ``save_id``, ``totals`` (``tensors``, ``bytes``, ``levels``,
        ``json_values``, ``python_values``, ``pickled_values``, ``checksummed``, ``dtypes``: name ->
        ``{"tensors", "bytes"}``) and ``entries``: every key depth-first, each with ``key`` (the
        list of keys from the root), ``kind`` (``tensor``/``tree``/``subclass``/``json``/
        ``value``/``pickle``) and per kind ``dtype``, ``shape``, ``nbytes``, ``file``, ``checksum`` (and
        for a growable leaf ``capacity``, the rows its file holds, and ``file_nbytes``; for
        per-chunk checksums ``chunks``: ``algorithm``, ``chunk_bytes``, ``count``) / ``dir``,
        ``batch_size``, ``type`` / ``type`` (the class's registered name), ``dtype``, ``shape``,
        ``dir``, its inner tensors following as the entries below its key / ``value`` /
        ``type`` (e.g. ``set``, ``torch.device``) and ``value`` (its ``repr``) / ``file``
        (paths relative to ``path``; ``None`` where the format has no such file). A checkpoint (``kind == "checkpoint"``) lists its dotted keys flat and adds
        ``files`` (its files, relative to the directory of ``path``) and ``metadata`` (a
        safetensors header's ``__metadata__``).

    Raises:
        MemtreeError: the source is missing, is none of the above, is an uncommitted staging
            directory, or its metadata is damaged or hostile (a pickle that asks for more than
            tensors and plain data is refused, never run).

    Example:
        >>> import tempfile, torch, memtree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = memtree.TensorTree({"w": torch.zeros(2, 3), "sub": {"n": 1}}).memmap(d)
        >>> info = describe(d)
        >>> info["kind"], info["totals"]["bytes"], [e["key"] for e in info["entries"]]
        ('memtree', 24, [['w'], ['sub'], ['sub', 'n']])
    """
    source = local_path(source)  # file:///path is the local path
    if is_url(source):
        from ..store.urls.fsspec_storage import DEFAULT_TIMEOUT, FsspecStorage

        url = str(source)
        remote = FsspecStorage(url, storage_options=storage_options,
                               timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
        with ThreadPoolExecutor(_REMOTE_THREADS) as pool:
            return _describe_storage(remote, url, pool)
    if storage_options is not None or timeout is not None:
        from ..errors import InvalidArgumentError

        raise InvalidArgumentError(f"storage_options and timeout are for URLs only, got the path {source!r}")
    path = os.path.abspath(os.fspath(source))
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise NotAMemtreeError(f"{path} does not exist; check the path") from None
    except OSError as err:
        from ..store.primitives.files import storage_error

        raise storage_error(err, f"reading {path}") from err
    if not stat.S_ISDIR(mode):  # a checkpoint file or a shard index
        return _describe_checkpoint(path, allow_pickle)
    with LocalStorage(path) as storage:  # refuses a staging directory
        try:
            data = storage.read_meta("")
        except NotAMemtreeError:  # no meta.json: a checkpoint root, a model directory?
            if any(is_step_name(n) for n in os.listdir(path)):
                return describe_root(path)
            from ..interop.sharded import find_checkpoint

            if find_checkpoint(path) is not None:
                return _describe_checkpoint(path, allow_pickle)
            raise
        if not data.startswith(b'{"format":"memtree"'):  # tensordict's, or something else
            from ..store.foreign.tensordict import is_tensordict_dir

            if is_tensordict_dir(path):
                return _describe_tensordict(path)
        return _describe_storage(storage, storage.root, data=data)


def describe_root(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a checkpoint root: its steps (by the rule of :mod:`memtree.store.reading.steps`, which
    ``Checkpointer.steps()`` applies: a directory, not a link, named by its decimal step, whose
    root ``meta.json`` parses), their sizes, and the latest one. Staging directories and lock
    files are left out; entries named like steps that are not steps are listed as ignored.

    Returns:
        ``{"kind": "checkpoint-root", "path", "latest", "disk", "steps": [...], "ignored":
        [...]}``: ``steps`` in increasing order, each ``{"step", "path", "ok", "tensors",
        "bytes", "save_id", "error", "disk"}`` (``ok`` is False and ``error`` says why when a
        deeper ``meta.json`` of the step cannot be read or is damaged: ``restore`` of it would
        raise; the sizes are then ``None``); ``latest`` is the highest step, as
        ``Checkpointer.latest()`` (``None`` if there is none); a step whose names are encrypted
        has ``"sealed": True`` and sizes ``None`` (hidden, not empty). ``ignored``: each
        ``{"name", "reason"}`` named like a step but not one (no ``meta.json``, a damaged one, a
        link, a FIFO...). ``disk`` is what ``memtree du`` counts (:mod:`memtree.cli.du`): for the
        root ``apparent_bytes``, ``allocated_bytes`` and ``linked_bytes`` (what hard links
        between steps save), for a step ``apparent_bytes``, ``allocated_bytes``, ``shared_bytes``
        (of files another step names too) and ``exclusive_bytes`` (about what deleting the step
        frees); ``None`` where no tree is.

    Raises:
        NotAMemtreeError: ``root`` does not exist or is not a directory.

    Example:
        >>> import os, tempfile, torch, memtree
        >>> root = tempfile.mkdtemp()
        >>> for step in (100, 200):
        ...     _ = memtree.TensorTree({"w": torch.zeros(step)}).memmap(os.path.join(root, str(step)))
        >>> os.mkdir(os.path.join(root, "300"))   # no meta.json: not a step
        >>> info = describe_root(root)
        >>> info["latest"], [(s["step"], s["bytes"]) for s in info["steps"]], [i["name"] for i in info["ignored"]]
        (200, [(100, 400), (200, 800)], ['300'])
    """
    path = os.path.abspath(os.fspath(root))
    listing = list_steps(path)
    steps: list[dict[str, Any]] = []
    for step in listing.steps:
        where = os.path.join(path, str(step))
        item: dict[str, Any] = {"step": step, "path": where, "ok": False, "tensors": None,
                                "bytes": None, "save_id": None, "error": None}
        try:
            with LocalStorage(where) as storage:
                tree = _describe_storage(storage, where)
        except MemtreeError as err:
            item["error"] = str(err)
        else:
            item.update(ok=True, tensors=tree["totals"]["tensors"], bytes=tree["totals"]["bytes"],
                        save_id=tree["save_id"])
            if tree["encryption"] is not None and tree["encryption"]["names_sealed"]:
                item.update(tensors=None, bytes=None, error=None, sealed=True)  # hidden, not empty
        steps.append(item)
    ignored = [{"name": n, "reason": r} for n, r in sorted(listing.ignored.items(), key=lambda i: int(i[0]))]
    latest = steps[-1]["step"] if steps else None
    disk = _root_disk(path, steps)
    return {"kind": "checkpoint-root", "path": path, "latest": latest, "disk": disk, "steps": steps,
            "ignored": ignored}


def _root_disk(path: str, steps: list[dict[str, Any]]) -> dict[str, int] | None:
    """The root's disk use (:func:`memtree.cli.du.disk_usage`): its totals, and each step's
    ``disk`` entry; ``None`` when no step holds a tree."""
    try:
        usage = disk_usage(path)
    except NotAMemtreeError:
        return None
    by_name = {u.name: u for u in usage.steps}
    for item in steps:
        u = by_name.get(str(item["step"]))
        item["disk"] = None if u is None else {
            "apparent_bytes": u.apparent_bytes, "allocated_bytes": u.allocated_bytes,
            "shared_bytes": u.shared_bytes, "exclusive_bytes": u.exclusive_bytes}
    return {"apparent_bytes": usage.apparent_bytes, "allocated_bytes": usage.allocated_bytes,
            "linked_bytes": usage.linked_bytes}


def _shown_key(key: str) -> str:
    text = key if key.isprintable() else repr(key)
    return text if len(text) <= _KEY_WIDTH else text[: _KEY_WIDTH - 1] + "…"


def _glyphs() -> tuple[str, str, str, str]:
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        "├└│…".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return "|-- ", "`-- ", "|   ", "    "
    return "├── ", "└── ", "│   ", "    "


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def render_text(info: dict[str, Any], *, max_depth: int | None = None, label: str | None = None) -> str:
    """Render :func:`describe`'s result as an aligned tree with totals.

    Args:
        info: the result of :func:`describe`.
        max_depth: show keys down to this depth (1: the root's keys only); deeper levels are
            summarised on their sub-tree's line. ``None`` shows everything.
        label: how to name the directory on the first line (default: its path).
    """
    tee, last, pipe, blank = _glyphs()
    entries = info["entries"]
    # For each entry: is it the last of its level? (look ahead for a sibling with the same parent)
    is_last = [True] * len(entries)
    next_sibling: dict[tuple[str, ...], int] = {}
    for i in range(len(entries) - 1, -1, -1):
        parent = tuple(entries[i]["key"][:-1])
        is_last[i] = parent not in next_sibling
        next_sibling[parent] = i
    # Sub-tree summaries (for lines of collapsed sub-trees).
    below: dict[tuple[str, ...], list[int]] = {}
    for e in entries:
        if e["kind"] == "tensor":
            key = e["key"]
            for d in range(1, len(key)):
                agg = below.setdefault(tuple(key[:d]), [0, 0])
                agg[0] += 1
                agg[1] += e["nbytes"]

    rows: list[tuple[str, str, str, str]] = []
    stems: list[str] = []  # the indentation prefix for each depth
    for i, e in enumerate(entries):
        depth = len(e["key"])
        if max_depth is not None and depth > max_depth:
            continue
        del stems[depth - 1:]
        branch = "".join(stems) + (last if is_last[i] else tee)
        stems.append(blank if is_last[i] else pipe)
        name = branch + _shown_key(e["key"][-1])
        kind = e["kind"]
        if kind == "tensor":
            size = format_bytes(e["nbytes"])
            if e.get("capacity") is not None:
                size += f"  (file: {e['capacity']:,} rows, {format_bytes(e['file_nbytes'])})"
            rows.append((name, e["dtype"], str(e["shape"]), size))
        elif kind == "subclass":
            n, nbytes = below.get(tuple(e["key"]), [0, 0])
            rows.append((name + "/", e["type"], f"{e['dtype']}{e['shape']}", f"{_plural(n, 'inner tensor')}, {format_bytes(nbytes)}"))
        elif kind == "tree":
            n, nbytes = below.get(tuple(e["key"]), [0, 0])
            collapsed = max_depth is not None and depth >= max_depth
            note = f"{'… ' if collapsed else ''}{_plural(n, 'tensor')}, {format_bytes(nbytes)}"
            typed = f" {e['type']}" if e["type"] != TREE_TYPE else ""
            rows.append((name + "/", "", f"batch_size {e['batch_size']}{typed}", note))
        elif kind in ("json", "value"):
            value = to_json(e["value"]) if kind == "json" else e["value"]
            if len(value) > _VALUE_WIDTH:
                value = value[: _VALUE_WIDTH - 1] + "…"
            rows.append((name, "json" if kind == "json" else e["type"], value, ""))
        else:
            rows.append((name, "pickle", e["file"] + " (not unpickled)", ""))

    # Column widths come from the tensor rows; other rows put free text in the last columns.
    widths = [max((len(r[0]) for r in rows), default=0)] + [
        max((len(r[c]) for r in rows if r[3] and r[1]), default=0) for c in (1, 2)
    ]
    t = info["totals"]
    head = label if label is not None else info["path"]
    enc = info.get("encryption")
    if info["kind"] == "checkpoint":
        shards = len(info["files"])
        what = (f"{'torch.save' if info['format'] == 'torch' else info['format']} checkpoint"
                + (f" in {shards} files" if shards > 1 else "") + " (dotted keys, flat)")
        out = [f"{head}: {what}"]
    else:
        what = (f"memtree format v{info['version']}" if info["format"] == FORMAT
                else f"{info['format']} directory (read-only, no file names)")
        out = [f"{head}: {what}, batch_size {info['batch_size']}"
               + (f", type {info['type']}" if info["type"] != TREE_TYPE else "")
               + (f", save_id {info['save_id']}" if info["save_id"] else "")
               + (f", encrypted ({enc['algorithm']}{', names sealed' if enc['names_sealed'] else ''})"
                  if enc else "")]
    for name, kind, detail, size in rows:
        if kind and size:  # a tensor: aligned columns
            size, _, note = size.partition("  ")
            line = (f"{name.ljust(widths[0])}  {kind.ljust(widths[1])}  {detail.ljust(widths[2])}  "
                    f"{size.rjust(9)}  {note}")
        else:
            line = f"{name.ljust(widths[0])}  {kind.ljust(widths[1])}  {detail}  {size}"
        out.append(line.rstrip())
    if enc and enc["names_sealed"]:  # no entry is visible: say what is hidden, not "0 tensors"
        hidden = enc["hidden"]
        out.append("names sealed: keys, dtypes, shapes and values are encrypted and shown only with the key"
                   + (f"; {_plural(hidden['files'], 'file')} ({format_bytes(hidden['bytes'])}) on disk"
                      if hidden else ""))
        return "\n".join(out)
    summary = f"{_plural(t['tensors'], 'tensor')} ({format_bytes(t['bytes'])}) in {_plural(t['levels'], 'level')}"
    extras = []
    if t["json_values"]:
        extras.append(_plural(t["json_values"], "JSON value"))
    if t["python_values"]:
        extras.append(_plural(t["python_values"], "Python value"))
    if t["pickled_values"]:
        extras.append(_plural(t["pickled_values"], "pickled value"))
    if t["checksummed"]:
        extras.append(f"{t['checksummed']:,} with checksums")
    if info.get("packs"):  # format version 3: small leaves share pack files
        packed = sum(1 for e in info["entries"] if e.get("offset") is not None)
        extras.append(f"{packed:,} packed in {_plural(len(info['packs']), 'pack')}")
    out.append(summary + (", " + ", ".join(extras) if extras else ""))
    if len(t["dtypes"]) > 1:
        out.append("by dtype: " + ", ".join(
            f"{name} {_plural(v['tensors'], 'tensor')} ({format_bytes(v['bytes'])})"
            for name, v in t["dtypes"].items()
        ))
    return "\n".join(out)


def render_root(info: dict[str, Any], *, label: str | None = None) -> str:
    """Render :func:`describe_root`'s result: one line per step, the latest marked, then one
    per ignored entry.

    Example:
        >>> print(render_root({"path": "ckpts", "latest": 200, "steps": [
        ...     {"step": 100, "ok": True, "tensors": 3, "bytes": 4096, "error": None},
        ...     {"step": 200, "ok": True, "tensors": 3, "bytes": 4096, "error": None}]}))
        ckpts: checkpoint root, 2 steps, latest 200
          step  tensors       size
           100        3    4.0 KiB
           200        3    4.0 KiB  (latest)
    """
    steps = info["steps"]
    head = label if label is not None else info["path"]
    latest = info["latest"]
    disk = info.get("disk")
    ignored = info.get("ignored") or []
    out = [f"{head}: checkpoint root, {_plural(len(steps), 'step')}, "
           + (f"latest {latest}" if latest is not None else "no step")
           + (f", {len(ignored)} ignored" if ignored else "")
           + (f"; {format_bytes(disk['allocated_bytes'])} on disk, {format_bytes(disk['linked_bytes'])} "
              "shared by hard links between steps" if disk else "")]
    ignored_lines = [f"  ignored {i['name']}: {i['reason']}" for i in ignored]
    if not steps:
        return "\n".join(out + ignored_lines)
    width = max(4, *(len(str(s["step"])) for s in steps))
    out.append(f"  {'step'.rjust(width)}  tensors       size" + ("     shared  exclusive" if disk else ""))
    for s in steps:
        if s["ok"]:
            if s.get("sealed"):
                out.append(f"  {str(s['step']).rjust(width)}  names sealed (encrypted)"
                           + ("  (latest)" if s["step"] == latest else ""))
                continue
            line = f"  {str(s['step']).rjust(width)}  {s['tensors']:>7,}  {format_bytes(s['bytes']):>9}"
            if disk and s.get("disk"):
                line += f"  {format_bytes(s['disk']['shared_bytes']):>9}  {format_bytes(s['disk']['exclusive_bytes']):>9}"
            out.append(line + ("  (latest)" if s["step"] == latest else ""))
        else:
            out.append(f"  {str(s['step']).rjust(width)}  damaged: {s['error']}"
                       + ("  (latest)" if s["step"] == latest else ""))
    return "\n".join(out + ignored_lines)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree info``."""
    parser.add_argument(
        "source", metavar="SOURCE",
        help="a memtree directory or URL, a tensordict directory, a checkpoint root, a torch.save "
             "or .safetensors file, a shard index (*.index.json) or a Hugging Face model directory",
    )
    add_json_flag(parser)
    parser.add_argument("--depth", type=_positive_int, metavar="N", default=None,
                        help="show keys down to depth N only (1: top level); deeper sub-trees are "
                             "summarised. Totals always cover the whole tree; ignored with --json")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", default=None,
                        help="URLs only: seconds one request may take (default 60)")


def run(args: argparse.Namespace) -> int:
    """Describe ``args.source`` on standard output; returns the exit code."""
    info = describe(args.source, timeout=args.timeout)
    if args.json:
        emit_json(info)
    elif info["kind"] == "checkpoint-root":
        emit_text(render_root(info, label=args.source))
    else:
        emit_text(render_text(info, max_depth=args.depth, label=args.source))
    return EXIT_OK
