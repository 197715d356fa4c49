"""Filling existing tensors from byte ranges of files: threaded ``preadv`` into their own memory.

:func:`fill` takes a list of :class:`FillJob` (a destination tensor and the
:class:`~memtree.store.primitives.files.FileRange` that holds its bytes) and reads every range once, with
no mapping of the file and no second copy in memory:

* **direct** (a contiguous CPU tensor of the source's dtype, the usual case): the bytes are read
  with ``os.preadv`` straight into the tensor's storage, in pieces of at most
  :data:`READ_CHUNK` bytes spread over up to ``num_threads`` threads (as many as the work keeps
  busy: a small load runs in the calling thread). Pieces are read in file order, and pieces
  that lie one after another in one file (a checkpoint's small tensors) are read together, one
  ``preadv`` into several tensors (gaps of at most :data:`READ_GAP` bytes between them are read
  into a scratch buffer). Short reads are continued; a file that ends inside its range raises
  :class:`~memtree.errors.StorageError` (``EIO``) naming the tensor;
* **staged** (a dtype cast, a non-contiguous or non-CPU destination): reader threads fill a
  bounded ring of host buffers, the calling thread copies each buffer into its place in the
  destination (``copy_``, casting on the way) and hands the buffer back once its copy is done.
  For CPU destinations the ring holds a few :data:`BOUNCE_BYTES` buffers; for CUDA it holds
  page-locked buffers (at most :data:`PINNED_RING_BYTES` in all, a module setting) and the
  host-to-device copies run on a CUDA stream, ordered by events, while the next reads go on.
  The ring is released before :func:`fill` returns, whatever happened (page-locked buffers go
  back to torch's pinned-memory cache); any error in a reader thread or in a copy stops the
  others, joins every thread and is raised.

Every range is checked against its file's size first (``fstat``): a file already too short
raises before anything is written. A file that shrinks during the read raises the same error,
and says that destinations may then be partly overwritten. A job may carry a checksum check
(``(algorithm, callback)``): the callback gets the ``"algorithm:hex"`` of the bytes read.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.store.primitives.files import FileRange
    >>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
    >>> _ = open(path, "wb").write(torch.arange(6, dtype=torch.float32).numpy().tobytes())
    >>> fd = os.open(path, os.O_RDONLY)
    >>> live = torch.zeros(2, 3)
    >>> fill([FillJob(live, FileRange(fd, 0, 24, "tensor 'w'"))])
    >>> os.close(fd); live.tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
"""

from __future__ import annotations

import errno
import functools
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...errors import InvalidArgumentError, MemtreeError, StorageError
from ...format.dtypes import itemsize
from .files import FileRange, storage_error
from .checksums import crc32, file_checksum, tensor_checksum
from .memory import byte_view, is_plain_memory, writable_view

__all__ = [
    "READ_THREADS",
    "READ_CHUNK",
    "BOUNCE_BYTES",
    "PINNED_RING_BYTES",
    "FillJob",
    "Copier",
    "HostCopier",
    "CudaCopier",
    "fill",
    "mapped_range",
    "read_exact",
    "read_views",
]

#: Threads that read at most (a small load is read by fewer, or by the calling thread).
READ_THREADS = 4
#: Bytes each reader thread must have to read, at least: a smaller load is read by fewer
#: threads, or by the calling thread alone (starting a thread costs more than it saves).
READ_MIN_WORK = 4 * 1024 * 1024
#: Bytes one ``preadv`` asks for: large reads, and pieces small enough to spread one big tensor
#: over the threads.
READ_CHUNK = 16 * 1024 * 1024
#: Most bytes of a file between two ranges that one read spans (their bytes are read into a
#: scratch buffer and dropped): a ``torch.save`` file has a zip header (~100 bytes, with its
#: alignment padding) between two records, so its small tensors are read a run at a time.
READ_GAP = 4096


def _iov_max() -> int:
    """Most buffers one ``preadv`` takes here (Linux: 1024)."""
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 16
    return min(n, 1024) if n > 0 else 16


