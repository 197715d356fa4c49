"""Remote trees: load from and upload to any fsspec URL (``s3://``, ``https://``, ``memory://``...).

Optional extra: ``pip install 'memtree[remote]'`` (fsspec, aiohttp; s3fs for ``s3://``).

What :func:`load` (``memtree.load_memmap("s3://bucket/tree", ...)``) does:

1. read the root ``meta.json`` (its identity, the ETag or version, is pinned), then every
   ``meta.json`` on the path to the selected keys, breadth first and concurrently, each checked by
   :func:`memtree.format.parse_level` exactly as the local loader does;
2. ``fs.info`` each selected leaf that records no checksum: it must exist and have exactly
   ``numel × itemsize`` bytes (a recorded checksum proves the bytes exactly, so leaves that have
   one, as every leaf :func:`upload` writes, cost no extra request);
3. fetch the leaves as byte ranges of ``chunk_bytes`` with ``num_threads`` concurrent requests.
   Every answer must hold exactly ``end - start`` bytes: a short body, a dropped connection or a
   5xx is retried (``retries`` times, exponential backoff with jitter), a server that ignores
   ``Range`` or answers 416 fails at once, and what still fails raises a
   :class:`~memtree.errors.RemoteError` -- never a partial tensor;
4. checksums recorded in ``meta.json`` (``crc32:``/``sha256:``) are verified; ranges carry an
   ``If-Match`` (HTTP) or a version id (S3 with versioning), and otherwise the leaf's identity is
   compared after the read; the root's identity is compared at the end
   (:class:`~memtree.errors.RemoteChangedError` if the tree changed while it was read);
5. the data lands in ordinary tensors, or with ``cache_dir=`` in a local cache entry: the
   leaves are downloaded into a hidden scratch directory (``.<entry>.memtree-download-<hex>``),
   verified, then written by :func:`memtree.store.write.write_tree` (staging directory, writer lock,
   rename) and the scratch directory is removed. A cache entry is a normal memtree named after
   the URL, the root ``meta.json`` bytes (which carry the save's random ``save_id``) and the
   selected keys; it is only ever mapped after its commit, and a later load of the same save
   (or of any selection of it, from a whole-tree entry) reads it without fetching any leaf.

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
import hashlib
import os
import pickle
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import torch

try:
    from fsspec import AbstractFileSystem
    from fsspec.core import url_to_fs
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "memtree's remote trees need fsspec: pip install 'memtree[remote]' "
        "(and s3fs for s3:// URLs)"
    ) from _err

from ..errors import (
    DestinationExistsError,
    IntegrityError,
    LeafSizeError,
    LimitError,
    LockError,
    MemtreeError,
    MemtreeKeyError,
    MetaFormatError,
    MissingLeafError,
    NotAMemtreeError,
    NotCommittedError,
    PickleNotAllowedError,
    RemoteChangedError,
    RemoteError,
    RemoteRangeError,
)
from .files import (
    byte_view,
    check_checksum_option,
    create_leaf,
    file_checksum,
    storage_error,
    tensor_checksum,
)
from ..format.schema import (
    MAX_META_BYTES,
    ChildMeta,
    Entry,
    JsonMeta,
    LeafMeta,
    LevelMeta,
    PickleMeta,
    dump_level,
    parse_level,
)
from ..format.names import LEAF_SUFFIX, META_NAME, PICKLE_SUFFIX, STAGING_MARK, scratch_path
from ..format.level import Level, as_level
from .mapped import MemoryMappedTensor, to_storable
from ..format.values import NonTensor
from .read import KeySelection, normalize_keys, read_tree, select_entries
from .write import plan_write, write_tree
from .options import check_mode

__all__ = ["load", "upload", "DEFAULT_CHUNK_BYTES", "DEFAULT_NUM_THREADS"]

DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
DEFAULT_NUM_THREADS = 8
_UPLOAD_PART_BYTES = 64 * 1024 * 1024
_BACKOFF_S = 0.05
_T = TypeVar("_T")
_Trie = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# retries and error classification


class _ShortRead(Exception):
    """A range answer with fewer bytes than asked (retried, then a RemoteRangeError)."""


def _status(err: BaseException) -> int | None:
    status = getattr(err, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(err, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    return None


def _permanent(err: Exception, what: str) -> MemtreeError | None:
    """The error to raise at once for a failure no retry can fix, else ``None``."""
    if isinstance(err, MemtreeError):
        return err
    cause = err.__cause__
    if isinstance(err, FileNotFoundError) and isinstance(cause, Exception) and _status(cause) not in (404, 410):
        # fsspec's HTTP info() turns every failure (a 503, a reset) into FileNotFoundError
        return _permanent(cause, what)
    if isinstance(err, FileNotFoundError):
        return MissingLeafError(f"{what}: the remote object does not exist; the tree is damaged")
    status = _status(err)
    if status == 412:
        return RemoteChangedError(
            f"{what}: the remote object changed while it was being read (HTTP 412 on If-Match); "
            "the tree was overwritten meanwhile: load it again"
        )
    if status == 416:
        return RemoteRangeError(
            f"{what}: the server refused the byte range (HTTP 416); the remote object is shorter "
            "than its meta.json says: the tree is damaged or being rewritten"
        )
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return RemoteError(f"{what}: the server answered HTTP {status} ({err}); check the URL and credentials")
    if isinstance(err, PermissionError):
        return RemoteError(f"{what}: permission denied ({err}); check the credentials")
    return None


def _retry(fn: Callable[[], _T], what: str, retries: int) -> _T:
    """Call ``fn`` with bounded retries and exponential backoff (with jitter)."""
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(_BACKOFF_S * 2 ** (attempt - 1) * (0.5 + random.random()))
        try:
            return fn()
        except Exception as err:  # classified below: permanent errors are raised at once
            permanent = _permanent(err, what)
            if permanent is not None:
                if permanent is err:
                    raise
                raise permanent from err
            last = err
    if isinstance(last, _ShortRead):
        raise RemoteRangeError(
            f"{what}: {last} on each of {retries + 1} attempts; the server truncates its answers "
            "(or the connection drops): nothing was loaded, retry later"
        ) from last
    raise RemoteError(
        f"{what}: failed on each of {retries + 1} attempts, last error: "
        f"{type(last).__name__}: {last}; nothing was loaded, retry later"
    ) from last


def _run_all(pool: ThreadPoolExecutor, fn: Callable[[Any], _T], items: Iterable[Any]) -> list[_T]:
    """``fn`` over ``items`` in ``pool``; on the first failure cancel the rest, wait, re-raise it."""
    futures: list[Future[_T]] = [pool.submit(fn, item) for item in items]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


# ---------------------------------------------------------------------------------------------
# the read plan


@dataclass
class _Leaf:
    rel: str  # path relative to the root, e.g. "b/c.memmap"
    url: str
    meta: LeafMeta
    label: str
    fetch_kwargs: dict[str, Any] = field(default_factory=dict)
    identity: tuple[Any, ...] | None = None  # compared after the read when it cannot be pinned


@dataclass
class _RemoteLevel:
    rel: str
    meta: LevelMeta  # the level's entries, filtered by keys=
    depth: int
    children: dict[str, _RemoteLevel] = field(default_factory=dict)


def _join(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}" if rel else root.rstrip("/")


def _label(path: tuple[str, ...]) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


def _identity(info: Mapping[str, Any]) -> tuple[Any, ...]:
    fields = ("ETag", "etag", "VersionId", "version_id", "LastModified", "Last-Modified", "mtime", "created", "size")
    return tuple((k, str(info[k])) for k in fields if info.get(k) is not None)


class _Remote:
    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, num_threads: int,
                 chunk_bytes: int, retries: int) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 for a remote tree, got {num_threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = url
        fs, root = url_to_fs(url, **dict(storage_options or {}))
        self.fs: AbstractFileSystem = fs
        self.root: str = root.rstrip("/")
        self.num_threads = num_threads
        self.chunk_bytes = chunk_bytes
        self.retries = retries
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.http = bool({"http", "https"} & set(protocols))
        self.s3 = bool({"s3", "s3a"} & set(protocols))

    def info(self, path: str, what: str) -> dict[str, Any]:
        def call() -> dict[str, Any]:
            self.fs.invalidate_cache(path)
            return dict(self.fs.info(path))

        return _retry(call, what, self.retries)

    def cat(self, path: str, what: str, start: int | None = None, end: int | None = None,
            expect: int | None = None, **kwargs: Any) -> bytes:
        def call() -> bytes:
            data = self.fs.cat_file(path, start=start, end=end, **kwargs)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise RemoteError(f"{what}: the filesystem returned {type(data).__name__}, not bytes")
            if expect is not None and len(data) != expect:
                if len(data) > expect:
                    raise RemoteRangeError(
                        f"{what}: asked for bytes [{start}, {end}) and got {len(data):,} bytes "
                        f"instead of {expect:,}: the server ignores Range requests. Serve the tree "
                        "from a server that honours Range (any object store, nginx, caddy...)"
                    )
                raise _ShortRead(f"got {len(data):,} of {expect:,} bytes for [{start}, {end})")
            return bytes(data)

        return _retry(call, what, self.retries)

    # -- metadata ---------------------------------------------------------------------------
    def root_meta(self) -> tuple[bytes, LevelMeta, tuple[Any, ...]]:
        """Read and validate the root ``meta.json``; return its bytes, meta and identity."""
        name = self.root.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(".") and STAGING_MARK in name:
            raise NotCommittedError(f"{self.url} is the staging prefix of a write that never committed")
        path = _join(self.root, META_NAME)
        try:
            info = self.info(path, f"root meta.json of {self.url}")
        except MissingLeafError:
            if self._has_content():
                raise NotCommittedError(
                    f"{self.url} has objects but no root {META_NAME}: its upload never committed "
                    "(the root meta.json is written last). Upload the tree again"
                ) from None
            raise NotAMemtreeError(f"{self.url} has no {META_NAME}: it is not a memtree (check the URL)") from None
        size = info.get("size")
        if isinstance(size, int) and size > MAX_META_BYTES:
            raise LimitError(
                f"{path} has {size:,} bytes, more than the {MAX_META_BYTES:,} allowed; it is not a memtree meta.json"
            )
        data = self.cat(path, f"reading {path}", start=0, end=MAX_META_BYTES + 1, **self.pin_kwargs(info))
        return data, parse_level(data, _join(self.url, META_NAME), depth=0), _identity(info)

    def _has_content(self) -> bool:
        try:
            return bool(self.fs.ls(self.root, detail=False))
        except Exception:  # listing is not supported everywhere (plain HTTP): treat as empty
            return False

    def child_meta(self, rel: str, depth: int) -> LevelMeta:
        path = _join(self.root, f"{rel}/{META_NAME}")
        # a ranged read bounds what a hostile server can make us download
        data = self.cat(path, f"reading {path}", start=0, end=MAX_META_BYTES + 1)
        return parse_level(data, _join(self.url, f"{rel}/{META_NAME}"), depth=depth)

    def pin_kwargs(self, info: Mapping[str, Any]) -> dict[str, Any]:
        """Arguments that make a read fail if the object is no longer the one ``info`` saw."""
        if self.http and info.get("ETag"):
            return {"headers": {"If-Match": info["ETag"]}}
        if self.s3 and info.get("VersionId") not in (None, "null"):
            return {"version_id": info["VersionId"]}
        return {}

    def plan(self, root: LevelMeta, selection: _Trie | None, pool: ThreadPoolExecutor,
             ) -> tuple[_RemoteLevel, list[_Leaf], list[tuple[str, PickleMeta]]]:
        """Walk the selected levels breadth first; return them, their leaves and pickles."""
        top = _RemoteLevel("", root, 0)
        leaves: list[_Leaf] = []
        pickles: list[tuple[str, PickleMeta]] = []
        frontier: list[tuple[_RemoteLevel, _Trie | None, tuple[str, ...]]] = [(top, selection, ())]
        while frontier:
            nxt: list[tuple[_RemoteLevel, _Trie | None, tuple[str, ...], str, ChildMeta]] = []
            for lvl, sel, path in frontier:
                lvl.meta = select_entries(lvl.meta, sel, path, _join(self.url, lvl.rel))
                for e in lvl.meta.entries:
                    rel = f"{lvl.rel}/" if lvl.rel else ""
                    if isinstance(e, LeafMeta):
                        if sel is not None and sel.get(e.key) is not None:
                            raise MemtreeKeyError(
                                f"key {path + (e.key,)!r} is a tensor leaf at {self.url}/{lvl.rel}; "
                                f"it has no sub-key {next(iter(sel[e.key]))!r}"
                            )
                        leaves.append(_Leaf(rel + e.file, _join(self.root, rel + e.file), e, _label(path + (e.key,))))
                    elif isinstance(e, PickleMeta):
                        pickles.append((rel + e.file, e))
                    elif isinstance(e, ChildMeta):
                        sub = sel.get(e.key) if sel is not None else None
                        nxt.append((lvl, sub, path + (e.key,), rel + e.dir, e))
            metas = _run_all(pool, lambda job: self.child_meta(job[3], job[0].depth + 1), nxt)
            frontier = []
            for (parent, sub, path, rel, entry), meta in zip(nxt, metas):
                if meta.batch_size[: len(parent.meta.batch_size)] != parent.meta.batch_size:
                    raise MetaFormatError(
                        f"{_join(self.url, rel + '/' + META_NAME)}: batch_size {list(meta.batch_size)} "
                        f"does not start with the parent's {list(parent.meta.batch_size)}; the tree is damaged"
                    )
                child = _RemoteLevel(rel, meta, parent.depth + 1)
                parent.children[entry.key] = child
                frontier.append((child, sub, path))
        return top, leaves, pickles

    def stat_leaf(self, leaf: _Leaf) -> None:
        """Check a leaf's size before any data is read and pin its identity."""
        info = self.info(leaf.url, f"leaf {leaf.label} at {leaf.url}")
        size = info.get("size")
        if size != leaf.meta.file_nbytes:  # a growable leaf's file holds its whole capacity
            raise LeafSizeError(
                f"remote leaf {leaf.label} at {leaf.url} has {size} bytes, expected "
                f"{leaf.meta.file_nbytes:,}: the upload was interrupted or the object was changed; "
                "upload the tree again"
            )
        leaf.fetch_kwargs = self.pin_kwargs(info)
        leaf.identity = None if leaf.fetch_kwargs else _identity(info)

    def recheck(self, url: str, identity: tuple[Any, ...], what: str) -> None:
        now = _identity(self.info(url, what))
        if now != identity:
            raise RemoteChangedError(
                f"{what} at {url} changed while the tree was being read ({dict(identity)} -> "
                f"{dict(now)}); nothing was loaded: load it again"
            )


