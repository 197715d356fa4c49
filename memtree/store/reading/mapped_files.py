"""The file behind each memory-mapped tensor, and the bounded cache of write descriptors.

Row writes into a :class:`~memtree.MemoryMappedTensor` go to its file with ``pwrite`` through a
descriptor of that very file (checked by identity), never through whatever the path names now;
see :mod:`memtree.store.reading.mapped`.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "x.memmap")
    >>> _ = open(path, "wb").write(b"0123")
    >>> st = os.stat(path)
    >>> f = MappedFile(path, (st.st_dev, st.st_ino))
    >>> os.pwrite(WRITERS.get(f).fd, b"ab", 1), open(path, "rb").read()
    (2, b'0ab3')
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["FileId", "WriteFd", "MappedFile", "Writers", "WRITERS"]

#: A file's identity: ``(st_dev, st_ino)``.
FileId = tuple[int, int]
_WRITE_FLAGS = os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_NOFOLLOW", 0)


class WriteFd:
    """An open write descriptor; closed when the last user lets go of it."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:
        # os.close bound at definition: at interpreter exit a module's globals may already be
        # None when the last mapping goes ("Exception ignored in WriteFd.__del__ ... AttributeError")
        try:
            _close(self.fd)
        except OSError:
            pass


class MappedFile:
    """The file a :class:`~memtree.MemoryMappedTensor` was mapped from, shared by all views of it.

    ``file_id`` is the file's identity ``(st_dev, st_ino)``, read from the descriptor it was
    mapped from: row writes go to that very file with ``pwrite`` (see :mod:`memtree.store.reading.mapped`),
    never to whatever file the path names now. Recently written files keep a write descriptor
    (``writer``); it closes with the last view of the mapping, or earlier when more than
    ``WRITERS.size`` files are being written (the least recently written closes first).
    """

    __slots__ = ("path", "file_id", "writer", "stale", "__weakref__")

    def __init__(self, path: str, file_id: FileId) -> None:
        self.path = path
        self.file_id = file_id
        self.writer: WriteFd | None = None
        self.stale = False  # the path names another file now: write through the mapping


class Writers:
    """The bounded set of :class:`MappedFile` objects holding a write descriptor, in LRU order.

    A descriptor is opened by path and kept only when ``fstat`` shows the identity the file
    was mapped with; a path that names another file now (the tree was re-saved in place) marks
    the mapping stale, and its writes go through the mapping. An evicted descriptor closes when
    the last writer using it lets go (:class:`WriteFd`), so a concurrent ``pwrite`` never uses
    a closed (or reused) descriptor number. A forked child drops every descriptor
    (:meth:`forget` runs right after ``fork``, before the child's code can close or reuse
    descriptor numbers).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.open: OrderedDict[int, weakref.ref[MappedFile]] = OrderedDict()

    def get(self, file: MappedFile) -> WriteFd | None:
        """A write descriptor of ``file``, or None when only the mapping can reach the file."""
        writer = file.writer
        if writer is not None:
            self.touch(file)
            return writer
        with self.lock:
            writer = file.writer
            if writer is not None:
                return writer
            if file.stale:
                return None
            try:
                fd = os.open(file.path, _WRITE_FLAGS)
            except OSError as err:
                # gone (the tree was removed): for good; other errors (EMFILE...) may pass
                file.stale = err.errno in (errno.ENOENT, errno.ENOTDIR)
                return None
            writer = WriteFd(fd)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != file.file_id:
                file.stale = True
                return None  # closes fd
            file.writer = writer
            key = id(file)
            self.open[key] = weakref.ref(file, lambda _: self.open.pop(key, None))
            while len(self.open) > self.size:
                evicted = self.open.popitem(last=False)[1]()
                if evicted is not None:
                    evicted.writer = None
            return writer

    def touch(self, file: MappedFile) -> None:
        """Mark ``file``'s descriptor as just used."""
        try:
            self.open.move_to_end(id(file))
        except KeyError:  # evicted just now: the caller still holds the descriptor
            pass

    def forget(self) -> None:
        """Drop every descriptor at once (in a new child: the parent's lock may be held)."""
        self.lock = threading.Lock()
        for ref in self.open.values():
            file = ref()
            if file is not None:
                file.writer = None
        self.open.clear()


#: At most this many mapped files keep a write descriptor open.
WRITERS = Writers(8)
os.register_at_fork(after_in_child=WRITERS.forget)