_IOV_MAX = _iov_max()
_SCRATCH = bytearray(READ_GAP)  # where gap bytes land (never read; threads share it)
#: Host buffer size for casts and non-contiguous CPU destinations (``READ_THREADS + 2`` of them:
#: the most memory a cast load holds besides its destinations).
BOUNCE_BYTES = 8 * 1024 * 1024
#: Most page-locked host memory a load onto a CUDA device holds at once (the ring of buffers the
#: reads fill while earlier buffers are copied to the device). A module setting: assign
#: ``memtree.store.primitives.fill.PINNED_RING_BYTES = 256 << 20`` to use less. The ring uses at most
#: ``2 * READ_THREADS + 2`` buffers of up to :data:`PINNED_CHUNK` bytes, and never more than
#: the load needs; it is released before the load returns (into torch's pinned-memory cache,
#: which reuses it for the next pinned allocation).
PINNED_RING_BYTES = 512 * 1024 * 1024
#: Size of one buffer of the pinned ring.
PINNED_CHUNK = 32 * 1024 * 1024
_READ_ONLY = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_POLL = 0.05  # seconds a waiting reader sleeps between checks of the stop flag
_Check = tuple[str, Callable[[str], None]]


@dataclass(frozen=True)
class FillJob:
    """One destination tensor and the bytes of a file that fill it.

    Attributes:
        dest: the tensor to fill, on any device but ``meta``, any layout; its ``numel`` times
            the source dtype's item size must be ``source.nbytes``.
        source: where the bytes are (the descriptor stays open during :func:`fill`).
        dtype: the dtype of the bytes, when it differs from ``dest.dtype`` (they are cast).
        checksum: ``(algorithm, check)``: ``check("<algorithm>:<hex>")`` is called with the
            checksum of the bytes once they are read (it raises on a mismatch).
    """

    dest: torch.Tensor
    source: FileRange
    dtype: torch.dtype | None = None
    checksum: _Check | None = None

    @property
    def src_dtype(self) -> torch.dtype:
        """The dtype of the bytes in the file."""
        return self.dtype if self.dtype is not None else self.dest.dtype

    @property
    def direct(self) -> bool:
        """True when the bytes are read straight into ``dest``'s memory."""
        return self.src_dtype == self.dest.dtype and is_plain_memory(self.dest)


def read_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``offset``; continue short reads.

    Raises:
        StorageError: the file ends before ``view`` is full (``EIO``), or a read fails.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(path, "wb").write(b"0123456789")
        >>> fd, buf = os.open(path, os.O_RDONLY), bytearray(4)
        >>> read_exact(fd, memoryview(buf), 3, "bytes"); os.close(fd); bytes(buf)
        b'3456'
    """
    read_views(fd, [view], offset, what)


def read_views(fd: int, views: Sequence[memoryview], offset: int, what: str) -> None:
    """Fill ``views`` one after another with the bytes of ``fd`` from ``offset``: one ``preadv``
    for all of them (at most ``IOV_MAX``), continued on short reads.

    Raises:
        StorageError: the file ends before the last view is full (``EIO``), or a read fails.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(path, "wb").write(b"0123456789")
        >>> fd, a, b = os.open(path, os.O_RDONLY), bytearray(2), bytearray(3)
        >>> read_views(fd, [memoryview(a), memoryview(b)], 4, "bytes"); os.close(fd); bytes(a), bytes(b)
        (b'45', b'678')
    """
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        try:
            n = os.preadv(fd, views, offset + done)
        except OSError as err:
            raise storage_error(err, f"reading {what}") from err
        if n <= 0:
            raise StorageError(
                errno.EIO,
                f"{what}: the file ends at byte {offset + done:,}, inside the recorded range "
                f"[{offset:,}, {offset + total:,}); it was truncated or replaced while being "
                "read. The destination of this tensor (and others of the same load) may be "
                "partly overwritten: load again from an intact file",
            )
        done += n
        if done < total:  # a short read: drop what is full, continue in the view it ended in
            views = list(views)
            while n >= len(views[0]):
                n -= len(views.pop(0))
            views[0] = views[0][n:]


class Copier(Protocol):
    """How staged bytes reach their destination: the one part of :func:`fill` that knows the
    device. :class:`HostCopier` (CPU) and :class:`CudaCopier`; tests pass their own."""

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A new host buffer (a 1-d ``uint8`` CPU tensor of ``nbytes``)."""

    def release(self, buffer: torch.Tensor) -> None:
        """Give back a buffer of :meth:`buffer` (every one is released, errors or not)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying the host tensor ``src`` into ``dst`` (same shape); returns a token."""

    def wait(self, token: Any) -> None:
        """Wait until the copy of ``token`` is done (its buffer may then be reused)."""


