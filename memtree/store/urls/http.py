"""HTTP(S) reads for :class:`~memtree.store.reading.storage.FsspecStorage`, on fsspec's aiohttp session.

fsspec's own HTTP calls read every body whole, follow any redirect, decompress whatever the
server compresses and put recorded names into URLs as they are. A hostile or broken server can
then make a load read a file outside the tree (a name such as ``%2E%2E%2Fsecret.memmap``,
decoded by the server), hold gigabytes in memory (a ``meta.json`` body of 512 MiB, a small gzip
body that inflates, a ``Range`` ignored), or stall for many minutes (a body that drips). Here:

* **names are quoted**: each recorded name is one path segment, percent-encoded with nothing
  left unescaped (``%`` included), so a server that decodes the path once gets exactly the
  recorded name, inside the tree's prefix. Names are first checked by
  :func:`~memtree.store.reading.storage.split_rel` (no ``/``, ``\\``, ``..``, hidden names);
* **redirects** are followed only to the tree URL's own origin (scheme, host, port) unless
  ``allow_redirects="any"``, at most 10 in a row, and credentials (``Authorization``,
  ``Cookie``) are never sent to another origin;
* **bodies are streamed with caps**: a ``meta.json`` stops at the size limit (counted after
  decompression, which is done here, bounded, when the server compresses despite
  ``Accept-Encoding: identity``); a range answer must be exactly the bytes asked (checked against
  ``Content-Range``, the size from ``HEAD`` and the bytes that arrive) and goes straight into the
  caller's buffer; a compressed range is refused;
* **every request has a deadline** (``timeout`` seconds from sending to its last byte); when
  it passes, the request is cancelled and a :class:`~memtree.errors.RemoteError` says so.

Example:
    >>> import fsspec
    >>> t = HttpTransport(fsspec.filesystem("http"), "http://h/tree", timeout=5, allow_redirects="same-origin")
    >>> str(t.url("a%20b.memmap"))
    'http://h/tree/a%2520b.memmap'
"""

from __future__ import annotations

import inspect
import re
import zlib
from typing import Any
from urllib.parse import quote

import aiohttp
import yarl
from fsspec.asyn import sync
from fsspec.exceptions import FSTimeoutError

from ...errors import InvalidArgumentError, LimitError, MissingLeafError, RemoteChangedError, RemoteError, RemoteRangeError
from ..reading.storage import FileInfo, ShortReadError, TransientError, identity_of, split_rel

__all__ = ["HttpTransport", "MAX_REDIRECTS"]

