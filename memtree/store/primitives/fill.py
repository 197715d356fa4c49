"""Filling existing tensors from byte ranges of files: threaded ``preadv`` into their own memory.

:func:`fill` takes a list of :class:`FillJob` (a destination tensor and the
:class:`~memtree.store.primitives.files.FileRange` that holds its bytes, or the :class:`MemoryRange` of a
tensor in host memory) and reads every range once, with no mapping of the file and no second
copy in memory:

* **direct** (a contiguous CPU tensor of the source's dtype, the usual case): the bytes are read
  with ``os.preadv`` straight into the tensor's storage, in pieces of at most
  :data:`READ_CHUNK` bytes spread over up to ``num_threads`` threads (as many as the work keeps
  busy: a small load runs in the calling thread). Pieces are read in file order, and pieces
  that lie one after another in one file (a checkpoint's small tensors) are read together, one
  ``preadv`` into several tensors (gaps of at most :data:`READ_GAP` bytes between them are read
  into a scratch buffer). Short reads are continued; a file that ends inside its range raises
  :class:`~memtree.errors.StorageError` (``EIO``) naming the tensor;
* **staged** (a dtype cast, a non-contiguous or non-CPU destination, or bytes already in host
  memory, :class:`MemoryRange`): reader threads fill a bounded ring of host buffers (``preadv``
  from the file, or a copy from the source's memory), the calling thread copies each buffer into
  its place in the destination (``copy_``, casting on the way) and hands the buffer back once
  its copy is done. For CPU destinations the ring holds a few :data:`BOUNCE_BYTES` buffers,
  allocated for the call. For CUDA it is :class:`PinnedRing`: page-locked buffers allocated
  once and lent to every load, sized to the load (a load never pins more than its bytes, all
  loads together never more than :data:`PINNED_RING_BYTES`), whose host-to-device copies run
  on a CUDA stream, ordered by events, while the next reads go on;
  :func:`release_pinned_memory` frees them. Any error in a reader thread or in a copy stops the
  others, joins every thread, waits for every copy in flight and is raised; the buffers go
  back to their ring whatever happened.

Every range is checked against its file's size first (``fstat``): a file already too short
raises before anything is written. A file that shrinks during the read raises the same error,
and says that destinations may then be partly overwritten. A job may carry a checksum check
(``(algorithm, callback)``): the callback gets the ``"algorithm:hex"`` of the bytes read; or
``(chunk sums, callback)`` (:class:`~memtree.format.chunks.ChunkSums`: per-chunk checksums):
each chunk is hashed as soon as its bytes are read, by the thread that read them, and the
callback gets the hex digest of every chunk.

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
import os
import queue
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union, cast

import torch

from ...errors import InvalidArgumentError, MemtreeError, StorageError
from ...format.chunks import ChunkSums, chunk_span, chunks_covering
from ...format.dtypes import itemsize
from .files import FileRange, storage_error
from .checksums import crc32, crc_combine, digest_factory, file_checksum, file_sums, tensor_checksum
from .memory import byte_view, is_plain_memory, writable_view

__all__ = [
    "READ_THREADS",
    "READ_CHUNK",
    "BOUNCE_BYTES",
    "PINNED_RING_BYTES",
    "PINNED_CHUNK",
    "PINNED",
    "FillJob",
    "MemoryRange",
    "memory_job",
    "Copier",
    "HostCopier",
    "PinnedRing",
    "CudaCopier",
    "release_pinned_memory",
    "fill",
    "mapped_range",
    "check_ranges",
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
#: Most page-locked host memory that CUDA loads hold, all loads of the process together: the
#: bytes of :class:`PinnedRing`, whose buffers the reads fill while earlier buffers are copied
#: to the device. A module setting, read at each load: assign
#: ``memtree.store.primitives.fill.PINNED_RING_BYTES = 128 << 20`` to pin less (a ring already larger is
#: cut down to it by the next load). One load asks for at most ``2 * READ_THREADS + 2``
#: buffers of up to :data:`PINNED_CHUNK` bytes, and never for more than its own bytes.
PINNED_RING_BYTES = 512 * 1024 * 1024
#: Most bytes of one buffer of the pinned ring.
PINNED_CHUNK = 32 * 1024 * 1024
_READ_ONLY = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_POLL = 0.05  # seconds a waiting reader sleeps between checks of the stop flag
_Check = Union[tuple[str, Callable[[str], None]], tuple[ChunkSums, Callable[[dict[int, str]], None]]]


@dataclass(frozen=True)
class MemoryRange:
    """Bytes already in host memory, that :func:`fill` stages like a file's: the reader threads
    copy them into the ring, whose buffers are copied into the destination (a CUDA tensor
    filled from a tensor in memory, or from a file mapping that may differ from its file).

    Attributes:
        data: the bytes, a 1-d ``uint8`` CPU tensor (a view of the source tensor's memory, which
            it keeps alive).
        what: the source, for messages.
    """

    data: torch.Tensor
    what: str

    @property
    def offset(self) -> int:
        """Where the bytes start in :attr:`data` (as in a file): always 0."""
        return 0

    @property
    def nbytes(self) -> int:
        """How many bytes."""
        return int(self.data.numel())


@dataclass(frozen=True)
class FillJob:
    """One destination tensor and the bytes of a file (or of host memory) that fill it.

    Attributes:
        dest: the tensor to fill, on any device but ``meta``, any layout; its ``numel`` times
            the source dtype's item size must be ``source.nbytes``.
        source: where the bytes are: a file range (the descriptor stays open during
            :func:`fill`), or a :class:`MemoryRange` (always staged through the ring).
        dtype: the dtype of the bytes, when it differs from ``dest.dtype`` (they are cast).
        checksum: ``(algorithm, check)``: ``check("<algorithm>:<hex>")`` is called with the
            checksum of the bytes once they are read (it raises on a mismatch); or ``(sums,
            check)``: ``check`` gets the hex digest of each of the chunks of ``sums`` (a
            :class:`~memtree.format.chunks.ChunkSums` of the range's bytes). File ranges only.
        max_gap: most bytes of the file between the end of the previous range and this one
            that a read may span to read both at once (the gap read and dropped): at most
            :data:`READ_GAP`; a rank reading one range per row of a column shard passes a
            fraction of the row, which bounds what it reads beyond its own bytes.
    """

    dest: torch.Tensor
    source: FileRange | MemoryRange
    dtype: torch.dtype | None = None
    checksum: _Check | None = None
    max_gap: int = READ_GAP

    @property
    def src_dtype(self) -> torch.dtype:
        """The dtype of the bytes in the file."""
        return self.dtype if self.dtype is not None else self.dest.dtype

    @property
    def direct(self) -> bool:
        """True when the bytes are read straight into ``dest``'s memory."""
        return (
            isinstance(self.source, FileRange)
            and self.src_dtype == self.dest.dtype
            and is_plain_memory(self.dest)
        )


def memory_job(dest: torch.Tensor, source: torch.Tensor, what: str) -> FillJob | None:
    """A job that fills ``dest`` from the host memory of ``source`` (same shape; cast if the
    dtypes differ) through the ring, or ``None`` when ``source`` is not a plain contiguous CPU
    tensor of that shape or ``dest`` not a plain tensor (no subclass: pass a
    ``MemoryMappedTensor`` as the plain tensor over its mapping, a parameter detached; the
    caller then copies it itself).

    Example:
        >>> import torch
        >>> dest = torch.zeros(2, 3, dtype=torch.float64).t()     # strided, and a cast
        >>> fill([memory_job(dest, torch.arange(6.0).reshape(3, 2), "x")])
        >>> dest.tolist()
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    if type(dest) is not torch.Tensor or not is_plain_memory(source) or source.shape != dest.shape:
        return None
    data = source.reshape(-1).view(torch.uint8)
    return FillJob(dest, MemoryRange(data, what), source.dtype if source.dtype != dest.dtype else None)


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

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """Between one and ``count`` host buffers (1-d ``uint8`` CPU tensors) of ``nbytes`` at
        least, for one load alone until :meth:`release`."""

    def release(self, buffers: list[torch.Tensor], reuse: bool) -> None:
        """Give back the buffers of :meth:`buffers` (once, errors or not). ``reuse`` is False
        when a copy from them failed, so that one may still read them: they are never lent
        again."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying the host tensor ``src`` into ``dst`` (same shape); returns a token."""

    def wait(self, token: Any) -> None:
        """Wait until the copy of ``token`` is done (its buffer may then be reused)."""


def _pageable(nbytes: int, count: int) -> list[torch.Tensor]:
    return [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]


class HostCopier:
    """Copies into CPU destinations, in the calling thread (a cast, or a strided destination),
    from buffers allocated for the call."""

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        return _pageable(nbytes, count)

    def release(self, buffers: list[torch.Tensor], reuse: bool) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        dst.copy_(src)
        return None

    def wait(self, token: Any) -> None:
        pass


def _pinned(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer from torch's pinned allocator (raises ``RuntimeError`` where
    none can be pinned; torch clears the CUDA error it got)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _unpin_cached() -> None:
    """Give the page-locked blocks that torch's pinned allocator keeps cached back to the
    system (it caches every freed block: without this, a buffer the ring frees stays pinned)."""
    if not torch.cuda.is_initialized():
        return  # nothing was pinned
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)  # torch >= 2.9
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class PinnedRing:
    """The page-locked host buffers that CUDA loads stage through, allocated once and lent to
    one load at a time (thread-safe: two loads at once never share a buffer).

    Its buffers all have one size, a power of two (what torch's pinned allocator reserves for
    any request): the largest a load has asked for since the ring was last emptied. A load
    gets *slots*: views of the buffers lent to it, of the size it asked for, as many as it asked
    for and no more buffers than those cover (so a small load borrows a larger buffer rather
    than pinning a new one). New buffers are allocated only to cover what a load asks for,
    and never beyond :data:`PINNED_RING_BYTES` (read at each :meth:`take`) for the buffers
    of every load together, idle or lent: a load that finds none free and no room (or where
    pinning fails) gets pageable buffers of its own instead (slower, still correct: it never
    waits for another load). A load asking for larger slots than the buffers makes the ring
    drop its idle buffers and allocate larger ones; buffers still lent are dropped when given
    back.

    Buffers are freed by :meth:`release` (:func:`release_pinned_memory`), by a lowered cap,
    when a larger size replaces theirs, and when given back after a failed copy. Freed memory
    goes back to the system (torch's pinned allocator would otherwise keep it cached): at once
    for idle buffers, at the next :meth:`take` or :meth:`release` for a buffer dropped as it is
    given back (its load still holds views of it then).

    ``allocate`` makes one buffer (default: pinned by torch), ``unpin`` returns freed memory to
    the system (default: empties torch's pinned cache); tests pass their own.

    Example:
        >>> ring = PinnedRing(allocate=lambda n: torch.empty(n, dtype=torch.uint8), unpin=lambda: None)
        >>> slots = ring.take(3000, 2)                 # two slots of 4096 bytes, in new buffers
        >>> [len(s) for s in slots], ring.held
        ([4096, 4096], 8192)
        >>> ring.give(slots, reuse=True)
        >>> [len(s) for s in ring.take(100_000, 1)], ring.held   # larger: the idle ones are freed
        ([131072], 131072)
    """

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor] = _pinned,
        unpin: Callable[[], None] = _unpin_cached,
    ) -> None:
        self._allocate = allocate
        self._unpin = unpin
        self._lock = threading.Lock()
        self._size = 0  # bytes of each buffer (0: none yet)
        self._idle: list[torch.Tensor] = []
        self._lent: dict[int, tuple[torch.Tensor, int]] = {}  # data_ptr -> (buffer, generation)
        self._generation = 0  # bumped by release(): buffers lent before it are dropped on return
        self._unpin_due = False  # a buffer was dropped since the last unpin
        self.held = 0  #: bytes of every buffer of the ring, idle or lent

    def take(self, nbytes: int, count: int) -> list[torch.Tensor]:
        """Up to ``count`` slots of ``nbytes`` (rounded up to a power of two) for one load,
        in buffers no other load holds until :meth:`give`; ``count`` pageable buffers where the
        ring has none for it."""
        cap = PINNED_RING_BYTES
        want = _pow2_at_least(nbytes)
        need = want * count
        if want > cap:  # never pinned: the ring keeps its buffers
            return _pageable(want, count)
        with self._lock:
            if want > self._size or self._size > cap or not self.held:  # larger, a cap below them, or none
                self._drop(len(self._idle))
                self._size = want
            while self._idle and self.held > cap:  # a cap lowered since: trim
                self._drop(1)
            size, generation = self._size, self._generation
            got: list[torch.Tensor] = []
            while self._idle and len(got) * size < need:
                got.append(self._idle.pop())
            new = 0
            while size <= need and (len(got) + new) * size < need and self.held + size <= cap:
                self.held += size  # reserved: allocated below, outside the lock
                new += 1
            unpin, self._unpin_due = self._unpin_due, False
        if unpin:  # before pinning more
            self._unpin()
        made: list[torch.Tensor] = []
        done = False
        try:
            try:
                while len(made) < new:
                    made.append(self._allocate(size))
            except RuntimeError:  # no page-locked memory left: the load uses what it got
                pass
            done = True
        finally:
            with self._lock:
                self.held -= size * (new - len(made))
                for buf in got + made:
                    self._lent[buf.data_ptr()] = (buf, generation)
            if not done:  # interrupted: none of them is lent
                self.give(got + made, reuse=True)
        if not got and not made:
            return _pageable(want, count)
        return [buf[i : i + want] for buf in got + made for i in range(0, size, want)][:count]

    def give(self, slots: list[torch.Tensor], reuse: bool) -> None:
        """Take back the buffers of slots of :meth:`take` (other tensors are ignored);
        ``reuse=False``: drop them (a copy from them may have failed)."""
        ptrs = {s.untyped_storage().data_ptr() for s in slots}
        with self._lock:
            for ptr in ptrs:
                lent = self._lent.pop(ptr, None)
                if lent is None:
                    continue
                buf, generation = lent
                if reuse and len(buf) == self._size and generation == self._generation and self.held <= PINNED_RING_BYTES:
                    self._idle.append(buf)
                else:
                    self.held -= len(buf)
                    self._unpin_due = True

    def release(self) -> int:
        """Free every idle buffer now, and those lent to loads running when they end; returns
        the bytes freed now."""
        with self._lock:
            freed = self._drop(len(self._idle))
            self._generation += 1
            unpin, self._unpin_due = self._unpin_due, False
        if unpin:
            self._unpin()
        return freed

    def _drop(self, n: int) -> int:
        """Forget the last ``n`` idle buffers (the lock held); their bytes."""
        dropped = self._idle[len(self._idle) - n :]
        del self._idle[len(self._idle) - n :]
        freed = sum(len(b) for b in dropped)
        self.held -= freed
        self._unpin_due = self._unpin_due or freed > 0
        return freed