def _check_digest(leaf: _Leaf, compute: Callable[[str], str]) -> None:
    checksum = leaf.meta.checksum
    if checksum is None:
        return
    got = compute(checksum.partition(":")[0])
    if got != checksum:
        raise IntegrityError(
            f"remote leaf {leaf.label} at {leaf.url}: checksum {got} does not match {checksum} "
            "recorded in meta.json; the object is corrupt or was changed: nothing was loaded"
        )


# ---------------------------------------------------------------------------------------------
# loading


def _ranges(leaves: list[_Leaf], chunk_bytes: int) -> list[tuple[_Leaf, int, int]]:
    out: list[tuple[_Leaf, int, int]] = []
    for leaf in leaves:
        n = leaf.meta.nbytes
        out.extend((leaf, a, min(a + chunk_bytes, n)) for a in range(0, n, chunk_bytes))
    out.sort(key=lambda r: r[1])  # round-robin over leaves: many small leaves finish early
    return out


def _fetch(remote: _Remote, pool: ThreadPoolExecutor, leaves: list[_Leaf],
           sink: Callable[[_Leaf, int, bytes], None]) -> None:
    def one(job: tuple[_Leaf, int, int]) -> None:
        leaf, a, b = job
        data = remote.cat(leaf.url, f"leaf {leaf.label} at {leaf.url}", start=a, end=b,
                          expect=b - a, **leaf.fetch_kwargs)
        sink(leaf, a, data)

    _run_all(pool, one, _ranges(leaves, remote.chunk_bytes))