class HostCopier:
    """Copies into CPU destinations, in the calling thread (a cast, or a strided destination)."""

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buffer: torch.Tensor) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def wait(self, token: Any) -> None:
        pass


class CudaCopier:
    """Host-to-device copies on a CUDA stream of their own, from page-locked buffers.

    Buffers are allocated page-locked by torch (``torch.empty(..., pin_memory=True)``, its
    caching host allocator, which records the copies' stream and keeps the memory for the next
    pinned allocation); where pinning fails they are pageable (slower, still correct), and no
    CUDA error is left pending: a failed ``cudaHostRegister`` called directly would leave one,
    which the next kernel launched in the thread raises as its own. The stream first waits for
    the device's current stream, so kernels queued before the load that use the destinations
    finish first.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def buffer(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # no page-locked memory left (torch clears the CUDA error it got)
            return torch.empty(nbytes, dtype=torch.uint8)

    def release(self, buffer: torch.Tensor) -> None:
        pass  # back to torch's allocator when dropped, once the copies recorded on it are done

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, token: Any) -> None:
        token.synchronize()


def _check_jobs(jobs: Sequence[FillJob]) -> None:
    sizes: dict[int, int] = {}
    for job in jobs:
        src = job.source
        if job.dest.device.type == "meta":
            raise InvalidArgumentError(f"{src.what}: cannot fill a tensor on the meta device")
        want = job.dest.numel() * itemsize(job.src_dtype)
        if src.nbytes != want or src.offset < 0:
            raise InvalidArgumentError(
                f"{src.what}: the file range holds {src.nbytes:,} bytes at offset {src.offset:,}, "
                f"the destination {job.src_dtype}{list(job.dest.shape)} needs {want:,}"
            )
        if src.fd not in sizes:
            try:
                sizes[src.fd] = os.fstat(src.fd).st_size
            except OSError as err:
                raise storage_error(err, f"reading {src.what}") from err
        if src.offset + src.nbytes > sizes[src.fd]:
            raise StorageError(
                errno.EIO,
                f"{src.what}: the file has {sizes[src.fd]:,} bytes, but the tensor's bytes are "
                f"recorded at [{src.offset:,}, {src.offset + src.nbytes:,}); the file is "
                "truncated or damaged. Nothing was written",
            )


def fill(
    jobs: Sequence[FillJob],
    *,
    num_threads: int | None = None,
    copier: Callable[[torch.device], Copier] | None = None,
    ring_bytes: int | None = None,
) -> None:
    """Read every job's bytes into its destination (see the module docstring).

    Args:
        jobs: what to fill; destinations must not overlap one another.
        num_threads: most reader threads (default :data:`READ_THREADS`; 0: the calling thread).
        copier: makes the :class:`Copier` for the destinations of one device that are not
            filled directly (default: :class:`HostCopier` on the CPU, :class:`CudaCopier` on
            CUDA).
        ring_bytes: most bytes of staging buffers held at once (default: :data:`BOUNCE_BYTES`
            per thread on the CPU, :data:`PINNED_RING_BYTES` on a device).

    Raises:
        StorageError: a file is shorter than a range (before anything is written), ends or
            fails while being read.
        InvalidArgumentError: a destination's size does not match its range, or is on ``meta``.
        MemtreeError: what a job's checksum check raises (its message then says that the
            destinations may be partly overwritten: the bytes are checked as they are read).

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "h.bin")
        >>> _ = open(path, "wb").write(torch.ones(4, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
        >>> fd, out = os.open(path, os.O_RDONLY), torch.zeros(4)   # bf16 bytes into float32
        >>> fill([FillJob(out, FileRange(fd, 0, 8, "h"), dtype=torch.bfloat16)])
        >>> os.close(fd); out.tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    threads = READ_THREADS if num_threads is None else num_threads
    _check_jobs(jobs)
    direct: list[FillJob] = []
    staged: dict[torch.device, list[FillJob]] = {}
    for job in jobs:
        if job.direct:
            direct.append(job)
        else:
            staged.setdefault(job.dest.device, []).append(job)
    if direct:
        _fill_direct(direct, threads)
    for device, group in staged.items():
        if copier is not None:
            made = copier(device)
        elif device.type == "cpu":
            made = HostCopier()
        elif device.type == "cuda":
            made = CudaCopier(device)
        else:  # another accelerator: stage in host memory, copy_ moves it
            made = HostCopier()
        host = device.type == "cpu"
        if ring_bytes is not None:
            ring = ring_bytes
        else:
            ring = BOUNCE_BYTES * (max(threads, 1) + 2) if host else PINNED_RING_BYTES
        _fill_staged(group, made, threads, ring, BOUNCE_BYTES if host else PINNED_CHUNK)


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=1)
def _zeros_operators() -> list[list[int]]:
    """``ops[k]``: the GF(2) operator that appends ``2**k`` zero bytes to a CRC-32 (zlib's)."""
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]
    op = one_bit
    for _ in range(3):  # 8 bits: one byte
        op = [_gf2_times(op, op[n]) for n in range(32)]
    ops = [op]
    for _ in range(63):
        op = [_gf2_times(op, op[n]) for n in range(32)]
        ops.append(op)
    return ops


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)``.

    Example:
        >>> import zlib
        >>> crc32_combine(zlib.crc32(b"hello "), zlib.crc32(b"world"), 5) == zlib.crc32(b"hello world")
        True
    """
    zeros = _zeros_operators()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(zeros[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


class _Sums:
    """The checksums of the jobs that carry one, made as their pieces are read.

    CRC-32 is computed piece by piece, by the thread that read the piece (its bytes still in
    the CPU cache), and the pieces' CRCs are combined in order. Other algorithms hash the
    whole destination once it is read (direct fills), or read the range again (staged fills).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parts: dict[int, list[tuple[int, int, int]]] = {}  # job -> (offset, crc, nbytes)
        self.done: dict[int, int] = {}

    def empty(self, job: FillJob) -> None:
        if job.checksum is not None and job.source.nbytes == 0:
            self._finish(job, [], staged=not job.direct)

    def add(self, job: FillJob, offset: int, data: memoryview, *, staged: bool) -> None:
        if job.checksum is None:
            return
        crc = crc32(data) if job.checksum[0] == "crc32" else 0
        with self.lock:
            parts = self.parts.setdefault(id(job), [])
            parts.append((offset, crc, len(data)))
            done = self.done[id(job)] = self.done.get(id(job), 0) + len(data)
        if done == job.source.nbytes:
            self._finish(job, parts, staged=staged)

    @staticmethod
    def _finish(job: FillJob, parts: list[tuple[int, int, int]], *, staged: bool) -> None:
        assert job.checksum is not None
        algorithm, check = job.checksum
        src = job.source
        if algorithm == "crc32":
            crc = 0
            for _, part, nbytes in sorted(parts):
                crc = crc32_combine(crc, part, nbytes)
            found = f"crc32:{crc:08x}"
        elif not staged:
            found = tensor_checksum(job.dest, algorithm)
        else:
            try:
                found = file_checksum(src.fd, src.nbytes, algorithm, src.offset)
            except OSError as err:
                raise storage_error(err, f"checking {src.what}") from err
        try:
            check(found)
        except MemtreeError as err:  # the bytes are in the destination already: say so
            if len(err.args) == 1 and isinstance(err.args[0], str):
                err.args = (
                    f"{err.args[0]}. The bytes were checked as they were read into place, so the "
                    "destination of this tensor (and others of the same load) may be partly "
                    "overwritten: load again from an intact file",
                )
            raise


