"""A large leaf written in pieces, by several writer threads at once, each piece hashed as it
is written; and the hashing thread of a single writer.

:func:`memtree.store.writing.write.write_tree` writes a leaf larger than one piece as :class:`Pieces`:
with a checksum, one piece per checksum chunk (:mod:`memtree.format.chunks`), else
:data:`PIECE_BYTES`. Each piece is a task of its own, so the writer threads share one large
leaf instead of one thread writing (and hashing) all of it while the others are done. The first
piece to start creates the file (``O_EXCL``, preallocated), each piece is written with
``pwrite`` at its offset and hashed right after (its bytes still in the CPU cache), and the last
piece to finish fsyncs (when asked) and closes it.

A write without writer threads (``num_threads`` 0 or 1) that has chunks to hash gives them to a
:class:`Hasher`: one more thread, which hashes each chunk while the calling thread writes the
next one (``pwrite`` and every checksum algorithm release the GIL), so that the hashing
overlaps the writing instead of adding to it.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.format.chunks import ChunkSums
    >>> from memtree.store.primitives.checksums import digest_factory, view_sums
    >>> data = torch.arange(300_000, dtype=torch.int32)
    >>> leaf = Pieces(os.path.join(tempfile.mkdtemp(), "x.memmap"), data, data.nbytes, 1 << 18, "x")
    >>> [write_piece(leaf, i, digest_factory("crc32"), fsync=False) for i in range(leaf.count)]
    [False, False, False, False, True]
    >>> leaf.sums("crc32") == view_sums(memoryview(data.numpy()).cast("B"), "crc32", 1 << 18)
    True
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...format.chunks import ChunkSums, chunk_count, chunk_span
from ..primitives.checksums import DIGEST_SLICE, Digest
from ..primitives.files import FileRange, copy_from, new_file, preallocate_fd, write_view
from ..primitives.memory import byte_view

if TYPE_CHECKING:
    import torch

__all__ = ["PIECE_BYTES", "HASH_AHEAD", "Pieces", "Hasher", "write_piece"]

#: Bytes of a piece of a leaf written without a checksum (with one, a piece is a checksum chunk).
PIECE_BYTES = 16 * 1024 * 1024
#: Chunks a single writer may have written that its :class:`Hasher` has not hashed yet: it waits
#: beyond (a chunk is hashed while it is still in the CPU's last-level cache).
HASH_AHEAD = 2


class Pieces:
    """One leaf file written in pieces of ``size`` bytes (the last one shorter), in any order and
    by any threads.

    Attributes:
        target: the file's path (created by the first piece).
        data: a contiguous CPU tensor, or a :class:`~memtree.store.primitives.files.FileRange` of the bytes.
        nbytes: the file's size.
        size: bytes per piece.
        count: number of pieces.
        digests: each piece's hex digest, once hashed.
    """

    __slots__ = ("target", "data", "nbytes", "size", "count", "digests", "where", "_lock", "_fd", "_left", "_view")

    def __init__(self, target: str, data: torch.Tensor | FileRange, nbytes: int, size: int, where: str) -> None:
        self.target = target
        self.data = data
        self.nbytes = nbytes
        self.size = size
        self.count = chunk_count(nbytes, size)
        self.digests = [""] * self.count
        self.where = where  # the leaf's key, for messages
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._left = self.count
        self._view: memoryview | None = None  # the tensor's bytes

    def open(self) -> tuple[int, memoryview | None]:
        """The file (created and preallocated by the first caller) and the data's bytes (None
        for a file range)."""
        with self._lock:
            if self._fd is None:
                fd = new_file(self.target)
                try:
                    preallocate_fd(fd, self.nbytes)
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
                data = self.data
                if not isinstance(data, FileRange):
                    self._view = byte_view(data)
            return self._fd, self._view

    def done(self, *, fsync: bool) -> bool:
        """Count one piece written; the last one fsyncs (with ``fsync``) and closes the file.
        True for the last one."""
        with self._lock:
            self._left -= 1
            if self._left:
                return False
            fd, self._fd = self._fd, None
        assert fd is not None
        try:
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def close(self) -> None:
        """Close the file if a failure left it open (the staging directory is removed anyway)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def sums(self, algorithm: str) -> ChunkSums:
        """The checksums of the pieces, once every one was hashed (with ``algorithm``)."""
        return ChunkSums(algorithm, self.size, "".join(self.digests))


def write_piece(
    leaf: Pieces, i: int, digest: Callable[[], Digest] | None, *, fsync: bool, hasher: Hasher | None = None
) -> bool:
    """Write piece ``i`` of ``leaf`` at its offset, hashed with a new ``digest()`` right after
    each slice is written, or by ``hasher``; True when it was the leaf's last piece (its file
    closed).

    Raises:
        OSError: a write failed (the caller names the leaf).
        StorageError: a file range's file ended early.
    """
    fd, view = leaf.open()
    start, stop = chunk_span(i, leaf.nbytes, leaf.size)
    running = digest() if digest is not None and (hasher is None or view is None) else None
    if view is None:
        assert isinstance(leaf.data, FileRange)
        copy_from(leaf.data, fd, start, stop, running)
    else:
        write_view(fd, view[start:stop], start, running)
        if hasher is not None and digest is not None and running is None:
            hasher.submit(leaf, i, view[start:stop])
    if running is not None:
        leaf.digests[i] = running.hexdigest()
    return leaf.done(fsync=fsync)


class Hasher:
    """Hashes chunks in a thread of its own while the calling thread writes the next ones.

    :meth:`submit` queues a chunk (waiting while :data:`HASH_AHEAD` are queued); :meth:`close`
    waits for the last one and raises the first error of the hashing thread. The chunks' memory
    must stay valid until :meth:`close` returns.
    """

    def __init__(self, digest: Callable[[], Digest]) -> None:
        self._digest = digest
        self._queue: queue.Queue[tuple[Pieces, int, memoryview] | None] = queue.Queue(maxsize=HASH_AHEAD)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="memtree-hash", daemon=True)
        self._thread.start()

    def submit(self, leaf: Pieces, i: int, view: memoryview) -> None:
        """Hash ``view`` as piece ``i`` of ``leaf`` (raises the hashing thread's error, if any)."""
        if self._error is not None:
            raise self._error
        self._queue.put((leaf, i, view))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:  # failed: take the rest without hashing, never block a submit
                continue
            leaf, i, view = item
            try:
                d = self._digest()
                for start in range(0, len(view), DIGEST_SLICE):
                    d.update(view[start : start + DIGEST_SLICE])
                leaf.digests[i] = d.hexdigest()
            except BaseException as err:  # noqa: BLE001 - raised by the writer
                self._error = err

    def close(self, *, check: bool = True) -> None:
        """Wait for the queued chunks and stop the thread; with ``check``, raise its error."""
        self._queue.put(None)
        self._thread.join()
        if check and self._error is not None:
            raise self._error
