"""Rank-aware reads of a tree at a URL (``load_memmap(url, mesh=...)``): ranged requests.

The tree is walked as :mod:`memtree.store.urls.remote` walks it (every ``meta.json`` validated, each
leaf ``stat`` ed and its size checked before anything is allocated). A leaf read as a
``DTensor`` is fetched as this rank's ranges only (close ranges in one request, the gap read
over only when it is at most a quarter of the next range); every other leaf is fetched whole.
A packed leaf (format version 3) is read from its pack at its offset, the same way. What a leaf records is checked: the chunks a rank's ranges touch with ``verify=True`` (all of
a plain leaf, always, as a remote load does), read whole and hashed. :data:`REQUESTS` requests
are in flight; a column shard is one request per row.

Example:
    >>> REQUESTS
    8
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..errors import InvalidArgumentError, PickleNotAllowedError
from ..format.dtypes import itemsize
from ..format.level import Level, fmt_key
from ..format.names import META_NAME
from .placement import box_runs, box_shape, split_runs
from ..format.schema import PickleMeta, parse_level
from ..store.reading.integrity import check_tree_hash
from ..store.primitives.chunk_check import read_ranges
from ..store.primitives.memory import byte_view
from ..store.reading.options import KeySelection, ReadOptions
from ..store.reading.ranges import SPAN_BYTES, read_runs
from ..store.urls.remote import (
    DEFAULT_NUM_THREADS,
    RemoteLeaf,
    build_level,
    check_size,
    final_checks,
    remote_leaves,
    tensor_id,
)
from ..store.reading.storage import Storage
from ..store.reading.walk import map_all, walk
from .dtensor import from_local, mesh_device
from .shards import OVER_READ, shard_box
from .targets import Target, Targets

__all__ = ["REQUESTS", "load_sharded_remote"]

#: Requests in flight at once.
REQUESTS = DEFAULT_NUM_THREADS


class _Part:
    """What one leaf's read fills: a tensor, from these ranges of the leaf's object."""

    def __init__(self, leaf: RemoteLeaf, target: Target | None, runs: list[tuple[int, int]], out: torch.Tensor) -> None:
        self.leaf, self.target, self.runs, self.out = leaf, target, runs, out


def _batches(part: _Part) -> Iterable[tuple[_Part, list[tuple[int, int]], memoryview]]:
    """``part``'s ranges cut into batches of about :data:`SPAN_BYTES`, each with its place in
    the output (the batches go to the pool one by one)."""
    view = byte_view(part.out)
    runs: list[tuple[int, int]] = []
    start = filled = 0
    for run in split_runs(iter(part.runs), SPAN_BYTES):
        runs.append(run)
        filled += run[1]
        if filled - start >= SPAN_BYTES:
            yield part, runs, view[start:filled]
            runs, start = [], filled
    if runs:
        yield part, runs, view[start:filled]


def load_sharded_remote(
    url: str,
    targets: Targets,
    *,
    verify: bool = False,
    keys: Iterable[KeySelection] | None = None,
    storage_options: Any = None,
) -> Level:
    """Load the tree at ``url`` with each leaf ``targets`` names as a ``DTensor`` holding this
    rank's shard, fetched as ranged requests (see the module docstring).

    Raises:
        InvalidArgumentError: an encrypted tree (decrypted from a local copy only).
        PickleNotAllowedError: the tree pickles a value.
        IntegrityError: a chunk (or a leaf) read differs from its recorded checksum.
        MemtreeError: as ``load_memmap(url)``: a missing, damaged or changed tree.
    """
    from ..store.urls.fsspec_storage import FsspecStorage

    options = ReadOptions.of(keys=keys, verify=verify)
    storage = FsspecStorage(url, storage_options=storage_options)
    try:
        root_info = storage.stat(META_NAME)
        root = parse_level(storage.read_meta(""), storage.describe(META_NAME), depth=0)
        if root.encryption is not None:
            raise InvalidArgumentError(
                f"{storage.describe('')}: encrypted trees load from a local directory only; remote "
                "trees are never decrypted"
            )
        with ThreadPoolExecutor(REQUESTS, thread_name_prefix="memtree-shards") as pool:
            if verify and root.tree_hash is not None:
                check_tree_hash(storage, root, pool=pool, after="uploaded",
                                fix="nothing was loaded (`memtree verify URL` lists every problem)")
            levels = list(walk(storage, selection=options.selection, pool=pool, root=root))
            for lvl in levels:
                for e in lvl.meta.entries:
                    if isinstance(e, PickleMeta):
                        raise PickleNotAllowedError(
                            f"non-tensor leaf {fmt_key(lvl.keys + (e.key,))} is pickled in "
                            f"{storage.describe(lvl.file(e.file))}; mesh= loads trees without pickles only"
                        )
            found = remote_leaves(levels, root)  # a packed leaf: its range of its pack
            leaves = [leaf for _, leaf in found]
            rels = list(dict.fromkeys(leaf.rel for leaf in leaves))  # a pack is stat'ed once
            infos = dict(zip(rels, map_all(pool, storage.stat, rels)))
            for leaf in leaves:
                leaf.info = infos[leaf.rel]
                check_size(storage, leaf)
            parts = [_plan(key, leaf, targets.resolve(key, leaf.meta)) for key, leaf in found]
            checked = [p for p in parts if p.leaf.meta.sums is not None and (verify or p.target is None)]
            unchecked = [p for p in parts if p.leaf.meta.sums is None or not (verify or p.target is None)]
            map_all(pool, lambda p: _read_checked(storage, p), checked)
            map_all(pool, lambda batch: _read_batch(storage, *batch), [b for p in unchecked for b in _batches(p)])
            final_checks(storage, pool, list({leaf.rel: leaf for leaf in leaves}.values()), root_info)
        tensors = {
            tensor_id(key, p.leaf.rel, p.leaf.meta): p.out if p.target is None else
            from_local(p.out.to(mesh_device(p.target.mesh)), p.target.mesh, p.target.placements, p.leaf.meta.shape)
            for (key, _), p in zip(found, parts)
        }
        level = build_level(storage, levels, tensors, {}, torch.device("cpu"))
    finally:
        storage.close()
    targets.check_used()
    return level


def _plan(key: tuple[str, ...], leaf: RemoteLeaf, target: Target | None) -> _Part:
    """What to read of ``leaf``: this rank's ranges (``target``), or all of it."""
    entry = leaf.meta
    if target is None:
        return _Part(leaf, None, [(0, entry.nbytes)] if entry.nbytes else [], torch.empty(entry.shape, dtype=entry.dtype))
    box = shard_box(target, entry.shape, f"leaf {fmt_key(key)}")
    runs = list(box_runs(entry.shape, itemsize(entry.dtype), box))
    return _Part(leaf, target, runs, torch.empty(box_shape(box), dtype=entry.dtype))


def _reader(storage: Storage, leaf: RemoteLeaf) -> Any:
    """Reads of ``leaf``'s bytes, from its first (at its offset in its pack, if packed)."""
    return lambda offset, view: storage.read_into(leaf.rel, leaf.offset + offset, view, leaf.info)


def _read_checked(storage: Storage, part: _Part) -> None:
    """Read ``part``'s ranges, checked against the leaf's chunk checksums (or its whole checksum)."""
    what = f"leaf {part.leaf.label} at {storage.describe(part.leaf.rel)}"
    read_ranges(_reader(storage, part.leaf), part.leaf.meta, part.runs, byte_view(part.out), what)


def _read_batch(storage: Storage, part: _Part, runs: list[tuple[int, int]], out: memoryview) -> None:
    read_runs(_reader(storage, part.leaf), runs, out, OVER_READ)
