"""Writing packs of small leaves (format version 3, :mod:`memtree.format.packs`).

:func:`memtree.store.writing.write.plan_write` gives every tensor leaf under the write's threshold
(``pack_below``) a place in a pack (:func:`~memtree.format.packs.layout_packs`); the writer then
makes each pack with :func:`write_pack`: the members' bytes are copied into one buffer at their
offsets (zeros between them), each member's checksum is taken from the buffer, and the buffer is
written with one ``pwrite`` into a new file at the staging directory's root (or, with
``link_from``, the previous tree's pack is hard-linked instead when it holds these very bytes:
:meth:`memtree.store.writing.linking.LinkSource.link_pack`). One file, one write and one checksum pass
per pack instead of one file per leaf: the per-file work of the kernel (creating, allocating,
closing, later opening and mapping) is what makes many small files slow.

Example:
    >>> import os, tempfile, torch
    >>> d = tempfile.mkdtemp()
    >>> job = PackJob("~pack-0.memmap", 128, [PackMember(("a",), torch.ones(2), 8, 0),
    ...                                      PackMember(("b",), torch.arange(3, dtype=torch.int16), 6, 64)])
    >>> data, sums = assemble(job, lambda m: m.tensor, "crc32")
    >>> write_pack(d, job, data)
    >>> sorted(sums), os.path.getsize(os.path.join(d, "~pack-0.memmap"))
    ([('a',), ('b',)], 128)
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
import torch

from ...errors import MemtreeError, StorageError
from ..primitives.files import FileRange, allocate_fd, new_file, preallocate_fd, storage_error, write_fd
from ..primitives.memory import byte_view, is_plain_memory
from ..reading.integrity import bytes_checksum

__all__ = ["PackMember", "PackJob", "assemble", "write_pack"]


@dataclass(slots=True)
class PackMember:
    """A leaf that goes into a pack: its key path, its data, its size and its offset there."""

    key: tuple[str, ...]
    tensor: torch.Tensor
    nbytes: int
    offset: int


@dataclass
class PackJob:
    """One pack file to write: its name (at the tree's root), size, and members in offset order."""

    name: str
    nbytes: int
    members: list[PackMember] = field(default_factory=list)

    @property
    def where(self) -> str:
        """The pack as error messages show it."""
        return f"pack {self.name} ({len(self.members)} leaves)"


def assemble(
    job: PackJob,
    data_of: Callable[[PackMember], torch.Tensor | FileRange],
    checksum: str | None,
) -> tuple[torch.Tensor, dict[tuple[str, ...], str]]:
    """The pack's bytes (a uint8 tensor of ``job.nbytes``, zeros between the members) and, with
    ``checksum``, each member's checksum by key path.

    ``data_of(member)`` gives the bytes to copy: a contiguous CPU tensor, or a
    :class:`~memtree.store.primitives.files.FileRange` read with ``pread`` (a checkpoint's tensor).
    """
    buf = bytearray(job.nbytes)  # zeros: the gaps between members are defined bytes
    view = memoryview(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf)) if job.nbytes else 0
    sums: dict[tuple[str, ...], str] = {}
    for m in job.members:
        if m.nbytes:
            data = data_of(m)
            if isinstance(data, FileRange):
                _read_range(data, view[m.offset : m.offset + m.nbytes])
            elif is_plain_memory(data):
                ctypes.memmove(base + m.offset, data.data_ptr(), m.nbytes)
            else:
                view[m.offset : m.offset + m.nbytes] = byte_view(data)
        if checksum is not None:
            sums[m.key] = bytes_checksum(checksum, view[m.offset : m.offset + m.nbytes])  # (any buffer)
    out = torch.frombuffer(buf, dtype=torch.uint8) if job.nbytes else torch.empty(0, dtype=torch.uint8)
    return out, sums


def _read_range(data: FileRange, out: memoryview) -> None:
    done = 0
    while done < len(out):
        n = os.preadv(data.fd, [out[done:]], data.offset + done)
        if n <= 0:
            raise StorageError(
                errno.EIO,
                f"{data.what} ends before its {data.nbytes:,} bytes: the file was truncated or "
                "replaced while it was read; check it and try again",
            )
        done += n


def write_pack(
    staging: str,
    job: PackJob,
    data: torch.Tensor | None,
    *,
    reserve: bool = False,
    fsync: bool = False,
) -> None:
    """Create the pack ``job`` at the root of the staging directory ``staging``, holding ``data``
    (its bytes, from :func:`assemble`), or zeros for ``data=None`` (``memmap_like``: sparse
    unless ``reserve``); ``fsync`` flushes it (when the commit does not flush the whole staging
    directory at once).

    Raises:
        StorageError: the file cannot be created or written (a full disk...).
    """
    try:
        fd = new_file(os.path.join(staging, job.name))
        try:
            if data is None:
                allocate_fd(fd, job.nbytes, reserve=reserve)
            else:
                preallocate_fd(fd, job.nbytes)
                write_fd(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except MemtreeError:
        raise
    except OSError as err:
        raise storage_error(err, f"writing {job.where}") from err