#: Redirects followed in a row before a request fails.
MAX_REDIRECTS = 10
_REDIRECTS = frozenset((301, 302, 303, 307, 308))
#: Headers never sent to an origin other than the tree URL's.
_CREDENTIALS = frozenset(("authorization", "cookie", "proxy-authorization"))
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: aiohttp >= 3.10 can leave a body compressed per request; older versions inflate it (capped
#: by what is read, not by what one network read inflates to).
_RAW_BODIES = "auto_decompress" in inspect.signature(aiohttp.ClientSession._request).parameters


class HttpTransport:
    """Ranged, capped, deadline-bound HTTP(S) reads of one tree (see the module docstring).

    Args:
        fs: fsspec's ``HTTPFileSystem`` (its aiohttp session, event loop and request options,
            such as ``headers`` or ``auth``, are used).
        url: the tree's URL, as the user wrote it.
        timeout: seconds one request may take (``None``: no limit).
        allow_redirects: ``"same-origin"``, ``"any"`` or ``"none"``.
    """

    def __init__(self, fs: Any, url: str, *, timeout: float | None, allow_redirects: str) -> None:
        self.fs = fs
        self.base = yarl.URL(url.rstrip("/"))
        if self.base.scheme not in ("http", "https") or not self.base.host:
            raise InvalidArgumentError(f"{url!r} is not an http(s) URL")
        self.timeout = timeout
        self.redirects = allow_redirects
        options = dict(fs.kwargs)
        options.pop("allow_redirects", None)  # memtree decides, per its policy
        self.headers: dict[str, str] = dict(options.pop("headers", None) or {})
        if _RAW_BODIES:
            options["auto_decompress"] = False
        self.options = options

    # -- URLs and requests ---------------------------------------------------------------------
    def url(self, rel: str) -> yarl.URL:
        """The URL of ``rel``: every name quoted as one segment (``%`` too), below the tree URL."""
        names = split_rel(rel)
        if not names:
            return self.base
        raw = self.base.raw_path.rstrip("/") + "".join("/" + quote(n, safe="") for n in names)
        return self.base.with_path(raw, encoded=True)

    def _run(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return sync(self.fs.loop, fn, *args, timeout=self.timeout)
        except FSTimeoutError:
            raise RemoteError(
                f"{what}: no complete answer within timeout={self.timeout:g} s; the server is "
                "stalled or too slow. Retry later, or raise timeout= (or lower chunk_bytes=)"
            ) from None

    async def _send(self, method: str, rel: str, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """Send a request and follow redirects as the policy allows; the caller closes the answer."""
        session = await self.fs.set_session()
        url = self.url(rel)
        sent = {**self.headers, "Accept-Encoding": "identity", **headers}
        for _ in range(MAX_REDIRECTS + 1):
            r: aiohttp.ClientResponse = await session.request(
                method, url, headers=sent, allow_redirects=False, **self.options
            )
            location = r.headers.get("Location")
            if r.status not in _REDIRECTS or location is None:
                return r
            r.release()
            target = url.join(yarl.URL(location))
            self._check_redirect(rel, target)
            if target.origin() != url.origin():
                sent = {k: v for k, v in sent.items() if k.lower() not in _CREDENTIALS}
            url = target
        raise RemoteError(f"{self.url(rel)}: more than {MAX_REDIRECTS} redirects in a row; check the URL")

    def _check_redirect(self, rel: str, target: yarl.URL) -> None:
        if self.redirects == "any":
            return
        if self.redirects == "none":
            raise RemoteError(
                f"{self.url(rel)} redirects to {target}; allow_redirects='none' follows no "
                "redirect: pass allow_redirects='same-origin' or 'any', or use the final URL"
            )
        if target.origin() != self.base.origin():
            raise RemoteError(
                f"{self.url(rel)} redirects to another origin ({target.origin()}); memtree "
                f"follows redirects within {self.base.origin()} only. Pass "
                "allow_redirects='any' if you trust where it leads, or use that URL directly"
            )

    def _check_status(self, r: aiohttp.ClientResponse, rel: str) -> None:
        status = r.status
        if status in (200, 206):
            return
        where = self.url(rel)
        if status in (404, 410):
            raise MissingLeafError(f"{where} does not exist (HTTP {status}); the tree is damaged")
        if status == 412:
            raise RemoteChangedError(
                f"{where} changed while the tree was being read (HTTP 412 on If-Match); it was "
                "overwritten meanwhile: load it again"
            )
        if status == 416:
            raise RemoteRangeError(
                f"{where}: the server refused the byte range (HTTP 416); the object is shorter "
                "than its meta.json says: the tree is damaged or being rewritten"
            )
        if status >= 500 or status in (408, 429):
            raise TransientError(f"HTTP {status} {r.reason or ''}".rstrip())
        raise RemoteError(f"{where}: the server answered HTTP {status} {r.reason or ''}; check the URL and credentials")

    # -- the three reads -----------------------------------------------------------------------
    def stat(self, rel: str) -> FileInfo:
        """``HEAD`` (``GET`` of byte 0 where ``HEAD`` is refused or gives no size)."""
        return self._run(f"HEAD {self.url(rel)}", self._stat, rel)  # type: ignore[no-any-return]

    async def _stat(self, rel: str) -> FileInfo:
        size: int | None = None
        async with await self._send("HEAD", rel, {}) as r:
            if r.status not in (405, 501):  # HEAD not allowed: ask for byte 0 instead
                self._check_status(r, rel)
                size = _plain_length(r)
            headers = r.headers
        if size is None:
            async with await self._send("GET", rel, {"Range": "bytes=0-0"}) as r:
                self._check_status(r, rel)
                m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", ""))
                size = int(m.group(3)) if r.status == 206 and m and m.group(3) != "*" else _plain_length(r)
                headers = r.headers
        if size is None:
            encoding = headers.get("Content-Encoding")
            why = (f"it compresses the object (Content-Encoding: {encoding}) although memtree asks for "
                   "identity" if encoding else "no Content-Length or Content-Range")
            raise RemoteError(
                f"{self.url(rel)}: the server does not say how large the object is ({why}); serve "
                "the tree uncompressed from a server that reports sizes"
            )
        etag = headers.get("ETag")
        fields = {"ETag": etag, "Last-Modified": headers.get("Last-Modified"), "size": size}
        pin = etag if etag and not etag.startswith("W/") else None  # If-Match compares strong ETags
        return FileInfo(size, identity_of(fields), pin)

    def read_meta(self, rel: str, cap: int) -> bytes:
        """The whole body of ``rel``, streamed; more than ``cap`` bytes (after decompression)
        raise :class:`~memtree.errors.LimitError` as soon as they arrive."""
        return self._run(f"GET {self.url(rel)}", self._read_meta, rel, cap)  # type: ignore[no-any-return]

    async def _read_meta(self, rel: str, cap: int) -> bytes:
        async with await self._send("GET", rel, {}) as r:
            self._check_status(r, rel)
            length = _plain_length(r)
            if length is not None and length > cap:
                raise _too_large(self.url(rel), cap, f"Content-Length says {length:,}")
            encoding = r.headers.get("Content-Encoding", "identity").lower()
            inflate = None
            if _RAW_BODIES and encoding in ("gzip", "x-gzip", "deflate"):
                inflate = zlib.decompressobj(wbits=47)  # gzip or zlib header
            elif _RAW_BODIES and encoding not in ("identity", ""):
                raise RemoteError(f"{self.url(rel)}: unsupported Content-Encoding {encoding!r}; serve meta.json uncompressed")
            parts: list[bytes] = []
            total = 0
            async for piece in r.content.iter_any():
                while piece and total <= cap:
                    if inflate is None:
                        out, piece = piece, b""
                    else:
                        try:
                            out = inflate.decompress(piece, cap + 1 - total)
                        except zlib.error as err:
                            raise RemoteError(f"{self.url(rel)}: its {encoding} body is corrupt ({err})") from None
                        piece = inflate.unconsumed_tail
                    parts.append(out)
                    total += len(out)
                if total > cap:
                    raise _too_large(self.url(rel), cap, "the body went on")
            return b"".join(parts)

    def read_into(self, rel: str, offset: int, out: memoryview, info: FileInfo | None) -> None:
        """One ``GET`` with ``Range`` (and ``If-Match`` when ``info`` pins a strong ETag)."""
        what = f"GET {self.url(rel)} bytes {offset:,}..{offset + len(out):,}"
        self._run(what, self._read_into, rel, offset, out, info)

    async def _read_into(self, rel: str, offset: int, out: memoryview, info: FileInfo | None) -> None:
        n = len(out)
        end = offset + n
        headers = {"Range": f"bytes={offset}-{end - 1}"}
        if info is not None and info.pin:
            headers["If-Match"] = info.pin
        async with await self._send("GET", rel, headers) as r:
            self._check_status(r, rel)
            where = self.url(rel)
            encoding = r.headers.get("Content-Encoding", "identity").lower()
            if encoding not in ("identity", ""):
                raise RemoteRangeError(
                    f"{where}: the server compressed its answer (Content-Encoding: {encoding}) "
                    "although memtree asked for identity; a compressed range is not the file's "
                    "bytes. Serve .memmap files uncompressed"
                )
            if r.status == 200:  # Range ignored: only the whole file, asked whole, will do
                length = _plain_length(r)
                if offset != 0 or (length is not None and length != n) or (info is not None and info.size != n):
                    raise RemoteRangeError(
                        f"{where}: asked for bytes [{offset:,}, {end:,}) and got the whole object "
                        f"({length if length is not None else 'unknown'} bytes): the server "
                        "ignores Range requests. Serve the tree from a server that honours Range "
                        "(any object store, nginx, caddy...)"
                    )
            else:
                m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", ""))
                if m is None or (int(m.group(1)), int(m.group(2))) != (offset, end - 1):
                    raise RemoteRangeError(
                        f"{where}: asked for bytes {offset}-{end - 1}, the server answered "
                        f"Content-Range {r.headers.get('Content-Range')!r}"
                    )
                if info is not None and m.group(3) != "*" and int(m.group(3)) != info.size:
                    raise RemoteChangedError(
                        f"{where} now has {int(m.group(3)):,} bytes, it had {info.size:,} when "
                        "the load began: it changed meanwhile; load the tree again"
                    )
            pos = 0
            async for piece in r.content.iter_any():
                if pos + len(piece) > n:
                    raise RemoteRangeError(
                        f"{where}: the answer to bytes [{offset:,}, {end:,}) holds more than "
                        f"{n:,} bytes; the server does not honour Range"
                    )
                out[pos : pos + len(piece)] = piece
                pos += len(piece)
            if pos < n:
                raise ShortReadError(f"got {pos:,} of {n:,} bytes for [{offset:,}, {end:,})")


def _too_large(url: yarl.URL, cap: int, why: str) -> LimitError:
    return LimitError(
        f"{url} has more than the {cap:,} bytes allowed for a meta.json ({why}); it is not a "
        "memtree meta.json. Nothing more was read"
    )


def _plain_length(r: aiohttp.ClientResponse) -> int | None:
    """``Content-Length`` of an uncompressed answer (a compressed one's says nothing of the file)."""
    if r.headers.get("Content-Encoding", "identity").lower() not in ("identity", ""):
        return None
    try:
        length = int(r.headers.get("Content-Length", ""))
    except ValueError:
        return None
    return length if length >= 0 else None