def load(
    url: str,
    *,
    keys: Iterable[KeySelection] | None = None,
    device: torch.device | str | None = None,
    mode: str = "r+",
    mmap: bool = True,
    allow_pickle: bool = False,
    verify: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    num_threads: int = DEFAULT_NUM_THREADS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    retries: int = 3,
    fsync: bool = False,
) -> Level:
    """Load a tree from an fsspec URL (what ``memtree.load_memmap(url, ...)`` calls).

    Args:
        url: the tree's prefix, e.g. ``"s3://bucket/tree"``, ``"https://host/tree"``.
        keys: load only these keys (str or tuples of str); only their ``meta.json`` files and
            leaves are fetched.
        device: ``"meta"``: structure only (no leaf fetched); another device: leaves are moved
            there after the download.
        mode, mmap: as for a local tree; they apply to the mapped leaves of a ``cache_dir``
            entry. Without ``cache_dir`` leaves are ordinary (writable) tensors in memory.
        allow_pickle: unpickle non-tensor leaves saved with ``allow_pickle=True`` (trusted only).
        verify: also re-hash the leaves of a cache entry that is reused (downloaded leaves are
            always checked against the checksums ``meta.json`` records).
        storage_options: passed to fsspec (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``).
        cache_dir: download into an atomically committed memtree under this directory and map
            it from there; a later load of the same save is served from it.
        num_threads: concurrent range requests.
        chunk_bytes: size of each range request.
        retries: attempts after the first for each request (transient errors, short bodies).
        fsync: fsync the cache entry before its commit.

    Raises:
        NotCommittedError: objects but no root ``meta.json`` (an upload that never finished).
        RemoteRangeError, RemoteChangedError, RemoteError, IntegrityError, LeafSizeError,
        MissingLeafError, MetaFormatError: see the module docstring; nothing is returned.

    Example:
        >>> import torch, memtree
        >>> from memtree.remote import upload, load
        >>> upload(memtree.TensorTree({"a": torch.ones(2), "b": {"c": torch.zeros(3)}}), "memory://ex/t")
        >>> sorted(load("memory://ex/t", keys=[("b", "c")]).entries)
        ['b']
    """
    check_mode(mode)
    remote = _Remote(url, storage_options, num_threads, chunk_bytes, retries)
    selection = normalize_keys(keys) if keys is not None else None
    dev = torch.device(device) if device is not None else torch.device("cpu")
    root_bytes, root_meta, root_identity = remote.root_meta()
    if cache_dir is not None and dev.type != "meta":
        cached = _cached_entry(os.fspath(cache_dir), url, root_bytes, selection)
        if cached is not None:
            return read_tree(cached, keys=keys, mode=mode, mmap=mmap, device=device,
                             allow_pickle=allow_pickle, verify=verify)
    with ThreadPoolExecutor(remote.num_threads, thread_name_prefix="memtree-remote") as pool:
        top, leaves, pickles = remote.plan(root_meta, selection, pool)
        if dev.type == "meta":
            return _build(top, {}, {}, dev)
        if pickles and not allow_pickle:
            rel, entry = pickles[0]
            raise PickleNotAllowedError(
                f"non-tensor leaf {entry.key!r} is pickled in {_join(url, rel)}; unpickling can run "
                "arbitrary code, so it is loaded only with allow_pickle=True (trusted trees only)"
            )
        # a recorded checksum proves a leaf's bytes exactly; the others are size-checked and pinned
        _run_all(pool, remote.stat_leaf, [leaf for leaf in leaves if leaf.meta.checksum is None])
        pickled = {
            rel: remote.cat(_join(remote.root, rel), f"reading {_join(url, rel)}") for rel, _ in pickles
        }
        if cache_dir is None:
            tensors = _load_memory(remote, pool, leaves, root_identity)
            return _build(top, tensors, {rel: pickle.loads(b) for rel, b in pickled.items()}, dev)
        entry_dir = _entry_dir(os.fspath(cache_dir), url, root_bytes, selection)
        objects = {rel: pickle.loads(b) for rel, b in pickled.items()}
        _download_entry(remote, pool, top, leaves, objects, entry_dir, root_identity, fsync)
    return read_tree(entry_dir, keys=keys, mode=mode, mmap=mmap, device=device, allow_pickle=allow_pickle)


