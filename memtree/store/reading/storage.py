"""The read seam: one small interface for reading a tree, local or remote.

Everything that reads a tree's files goes through a :class:`Storage` (in the spirit of zarr
v3's ``Store`` and ``torch.distributed.checkpoint``'s ``FileSystemBase``): the level walker
(:mod:`memtree.store.reading.walk`) and the remote loader today, and in time read, verify, grow,
recovery and convert. A storage reads, never writes. Paths are ``rel`` strings: ``/``-separated
names below the tree's root (``""`` is the root, ``"b/c.memmap"`` a leaf of sub-tree ``b``),
each name a safe one-component name as :func:`memtree.format.names.is_safe_name` defines
(:func:`split_rel` refuses anything else, so no path can leave the root).

Two implementations:

* :class:`LocalStorage`: a directory, held open by descriptor; every name is opened relative
  to its parent's descriptor without following links (``O_NOFOLLOW``), files must be regular
  (:func:`open_dir`, :func:`read_meta_bytes` here, and :func:`memtree.store.primitives.files.open_leaf`);
* :class:`~memtree.store.urls.fsspec_storage.FsspecStorage` (its own module: it needs the optional
  fsspec extra): any fsspec URL. HTTP(S) goes through :class:`memtree.store.urls.http.HttpTransport`
  (quoted names, same-origin redirects, streamed bodies with caps, per-request timeouts); other
  filesystems through fsspec's ranged reads, with per-request timeouts on asynchronous ones.
  Transient failures are retried a bounded number of times with backoff
  (:func:`with_retries`); every read is checked for its exact length.

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.writing.write import write_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
    >>> with LocalStorage(d) as s:
    ...     out = bytearray(8)
    ...     s.read_into("x.memmap", 8, memoryview(out))
    ...     s.stat("x.memmap").size, bytes(out[:1])
    (24, b'\\x01')
"""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...errors import (
    InvalidArgumentError,
    LimitError,
    MemtreeError,
    MissingLeafError,
    NotAMemtreeError,
    NotCommittedError,
    RemoteChangedError,
    RemoteError,
    RemoteRangeError,
    StorageError,
    UnsafePathError,
)
from ...format.record import Record
from ...format.names import META_NAME, is_safe_name, is_uncommitted_name
from ...format.schema import MAX_META_BYTES, ChildMeta, LeafMeta, LevelMeta, PickleMeta, parse_level
from ..primitives.files import open_leaf, storage_error

__all__ = [
    "FileInfo",
    "Storage",
    "LocalStorage",
    "TransientError",
    "ShortReadError",
    "split_rel",
    "join_rel",
    "with_retries",
    "http_status",
    "identity_of",
    "is_url",
    "local_path",
    "open_dir",
    "read_meta_bytes",
    "read_small_file",
    "read_meta",
    "META_FLAGS",
]

_BACKOFF_S = 0.05
_T = TypeVar("_T")


#: fsspec's URL schemes of the local filesystem: such a URL names a local path.
_LOCAL_SCHEMES = ("file://", "local://")


def _is_local_url(prefix: object) -> bool:
    return isinstance(prefix, str) and prefix[:8].lower().startswith(_LOCAL_SCHEMES)


def is_url(prefix: str | os.PathLike[str]) -> bool:
    """True for an fsspec URL that the remote reader handles (any scheme but ``file://``).

    Example:
        >>> is_url("s3://bucket/tree"), is_url("/data/tree"), is_url("file:///data/tree")
        (True, False, False)
    """
    return isinstance(prefix, str) and "://" in prefix and not _is_local_url(prefix)


