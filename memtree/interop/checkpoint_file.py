"""A checkpoint file opened for lazy reads: one checked descriptor, exact ``pread``, one mapping.

Both checkpoint readers (:mod:`memtree.interop.torchsave`, :mod:`memtree.interop.safetensors_file`)
read tensors out of one big file at computed offsets, in one of two ways:

* :meth:`CheckpointFile.read_into` fills a new tensor with ``preadv`` at an offset: the process
  then holds exactly that tensor (used when converting, to bound the peak memory);
* :meth:`CheckpointFile.mapped` maps the whole file once, read-only and copy-on-write (pages are
  read when touched, and the file never changes through the mapping); tensors are zero-copy
  slices of it.

The path given by the user may be a symbolic link (model caches link to blobs); the file it
names must be a regular file.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.interop.checkpoint_file import CheckpointFile
    >>> path = os.path.join(tempfile.mkdtemp(), "blob")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(bytes(range(8)))
    >>> with CheckpointFile(path) as cf:
    ...     out = torch.empty(4, dtype=torch.uint8)
    ...     cf.read_into(out, 2)
    ...     out.tolist(), cf.mapped()[6:].tolist()
    ([2, 3, 4, 5], [6, 7])
"""

from __future__ import annotations

import errno
import os
import stat
from types import TracebackType
from typing import TypeVar

import torch

from ..errors import CheckpointFormatError, StorageError
from ..store.primitives.files import CHUNK_BYTES, map_fd, storage_error
from ..store.primitives.memory import byte_view

_Self = TypeVar("_Self", bound="Closing")

__all__ = ["CheckpointFile"]

_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


class Closing:
    """Mixin: ``with obj:`` returns ``obj`` and calls ``obj.close()`` on the way out."""

    def close(self) -> None:  # pragma: no cover - every user defines it
        raise NotImplementedError

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class CheckpointFile(Closing):
    """A regular file opened read-only, with its size fixed at open time.

    Args:
        path: the file (symbolic links are followed; the target must be a regular file).

    Raises:
        StorageError: the path does not exist (errno ``ENOENT``) or cannot be opened.
        CheckpointFormatError: the path is a directory, FIFO, device or socket.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            self.fd = os.open(self.path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise StorageError(
                errno.ENOENT, f"checkpoint {self.path} does not exist; check the path"
            ) from None
        except OSError as err:
            raise storage_error(err, f"opening checkpoint {self.path}") from err
        try:
            st = os.fstat(self.fd)
            if stat.S_ISDIR(st.st_mode):
                raise CheckpointFormatError(
                    f"{self.path} is a directory, not a checkpoint file; load memtree or "
                    "tensordict directories with memtree.load_memmap"
                )
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointFormatError(
                    f"{self.path} is not a regular file (mode {stat.filemode(st.st_mode)}); "
                    "a checkpoint must be a regular file"
                )
        except BaseException:
            os.close(self.fd)
            self.fd = -1  # __del__ still runs for an object whose __init__ raised
            raise
        self.size = st.st_size
        self._map: torch.Tensor | None = None

    def head(self, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes of the file (fewer if the file is shorter)."""
        return os.pread(self.fd, nbytes, 0)

    def read_bytes(self, offset: int, nbytes: int, what: str) -> bytes:
        """Exactly ``nbytes`` bytes at ``offset``.

        Raises:
            CheckpointFormatError: the file ends before ``offset + nbytes`` (truncated).
        """
        self.check_range(offset, nbytes, what)
        data = os.pread(self.fd, nbytes, offset)
        if len(data) != nbytes:
            raise self._truncated(offset, nbytes, what)
        return data

    def read_into(self, out: torch.Tensor, offset: int, what: str = "data") -> None:
        """Fill the contiguous CPU tensor ``out`` with the file's bytes at ``offset``."""
        view = byte_view(out)
        total = len(view)
        self.check_range(offset, total, what)
        done = 0
        while done < total:
            try:
                n = os.preadv(self.fd, [view[done : done + CHUNK_BYTES]], offset + done)
            except OSError as err:
                raise storage_error(err, f"reading {what} from {self.path}") from err
            if n <= 0:
                raise self._truncated(offset, total, what)
            done += n

    def mapped(self) -> torch.Tensor:
        """The whole file as a flat ``uint8`` tensor, mapped once, read-only (copy-on-write)."""
        if self._map is None:
            try:
                self._map = map_fd(self.fd, self.path, self.size, writable=False)
            except RuntimeError as err:  # torch reports mapping failures as RuntimeError
                raise StorageError(errno.EIO, f"cannot map {self.path}: {err}") from err
        return self._map

    def check_range(self, offset: int, nbytes: int, what: str) -> None:
        """Raise :class:`CheckpointFormatError` unless the file has bytes ``offset .. +nbytes``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise self._truncated(offset, nbytes, what)

    def _truncated(self, offset: int, nbytes: int, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{self.path}: {what} needs bytes {offset:,}..{offset + nbytes:,} but the file has "
            f"{self.size:,} bytes; the file is truncated or damaged: download or save it again"
        )

    def close(self) -> None:
        """Close the descriptor; tensors already mapped stay valid."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._map = None


    def __del__(self) -> None:
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