#: The ring of every CUDA load of this process.
PINNED = PinnedRing()


def release_pinned_memory() -> int:
    """Free the page-locked buffers that CUDA loads keep between loads; returns the bytes freed.

    Loads onto a CUDA device stage their reads through one ring of page-locked host buffers
    (at most :data:`PINNED_RING_BYTES`, never more than the largest load needed), allocated by
    the first such load and kept for the next ones, as torch's own pinned allocator keeps what
    it frees. Call this after a one-off load to give that memory back to the system (the
    buffers of a load still running are freed when it ends); the next CUDA load pins new ones.

    Example:
        >>> release_pinned_memory() >= 0
        True
    """
    return PINNED.release()


class CudaCopier:
    """Host-to-device copies on a CUDA stream of their own, from the buffers of :data:`PINNED`.

    The buffers are allocated page-locked by torch (``torch.empty(..., pin_memory=True)``);
    where none can be pinned (no page-locked memory left, or the ring's buffers all lent to
    other loads), the load uses pageable buffers of its own (slower, still correct), and no
    CUDA error is left pending: a failed ``cudaHostRegister`` called directly would leave one,
    which the next kernel launched in the thread raises as its own. The stream first waits for
    the device's current stream, so kernels queued before the load that use the destinations
    finish first; every copy is waited for before :func:`fill` returns.
    """

    def __init__(self, device: torch.device, ring: PinnedRing | None = None) -> None:
        self.device = device
        self.ring = PINNED if ring is None else ring
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        return self.ring.take(nbytes, count)

    def release(self, buffers: list[torch.Tensor], reuse: bool) -> None:
        self.ring.give(buffers, reuse)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, token: Any) -> None:
        token.synchronize()