def _final_checks(remote: _Remote, pool: ThreadPoolExecutor, leaves: list[_Leaf],
                  root_identity: tuple[Any, ...]) -> None:
    unpinned = [leaf for leaf in leaves if leaf.identity is not None]
    _run_all(pool, lambda leaf: remote.recheck(leaf.url, leaf.identity, f"leaf {leaf.label}"), unpinned)
    remote.recheck(_join(remote.root, META_NAME), root_identity, "the root meta.json")


def _load_memory(remote: _Remote, pool: ThreadPoolExecutor, leaves: list[_Leaf],
                 root_identity: tuple[Any, ...]) -> dict[str, torch.Tensor]:
    tensors = {leaf.rel: torch.empty(leaf.meta.shape, dtype=leaf.meta.dtype) for leaf in leaves}
    views = {rel: byte_view(t) for rel, t in tensors.items()}

    def sink(leaf: _Leaf, start: int, data: bytes) -> None:
        views[leaf.rel][start : start + len(data)] = data

    _fetch(remote, pool, leaves, sink)
    _final_checks(remote, pool, leaves, root_identity)  # first: a rewrite is reported as such
    _run_all(pool, lambda leaf: _check_digest(leaf, lambda algo: tensor_checksum(tensors[leaf.rel], algo)), leaves)
    return tensors