@dataclass
class _Read:
    """One ``preadv`` of a direct fill: pieces of destinations that lie one after another in
    one file (with at most :data:`READ_GAP` bytes between two), in file order."""

    fd: int
    offset: int
    nbytes: int
    views: list[memoryview]  # the pieces, and scratch views for the gaps between them
    parts: list[tuple[FillJob, int, memoryview]]  # (job, where the piece starts in it, piece)

    @property
    def what(self) -> str:
        """The first tensor read, for messages (a tensor's pieces are never in one read)."""
        first, more = self.parts[0][0].source.what, len(self.parts) - 1
        return f"{first} (and {more} more tensors read with it)" if more else first


def _direct_reads(jobs: list[FillJob]) -> list[_Read]:
    """The reads of ``jobs``: each destination cut in pieces of at most :data:`READ_CHUNK`
    bytes, sorted by file and offset, and neighbours merged into one read of at most
    :data:`READ_CHUNK` bytes and :data:`_IOV_MAX` buffers (a gap's bytes land in scratch)."""
    pieces: list[tuple[int, int, FillJob, int, memoryview]] = []
    for job in jobs:
        view, src = writable_view(job.dest), job.source  # direct jobs: plain memory
        for s in range(0, len(view), READ_CHUNK):
            pieces.append((src.fd, src.offset + s, job, s, view[s : s + READ_CHUNK]))
    pieces.sort(key=lambda p: (p[0], p[1]))
    reads: list[_Read] = []
    last: _Read | None = None
    for fd, offset, job, start, piece in pieces:
        if last is not None and fd == last.fd:
            gap = offset - last.offset - last.nbytes  # < 0: overlaps (views of one storage)
            if (
                0 <= gap <= READ_GAP
                and last.nbytes + gap + len(piece) <= READ_CHUNK
                and len(last.views) + 2 <= _IOV_MAX
            ):
                if gap:
                    last.views.append(memoryview(_SCRATCH)[:gap])
                last.views.append(piece)
                last.parts.append((job, start, piece))
                last.nbytes += gap + len(piece)
                continue
        last = _Read(fd, offset, len(piece), [piece], [(job, start, piece)])
        reads.append(last)
    return reads


