"""The storage seam over any fsspec URL (``s3://``, ``https://``, ``memory://``...).

:class:`FsspecStorage` is the :class:`~memtree.store.reading.storage.Storage` of a remote tree (the
optional extra ``memtree[remote]``: fsspec, aiohttp; s3fs for ``s3://``). HTTP(S) goes through
:class:`~memtree.store.urls.http.HttpTransport`: names quoted into URLs, redirects within the URL's
origin only (unless ``allow_redirects="any"``), bodies streamed with caps, a deadline per
request. Other filesystems go through fsspec's ranged reads (``cat_file`` with ``start``/``end``,
a ``meta.json`` read as one range of at most the size limit plus one byte), with the same
deadline on asynchronous filesystems (S3, GCS...). Every request is retried on transient
failures (:func:`~memtree.store.reading.storage.with_retries`) and every answer is checked for its exact
length.

Example:
    >>> import fsspec
    >>> fsspec.filesystem("memory").pipe_file("memory://doc-storage/t/x.memmap", b"abcd")
    >>> s = FsspecStorage("memory://doc-storage/t")
    >>> out = bytearray(2)
    >>> s.read_into("x.memmap", 1, memoryview(out)); bytes(out), s.stat("x.memmap").size
    (b'bc', 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import (
    InvalidArgumentError,
    LimitError,
    MemtreeError,
    MissingLeafError,
    NotAMemtreeError,
    NotCommittedError,
    RemoteError,
    RemoteRangeError,
    UnsafePathError,
)
from ...format.names import META_NAME, is_uncommitted_name
from ...format.schema import MAX_META_BYTES
from ..reading.storage import FileInfo, ShortReadError, identity_of, join_rel, split_rel, with_retries

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

__all__ = ["FsspecStorage", "DEFAULT_TIMEOUT", "REDIRECT_POLICIES"]

#: Seconds one remote request may take, from sending it to its last byte.
DEFAULT_TIMEOUT = 60.0
#: What ``allow_redirects=`` accepts: follow redirects to the same origin (scheme, host, port)
#: only, to any origin, or none at all.
REDIRECT_POLICIES = ("same-origin", "any", "none")


class FsspecStorage:
    """A tree at an fsspec URL (``s3://``, ``https://``, ``memory://``...).

    Args:
        url: the tree's prefix.
        storage_options: passed to fsspec.
        retries: attempts after the first for each request (transient failures only).
        timeout: seconds one request may take, from sending it to its last byte (``None``: no
            limit). Enforced for HTTP(S) and fsspec's asynchronous filesystems (S3, GCS...);
            a request that takes longer raises :class:`~memtree.errors.RemoteError` at once
            (a server that drips bytes is not retried).
        allow_redirects: HTTP(S) only: ``"same-origin"`` (default) follows redirects to the
            same scheme, host and port only; ``"any"`` follows any; ``"none"`` refuses every
            redirect.

    Raises:
        ImportError: fsspec is not installed (the ``memtree[remote]`` extra).
        NotCommittedError: the URL names the staging prefix of an unfinished write.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        retries: int = 3,
        timeout: float | None = DEFAULT_TIMEOUT,
        allow_redirects: str = "same-origin",
    ) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError as err:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "memtree's remote trees need fsspec: pip install 'memtree[remote]' (and s3fs for s3:// URLs)"
            ) from err
        if retries < 0:
            raise InvalidArgumentError(f"retries must be >= 0, got {retries}")
        if timeout is not None and not timeout > 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds > 0 (or None), got {timeout!r}")
        if allow_redirects not in REDIRECT_POLICIES:
            raise InvalidArgumentError(f"allow_redirects must be one of {REDIRECT_POLICIES}, got {allow_redirects!r}")
        self.url = url.rstrip("/")
        if is_uncommitted_name(self.url.rsplit("/", 1)[-1]):
            raise NotCommittedError(f"{url} is the staging prefix of a write that never committed")
        fs, root = url_to_fs(url, **dict(storage_options or {}))
        self.fs: AbstractFileSystem = fs
        self.root: str = root.rstrip("/")
        self.retries = retries
        self.timeout = timeout
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.s3 = bool({"s3", "s3a"} & set(protocols))
        self.http = None
        if {"http", "https"} & set(protocols):
            from .http import HttpTransport

            self.http = HttpTransport(fs, self.url, timeout=timeout, allow_redirects=allow_redirects)

    def close(self) -> None:
        """Nothing to release (fsspec keeps its sessions per filesystem instance)."""

    def describe(self, rel: str) -> str:
        """The object's URL (quoted, as requested, for HTTP)."""
        if self.http is not None:
            return str(self.http.url(rel))
        return join_rel(self.url, "/".join(split_rel(rel)))

    def path(self, rel: str) -> str:
        """The object's path on the filesystem (what fsspec calls take)."""
        return join_rel(self.root, "/".join(split_rel(rel)))

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>(...)``; on an asynchronous filesystem, under the request timeout."""
        fs = self.fs
        if not getattr(fs, "async_impl", False) or self.timeout is None:
            return getattr(fs, name)(*args, **kwargs)
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        try:
            return sync(fs.loop, getattr(fs, "_" + name), *args, timeout=self.timeout, **kwargs)
        except FSTimeoutError:
            raise RemoteError(
                f"{name} of {args[0] if args else self.url} took more than timeout={self.timeout:g} s; "
                "the server is too slow or stalled: retry later, or raise timeout= "
                "(or lower chunk_bytes=)"
            ) from None

    def _missing(self, rel: str) -> MemtreeError:
        if rel != META_NAME:
            return MissingLeafError(f"{self.describe(rel)} does not exist; the tree is damaged")
        if self.http is None:
            try:
                listed = bool(self.call("ls", self.root, detail=False))
            except Exception:  # listing is not supported everywhere: treat as empty
                listed = False
            if listed:
                return NotCommittedError(
                    f"{self.url} has objects but no root {META_NAME}: its upload never committed "
                    "(the root meta.json is written last). Upload the tree again"
                )
        return NotAMemtreeError(f"{self.url} has no {META_NAME}: it is not a memtree (check the URL)")

    def stat(self, rel: str) -> FileInfo:
        """``HEAD`` (HTTP) or ``fs.info``: size, identity and the pin for later reads."""
        what = f"{self.describe(rel)}"
        if self.http is not None:
            http = self.http
            try:
                return with_retries(lambda: http.stat(rel), what, self.retries)
            except MissingLeafError:
                raise self._missing(rel) from None
        path = self.path(rel)

        def call() -> FileInfo:
            self.fs.invalidate_cache(path)
            try:
                info = dict(self.call("info", path))
            except FileNotFoundError:
                raise self._missing(rel) from None
            size = info.get("size")
            if info.get("type") == "directory" or type(size) is not int:
                raise UnsafePathError(f"{what} is not a file (fsspec reports {info.get('type')!r}, size {size!r})")
            pin = {"version_id": info["VersionId"]} if self.s3 and info.get("VersionId") not in (None, "null") else None
            return FileInfo(size, identity_of(info), pin)

        return with_retries(call, what, self.retries)

    def read_meta(self, rel: str) -> bytes:
        """The level's ``meta.json``: streamed with a cap (HTTP), or one bounded ranged read."""
        meta_rel = join_rel(rel, META_NAME)
        what = f"reading {self.describe(meta_rel)}"
        if self.http is not None:
            http = self.http
            try:
                data = with_retries(lambda: http.read_meta(meta_rel, MAX_META_BYTES), what, self.retries)
            except MissingLeafError:
                raise self._missing(meta_rel) from None
        else:
            path = self.path(meta_rel)

            def call() -> bytes:
                try:
                    got = self.call("cat_file", path, start=0, end=MAX_META_BYTES + 1)
                except FileNotFoundError:
                    raise self._missing(meta_rel) from None
                return bytes(got)

            data = with_retries(call, what, self.retries)
        if len(data) > MAX_META_BYTES:
            raise LimitError(
                f"{self.describe(meta_rel)} has more than the {MAX_META_BYTES:,} bytes allowed for "
                "a meta.json; it is not a memtree meta.json"
            )
        return data

    def read_into(self, rel: str, offset: int, out: memoryview, info: FileInfo | None = None) -> None:
        """One ranged request (retried when short or dropped) whose answer must hold exactly
        ``len(out)`` bytes; pinned to ``info`` where the store supports it."""
        n = len(out)
        if n == 0:
            return
        what = f"{self.describe(rel)}"
        if self.http is not None:
            http = self.http
            with_retries(lambda: http.read_into(rel, offset, out, info), what, self.retries)
            return
        path = self.path(rel)
        kwargs = dict(info.pin) if info is not None and info.pin else {}

        def call() -> None:
            data = self.call("cat_file", path, start=offset, end=offset + n, **kwargs)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise RemoteError(f"{what}: the filesystem returned {type(data).__name__}, not bytes")
            if len(data) > n:
                raise RemoteRangeError(
                    f"{what}: asked for bytes [{offset:,}, {offset + n:,}) and got {len(data):,} "
                    "bytes: the store ignores ranged reads"
                )
            if len(data) < n:
                raise ShortReadError(f"got {len(data):,} of {n:,} bytes for [{offset:,}, {offset + n:,})")
            out[:] = data

        with_retries(call, what, self.retries)