def _check_jobs(jobs: Sequence[FillJob]) -> None:
    ranges: list[FileRange] = []
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
        if isinstance(src, MemoryRange):
            if job.checksum is not None:
                raise InvalidArgumentError(f"{src.what}: a checksum is checked on a file's bytes, not memory's")
            continue
        ranges.append(src)
    check_ranges(ranges)


def check_ranges(ranges: Iterable[FileRange]) -> None:
    """Refuse a range that reaches past the end of its file (one ``fstat`` per descriptor): what
    :func:`fill` checks before it reads anything, for a caller that fills in several calls.

    Raises:
        StorageError: a range ends past its file's end (``EIO``), or ``fstat`` failed.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "f")
        >>> _ = open(path, "wb").write(b"0123")
        >>> fd = os.open(path, os.O_RDONLY)
        >>> check_ranges([FileRange(fd, 2, 4, "tensor 'w'")])
        Traceback (most recent call last):
        ...
        memtree.errors.StorageError: [Errno 5] tensor 'w': the file has 4 bytes, but the tensor's bytes are recorded at [2, 6); the file is truncated or damaged. Nothing was written
        >>> os.close(fd)
    """
    sizes: dict[int, int] = {}
    for src in ranges:
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
        ring_bytes: most bytes of staging buffers one device's destinations use (default:
            :data:`BOUNCE_BYTES` per thread and two more on the CPU, :data:`PINNED_RING_BYTES`
            on a device); never more than their own bytes (one element at least).

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
        _fill_staged(group, made, threads, ring, BOUNCE_BYTES if host else PINNED_CHUNK, host)