def local_path(location: str | os.PathLike[str], *, remote: str | None = None) -> str | os.PathLike[str]:
    """The local path a tree location names: the one rule of every entry point taking one.

    A ``file://`` URL names the local path after it, as fsspec reads it: ``file:///data/tree``
    (and ``file://localhost/data/tree``, and fsspec's ``local:///data/tree``) is
    ``/data/tree``, the rest of the URL kept verbatim (no percent-decoding, as in fsspec). A
    path is returned unchanged; so is any other URL (``s3://``, ``https://``...) unless
    ``remote`` says that the caller reads and writes local files only.

    Args:
        location: a path or a URL.
        remote: for a caller of local files only, what to do instead of passing a remote URL
            (the end of the error message); ``None``: other URLs are returned for the caller's
            remote reader (:func:`is_url` tells them).

    Raises:
        InvalidArgumentError: a ``file://`` URL that names a host or a relative path
            (``file://data/tree``), or nothing; a remote URL when ``remote`` is given.

    Example:
        >>> local_path("file:///data/tree"), local_path("/data/tree"), local_path("s3://b/t")
        ('/data/tree', '/data/tree', 's3://b/t')
    """
    if _is_local_url(location):
        rest = str(location).split("://", 1)[1]
        host, slash, path = rest.partition("/")
        if host.lower() == "localhost":
            host = ""
        if host or not slash:
            raise InvalidArgumentError(
                f"{location!r} is a file URL without an absolute local path (it names "
                f"{'the host ' + repr(host) if host else 'no path'}); memtree reads the files of this "
                "machine only: write file:///absolute/path (three slashes), or pass the path itself"
            )
        return "/" + path
    if remote is not None and is_url(location):
        raise InvalidArgumentError(f"{location!r} is a remote URL: {remote}")
    return location


# The openers of a local tree's directories and meta.json files (LocalStorage and the fd-based
# readers of store/reading/read.py, recovery, grow use them): no link followed, regular files only.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
META_FLAGS = os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)


