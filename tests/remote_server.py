"""An in-test HTTP server for remote trees, with switches for faults and hostile answers.

``ThreadingHTTPServer(("127.0.0.1", 0))`` with ``request_queue_size = 128`` (RELIABILITY §0.8:
the default backlog of 5 stalls concurrent clients for a second at a time). Paths are decoded
once and normalised, as a plain static file server does, so that a client that puts names into
URLs unquoted is caught the way a real server would catch it. It serves ``files`` (decoded URL
path -> bytes) with ``Range``, ``ETag`` and ``If-Match``, and counts what it sends.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import posixpath
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class FaultyServer(ThreadingHTTPServer):
    """Serves ``files`` with Range, ETag and If-Match; faults and lies by switch (see ``reset``)."""

    request_queue_size = 128
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.reset()

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hangs up mid-answer (what the tests provoke) is not an error."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def reset(self) -> None:
        self.ignore_range = False
        self.short_first = 0  # answer the next N leaf GETs with an honest but short body
        self.drop_first = 0  # promise the full length, send half, close the connection
        self.fail_first = 0  # answer the next N requests with 503
        self.latency = 0.0
        self.in_flight = 0  # requests inside their latency sleep now (counted only with latency)
        self.max_in_flight = 0
        self.change_after: int | None = None  # after N leaf GETs, every leaf changes (new ETag)
        self.redirects: dict[str, str] = {}  # path -> Location (302)
        self.drip: tuple[str, float] | None = None  # (path suffix, seconds per byte) of GET bodies
        self.streams: dict[str, int] = {}  # path -> size of a generated body, sent close-delimited
        self.head_sizes: dict[str, int] = {}  # path -> Content-Length a HEAD claims (a lie)
        self.encoded: dict[str, tuple[str, bytes]] = {}  # path -> (Content-Encoding, body)
        self.no_head = False  # answer every HEAD with 405
        self.content_range_shift = 0  # add this to the start in every Content-Range answered
        self.compress_ranges = False  # answer ranges gzipped (Content-Encoding: gzip), HEAD plain
        self.hold_after: int | None = None  # leaf GETs after the first N wait for ``release``, then are dropped
        self.release = threading.Event()
        self.leaf_gets = 0
        self.served: Counter[str] = Counter()  # body bytes sent per path
        self.gets: Counter[str] = Counter()
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def publish(self, local_dir: str, prefix: str) -> None:
        """Serve every file of a local tree under ``/<prefix>/``, by its real file name."""
        for dirpath, _, names in os.walk(local_dir):
            for name in names:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
                with open(full, "rb") as f:
                    self.files[f"/{prefix}/{rel}"] = f.read()

    def leaf_bytes(self) -> int:
        return sum(n for p, n in self.served.items() if p.endswith(".memmap"))


def etag(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultyServer

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def _take(self, name: str) -> bool:
        with self.server.lock:
            n = getattr(self.server, name)
            if n > 0:
                setattr(self.server, name, n - 1)
                return True
            return False

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _send(self, status: int, headers: dict[str, str], payload: bytes = b"") -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if payload:
            self.wfile.write(payload)

    def _count(self, path: str, n: int) -> None:
        with self.server.lock:
            self.server.served[path] += n

    def _serve(self, body: bool) -> None:
        srv = self.server
        raw = urlsplit(self.path).path
        path = posixpath.normpath(unquote(raw))  # what a static file server does with a path
        with srv.lock:
            srv.requests.append((self.command, path, dict(self.headers.items())))
        if srv.latency:
            with srv.lock:  # how many requests the server is answering at once
                srv.in_flight += 1
                srv.max_in_flight = max(srv.max_in_flight, srv.in_flight)
            try:
                time.sleep(srv.latency)
            finally:
                with srv.lock:
                    srv.in_flight -= 1
        if self._take("fail_first"):
            self._send(503, {"Content-Length": "0"})
            return
        if path in srv.redirects:
            self._send(302, {"Location": srv.redirects[path], "Content-Length": "0"})
            return
        leaf = path.endswith(".memmap")
        if body:
            hold = False
            with srv.lock:
                srv.gets[path] += 1
                if leaf:
                    srv.leaf_gets += 1
                    if srv.change_after is not None and srv.leaf_gets > srv.change_after:
                        for p in [p for p in srv.files if p.endswith(".memmap")]:
                            srv.files[p] = bytes(b ^ 0xFF for b in srv.files[p])
                        srv.change_after = None
                    hold = srv.hold_after is not None and srv.leaf_gets > srv.hold_after
            if hold:
                srv.release.wait(300)
                self.close_connection = True
                return
        if path in srv.streams:
            self._stream(path, srv.streams[path], body)
            return
        if not body and srv.no_head:
            self._send(405, {"Content-Length": "0", "Allow": "GET"})
            return
        if path in srv.encoded:
            encoding, data = srv.encoded[path]
            self._send(200, {"Content-Length": str(len(data)), "Content-Encoding": encoding}, data if body else b"")
            if body:
                self._count(path, len(data))
            return
        data = srv.files.get(path)
        if data is None:
            self._send(404, {"Content-Length": "0"})
            return
        tag = etag(data)
        match = self.headers.get("If-Match")
        if match is not None and match != tag:
            self._send(412, {"Content-Length": "0"})
            return
        start, end, status = 0, len(data), 200
        rng = self.headers.get("Range")
        if rng and not srv.ignore_range:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            start, end = int(a), min(int(b) + 1 if b else len(data), len(data))
            if start >= len(data):
                self._send(416, {"Content-Length": "0", "Content-Range": f"bytes */{len(data)}"})
                return
            status = 206
        part = data[start:end]
        headers = {"Content-Length": str(len(part)), "ETag": tag, "Accept-Ranges": "bytes"}
        if status == 206:
            s = start + srv.content_range_shift
            headers["Content-Range"] = f"bytes {s}-{s + len(part) - 1}/{len(data)}"
        if not body:
            if path in srv.head_sizes:
                headers["Content-Length"] = str(srv.head_sizes[path])
            self._send(status, headers)
            return
        if status == 206 and srv.compress_ranges:
            part = gzip.compress(part)
            headers.update({"Content-Length": str(len(part)), "Content-Encoding": "gzip"})
        if leaf and rng and self._take("short_first"):
            part = part[: len(part) // 2]
            headers["Content-Length"] = str(len(part))
        elif leaf and rng and self._take("drop_first"):
            self._send(status, headers, part[: len(part) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            self._count(path, len(part) // 2)
            return
        if srv.drip is not None and path.endswith(srv.drip[0]):
            self._drip(path, status, headers, part, srv.drip[1])
            return
        self._send(status, headers)
        try:
            for i in range(0, len(part), 1 << 20):  # count what the client lets through
                self.wfile.write(part[i : i + (1 << 20)])
                self._count(path, len(part[i : i + (1 << 20)]))
        except OSError:
            self.close_connection = True

    def _drip(self, path: str, status: int, headers: dict[str, str], part: bytes, pause: float) -> None:
        """Send the answer one byte at a time (until the client gives up)."""
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.close_connection = True
        try:
            for i in range(len(part)):
                self.wfile.write(part[i : i + 1])
                self.wfile.flush()
                self._count(path, 1)
                time.sleep(pause)
        except OSError:
            pass

    def _stream(self, path: str, size: int, body: bool) -> None:
        """A generated body of ``size`` bytes with no Content-Length (ended by closing), Range
        ignored; a HEAD claims ``head_sizes[path]`` bytes."""
        self.close_connection = True
        self.send_response(200)
        if not body:
            self.send_header("Content-Length", str(self.server.head_sizes.get(path, size)))
            self.end_headers()
            return
        self.send_header("Connection", "close")
        self.end_headers()
        piece = b"{" + b" " * ((1 << 20) - 1)
        sent = 0
        try:
            while sent < size:
                n = min(len(piece), size - sent)
                self.wfile.write(piece[:n])
                sent += n
                self._count(path, n)
        except OSError:
            pass


def start() -> tuple[FaultyServer, threading.Thread]:
    srv = FaultyServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    return srv, thread


def stop(srv: FaultyServer) -> None:
    srv.shutdown()
    srv.server_close()