class _Sums:
    """The checksums of the jobs that carry one, made as their pieces are read.

    CRC-32 is computed piece by piece, by the thread that read the piece (its bytes still in
    the CPU cache), and the pieces' CRCs are combined in order. Per-chunk checksums
    (:class:`_Chunks`) hash each chunk that a piece holds whole right away, in the thread that
    read it. Other algorithms hash the whole destination once it is read (direct fills), or
    read the range again (staged fills).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parts: dict[int, list[tuple[int, int, int]]] = {}  # job -> (offset, crc, nbytes)
        self.done: dict[int, int] = {}
        self.chunks: dict[int, _Chunks] = {}

    def empty(self, job: FillJob) -> None:
        if job.checksum is not None and job.source.nbytes == 0:
            if isinstance(job.checksum[0], ChunkSums):  # never: a leaf of chunks has bytes
                raise InvalidArgumentError(f"{job.source.what}: per-chunk checksums of no byte")
            self._finish(job, [], staged=not job.direct)

    def add(self, job: FillJob, offset: int, data: memoryview, *, staged: bool) -> None:
        if job.checksum is None:
            return
        if isinstance(job.checksum[0], ChunkSums):
            with self.lock:
                state = self.chunks.get(id(job))
                if state is None:
                    state = self.chunks[id(job)] = _Chunks(job, job.checksum[0])
            state.add(offset, data, staged=staged)
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
        algorithm, check = cast(tuple[str, Callable[[str], None]], job.checksum)
        src = job.source
        if algorithm == "crc32":
            crc = 0
            for _, part, nbytes in sorted(parts):
                crc = crc_combine("crc32", crc, part, nbytes)
            found = f"crc32:{crc:08x}"
        elif not staged:
            found = tensor_checksum(job.dest, algorithm)
        else:
            assert isinstance(src, FileRange)  # _check_jobs: checksums of file ranges only
            try:
                found = file_checksum(src.fd, src.nbytes, algorithm, src.offset)
            except OSError as err:
                raise storage_error(err, f"checking {src.what}") from err
        _report(check, found)


def _report(check: Callable[[Any], None], found: Any) -> None:
    """Call a job's check; its error says that the destination may be partly written."""
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