def open_dir(name: str, where: str, dir_fd: int | None) -> int:
    """Open a tree's root (``dir_fd=None``) or a sub-tree directory without following links.

    Raises:
        NotAMemtreeError, MissingLeafError, UnsafePathError, StorageError.
    """
    try:
        return os.open(name, _DIR_FLAGS | (_NOFOLLOW if dir_fd is not None else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        if dir_fd is None:
            raise NotAMemtreeError(f"{where} does not exist; check the path") from None
        raise MissingLeafError(f"sub-tree directory {where} is missing; the tree is damaged") from None
    except NotADirectoryError:
        if dir_fd is None:
            raise NotAMemtreeError(f"{where} is not a directory; a memtree is a directory") from None
        raise UnsafePathError(f"{where} is not a directory (or is a symbolic link)") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{where} is a symbolic link; memtree does not follow links inside a tree"
            ) from None
        raise storage_error(err, f"opening {where}") from err


def read_meta_bytes(dir_fd: int, where: str, *, root: bool) -> tuple[bytes, str]:
    """The bytes of the ``meta.json`` in an open directory, and its path.

    Opened without following links, refused unless it is a regular file of at most
    :data:`~memtree.format.MAX_META_BYTES` (checked with ``fstat`` before reading).
    """
    path = os.path.join(where, META_NAME)
    data = read_small_file(
        META_NAME, path, MAX_META_BYTES, "a meta.json; it was not written by memtree (or tensordict)", dir_fd=dir_fd
    )
    if data is None:
        if root:
            raise NotAMemtreeError(
                f"{where} has no {META_NAME}: it is not a memtree directory (or its write never "
                "finished)"
            )
        raise MissingLeafError(f"{path} is missing; the tree is damaged")
    return data, path


def read_small_file(name: str, path: str, limit: int, what: str, *, dir_fd: int | None = None) -> bytes | None:
    """The bytes of a small file (``name``, relative to ``dir_fd`` if given; ``path`` for
    messages), ``None`` when there is none: opened without following links, refused unless a
    regular file of at most ``limit`` bytes, checked with ``fstat`` before reading; a file that
    grew since is read on to ``limit + 1`` bytes, for the caller's parser to refuse.

    Raises:
        UnsafePathError: a symbolic link, or not a regular file (a FIFO, a directory, a device).
        LimitError: larger than ``limit`` (``what`` names the kind of file in the message).
        StorageError: the file cannot be opened or read.
    """
    try:
        fd = os.open(name, META_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link; refusing to follow it") from None
        raise storage_error(err, f"opening {path}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        if st.st_size > limit:
            raise LimitError(f"{path} has {st.st_size:,} bytes, more than the {limit:,} allowed for {what}")
        want = st.st_size + 1  # one byte more: a short read is the end of the file
        data = os.read(fd, want)
        if len(data) == want:  # it grew since fstat: read on to its end (the parser checks)
            parts = [data]
            left = limit + 1 - len(data)
            while left > 0:
                part = os.read(fd, min(left, 1 << 20))
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            data = b"".join(parts)
    except OSError as err:
        if isinstance(err, MemtreeError):
            raise
        raise storage_error(err, f"reading {path}") from err
    finally:
        os.close(fd)
    return data


def read_meta(dir_fd: int, where: str, *, depth: int, root: bool) -> LevelMeta:
    """Read and validate the ``meta.json`` in an open directory.

    The file is opened, checked and read every time; its validation is done once per process
    for the same bytes at the same depth (see :data:`PARSED_CACHE_BYTES`).

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.writing.write import write_tree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
        >>> fd = os.open(d, os.O_RDONLY)
        >>> read_meta(fd, d, depth=0, root=True) is read_meta(fd, d, depth=0, root=True)
        True
        >>> os.close(fd)
    """
    data, path = read_meta_bytes(dir_fd, where, root=root)
    key = (data, depth)
    if len(data) <= PARSED_CACHE_BYTES:
        with _PARSED_LOCK:
            meta = _PARSED.get(key)
            if meta is not None:
                _PARSED.move_to_end(key)
                return meta
    meta = parse_level(data, path, depth=depth)  # raises for bytes that do not validate: never kept
    _keep_parsed(key, meta)
    return meta


#: Bytes of ``meta.json`` files that :func:`read_meta` keeps with their validated level (the
#: newest used first; a larger file is not kept, nor a level holding JSON values or subclass
#: contexts, lists and dicts that loads hand out), so that a process loading a tree again (an
#: evaluation loop, a resume, a reload) validates each file once. The level is an immutable
#: record and depends only on the bytes and the depth; only a file's validation is skipped,
#: never its opening, checks or reading.
PARSED_CACHE_BYTES = 1 << 20
_PARSED: OrderedDict[tuple[bytes, int], LevelMeta] = OrderedDict()
#: The entries whose every field is immutable (str, int, tuples, records of those).
_IMMUTABLE_ENTRIES = (LeafMeta, ChildMeta, PickleMeta)
_PARSED_LOCK = threading.Lock()
_parsed_bytes = 0


def _keep_parsed(key: tuple[bytes, int], meta: LevelMeta) -> None:
    global _parsed_bytes
    size = len(key[0])
    if size > PARSED_CACHE_BYTES or not all(type(e) in _IMMUTABLE_ENTRIES for e in meta.entries):
        return  # a JSON value (or a subclass's context) is a list or dict: never shared between loads
    with _PARSED_LOCK:
        if key in _PARSED:
            return
        _PARSED[key] = meta
        _parsed_bytes += size
        while _parsed_bytes > PARSED_CACHE_BYTES:
            (old, _), _ = _PARSED.popitem(last=False)
            _parsed_bytes -= len(old)



@dataclass(init=False, repr=False, eq=False)  # frozen: a Record (cheaper to define at import)
class FileInfo(Record):
    """What a storage knows about one file before reading it.

    Attributes:
        size: the file's size in bytes.
        identity: fields that change when the file is replaced (ETag, version id, mtime, size,
            inode...); two ``FileInfo`` of the same unchanged file have equal identities.
        pin: a storage-specific token that makes a later :meth:`Storage.read_into` given this
            ``FileInfo`` fail with :class:`~memtree.errors.RemoteChangedError` if the file was
            replaced meanwhile (an HTTP ``If-Match`` ETag, an S3 version id), or ``None`` when
            the storage cannot pin reads (the caller compares identities after reading).
    """

    size: int
    identity: tuple[tuple[str, str], ...]
    pin: Any = None

    def __init__(self, size: int, identity: tuple[tuple[str, str], ...], pin: Any = None) -> None:
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "identity", identity)
        object.__setattr__(self, "pin", pin)


class Storage(Protocol):
    """Reading a tree's files: what every reader needs, nothing more.

    Errors are :class:`~memtree.errors.MemtreeError` subclasses naming the file
    (:meth:`describe`): :class:`~memtree.errors.MissingLeafError` for a missing file (for the
    root ``meta.json``: :class:`~memtree.errors.NotAMemtreeError`, or
    :class:`~memtree.errors.NotCommittedError` when the root holds files but no ``meta.json``),
    :class:`~memtree.errors.UnsafePathError` for a link or non-regular file,
    :class:`~memtree.errors.LimitError` for a ``meta.json`` over the size limit, and
    :class:`~memtree.errors.RemoteError` (or ``StorageError``) for I/O that failed.
    """

    def describe(self, rel: str) -> str:
        """The full path or URL of ``rel``, for messages."""
        ...

    def read_meta(self, rel: str) -> bytes:
        """The bytes of the ``meta.json`` of the level at ``rel``; at most
        :data:`~memtree.format.schema.MAX_META_BYTES`, enforced while reading."""
        ...

    def stat(self, rel: str) -> FileInfo:
        """Size and identity of the regular file ``rel``."""
        ...

    def read_into(self, rel: str, offset: int, out: memoryview, info: FileInfo | None = None) -> None:
        """Fill ``out`` with exactly ``len(out)`` bytes of ``rel`` from ``offset``; with
        ``info`` (from :meth:`stat`) whose ``pin`` is set, fail if the file is no longer the
        one ``info`` saw."""
        ...

    def close(self) -> None:
        """Release what the storage holds (descriptors, sessions)."""
        ...


def split_rel(rel: str) -> list[str]:
    """The names of ``rel``; each must be a safe name (``meta.json`` only as the last one).

    Raises:
        UnsafePathError: a name is empty, ``.``/``..``, hidden, or holds ``/``, ``\\`` or NUL:
            it could leave the tree's root.

    Example:
        >>> split_rel("b/c.memmap"), split_rel("")
        (['b', 'c.memmap'], [])
    """
    if rel == "":
        return []
    parts = rel.split("/")
    for i, part in enumerate(parts):
        if not (is_safe_name(part) or (part == META_NAME and i == len(parts) - 1)):
            raise UnsafePathError(
                f"{rel!r} is not a path inside a tree (name {part!r} is not a safe file name); "
                "a tree's files are only ever named by memtree's escaping"
            )
    return parts


def join_rel(*parts: str) -> str:
    """Join ``rel`` paths and names with ``/``, skipping empty ones.

    Example:
        >>> join_rel("", "a.memmap"), join_rel("b", "c", "meta.json")
        ('a.memmap', 'b/c/meta.json')
    """
    return "/".join(p for p in parts if p)


# -- retries -----------------------------------------------------------------------------------


class TransientError(Exception):
    """A failure a retry may fix: a dropped connection, a 5xx answer, a short body."""


class ShortReadError(TransientError):
    """An answer with fewer bytes than asked (retried; then a RemoteRangeError)."""


def http_status(err: BaseException) -> int | None:
    """The HTTP status an fsspec/botocore exception carries, if any."""
    status = getattr(err, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(err, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code if isinstance(code, int) else None
    return None


def _permanent(err: Exception, what: str) -> MemtreeError | None:
    """The error to raise at once for a failure no retry can fix, else ``None`` (retry)."""
    if isinstance(err, MemtreeError):
        return err
    if isinstance(err, TransientError):
        return None
    if isinstance(err, FileNotFoundError):
        return MissingLeafError(f"{what}: the remote object does not exist; the tree is damaged")
    status = http_status(err)
    if status == 412:
        return RemoteChangedError(
            f"{what}: the remote object changed while it was being read (HTTP 412); the tree "
            "was overwritten meanwhile: load it again"
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


def with_retries(fn: Callable[[], _T], what: str, retries: int) -> _T:
    """Call ``fn`` with up to ``retries`` retries (exponential backoff with jitter).

    A :class:`~memtree.errors.MemtreeError`, a missing object, an HTTP 4xx (but 408/429) is
    raised at once; anything else is retried, then raised as a
    :class:`~memtree.errors.RemoteError` (:class:`~memtree.errors.RemoteRangeError` when the
    answers were short) that says how many attempts failed.

    Example:
        >>> with_retries(lambda: 7, "nothing", 3)
        7
    """
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(_BACKOFF_S * 2 ** (attempt - 1) * (0.5 + random.random()))
        try:
            return fn()
        except Exception as err:  # classified: permanent errors are raised at once
            permanent = _permanent(err, what)
            if permanent is not None:
                if permanent is err:
                    raise
                raise permanent from err
            last = err
    cls = RemoteRangeError if isinstance(last, ShortReadError) else RemoteError
    raise cls(
        f"{what}: failed on each of {retries + 1} attempts, last error: {type(last).__name__}: "
        f"{last}; nothing was loaded, retry later"
    ) from last


def identity_of(fields: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The identity fields of an fsspec ``info()`` (or HTTP headers), in a fixed order."""
    names = ("ETag", "etag", "VersionId", "version_id", "LastModified", "Last-Modified", "mtime", "created", "size")
    out = []
    for k in names:
        v = fields.get(k)
        if v is not None:
            text = str(v)
            out.append((k, text[2:] if k in ("ETag", "etag") and text.startswith("W/") else text))
    return tuple(out)


# -- a local directory -------------------------------------------------------------------------


class LocalStorage:
    """A tree in a local directory, read relative to the root's descriptor (held until :meth:`close`).

    Every directory and file below the root is opened relative to its parent's descriptor
    without following symbolic links; files must be regular. A root whose name is a staging
    directory or old copy of an unfinished write is refused.

    Raises:
        NotCommittedError: ``prefix`` is the staging directory or old copy of a write.
        NotAMemtreeError: ``prefix`` does not exist or is not a directory.
        InvalidArgumentError: ``prefix`` is a remote URL (a ``file://`` URL is its local path:
            :func:`local_path`).
    """

    def __init__(self, prefix: str | os.PathLike[str], *, root_fd: int | None = None) -> None:
        """Open the tree at ``prefix``; with ``root_fd``, read the root directory the caller has
        already opened (a duplicate of that descriptor is held): the very directory, even if
        ``prefix`` names another one by now."""
        where = local_path(
            prefix,
            remote="this reads local directories; memtree.load_memmap, memtree.verify_tree and "
            "memtree info take URLs, or copy the tree locally first",
        )
        self.root = os.path.realpath(os.fspath(where))
        if is_uncommitted_name(os.path.basename(self.root)):
            raise NotCommittedError(
                f"{self.root} is the staging directory (or old copy) of a write that never "
                "finished; it is not a committed tree. memtree.recover() on its parent directory "
                "restores or deletes it"
            )
        self.fd: int | None = open_dir(self.root, self.root, None) if root_fd is None else os.dup(root_fd)

    def __enter__(self) -> LocalStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the root's descriptor."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def describe(self, rel: str) -> str:
        """The file's path."""
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def _dir(self, names: list[str]) -> int:
        """A new descriptor of the directory ``names`` below the root (the caller closes it)."""
        if self.fd is None:
            raise InvalidArgumentError(f"the storage of {self.root} is closed; open a new one")
        fd, where = os.dup(self.fd), self.root
        for name in names:
            where = os.path.join(where, name)
            try:
                child = open_dir(name, where, fd)
            finally:
                os.close(fd)
            fd = child
        return fd

    def read_meta(self, rel: str) -> bytes:
        """The level's ``meta.json`` (regular file, size checked with ``fstat`` before reading)."""
        fd = self._dir(split_rel(rel))
        try:
            data, _ = read_meta_bytes(fd, self.describe(rel), root=not rel)
        finally:
            os.close(fd)
        if len(data) > MAX_META_BYTES:  # it grew after its fstat
            raise LimitError(
                f"{self.describe(join_rel(rel, META_NAME))} has more than the {MAX_META_BYTES:,} "
                "bytes allowed for a meta.json"
            )
        return data

    def _open(self, rel: str, nbytes: int) -> tuple[int, os.stat_result]:
        *dirs, name = split_rel(rel)
        dir_fd = self._dir(dirs)
        try:
            return open_leaf(name, nbytes, self.describe(rel), dir_fd=dir_fd, strict_size=False)
        except MissingLeafError:
            if rel == META_NAME:
                raise NotAMemtreeError(f"{self.root} has no {META_NAME}: it is not a memtree directory") from None
            if nbytes == 0:  # a stat: no size is expected yet
                raise MissingLeafError(f"{self.describe(rel)} is missing; the tree is damaged") from None
            raise
        finally:
            os.close(dir_fd)

    def stat(self, rel: str) -> FileInfo:
        """Size and identity (device, inode, size, mtime) of a regular file."""
        fd, st = self._open(rel, 0)
        os.close(fd)
        ident = (("dev", str(st.st_dev)), ("ino", str(st.st_ino)), ("size", str(st.st_size)),
                 ("mtime_ns", str(st.st_mtime_ns)))
        return FileInfo(st.st_size, ident)

    def read_into(self, rel: str, offset: int, out: memoryview, info: FileInfo | None = None) -> None:
        """``pread`` exactly ``len(out)`` bytes. A local read is never pinned (``info`` is not
        needed): memtree replaces files, it never rewrites them in place, and a caller that must
        know compares :meth:`stat` identities."""
        fd, _ = self._open(rel, offset + len(out))
        try:
            done = 0
            while done < len(out):
                n = os.preadv(fd, [out[done:]], offset + done)
                if n <= 0:
                    raise StorageError(errno.EIO, f"{self.describe(rel)} ended after {offset + done:,} bytes while it was read")
                done += n
        except OSError as err:
            if isinstance(err, MemtreeError):
                raise
            raise storage_error(err, f"reading {self.describe(rel)}") from err
        finally:
            os.close(fd)