def _fill_direct(jobs: list[FillJob], threads: int) -> None:
    """Read ``jobs`` (plain contiguous CPU destinations) in file order, neighbouring pieces of
    one file in one ``preadv`` (:func:`_direct_reads`), by up to ``threads`` threads."""
    sums = _Sums()
    for job in jobs:
        sums.empty(job)
    reads = _direct_reads(jobs)

    def work(read: _Read) -> int:
        read_views(read.fd, read.views, read.offset, read.what)
        for job, start, piece in read.parts:
            sums.add(job, start, piece, staged=False)
        return read.nbytes

    total = sum(j.source.nbytes for j in jobs)
    _run(reads, work, _thread_count(threads, len(reads), total))


def _thread_count(num_threads: int, pieces: int, nbytes: int) -> int:
    """Reader threads worth starting: each must have :data:`READ_MIN_WORK` bytes (0: none)."""
    if num_threads < 2 or pieces < 2:
        return 0
    useful = nbytes // READ_MIN_WORK
    return min(num_threads, pieces, useful) if useful >= 2 else 0


def _run(items: Iterable[Any], work: Callable[[Any], int], threads: int) -> None:
    """``work(item)`` for every item (never ``None``), by ``threads`` threads (0: this thread).
    ``items`` may be a generator: the threads take its items one at a time, under a lock."""
    todo = iter(items)
    if threads == 0:
        for item in todo:
            work(item)
        return
    take = threading.Lock()

    def body(stop: threading.Event) -> None:
        while not stop.is_set():
            with take:  # one iterator, several threads
                item = next(todo, None)
            if item is None:
                return
            work(item)

    _in_threads(threads, body)