class _Chunks:
    """The per-chunk checksums of one job, made as its pieces are read: a chunk that one piece
    holds whole is hashed from the piece at once (by the thread that read it); a chunk that
    pieces share is hashed once its last byte is read, from the destination (direct fills) or
    read again from the file (staged fills). The job's check gets every chunk's digest."""

    def __init__(self, job: FillJob, sums: ChunkSums) -> None:
        assert job.checksum is not None
        self.job = job
        self.check = cast(Callable[[Any], None], job.checksum[1])
        self.sums = sums
        self.nbytes = job.source.nbytes
        self.lock = threading.Lock()
        self.filled = [0] * sums.count  # bytes read of each chunk
        self.found: dict[int, str] = {}

    def add(self, offset: int, data: memoryview, *, staged: bool) -> None:
        size, end = self.sums.chunk_bytes, offset + len(data)
        whole: list[tuple[int, memoryview]] = []
        later: list[int] = []
        with self.lock:
            for k in chunks_covering(offset, end, self.nbytes, size):
                a, b = chunk_span(k, self.nbytes, size)
                if offset <= a and b <= end:
                    whole.append((k, data[a - offset : b - offset]))
                else:
                    self.filled[k] += min(b, end) - max(a, offset)
                    if self.filled[k] == b - a:
                        later.append(k)
        found = {k: self._hash(view) for k, view in whole}
        found.update((k, self._again(k, staged)) for k in later)
        with self.lock:
            self.found.update(found)
            complete = len(self.found) == self.sums.count and found
        if complete:
            _report(self.check, self.found)

    def _hash(self, view: memoryview) -> str:
        digest = digest_factory(self.sums.algorithm)()
        digest.update(view)
        return digest.hexdigest()

    def _again(self, k: int, staged: bool) -> str:
        """Chunk ``k``'s digest once all its bytes are read, in several pieces."""
        a, b = chunk_span(k, self.nbytes, self.sums.chunk_bytes)
        src = self.job.source
        if not staged:
            return self._hash(writable_view(self.job.dest)[a:b])
        assert isinstance(src, FileRange)
        try:
            return file_sums(src.fd, b - a, self.sums.algorithm, None, src.offset + a).digests
        except OSError as err:
            raise storage_error(err, f"checking {src.what}") from err


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
    bytes, sorted by file (in the order the jobs first name them) and offset, and neighbours
    merged into one read of at most :data:`READ_CHUNK` bytes and :data:`_IOV_MAX` buffers (a
    gap of at most the job's ``max_gap`` bytes lands in scratch)."""
    pieces: list[tuple[int, int, FillJob, int, memoryview]] = []
    order: dict[int, int] = {}  # fd -> place of the file in the jobs
    for job in jobs:
        view, src = writable_view(job.dest), job.source  # direct jobs: plain memory, from a file
        assert isinstance(src, FileRange)
        order.setdefault(src.fd, len(order))
        for s in range(0, len(view), READ_CHUNK):
            pieces.append((src.fd, src.offset + s, job, s, view[s : s + READ_CHUNK]))
    pieces.sort(key=lambda p: (order[p[0]], p[1]))
    reads: list[_Read] = []
    last: _Read | None = None
    for fd, offset, job, start, piece in pieces:
        if last is not None and fd == last.fd:
            gap = offset - last.offset - last.nbytes  # < 0: overlaps (views of one storage)
            if (
                0 <= gap <= min(READ_GAP, job.max_gap)
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


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _ring_shape(total: int, widest: int, slots: int, ring_bytes: int, chunk_max: int, jobs: int) -> tuple[int, int]:
    """``(bytes, count)`` of the buffers that ``jobs`` staged jobs of ``total`` bytes use:
    ``slots`` buffers of at most ``chunk_max`` bytes (a power of two, as torch's pinned
    allocator rounds), at most ``ring_bytes`` and ``total`` bytes in all, and no more buffers
    than pieces to read; one buffer of one element (``widest`` bytes) at least."""
    budget = max(widest, min(ring_bytes, total))
    chunk = _pow2_at_most(max(widest, min(chunk_max, budget // slots)))
    return chunk, max(1, min(slots, budget // chunk, total // chunk + jobs))


class _Watched:
    """A copier that remembers whether a copy or a wait failed: the device may then still read
    the buffers, which must not be lent again."""

    def __init__(self, copier: Copier) -> None:
        self.copier = copier
        self.failed = False

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        return self.copier.buffers(nbytes, count)

    def release(self, buffers: list[torch.Tensor], reuse: bool) -> None:
        self.copier.release(buffers, reuse and not self.failed)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        try:
            return self.copier.copy(dst, src)
        except BaseException:
            self.failed = True
            raise

    def wait(self, token: Any) -> None:
        try:
            self.copier.wait(token)
        except BaseException:
            self.failed = True
            raise


def _fill_staged(
    jobs: list[FillJob], copier: Copier, threads: int, ring_bytes: int, chunk_max: int, host: bool
) -> None:
    """Fill ``jobs`` through a ring of host buffers (:func:`_ring_shape`): ``readers + 2`` of
    them for a copier that copies as it is called (``host``), ``2 * readers + 2`` for one whose
    copies run meanwhile, one without reader threads."""
    sums = _Sums()
    for job in jobs:
        sums.empty(job)
    total = sum(j.source.nbytes for j in jobs)
    if total == 0:
        return
    widest = max(itemsize(j.src_dtype) for j in jobs)
    readers = _thread_count(threads, total // max(widest, min(chunk_max, ring_bytes // 2)) + len(jobs), total)
    slots = (readers + 2 if host else 2 * readers + 2) if readers else 1
    chunk, count = _ring_shape(total, widest, slots, ring_bytes, chunk_max, len(jobs))
    watched = _Watched(copier)
    buffers = watched.buffers(chunk, count)
    try:
        chunk = min(len(b) for b in buffers)  # a ring's buffers may be larger than asked
        pieces = _staged_pieces(jobs, chunk)
        if readers == 0:
            for piece in pieces:
                _read_piece(piece, buffers[0], sums)
                with torch.no_grad():
                    watched.wait(watched.copy(piece.dest, _typed(buffers[0], piece)))
        else:
            _pipeline(pieces, buffers, watched, readers, sums)
    finally:
        watched.release(buffers, True)


def _read_piece(piece: _Piece, buf: torch.Tensor, sums: _Sums) -> None:
    src = piece.job.source
    if isinstance(src, MemoryRange):
        buf[: piece.nbytes].copy_(src.data[piece.offset : piece.offset + piece.nbytes])  # without the GIL
        return
    view = byte_view(buf[: piece.nbytes])
    read_exact(src.fd, view, piece.offset, src.what)
    sums.add(piece.job, piece.offset - src.offset, view, staged=True)


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