def _build(lvl: _RemoteLevel, tensors: Mapping[str, torch.Tensor], pickled: Mapping[str, Any],
           device: torch.device) -> Level:
    out = Level(lvl.meta.batch_size, {}, lvl.meta.type)
    prefix = f"{lvl.rel}/" if lvl.rel else ""
    for e in lvl.meta.entries:
        if isinstance(e, LeafMeta):
            if device.type == "meta":
                out.entries[e.key] = torch.empty(e.shape, dtype=e.dtype, device="meta")
            else:
                t = tensors[prefix + e.file]
                out.entries[e.key] = t if device.type == "cpu" else t.to(device)
        elif isinstance(e, ChildMeta):
            out.entries[e.key] = _build(lvl.children[e.key], tensors, pickled, device)
        elif isinstance(e, JsonMeta):
            out.entries[e.key] = NonTensor(e.value)
        else:
            out.entries[e.key] = NonTensor(pickled[prefix + e.file])
    return out


# -- the local cache ----------------------------------------------------------------------------


def _entry_name(url: str, root_bytes: bytes, selection: _Trie | None) -> str:
    h = hashlib.sha256()
    for part in (url.rstrip("/").encode(), root_bytes, orjson.dumps(selection, option=orjson.OPT_SORT_KEYS)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:32]


