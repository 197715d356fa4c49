"""Remote load throughput vs ``num_threads``, over loopback HTTP with injected latency.

A local ``ThreadingHTTPServer`` (127.0.0.1, ``request_queue_size = 128``, Range + ETag support)
serves a memtree of ``--leaves`` leaves of ``--leaf-mib`` MiB; every request first sleeps
``--latency-ms`` (a stand-in for an object store's time to first byte). The tree is loaded with
``memtree.load_memmap(url, num_threads=N, chunk_bytes=...)`` for each N, bit-exactness is
checked, and the best of ``--repeat`` runs is reported as MiB/s and as a ratio to N = 1.

Run (needs the ``remote`` extra):

    .venv/bin/python benchmarks/remote_load.py
    .venv/bin/python benchmarks/remote_load.py --leaves 32 --leaf-mib 1 --latency-ms 20 --threads 1 2 4 8 16
    .venv/bin/python benchmarks/remote_load.py --checksum none   # + one size/ETag request per leaf
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

import memtree


class _Server(ThreadingHTTPServer):
    request_queue_size = 128
    daemon_threads = True

    def __init__(self, files: dict[str, bytes], latency: float) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.etags = {p: '"' + hashlib.sha256(b).hexdigest()[:16] + '"' for p, b in files.items()}
        self.latency = latency


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(False)

    def do_GET(self) -> None:
        self._serve(True)

    def _serve(self, body: bool) -> None:
        time.sleep(self.server.latency)
        data = self.server.files.get(self.path)
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end, status = 0, len(data), 200
        rng = self.headers.get("Range")
        if rng:
            a, _, b = rng.removeprefix("bytes=").partition("-")
            start, end, status = int(a), min(int(b) + 1, len(data)), 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", self.server.etags[self.path])
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start:end])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", type=int, default=32)
    parser.add_argument("--leaf-mib", type=float, default=1.0)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--chunk-mib", type=float, default=1.0)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--checksum", choices=["crc32", "sha256", "none"], default="crc32",
                        help="checksums recorded in meta.json (leaves without one cost a HEAD request)")
    args = parser.parse_args()

    n = int(args.leaf_mib * 2**20) // 4
    g = torch.Generator().manual_seed(0)
    tree = memtree.TensorTree({f"leaf{i:03d}": torch.randn(n, generator=g) for i in range(args.leaves)})
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tree.memmap(os.path.join(tmp, "t"), checksum=None if args.checksum == "none" else args.checksum)
        for name in os.listdir(os.path.join(tmp, "t")):
            with open(os.path.join(tmp, "t", name), "rb") as f:
                files[f"/t/{name}"] = f.read()
    server = _Server(files, args.latency_ms / 1000)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/t"
    total_mib = args.leaves * n * 4 / 2**20
    chunk = int(args.chunk_mib * 2**20)
    print(f"{args.leaves} leaves x {args.leaf_mib} MiB = {total_mib:.1f} MiB, chunk {args.chunk_mib} MiB, "
          f"{args.latency_ms} ms latency per request, checksum {args.checksum}, best of {args.repeat}")
    print(f"{'num_threads':>11} | {'seconds':>8} | {'MiB/s':>8} | {'vs 1 thread':>11}")
    print(f"{'-' * 11}-+-{'-' * 8}-+-{'-' * 8}-+-{'-' * 11}")
    base = None
    try:
        for threads in args.threads:
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                loaded = memtree.load_memmap(url, num_threads=threads, chunk_bytes=chunk)
                best = min(best, time.perf_counter() - t0)
            assert all(torch.equal(loaded[k], tree[k]) for k in tree.keys())
            rate = total_mib / best
            base = base or rate
            print(f"{threads:>11} | {best:>8.3f} | {rate:>8.1f} | {rate / base:>10.2f}x")
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
