"""Remote trees: load from and upload to any fsspec URL (``s3://``, ``https://``, ``memory://``...).

Optional extra: ``pip install 'memtree[remote]'`` (fsspec, aiohttp; s3fs for ``s3://``).

A remote tree is read through the storage seam (:class:`~memtree.store.reading.storage.FsspecStorage`)
and the level walker (:func:`~memtree.store.reading.walk.walk`), exactly as any reader reads a tree.
What :func:`load` (``memtree.load_memmap("s3://bucket/tree", ...)``) does:

1. ``stat`` the root ``meta.json`` (its identity, the ETag or version, is kept), read it (at
   most 16 MiB, enforced while it streams), then every ``meta.json`` on the path to the selected
   keys, breadth first and concurrently, each validated by
   :func:`memtree.format.schema.parse_level` as the local loader does;
2. ``stat`` each selected leaf (concurrently): each must exist and hold exactly the bytes its
   ``meta.json`` entry promises (:class:`~memtree.errors.LeafSizeError`) **before** any leaf
   byte is read and any memory or disk is allocated (a cache entry also checks free space).
   The stat also pins the leaf: its ranges carry ``If-Match`` (HTTP, strong ETags) or the
   version id (versioned S3); otherwise its identity is compared after the read;
3. fetch each leaf as byte ranges of ``chunk_bytes``, ``num_threads`` requests at a time, each
   with a deadline of ``timeout`` seconds. Every answer must hold exactly the bytes asked: a
   short body, a dropped connection or a 5xx is retried (``retries``, exponential backoff), a
   server that ignores ``Range``, answers 416 or passes the deadline fails at once, and what
   still fails raises a :class:`~memtree.errors.RemoteError` -- never a partial tensor;
4. compare the identities of unpinned leaves and of the root ``meta.json``
   (:class:`~memtree.errors.RemoteChangedError` if the tree changed while it was read), then
   verify the checksums ``meta.json`` records (:class:`~memtree.errors.IntegrityError`);
5. return ordinary tensors, or with ``cache_dir=`` map a local cache entry
   (:mod:`memtree.store.writing.cache`): the download is built in a locked scratch directory and
   committed by one rename, so an entry is complete or absent, and a later load of the same
   save (or of any selection of it, from a whole-tree entry) fetches no leaf.

What :func:`upload` does: leaves first (concurrently), then the pickles, then each sub-tree's
``meta.json`` deepest first, and the root ``meta.json`` last: object stores have no rename, so the
root ``meta.json`` is the commit marker and a prefix without one is refused with
:class:`~memtree.errors.NotCommittedError`. Replacing a tree first deletes the old root
``meta.json`` (readers then see an uncommitted tree, never a mix), and old leaf objects that the
new tree does not name are deleted after the commit.

Example:
    >>> import torch, memtree
    >>> from memtree.remote import upload
    >>> upload(memtree.TensorTree({"w": torch.arange(4)}), "memory://doc/tree")
    >>> memtree.load_memmap("memory://doc/tree", num_threads=2)["w"].tolist()
    [0, 1, 2, 3]
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from typing import TYPE_CHECKING, Any

import torch

from ...errors import (
    check_keywords,
    SourceError,
    InvalidArgumentError,
    DestinationExistsError,
    IntegrityError,
    LeafSizeError,
    MemtreeError,
    PickleNotAllowedError,
    RemoteChangedError,
)
from ...format.chunks import ChunkSums, chunk_bytes_for
from ...format.level import Level, as_level, fmt_key
from ...format.names import LEAF_SUFFIX, META_NAME, PICKLE_SUFFIX
from ...format.packs import PackRanges, leaf_location
from ...format.schema import ChildMeta, Entry, JsonMeta, LeafMeta, LevelMeta, PickleMeta, dump_level, parse_level
from ...format.subclass import SubclassMeta
from ...format.values import NonTensor, UnloadedPickle, lists_to_tuples
from ..primitives import faults
from ..writing.cache import Download, entry_name, find_entry
from ..primitives.files import check_free_space, storage_error
from ..primitives.checksums import check_checksum_option, file_checksum, view_sums
from ..primitives.chunk_check import Reader, differing, file_reader, hash_chunks, mismatch_words
from ..primitives.memory import byte_view
from ..reading.mapped import to_storable
from ..reading.options import ReadOptions, RemoteKeywords, WriteOptions, check_remote_keywords
from ..primitives.progress import Progress
from ..reading.read import read_tree
from .fsspec_storage import FsspecStorage
from ..reading.integrity import bytes_checksum, check_tree_hash, tree_hash
from ..reading.storage import FileInfo, Storage, http_status, with_retries
from ..reading.options import KeySelection
from ..reading.walk import WalkedLevel, map_all, walk
from ..writing.packing import PackJob, assemble
from ..writing.write import plan_write

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "load",
    "upload",
    "fetch_tree",
    "RemoteKeywords",
    "RemoteLeaf",
    "remote_leaves",
    "check_size",
    "final_checks",
    "tensor_id",
    "build_level",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_NUM_THREADS",
]

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
DEFAULT_NUM_THREADS = 8
_UPLOAD_PART_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass
class RemoteLeaf:
    """A range of a file to fetch: a leaf's bytes (from the start of its file, or from its
    ``offset`` in its pack), or the span of a pack (format version 3) that holds the selected
    packed leaves."""

    rel: str  # the file, relative to the root: "b/c.memmap", "~pack-0.memmap"
    meta: LeafMeta  # the leaf's (for a pack span: a uint8 leaf of the span's size)
    label: str  # the key (or the pack), for messages
    size: int  # the file's exact size
    offset: int = 0  # where the range starts in the file
    pack: bool = False  # a pack's span
    info: FileInfo | None = None  # its stat, once done

    @property
    def nbytes(self) -> int:
        """Bytes of the range."""
        return self.meta.nbytes


@dataclasses.dataclass
class _Packed:
    """A selected packed leaf: its bytes lie in ``span`` (a :class:`RemoteLeaf` of its pack)."""

    keys: tuple[str, ...]
    meta: LeafMeta
    span: RemoteLeaf


def remote_leaves(levels: list[WalkedLevel], root: LevelMeta) -> list[tuple[tuple[str, ...], RemoteLeaf]]:
    """Every leaf of the walked ``levels`` with its key path: its own file whole, or its range of
    its pack (``rel`` the pack, ``offset`` its place there, ``size`` the pack's), the packed
    ranges checked against the root's pack sizes and each other
    (:class:`~memtree.format.packs.PackRanges`).

    Raises:
        MetaFormatError: a packed leaf outside its pack, or two overlapping.
    """
    out: list[tuple[tuple[str, ...], RemoteLeaf]] = []
    sizes = {p.file: p.nbytes for p in root.packs}
    ranges = PackRanges(sizes)
    for lvl in levels:
        ranges.add_level(lvl.meta, lvl.file(META_NAME))
        for e in lvl.meta.entries:
            if isinstance(e, LeafMeta):
                keys = lvl.keys + (e.key,)
                rel, offset = leaf_location(lvl.rel, e)
                size = sizes[rel] if e.pack is not None else e.file_nbytes
                out.append((keys, RemoteLeaf(rel, e, fmt_key(keys), size, offset)))
    return out


def _to_fetch(levels: list[WalkedLevel], root: LevelMeta) -> tuple[list[RemoteLeaf], list[_Packed]]:
    """The ranges a load reads: each leaf file whole, and for each pack one span covering its
    selected leaves (their ranges were checked against the pack's size and each other)."""
    found = remote_leaves(levels, root)
    files = [leaf for _, leaf in found if leaf.meta.pack is None]
    packed = [(keys, leaf) for keys, leaf in found if leaf.meta.pack is not None]
    spans: dict[str, tuple[int, int]] = {}
    for _, leaf in packed:
        lo, hi = spans.get(leaf.rel, (leaf.offset, leaf.offset))
        spans[leaf.rel] = (min(lo, leaf.offset), max(hi, leaf.offset + leaf.nbytes))
    sizes = {p.file: p.nbytes for p in root.packs}
    made = {
        name: RemoteLeaf(name, LeafMeta(name, name, "uint8", (hi - lo,)), f"pack {name}", sizes[name], lo, pack=True)
        for name, (lo, hi) in spans.items()
    }
    return files + list(made.values()), [_Packed(k, leaf.meta, made[leaf.rel]) for k, leaf in packed]


#: The keywords of :class:`RemoteKeywords` that go to the storage (the others go to :func:`fetch_tree`).
_STORAGE_KEYWORDS = frozenset({"storage_options", "retries", "timeout", "allow_redirects"})


@check_keywords
def load(
    url: str,
    *,
    keys: Iterable[KeySelection] | None = None,
    device: torch.device | str | None = None,
    mode: str = "r+",
    mmap: bool = True,
    allow_pickle: bool = False,
    verify: bool = False,
    **remote: Unpack[RemoteKeywords],
) -> Level:
    """Load a tree from an fsspec URL (what ``memtree.load_memmap(url, ...)`` calls).

    Args:
        url: the tree's prefix, e.g. ``"s3://bucket/tree"``, ``"https://host/tree"``.
        keys: load only these keys (str or tuples of str); only their ``meta.json`` files and
            leaves are fetched.
        device: ``"meta"``: structure only (no leaf fetched); another device: leaves are moved
            there after the download.
        mode: as for a local tree (``"r"``: read-only mapping); it applies to the mapped
            leaves of a ``cache_dir`` entry. Without ``cache_dir`` leaves are ordinary
            (writable) tensors in memory.
        mmap: as for a local tree; it applies to the leaves of a ``cache_dir`` entry.
        allow_pickle: unpickle non-tensor leaves saved with ``allow_pickle=True`` (trusted only).
        verify: also re-hash the leaves of a cache entry that is reused (downloaded leaves are
            always checked against the checksums ``meta.json`` records).
        **remote: the keywords of :class:`RemoteKeywords` (all optional):

            * ``storage_options``: passed to fsspec (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``).
            * ``cache_dir``: download into an atomically committed memtree under this directory and map
              it from there; a later load of the same save is served from it.
            * ``num_threads``: concurrent requests (default :data:`DEFAULT_NUM_THREADS`: 8).
            * ``chunk_bytes``: size of each range request (default :data:`DEFAULT_CHUNK_BYTES`: 8 MiB).
            * ``retries``: attempts after the first for each request (transient errors, short bodies;
              default 3).
            * ``timeout``: seconds one request may take, from sending it to its last byte (HTTP(S) and
              asynchronous fsspec filesystems such as S3); a slower answer fails the load with a
              :class:`~memtree.errors.RemoteError`. ``None``: no limit (default: 60).
            * ``allow_redirects``: HTTP(S): ``"same-origin"`` (default: redirects within the URL's
              scheme, host and port), ``"any"`` or ``"none"``.
            * ``fsync``: fsync the cache entry before its commit (default False).
            * ``progress``: a progress bar of the bytes downloaded (:mod:`memtree.store.primitives.progress`):
              ``None`` (default) on a terminal outside CI only, ``True``/``False`` forced.

    Raises:
        NotAMemtreeError: no tree at ``url``.
        NotCommittedError: objects but no root ``meta.json`` (an upload that never finished).
        LeafSizeError: a leaf object's size is not the one its ``meta.json`` entry promises
            (checked before anything is allocated for it).
        RemoteRangeError: an answer with other bytes than asked (``Range`` ignored, 416,
            short bodies on every attempt).
        RemoteChangedError: the tree changed while it was read.
        RemoteError: a request failed on every attempt, passed ``timeout``, or was
            redirected where ``allow_redirects`` does not go.
        IntegrityError: a leaf's bytes do not match the checksum its ``meta.json`` records.
        MetaFormatError: a ``meta.json`` is malformed or over the size limit (``LimitError``).
        MissingLeafError: a ``meta.json`` or leaf named by the tree is missing.

    Example:
        >>> import torch, memtree
        >>> from memtree.remote import upload, load
        >>> upload(memtree.TensorTree({"a": torch.ones(2), "b": {"c": torch.zeros(3)}}), "memory://ex/t")
        >>> sorted(load("memory://ex/t", keys=[("b", "c")]).entries)
        ['b']
    """
    check_remote_keywords(load, remote)
    options = ReadOptions.of(keys=keys, device=device, mode=mode, mmap=mmap, allow_pickle=allow_pickle, verify=verify)
    return load_url(url, options, **remote)


def load_url(url: str, options: ReadOptions, **remote: Unpack[RemoteKeywords]) -> Level:
    """:func:`load` with its reading options already checked (:func:`memtree.store.open.open_prefix`)."""
    storage_keywords: dict[str, Any] = {k: v for k, v in remote.items() if k in _STORAGE_KEYWORDS}
    fetch_keywords: dict[str, Any] = {k: v for k, v in remote.items() if k not in _STORAGE_KEYWORDS}
    storage = FsspecStorage(url, **storage_keywords)
    return fetch_tree(storage, options, cache_key=url, **fetch_keywords)


def fetch_tree(
    storage: Storage,
    options: ReadOptions,
    *,
    cache_key: str,
    cache_dir: str | os.PathLike[str] | None = None,
    num_threads: int = DEFAULT_NUM_THREADS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fsync: bool = False,
    progress: bool | None = None,
) -> Level:
    """Copy a tree out of any :class:`~memtree.store.reading.storage.Storage` into memory, or into a
    cache entry that is then mapped (steps 1-5 of the module docstring); :func:`load` is this
    over an fsspec URL. ``cache_key`` names the source in cache entry names (the URL);
    ``progress`` shows a bar of the bytes downloaded (see :func:`load`).

    Example:
        >>> import tempfile, torch
        >>> from memtree.store.writing.write import write_tree
        >>> from memtree.store.reading.storage import LocalStorage
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
        >>> from memtree.store.reading.options import ReadOptions
        >>> fetch_tree(LocalStorage(d), ReadOptions(), cache_key=d, chunk_bytes=8).entries["x"].tolist()
        [0, 1, 2]
    """
    if num_threads < 1:
        raise InvalidArgumentError(f"num_threads must be >= 1 for a remote tree, got {num_threads}")
    if chunk_bytes < 1:
        raise InvalidArgumentError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    selection = options.selection
    dev = options.target
    root_info = storage.stat(META_NAME)  # before the read: a later change shows in the re-stat
    root_bytes = storage.read_meta("")
    root_meta = parse_level(root_bytes, storage.describe(META_NAME), depth=0)
    if root_meta.encryption is not None or options.encryption is not None:
        raise InvalidArgumentError(
            f"{storage.describe('')}: encrypted trees load from a local directory only (copy it "
            "there, then load_memmap(path, encryption=key)); remote trees are never decrypted"
        )
    if options.verify and root_meta.tree_hash is not None:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="memtree-remote") as pool:
            check_tree_hash(storage, root_meta, pool=pool, after="uploaded",
                            fix="nothing was loaded (`memtree verify URL` lists every problem)")
    if cache_dir is not None and dev.type != "meta":
        hit = find_entry(os.fspath(cache_dir), cache_key, root_bytes, selection)
        if hit is not None:
            return read_tree(hit, options)
    with ThreadPoolExecutor(num_threads, thread_name_prefix="memtree-remote") as pool:
        levels = list(walk(storage, selection=selection, pool=pool, root=root_meta))
        leaves, packed = _to_fetch(levels, root_meta)
        pickles = [(lvl.file(e.file), e) for lvl in levels for e in lvl.meta.entries if isinstance(e, PickleMeta)]
        if dev.type == "meta":
            return build_level(storage, levels, {}, {}, dev)
        if pickles and not options.allow_pickle:
            rel, entry = pickles[0]
            raise PickleNotAllowedError(
                f"non-tensor leaf {entry.key!r} is pickled in {storage.describe(rel)}; unpickling "
                "can run arbitrary code, so it is loaded only with allow_pickle=True (trusted trees only)"
            )
        pickled = {rel: _read_whole(storage, rel) for rel, _ in pickles}
        if cache_dir is None:
            tensors = _load_memory(storage, pool, leaves, packed, chunk_bytes, root_info, progress)
            return build_level(storage, levels, tensors, {r: pickle.loads(b) for r, b in pickled.items()}, dev)
        name = entry_name(cache_key, root_bytes, selection)
        with Download(cache_dir, name, fsync=fsync) as download:
            committed = _download(
                storage, pool, download, levels, leaves, packed, pickled, chunk_bytes, root_info, progress
            )
    return read_tree(committed, dataclasses.replace(options, verify=False))  # downloaded leaves were checked


def _read_whole(storage: Storage, rel: str) -> bytes:
    info = storage.stat(rel)
    buf = bytearray(info.size)
    storage.read_into(rel, 0, memoryview(buf), info)
    return bytes(buf)


def _fetch(
    storage: Storage,
    pool: ThreadPoolExecutor,
    leaves: list[RemoteLeaf],
    chunk_bytes: int,
    allocate: Callable[[list[RemoteLeaf]], None],
    read: Callable[[RemoteLeaf, int, int], None],
    finished: Callable[[RemoteLeaf], None] = lambda leaf: None,
    progress: bool | None = None,
) -> None:
    """Stat every leaf and check its size (a damaged tree fails before any leaf byte is read or
    any destination allocated), ``allocate`` the destinations, then ``read`` each leaf's ranges
    of ``chunk_bytes`` in the pool, calling ``finished`` after a leaf's last range. The first
    failure cancels what has not started, waits for what has, and is raised. A bar of the bytes
    read is shown as :mod:`memtree.store.primitives.progress` decides for ``progress``."""
    for leaf, info in zip(leaves, map_all(pool, lambda leaf: storage.stat(leaf.rel), leaves)):
        leaf.info = info
        check_size(storage, leaf)
    allocate(leaves)
    left = {leaf.rel: len(range(0, leaf.nbytes, chunk_bytes)) for leaf in leaves}
    futures: dict[Future[None], tuple[RemoteLeaf, int]] = {}
    try:
        for leaf in leaves:
            n = leaf.nbytes
            for a in range(0, n, chunk_bytes):
                futures[pool.submit(read, leaf, a, min(a + chunk_bytes, n))] = (leaf, min(chunk_bytes, n - a))
            if not n:
                finished(leaf)
        total = sum(leaf.nbytes for leaf in leaves)
        with Progress(total=total, desc="download", unit="B", progress=progress) as bar:
            for f in as_completed(futures):
                f.result()
                leaf, nbytes = futures[f]
                bar.update(nbytes)
                left[leaf.rel] -= 1
                if not left[leaf.rel]:
                    finished(leaf)
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise


def check_size(storage: Storage, leaf: RemoteLeaf) -> None:
    """Refuse a file (``leaf.info``, its ``stat``) that is not the size its entry promises.

    Raises:
        LeafSizeError: naming the leaf (or the pack), before anything is allocated for it.
    """
    assert leaf.info is not None
    if leaf.info.size != leaf.size:  # a growable leaf's file holds its whole capacity
        raise LeafSizeError(
            f"{'' if leaf.pack else 'leaf '}{leaf.label} at {storage.describe(leaf.rel)} has "
            f"{leaf.info.size:,} bytes, its meta.json says {leaf.size:,}: the upload was interrupted, the "
            "object was changed, or the meta.json lies; nothing was allocated or loaded"
        )


def final_checks(storage: Storage, pool: ThreadPoolExecutor, leaves: list[RemoteLeaf], root_info: FileInfo) -> None:
    """Re-stat what could not be pinned (unpinned leaves, the root ``meta.json``): unchanged?"""

    def same(job: tuple[str, FileInfo, str]) -> None:
        rel, before, what = job
        now = storage.stat(rel).identity
        if now != before.identity:
            raise RemoteChangedError(
                f"{what} at {storage.describe(rel)} changed while the tree was being read "
                f"({dict(before.identity)} -> {dict(now)}); nothing was loaded: load it again"
            )

    jobs = [(leaf.rel, leaf.info, f"leaf {leaf.label}") for leaf in leaves if leaf.info is not None and leaf.info.pin is None]
    map_all(pool, same, jobs)
    same((META_NAME, root_info, "the root meta.json"))


def _check_digest(storage: Storage, meta: LeafMeta, label: str, rel: str, read: Reader) -> None:
    """Check a leaf's fetched bytes (``read`` gives them, from the leaf's first byte) against its
    recorded checksums (``rel``: the file that holds them, for the message)."""
    sums = meta.sums
    if sums is None:
        return
    nbytes = meta.nbytes
    found = hash_chunks(read, sums, nbytes, range(sums.count))
    bad = differing(sums, found)
    if bad:
        raise IntegrityError(
            f"leaf {label} at {storage.describe(rel)}: meta.json records checksum "
            f"{mismatch_words(sums, found, bad, nbytes)}; the object is corrupt or was changed: nothing was loaded"
        )


def _load_memory(storage: Storage, pool: ThreadPoolExecutor, leaves: list[RemoteLeaf], packed: list[_Packed],
                 chunk_bytes: int, root_info: FileInfo, progress: bool | None) -> dict[str, torch.Tensor]:
    """Every range read into memory; the tensors by leaf file (and by key path for packed
    leaves: views of their pack span's one buffer)."""
    tensors: dict[str, torch.Tensor] = {}
    views: dict[str, memoryview] = {}

    def allocate(checked: list[RemoteLeaf]) -> None:  # after every size was confirmed by the server
        for leaf in checked:
            tensors[leaf.rel] = t = torch.empty(leaf.meta.shape, dtype=leaf.meta.dtype)
            views[leaf.rel] = byte_view(t)

    def read(leaf: RemoteLeaf, a: int, b: int) -> None:
        storage.read_into(leaf.rel, leaf.offset + a, views[leaf.rel][a:b], leaf.info)

    _fetch(storage, pool, leaves, chunk_bytes, allocate, read, progress=progress)
    final_checks(storage, pool, leaves, root_info)  # first: a rewrite is reported as such
    for p in packed:  # a view of its span's buffer (as a mapped load's views of one mapping)
        assert p.meta.offset is not None
        start = p.meta.offset - p.span.offset
        tensors[_packed_id(p.keys)] = (
            tensors[p.span.rel][start : start + p.meta.nbytes].view(p.meta.dtype).view(p.meta.shape)
        )
    map_all(pool, lambda leaf: _check_digest(
        storage, leaf.meta, leaf.label, leaf.rel, _memory_reader(views[leaf.rel])),
        [leaf for leaf in leaves if not leaf.pack])
    map_all(pool, lambda p: _check_digest(
        storage, p.meta, fmt_key(p.keys), p.span.rel, _memory_reader(_packed_view(views, p))), packed)
    return tensors


def _memory_reader(view: memoryview) -> Reader:
    def read(offset: int, out: memoryview) -> None:
        out[:] = view[offset : offset + len(out)]

    return read


def _packed_view(views: Mapping[str, memoryview], p: _Packed) -> memoryview:
    """A packed leaf's bytes in its span's buffer."""
    assert p.meta.offset is not None
    start = p.meta.offset - p.span.offset
    return views[p.span.rel][start : start + p.meta.nbytes]


def _packed_id(keys: tuple[str, ...]) -> str:
    """The name of a packed leaf's tensor among the leaf files' (no file path holds a NUL)."""
    return "\0".join(("", *keys))


def tensor_id(keys: tuple[str, ...], rel: str, entry: LeafMeta) -> str:
    """The name of a loaded leaf's tensor among those :func:`build_level` takes: its file
    ``rel``, or for a packed leaf (a pack holds many) its key path ``keys``."""
    return _packed_id(keys) if entry.pack is not None else rel


def _download(storage: Storage, pool: ThreadPoolExecutor, download: Download, levels: list[WalkedLevel],
              leaves: list[RemoteLeaf], packed: list[_Packed], pickled: Mapping[str, bytes], chunk_bytes: int,
              root_info: FileInfo, progress: bool | None) -> str:
    """Fetch the selection into the download's scratch directory, verify it, write its
    ``meta.json`` files (every leaf with a checksum) and commit it; returns the entry.

    A pack is downloaded into a file of its whole size at the entry's root, holding the span of
    its selected leaves at their offsets (zeros elsewhere, which no entry of the cache names)."""
    buffers = threading.local()

    def read(leaf: RemoteLeaf, a: int, b: int) -> None:
        buf = getattr(buffers, "buf", None)
        if buf is None or len(buf) < b - a:
            buf = buffers.buf = bytearray(min(chunk_bytes, max(b - a, 1 << 16)))
        view = memoryview(buf)[: b - a]
        storage.read_into(leaf.rel, leaf.offset + a, view, leaf.info)
        download.write(leaf.rel, leaf.offset + a, view)

    def allocate(checked: list[RemoteLeaf]) -> None:  # after every size was confirmed by the server
        check_free_space(download.parent, sum(leaf.nbytes for leaf in checked),
                         f"the cache entry {download.dest} of {storage.describe('')}")
        for leaf in checked:  # a leaf's file without its capacity; a pack whole
            download.create_file(leaf.rel, leaf.size if leaf.pack else leaf.nbytes)

    def digest(meta: LeafMeta, label: str, rel: str) -> str | ChunkSums:
        """A downloaded leaf's checksums (``rel``: its file, or its pack's): checked against the
        recorded ones; ``crc32`` of its bytes when it records none."""
        base = meta.offset or 0
        fd = download.open_read(rel)
        try:
            read = file_reader(fd, f"the downloaded leaf {label}")
            _check_digest(storage, meta, label, rel, lambda at, view: read(base + at, view))
            recorded = meta.chunks or meta.checksum  # over the tensor's bytes: the file's
            return recorded if recorded is not None else file_checksum(fd, meta.nbytes, "crc32", base)
        finally:
            os.close(fd)

    try:
        for lvl in levels[1:]:  # breadth first: parents before children
            download.make_dir(lvl.rel)
        _fetch(storage, pool, leaves, chunk_bytes, allocate, read, lambda leaf: faults.point("after_leaf"), progress)
        final_checks(storage, pool, leaves, root_info)
        files = [leaf for leaf in leaves if not leaf.pack]
        fetched = {leaf.rel for leaf in leaves if leaf.pack}
        sums = dict(zip((leaf.rel for leaf in files), map_all(pool, lambda leaf: digest(leaf.meta, leaf.label, leaf.rel), files)))
        sums.update(zip((_packed_id(p.keys) for p in packed),
                        map_all(pool, lambda p: digest(p.meta, fmt_key(p.keys), p.span.rel), packed)))
        for rel, data in pickled.items():
            download.write_file(rel, data)
        for lvl in levels:
            entries = tuple(
                dataclasses.replace(
                    e.with_sums(sums[tensor_id(lvl.keys + (e.key,), lvl.file(e.file), e)]), capacity=None
                )
                if isinstance(e, LeafMeta) else e
                for e in lvl.meta.entries
            )
            meta = dataclasses.replace(lvl.meta, entries=entries, tree_hash=None)  # the remote's hash, checked there
            if not lvl.dirs:  # the packs the entry holds (with keys=, those of the selected leaves)
                meta = dataclasses.replace(meta, packs=tuple(p for p in meta.packs if p.file in fetched))
            download.write_file(lvl.file(META_NAME), dump_level(meta))
        return download.commit()
    except OSError as err:
        if isinstance(err, MemtreeError):
            raise
        raise storage_error(err, f"downloading {storage.describe('')} into the cache entry {download.dest}") from err


def build_level(storage: Storage, levels: list[WalkedLevel], tensors: Mapping[str, torch.Tensor],
                pickled: Mapping[str, Any], device: torch.device) -> Level:
    """The :class:`Level` of walked ``levels`` (root first): each leaf the tensor named by
    :func:`tensor_id` in ``tensors`` (moved to ``device``; meta tensors for ``device="meta"``),
    each pickle its value in ``pickled``, JSON values as they are."""
    by_keys = {lvl.keys: lvl for lvl in levels}

    def build(lvl: WalkedLevel) -> Level:
        out = Level(lvl.meta.batch_size, {}, lvl.meta.type)
        for e in lvl.meta.entries:
            if isinstance(e, LeafMeta):
                if device.type == "meta":
                    out.entries[e.key] = torch.empty(e.shape, dtype=e.dtype, device="meta")
                else:
                    t = tensors[tensor_id(lvl.keys + (e.key,), lvl.file(e.file), e)]
                    out.entries[e.key] = t if device.type == "cpu" else t.to(device)
            elif isinstance(e, ChildMeta):
                child = out.entries[e.key] = build(by_keys[lvl.keys + (e.key,)])
                if isinstance(e, SubclassMeta):  # a tensor subclass's group
                    child.subclass = e.subclass
            elif isinstance(e, JsonMeta):
                out.entries[e.key] = NonTensor(lists_to_tuples(e.value, e.tuples))
            elif device.type == "meta":
                out.entries[e.key] = NonTensor(UnloadedPickle(storage.describe(lvl.file(e.file))))
            else:
                out.entries[e.key] = NonTensor(pickled[lvl.file(e.file)])
        return out

    return build(levels[0])


# ---------------------------------------------------------------------------------------------
# uploading


@check_keywords
def upload(
    tree: Any,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    num_threads: int = DEFAULT_NUM_THREADS,
    existsok: bool = False,
    allow_pickle: bool = False,
    checksum: str | None = "crc32",
    retries: int = 3,
) -> None:
    """Upload a tree to an fsspec URL; the root ``meta.json`` is written last, as the commit marker.

    Args:
        tree: a :class:`~memtree.TensorTree`, or the path of a local memtree directory.
        url: destination prefix, e.g. ``"s3://bucket/tree"``.
        storage_options: passed to fsspec.
        num_threads: leaves uploaded concurrently.
        existsok: replace a tree (or an uncommitted upload) already at ``url``. The old root
            ``meta.json`` is deleted first, so readers never see a mix of old and new leaves;
            old objects the new tree does not name are deleted after the commit.
        allow_pickle: pickle non-tensor values that JSON cannot hold.
        checksum: ``"crc32"`` (default), ``"sha256"`` or ``None``: recorded for each leaf in
            ``meta.json`` and verified by every remote load.
        retries: attempts after the first for each object.

    Raises:
        DestinationExistsError: something is at ``url`` and ``existsok`` is False, or another
            writer committed a tree at ``url`` while this one was uploading.

    Example:
        >>> import torch, memtree
        >>> from memtree.remote import upload
        >>> upload(memtree.TensorTree({"x": torch.zeros(2)}), "memory://up/t")
        >>> upload(memtree.TensorTree({"x": torch.ones(2)}), "memory://up/t", existsok=True)
        >>> memtree.load_memmap("memory://up/t")["x"].tolist()
        [1.0, 1.0]
    """
    check_checksum_option(checksum)
    level = as_level(tree)
    if level is None:
        if not isinstance(tree, (str, os.PathLike)):
            raise SourceError(f"upload() takes a TensorTree or a local memtree directory, got {type(tree).__name__}")
        level = read_tree(tree, ReadOptions(mode="r", allow_pickle=allow_pickle))
    plan = plan_write(level, WriteOptions(allow_pickle=allow_pickle, copy_existing=True))
    storage = FsspecStorage(url, storage_options=storage_options, retries=retries, timeout=None)
    fs = storage.fs
    root_meta = storage.path(META_NAME)
    old = _existing_objects(storage, existsok)
    if old and fs.exists(root_meta):
        with_retries(lambda: fs.rm_file(root_meta), f"un-committing the old tree at {url}", retries)
    if "file" in fs.protocol:  # a local filesystem (file://) has directories: make them
        for lp in plan.levels:
            fs.makedirs(storage.path(lp.rel) if lp.rel else storage.root, exist_ok=True)

    def put_leaf(job: Any) -> dict[tuple[str, ...], str | ChunkSums]:
        path = storage.path(job.rel)
        data = to_storable(job.tensor, f"leaf {job.where}")
        view = byte_view(data)
        with_retries(lambda: _put(fs, path, view), f"uploading leaf {job.where} to {path}", retries)
        if checksum is None:
            return {}
        # a large leaf: per-chunk checksums, so that a range of it is checked alone
        return {job.key: view_sums(view, checksum, chunk_bytes_for(len(view)))}

    def put_pack(job: PackJob) -> dict[tuple[str, ...], str]:  # one object for many small leaves
        path = storage.path(job.name)
        data, sums = assemble(job, lambda m: to_storable(m.tensor, f"leaf {fmt_key(m.key)}"), checksum)
        view = byte_view(data)
        with_retries(lambda: _put(fs, path, view), f"uploading {job.where} to {path}", retries)
        return sums

    with ThreadPoolExecutor(max(num_threads, 1), thread_name_prefix="memtree-upload") as pool:
        sums: dict[tuple[str, ...], str | ChunkSums] = {}
        for leaf_sums in map_all(pool, put_leaf, plan.leaves):
            sums.update(leaf_sums)
        for pack_sums in map_all(pool, put_pack, plan.packs):
            sums.update(pack_sums)
        for rel, data in plan.pickles:
            with_retries(lambda: fs.pipe_file(storage.path(rel), data), f"uploading {rel}", retries)
    written = {storage.path(j.rel) for j in plan.leaves} | {storage.path(rel) for rel, _ in plan.pickles}
    written |= {storage.path(p.name) for p in plan.packs}
    metas: dict[str, LevelMeta] = {}
    for lp in plan.levels:  # deepest first, the root's meta.json last
        meta = dataclasses.replace(lp.meta, entries=tuple(_with_sum(e, lp.keys, sums) for e in lp.meta.entries))
        path = storage.path(f"{lp.rel}/{META_NAME}" if lp.rel else META_NAME)
        written.add(path)
        if lp.rel:
            metas[lp.rel] = meta
            with_retries(lambda: fs.pipe_file(path, dump_level(meta)), f"uploading {path}", retries)
            continue
        meta = dataclasses.replace(meta, save_id=uuid.uuid4().hex)
        if checksum is not None:  # as a local write: the hash of every meta.json uploaded
            pickle_sums = {rel: bytes_checksum(checksum, data) for rel, data in plan.pickles}
            meta = dataclasses.replace(meta, tree_hash=tree_hash(checksum, {**metas, "": meta}, pickle_sums))
        commit_root(storage, dump_level(meta))
    stale = [p for p in old if p not in written and p.rsplit("/", 1)[-1].endswith((LEAF_SUFFIX, PICKLE_SUFFIX, META_NAME))]
    if stale:
        with_retries(lambda: fs.rm(stale), f"deleting {len(stale)} stale objects of the old tree at {url}", retries)


def _existing_objects(storage: FsspecStorage, existsok: bool) -> list[str]:
    """The objects under the destination prefix; refuse them unless ``existsok``."""
    fs, root = storage.fs, storage.root
    try:
        old = [] if storage.http is not None else list(fs.find(root))
    except (FileNotFoundError, NotImplementedError):
        old = []
    meta_path = storage.path(META_NAME)
    if fs.exists(meta_path):
        try:
            parse_level(storage.read_meta(""), storage.describe(META_NAME))
        except MemtreeError as err:
            raise DestinationExistsError(
                f"{storage.url} holds a {META_NAME} that is not a memtree's ({err}); memtree never "
                "replaces it. Choose another URL"
            ) from None
        old = old or [meta_path]
    if old and not existsok:
        raise DestinationExistsError(
            f"{storage.url} already holds objects; pass existsok=True to replace the tree there, "
            "or choose another URL"
        )
    return old


def _put(fs: Any, path: str, view: memoryview) -> None:
    if len(view) <= _UPLOAD_PART_BYTES:
        fs.pipe_file(path, bytes(view))
        return
    with fs.open(path, "wb", block_size=_UPLOAD_PART_BYTES) as f:
        for start in range(0, len(view), _UPLOAD_PART_BYTES):
            f.write(view[start : start + _UPLOAD_PART_BYTES])


def _with_sum(e: Entry, keys: tuple[str, ...], sums: Mapping[tuple[str, ...], str | ChunkSums]) -> Entry:
    if isinstance(e, LeafMeta):
        digest = sums.get(keys + (e.key,))
        if digest is not None:
            return e.with_sums(digest)
    return e


def commit_root(storage: FsspecStorage, data: bytes) -> None:
    """Create the root ``meta.json`` unless another writer committed one meanwhile (where the
    store can refuse an existing object: ``mode="create"``, S3 ``IfNoneMatch``)."""
    path = storage.path(META_NAME)
    conflict = DestinationExistsError(
        f"another writer committed a tree at {storage.url} while this upload ran; its tree is "
        "kept. Upload again with existsok=True to replace it"
    )

    def attempt() -> None:
        try:
            storage.fs.pipe_file(path, data, mode="create")
        except OSError as err:
            if not (isinstance(err, FileExistsError) or http_status(err) == 412
                    or (storage.s3 and err.errno == errno.EINVAL)):
                raise
            # an earlier attempt may have succeeded before its answer was lost
            if storage.read_meta("") != data:
                raise conflict from err

    with_retries(attempt, f"committing {path}", storage.retries)