def _entry_dir(cache_dir: str, url: str, root_bytes: bytes, selection: _Trie | None) -> str:
    return os.path.join(os.path.realpath(cache_dir), _entry_name(url, root_bytes, selection))


def _cached_entry(cache_dir: str, url: str, root_bytes: bytes, selection: _Trie | None) -> str | None:
    """A committed cache entry that holds the selection (the whole tree's serves any selection)."""
    candidates = [None] if selection is None else [None, selection]
    for sel in candidates:
        d = _entry_dir(cache_dir, url, root_bytes, sel)
        if os.path.isfile(os.path.join(d, META_NAME)):
            return d
    return None


def _download_entry(remote: _Remote, pool: ThreadPoolExecutor, top: _RemoteLevel, leaves: list[_Leaf],
                    pickled: Mapping[str, Any], dest: str, root_identity: tuple[Any, ...],
                    fsync: bool) -> None:
    """Download the selection into scratch files, verify it, then commit it with ``write_tree``.

    The cache entry is written like any local tree (staging directory, writer lock, rename), so
    an interrupted download leaves no entry at all; the scratch directory is always removed.
    """
    parent, name = os.path.split(dest)
    try:
        os.makedirs(parent, exist_ok=True)
        scratch = scratch_path(parent, name)
        os.mkdir(scratch, 0o700)
    except OSError as err:
        raise storage_error(err, f"creating a download directory in {parent}") from err
    fds: dict[str, int] = {}
    try:
        for i, leaf in enumerate(leaves):
            path = os.path.join(scratch, f"{i}.memmap")
            create_leaf(path, None, leaf.meta.nbytes, reserve=True)
            fds[leaf.rel] = os.open(path, os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))

        def sink(leaf: _Leaf, start: int, data: bytes) -> None:
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fds[leaf.rel], view, start + len(data) - len(view)) :]

        _fetch(remote, pool, leaves, sink)
        _final_checks(remote, pool, leaves, root_identity)
        _run_all(pool, lambda leaf: _check_digest(
            leaf, lambda algo: file_checksum(fds[leaf.rel], leaf.meta.nbytes, algo)), leaves)
        tensors = {
            leaf.rel: MemoryMappedTensor.from_filename(
                os.path.join(scratch, f"{i}.memmap"), leaf.meta.dtype, leaf.meta.shape, mode="r")
            for i, leaf in enumerate(leaves)
        }
        level = _build(top, tensors, pickled, torch.device("cpu"))
        try:
            write_tree(dest, level, existsok=False, copy_existing=True, allow_pickle=True,
                       num_threads=remote.num_threads, fsync=fsync, checksum="crc32")
        except (DestinationExistsError, LockError):
            if not os.path.isfile(os.path.join(dest, META_NAME)):
                raise
            # another process committed the same entry meanwhile: use theirs
    except OSError as err:
        if isinstance(err, MemtreeError):
            raise
        raise storage_error(err, f"downloading {remote.url} into the cache entry {dest}") from err
    finally:
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# uploading


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
    if level is not None:
        pass
    elif isinstance(tree, (str, os.PathLike)):
        level = read_tree(tree, mode="r", allow_pickle=allow_pickle)
    else:
        raise TypeError(f"upload() takes a TensorTree or a local memtree directory, got {type(tree).__name__}")
    plan = plan_write(level, allow_pickle=allow_pickle, copy_existing=True)
    remote = _Remote(url, storage_options, max(num_threads, 1), DEFAULT_CHUNK_BYTES, retries)
    fs, root = remote.fs, remote.root
    root_meta = _join(root, META_NAME)
    old = _existing_objects(remote, existsok)
    if old and fs.exists(root_meta):
        _retry(lambda: fs.rm_file(root_meta), f"un-committing the old tree at {url}", retries)

    def put_leaf(job: Any) -> tuple[str, str | None]:
        path = _join(root, job.rel)
        data = to_storable(job.tensor, f"leaf {job.where}")
        view = byte_view(data)
        _retry(lambda: _put(fs, path, view), f"uploading leaf {job.where} to {path}", retries)
        return job.rel, tensor_checksum(data, checksum) if checksum else None

    with ThreadPoolExecutor(remote.num_threads, thread_name_prefix="memtree-upload") as pool:
        sums = dict(_run_all(pool, put_leaf, plan.leaves))
        for rel, data in plan.pickles:
            _retry(lambda: fs.pipe_file(_join(root, rel), data), f"uploading {rel}", retries)
    written = {_join(root, j.rel) for j in plan.leaves} | {_join(root, rel) for rel, _ in plan.pickles}
    for lp in plan.levels:  # deepest first, the root's meta.json last
        meta = dataclasses.replace(lp.meta, entries=tuple(_with_sum(e, lp.rel, sums) for e in lp.meta.entries))
        path = _join(root, f"{lp.rel}/{META_NAME}" if lp.rel else META_NAME)
        written.add(path)
        if lp.rel:
            _retry(lambda: fs.pipe_file(path, dump_level(meta)), f"uploading {path}", retries)
        else:
            _commit(remote, path, dump_level(dataclasses.replace(meta, save_id=uuid.uuid4().hex)))
    stale = [p for p in old if p not in written and p.rsplit("/", 1)[-1].endswith((LEAF_SUFFIX, PICKLE_SUFFIX, META_NAME))]
    if stale:
        _retry(lambda: fs.rm(stale), f"deleting {len(stale)} stale objects of the old tree at {url}", retries)


