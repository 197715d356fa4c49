"""``memtree info DIR``: what a memtree directory holds, from its ``meta.json`` files only.

Also describes directories written by tensordict's ``memmap`` (which ``load_memmap`` reads).

Prints a tree of keys with dtypes, shapes and sizes, then totals and the format version. Leaf
files are never opened (use ``memtree verify`` to check them), pickled values are never
unpickled, and every ``meta.json`` is validated by the same parser as ``load_memmap``.

Example:
    $ memtree info ckpt
    ckpt: memtree format v1, batch_size []
    ├── weight   float32  [1024, 1024]  4.0 MiB
    └── opt/
        └── step   int64  []              8 B
    2 tensors (4.0 MiB) in 2 levels
    $ memtree info ckpt --json | jq '.entries[] | select(.kind == "tensor") | .nbytes'
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from ..format.dtypes import dtype_name
from ..format.schema import FORMAT, TREE_TYPE, VERSION, ChildMeta, JsonMeta, LeafMeta, LevelMeta
from ..store.tensordict import is_tensordict_dir, read_tensordict_dir
from ..format.level import Level
from ..format.values import NonTensor
from ..errors import NotCommittedError
from ..store.read import open_dir, read_meta
from ..format.names import is_uncommitted_name

__all__ = ["NAME", "HELP", "add_arguments", "run", "describe", "render_text", "format_bytes"]

NAME = "info"
HELP = "show the keys, dtypes, shapes and sizes of a memtree directory (reads meta.json only)"

_VALUE_WIDTH = 48
_KEY_WIDTH = 60


def format_bytes(n: int) -> str:
    """Human-readable size in binary units.

    Example:
        >>> format_bytes(48), format_bytes(4 * 2**20), format_bytes(1536)
        ('48 B', '4.0 MiB', '1.5 KiB')
    """
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:,.1f} {unit}"


@dataclass
class _Totals:
    tensors: int = 0
    nbytes: int = 0
    levels: int = 0
    json_values: int = 0
    pickled_values: int = 0
    checksummed: int = 0
    dtypes: dict[str, list[int]] = field(default_factory=dict)  # name -> [leaves, bytes]

    def tensor(self, dtype: str, nbytes: int, checksum: str | None) -> None:
        self.tensors += 1
        self.nbytes += nbytes
        self.checksummed += checksum is not None
        per = self.dtypes.setdefault(dtype, [0, 0])
        per[0] += 1
        per[1] += nbytes


def _walk(dir_fd: int, where: str, rel: str, path: list[str], depth: int,
          entries: list[dict[str, Any]], totals: _Totals) -> LevelMeta:
    meta = read_meta(dir_fd, where, depth=depth, root=depth == 0)
    totals.levels += 1
    for e in meta.entries:
        item: dict[str, Any] = {"key": path + [e.key]}
        if isinstance(e, LeafMeta):
            dtype = dtype_name(e.dtype)
            item.update(kind="tensor", dtype=dtype, shape=list(e.shape), nbytes=e.nbytes,
                        file=rel + e.file, checksum=e.checksum)
            if e.capacity is not None:  # a growable leaf: its file holds `capacity` rows
                item.update(capacity=e.capacity, file_nbytes=e.file_nbytes)
            totals.tensor(dtype, e.nbytes, e.checksum)
            entries.append(item)
        elif isinstance(e, ChildMeta):
            item.update(kind="tree", dir=rel + e.dir + "/")
            entries.append(item)
            child_fd = open_dir(e.dir, os.path.join(where, e.dir), dir_fd)
            try:
                child = _walk(child_fd, os.path.join(where, e.dir), rel + e.dir + "/",
                              path + [e.key], depth + 1, entries, totals)
            finally:
                os.close(child_fd)
            item.update(batch_size=list(child.batch_size), type=child.type)
        elif isinstance(e, JsonMeta):
            item.update(kind="json", value=e.value)
            totals.json_values += 1
            entries.append(item)
        else:
            item.update(kind="pickle", file=rel + e.file)
            totals.pickled_values += 1
            entries.append(item)
    return meta


def _walk_level(level: Level, path: list[str], entries: list[dict[str, Any]], totals: _Totals) -> None:
    """The same walk over a structure-only ``Level`` (tensordict directories: no file names)."""
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


def describe(prefix: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a memtree directory from its ``meta.json`` files (no leaf file is opened).

    Returns:
        A JSON-ready dict: ``path``, ``format``, ``version``, ``type``, ``batch_size``,
        ``save_id``, ``totals`` (``tensors``, ``bytes``, ``levels``, ``json_values``,
        ``pickled_values``, ``checksummed``, ``dtypes``: name -> ``{"tensors", "bytes"}``) and
        ``entries``: every key depth-first, each with ``key`` (the list of keys from the root),
        ``kind`` (``tensor``/``tree``/``json``/``pickle``) and per kind ``dtype``, ``shape``,
        ``nbytes``, ``file``, ``checksum`` (and for a growable leaf ``capacity``, the rows its
        file holds, and ``file_nbytes``) / ``dir``, ``batch_size``, ``type`` (``"TensorTree"``
        or a ``@tensorclass`` name) / ``value`` / ``file`` (paths relative to ``path``). A directory written by tensordict's ``memmap`` (which
        ``load_memmap`` also reads) is described with ``format`` ``"tensordict"``, ``version``
        ``None`` and ``file``/``dir`` ``None``.

    Raises:
        MemtreeError: the directory is missing, is not a memtree, is an uncommitted staging
            directory, or a ``meta.json`` is damaged.

    Example:
        >>> import tempfile, torch, memtree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = memtree.TensorTree({"w": torch.zeros(2, 3), "sub": {"n": 1}}).memmap(d)
        >>> info = describe(d)
        >>> info["totals"]["bytes"], [e["key"] for e in info["entries"]]
        (24, [['w'], ['sub'], ['sub', 'n']])
    """
    root = os.path.abspath(os.fspath(prefix))
    if is_uncommitted_name(os.path.basename(os.path.realpath(root))):
        raise NotCommittedError(
            f"{root} is the staging directory (or old copy) of a write that never finished, not "
            "a committed tree; memtree.recover() on its parent directory restores or deletes it"
        )
    entries: list[dict[str, Any]] = []
    totals = _Totals()
    if is_tensordict_dir(root):  # what load_memmap reads too (read-only compatibility)
        level = read_tensordict_dir(root, device="meta")
        _walk_level(level, [], entries, totals)
        head: dict[str, Any] = {"format": "tensordict", "version": None, "type": level.type,
                                "batch_size": list(level.batch_size), "save_id": None}
    else:
        fd = open_dir(root, root, None)
        try:
            meta = _walk(fd, root, "", [], 0, entries, totals)
        finally:
            os.close(fd)
        head = {"format": FORMAT, "version": VERSION, "type": meta.type,
                "batch_size": list(meta.batch_size), "save_id": meta.save_id}
    return {
        "path": root,
        **head,
        "totals": {
            "tensors": totals.tensors,
            "bytes": totals.nbytes,
            "levels": totals.levels,
            "json_values": totals.json_values,
            "pickled_values": totals.pickled_values,
            "checksummed": totals.checksummed,
            "dtypes": {k: {"tensors": v[0], "bytes": v[1]} for k, v in sorted(totals.dtypes.items())},
        },
        "entries": entries,
    }


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
        elif kind == "tree":
            n, nbytes = below.get(tuple(e["key"]), [0, 0])
            collapsed = max_depth is not None and depth >= max_depth
            note = f"{'… ' if collapsed else ''}{_plural(n, 'tensor')}, {format_bytes(nbytes)}"
            typed = f" {e['type']}" if e["type"] != TREE_TYPE else ""
            rows.append((name + "/", "", f"batch_size {e['batch_size']}{typed}", note))
        elif kind == "json":
            value = orjson.dumps(e["value"]).decode()
            if len(value) > _VALUE_WIDTH:
                value = value[: _VALUE_WIDTH - 1] + "…"
            rows.append((name, "json", value, ""))
        else:
            rows.append((name, "pickle", e["file"] + " (not unpickled)", ""))

    # Column widths come from the tensor rows; other rows put free text in the last columns.
    widths = [max((len(r[0]) for r in rows), default=0)] + [
        max((len(r[c]) for r in rows if r[3] and r[1]), default=0) for c in (1, 2)
    ]
    t = info["totals"]
    head = label if label is not None else info["path"]
    what = (f"memtree format v{info['version']}" if info["format"] == FORMAT
            else f"{info['format']} directory (read-only, no file names)")
    out = [f"{head}: {what}, batch_size {info['batch_size']}"
           + (f", type {info['type']}" if info["type"] != TREE_TYPE else "")
           + (f", save_id {info['save_id']}" if info["save_id"] else "")]
    for name, kind, detail, size in rows:
        if kind and size:  # a tensor: aligned columns
            size, _, note = size.partition("  ")
            line = (f"{name.ljust(widths[0])}  {kind.ljust(widths[1])}  {detail.ljust(widths[2])}  "
                    f"{size.rjust(9)}  {note}")
        else:
            line = f"{name.ljust(widths[0])}  {kind.ljust(widths[1])}  {detail}  {size}"
        out.append(line.rstrip())
    summary = f"{_plural(t['tensors'], 'tensor')} ({format_bytes(t['bytes'])}) in {_plural(t['levels'], 'level')}"
    extras = []
    if t["json_values"]:
        extras.append(_plural(t["json_values"], "JSON value"))
    if t["pickled_values"]:
        extras.append(_plural(t["pickled_values"], "pickled value"))
    if t["checksummed"]:
        extras.append(f"{t['checksummed']:,} with checksums")
    out.append(summary + (", " + ", ".join(extras) if extras else ""))
    if len(t["dtypes"]) > 1:
        out.append("by dtype: " + ", ".join(
            f"{name} {_plural(v['tensors'], 'tensor')} ({format_bytes(v['bytes'])})"
            for name, v in t["dtypes"].items()
        ))
    return "\n".join(out)


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
    parser.add_argument("dir", metavar="DIR", help="a memtree directory (written by memmap)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (every key, totals, format version) for scripts")
    parser.add_argument("--depth", type=_positive_int, metavar="N", default=None,
                        help="show keys down to depth N only (1: top level); deeper sub-trees are "
                             "summarised. Totals always cover the whole tree; ignored with --json")


def run(args: argparse.Namespace) -> int:
    """Describe ``args.dir`` on standard output; returns the exit code."""
    info = describe(args.dir)
    if args.json:
        text = orjson.dumps(info, option=orjson.OPT_INDENT_2).decode()
    else:
        text = render_text(info, max_depth=args.depth, label=args.dir)
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):  # e.g. an ASCII-only terminal
        text = text.replace("…", "...").encode(encoding, "backslashreplace").decode(encoding)
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `memtree info big | head`: the reader has gone; that is fine
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0