def _in_threads(
    threads: int,
    body: Callable[[threading.Event], None],
    main: Callable[[threading.Event], None] | None = None,
) -> None:
    """Run ``body(stop)`` in ``threads`` threads, and ``main(stop)`` in this one meanwhile.

    The first failure of a thread sets ``stop`` (bodies check it between pieces of work); a
    failure of ``main`` (or an interrupt) sets it too. Every thread is joined before anything
    is raised: ``main``'s failure first, else the first thread's.
    """
    stop = threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            body(stop)
        except BaseException as err:  # noqa: BLE001 - raised by the calling thread
            failures.append(err)
            stop.set()

    started: list[threading.Thread] = []
    try:
        for i in range(threads):
            t = threading.Thread(target=run, name=f"memtree-read-{i}", daemon=True)
            t.start()
            started.append(t)
        if main is not None:
            main(stop)
        for t in started:
            t.join()
    except BaseException:
        stop.set()
        for t in started:
            t.join()
        raise
    if failures:
        raise failures[0]


def _pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` that cover it in row-major order, each of at most ``limit`` elements."""
    n = t.numel()
    if n == 0:
        return
    if n <= limit or t.dim() == 0:
        yield t
    elif t.is_contiguous():
        flat = t.view(-1)
        for i in range(0, n, limit):
            yield flat[i : i + limit]
    else:
        row = n // t.shape[0]
        if row <= limit:
            step = limit // row
            for i in range(0, t.shape[0], step):
                yield t[i : i + step]
        else:
            for i in range(t.shape[0]):
                yield from _pieces(t[i], limit)


@dataclass
class _Piece:
    job: FillJob
    dest: torch.Tensor  # a view of job.dest
    offset: int  # in the file
    nbytes: int


def _staged_pieces(jobs: list[FillJob], chunk: int) -> Iterator[_Piece]:
    for job in jobs:
        size = itemsize(job.src_dtype)
        offset = job.source.offset
        for view in _pieces(job.dest, max(1, chunk // size)):
            nbytes = view.numel() * size
            yield _Piece(job, view, offset, nbytes)
            offset += nbytes


def _fill_staged(jobs: list[FillJob], copier: Copier, threads: int, ring_bytes: int, chunk: int) -> None:
    """Fill ``jobs`` through a ring of host buffers of at most ``chunk`` bytes each and
    ``ring_bytes`` in all (but one buffer of one element at least)."""
    total = sum(j.source.nbytes for j in jobs)
    widest = max(itemsize(j.src_dtype) for j in jobs)
    chunk = max(widest, min(chunk, ring_bytes // 2))
    estimate = total // chunk + len(jobs)
    readers = _thread_count(threads, estimate, total)
    count = max(1, min(ring_bytes // chunk, 2 * readers + 2, estimate))
    sums = _Sums()
    for job in jobs:
        sums.empty(job)
    buffers: list[torch.Tensor] = []
    try:
        for _ in range(count):
            buffers.append(copier.buffer(chunk))
        pieces = _staged_pieces(jobs, chunk)
        if readers == 0:
            for piece in pieces:
                buf = buffers[0]
                _read_piece(piece, buf, sums)
                with torch.no_grad():
                    copier.wait(copier.copy(piece.dest, _typed(buf, piece)))
        else:
            _pipeline(pieces, buffers, copier, readers, sums)
    finally:
        for buf in buffers:
            copier.release(buf)


def _read_piece(piece: _Piece, buf: torch.Tensor, sums: _Sums) -> None:
    job = piece.job
    view = byte_view(buf[: piece.nbytes])
    read_exact(job.source.fd, view, piece.offset, job.source.what)
    sums.add(job, piece.offset - job.source.offset, view, staged=True)


def _typed(buf: torch.Tensor, piece: _Piece) -> torch.Tensor:
    return buf[: piece.nbytes].view(piece.job.src_dtype).view(piece.dest.shape)


def _pipeline(
    pieces: Iterator[_Piece],
    buffers: list[torch.Tensor],
    copier: Copier,
    readers: int,
    sums: _Sums,
) -> None:
    """Reader threads fill free buffers; this thread copies them and frees them in order.

    Back-pressure: a reader waits for a free buffer, and a buffer is free again only once its
    copy is done (:meth:`Copier.wait`), one copy being in flight while the next is queued.
    """
    free: queue.Queue[torch.Tensor] = queue.Queue()
    for buf in buffers:
        free.put(buf)
    ready: queue.Queue[tuple[_Piece, torch.Tensor] | None] = queue.Queue()
    take = threading.Lock()

    def reader(stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                with take:  # one generator, several threads
                    piece = next(pieces, None)
                if piece is None:
                    return
                buf = None
                while buf is None and not stop.is_set():  # back-pressure: wait for a buffer
                    try:
                        buf = free.get(timeout=_POLL)
                    except queue.Empty:
                        pass
                if buf is None:
                    return
                try:
                    _read_piece(piece, buf, sums)
                except BaseException:
                    free.put(buf)
                    raise
                ready.put((piece, buf))
        finally:
            ready.put(None)  # this reader is done

    def copy_all(stop: threading.Event) -> None:
        inflight: deque[tuple[Any, torch.Tensor, _Piece]] = deque()

        def retire() -> None:
            token, buf, _ = inflight.popleft()
            copier.wait(token)
            free.put(buf)

        keep = 1 if len(buffers) > 1 else 0  # copies left in flight: never the last free buffer
        finished = 0
        try:
            while finished < readers:
                msg = ready.get()
                if msg is None:
                    finished += 1
                elif not stop.is_set():  # after a failure, only drain
                    piece, buf = msg
                    with torch.no_grad():
                        inflight.append((copier.copy(piece.dest, _typed(buf, piece)), buf, piece))
                    while len(inflight) > keep:
                        retire()
            while inflight and not stop.is_set():
                retire()
        finally:
            while inflight:  # the device must be done with a buffer before it is freed
                try:
                    copier.wait(inflight.popleft()[0])
                except Exception:  # noqa: BLE001 - the first failure is the one raised
                    pass

    _in_threads(readers, reader, copy_all)


def mapped_range(tensor: torch.Tensor) -> FileRange | None:
    """A new descriptor and range of the file bytes a mapped leaf shows, to read them again.

    For a contiguous :class:`~memtree.MemoryMappedTensor` of a file mapped from a tree: its
    file is opened again read-only, by path, without following links, and used only if it is
    the very file that was mapped (same ``st_dev``/``st_ino``; :func:`fill` checks its size:
    a mapped file that was truncated is an error, not a ``SIGBUS``). ``None`` when that does
    not hold (the caller then copies from the mapping). The caller closes the
    returned range's descriptor. Only for a mapping nobody has written to privately (a tree
    just loaded): a ``mode="r"`` mapping keeps private changes that the file does not have.

    Example:
        >>> import os, tempfile, torch, memtree
        >>> d = tempfile.mkdtemp() + "/t"
        >>> t = memtree.TensorTree({"x": torch.arange(4.0)}).memmap(d)
        >>> span = mapped_range(t["x"][1:])
        >>> (span.offset, span.nbytes), os.close(span.fd)
        ((4, 12), None)
    """
    file = getattr(tensor, "_file", None)
    if file is None:
        return None
    with torch._C.DisableTorchFunctionSubclass():  # no subclass round trip per attribute
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        offset = int(tensor.storage_offset()) * tensor.element_size()
        nbytes = tensor.numel() * tensor.element_size()
    try:
        fd = os.open(file.path, _READ_ONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == file.file_id and stat.S_ISREG(st.st_mode):
            return FileRange(fd, offset, nbytes, f"leaf {file.path}")  # fill checks the size
    except OSError:
        pass
    os.close(fd)
    return None