def _existing_objects(remote: _Remote, existsok: bool) -> list[str]:
    """The objects under the destination prefix; refuse them unless ``existsok``."""
    fs, root = remote.fs, remote.root
    try:
        old = [] if remote.http else list(fs.find(root))
    except (FileNotFoundError, NotImplementedError):
        old = []
    meta_path = _join(root, META_NAME)
    if fs.exists(meta_path):
        data = remote.cat(meta_path, f"reading {remote.url}/{META_NAME}")
        try:
            parse_level(data, _join(remote.url, META_NAME))
        except MemtreeError as err:
            raise DestinationExistsError(
                f"{remote.url} holds a {META_NAME} that is not a memtree's ({err}); memtree never "
                "replaces it. Choose another URL"
            ) from None
        old = old or [meta_path]
    if old and not existsok:
        raise DestinationExistsError(
            f"{remote.url} already holds objects; pass existsok=True to replace the tree there, "
            "or choose another URL"
        )
    return old


def _put(fs: AbstractFileSystem, path: str, view: memoryview) -> None:
    if len(view) <= _UPLOAD_PART_BYTES:
        fs.pipe_file(path, bytes(view))
        return
    with fs.open(path, "wb", block_size=_UPLOAD_PART_BYTES) as f:
        for start in range(0, len(view), _UPLOAD_PART_BYTES):
            f.write(view[start : start + _UPLOAD_PART_BYTES])


def _with_sum(e: Entry, rel: str, sums: Mapping[str, str | None]) -> Entry:
    if isinstance(e, LeafMeta):
        digest = sums.get(f"{rel}/{e.file}" if rel else e.file)
        if digest is not None:
            return dataclasses.replace(e, checksum=digest)
    return e


def _commit(remote: _Remote, path: str, data: bytes) -> None:
    """Create the root meta.json unless another writer committed meanwhile (where supported)."""
    conflict = DestinationExistsError(
        f"another writer committed a tree at {remote.url} while this upload ran; its tree is "
        "kept. Upload again with existsok=True to replace it"
    )

    def attempt() -> None:
        try:
            remote.fs.pipe_file(path, data, mode="create")
        except OSError as err:
            if not (isinstance(err, FileExistsError) or _status(err) == 412
                    or (remote.s3 and err.errno == errno.EINVAL)):
                raise
            # an earlier attempt may have succeeded before its answer was lost
            if remote.cat(path, f"reading back {path}") != data:
                raise conflict from err

    _retry(attempt, f"committing {path}", remote.retries)
