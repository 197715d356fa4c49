"""``open_checkpoint``: one lazy, read-only mapping interface over checkpoint files.

``open_checkpoint(path)`` recognises the file by its first bytes (not its name):

* a zip archive: a ``torch.save`` checkpoint (``.pt``, ``.pth``, ``.bin``, ``.ckpt``), read by
  :class:`~memtree.interop.torchsave.TorchSaveReader` (safe unpickling, lazy tensors);
* an 8-byte header size followed by ``{``, or a ``.safetensors`` name: a safetensors file, read
  by :class:`~memtree.interop.safetensors_file.SafetensorsReader`;
* a raw pickle or a tar archive: a legacy ``torch.save`` file, refused with a message saying how
  to convert it.

The result is a :class:`collections.abc.Mapping` from dotted keys (``"encoder.0.weight"``) to
tensors. Listing keys, ``len``, ``in`` and :meth:`Checkpoint.tensor_spec` read no tensor data;
each value is read when it is accessed, as a zero-copy view of a read-only (copy-on-write)
mapping of the file, so only the pages actually used are read from disk.

Example:
    >>> import os, tempfile, torch, memtree.interop
    >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
    >>> torch.save(torch.nn.Linear(3, 2).state_dict(), path)
    >>> with memtree.interop.open_checkpoint(path) as ckpt:
    ...     sorted(ckpt), ckpt.tensor_spec("weight")
    (['bias', 'weight'], (torch.Size([2, 3]), torch.float32))
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Union

import torch

from ..errors import CheckpointFormatError, LegacyCheckpointError
from .checkpoint_file import CheckpointFile, Closing
from .safetensors_file import SafetensorsReader, looks_like_safetensors
from .torchsave import TorchSaveReader, is_torch_zip, legacy_message

__all__ = ["Checkpoint", "open_checkpoint", "checkpoint_kind"]

Reader = Union[TorchSaveReader, SafetensorsReader]


def checkpoint_kind(path: str | os.PathLike[str]) -> str:
    """``"torch"`` or ``"safetensors"``, from the file's first bytes.

    Raises:
        LegacyCheckpointError: a legacy (pre-zip) ``torch.save`` file or a raw pickle.
        CheckpointFormatError: neither format.
    """
    with CheckpointFile(path) as f:
        head = f.head(512)
    name = os.fspath(path)
    if is_torch_zip(head):
        return "torch"
    if name.endswith(".safetensors") or looks_like_safetensors(head):
        return "safetensors"
    if head[:1] == b"\x80" or head[257:262] == b"ustar":
        raise LegacyCheckpointError(legacy_message(name))
    raise CheckpointFormatError(
        f"{name} is neither a torch.save checkpoint (zip) nor a safetensors file "
        f"(it starts with {head[:8]!r}); memtree reads those two, and memtree or tensordict "
        "directories with memtree.load_memmap"
    )


class Checkpoint(Closing, Mapping[str, torch.Tensor]):
    """A checkpoint file as a read-only mapping of dotted keys to lazily read tensors.

    Create one with :func:`open_checkpoint`. Close it (or use ``with``) to release the file;
    tensors already read stay valid.

    Attributes:
        path: the file.
        format: ``"torch"`` or ``"safetensors"``.
        non_tensors: non-tensor values by dotted key (``torch.save`` files: ``{"epoch": 3}``).
        metadata: a safetensors file's ``__metadata__`` (``None`` otherwise).
    """

    def __init__(self, reader: Reader, format: str) -> None:
        self._reader = reader
        self.path = reader.path
        self.format = format
        self.non_tensors: dict[str, Any] = (
            reader.non_tensors if isinstance(reader, TorchSaveReader) else {}
        )
        self.metadata: dict[str, str] | None = (
            reader.metadata if isinstance(reader, SafetensorsReader) else None
        )
        self._keys = reader.keys()
        self._key_set = set(self._keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._reader.read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def tensor_spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """``(shape, dtype)`` of ``key``, without reading its data.

        Raises:
            MemtreeKeyError: ``key`` is not a tensor of the checkpoint.
        """
        return self._reader.spec(key)

    def read(self, key: str, *, mmap: bool = True) -> torch.Tensor:
        """Read ``key``: a zero-copy mapped view, or with ``mmap=False`` a new tensor (``pread``).

        ``mmap=False`` holds exactly the tensor's bytes in memory (what a streaming conversion
        wants); a mapped view keeps file pages resident once touched.
        """
        return self._reader.read(key, mmap=mmap)

    def key_path(self, key: str) -> tuple[str, ...]:
        """How ``key`` was nested in the file (``("model", "encoder.weight")``)."""
        return self._reader.path_of(key)

    def close(self) -> None:
        """Release the file."""
        self._reader.close()


    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, format={self.format!r}, tensors={len(self)})"


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> Checkpoint:
    """Open a ``torch.save`` or ``.safetensors`` file lazily: a mapping of dotted keys to tensors.

    Args:
        path: the checkpoint file.
        allow_pickle: ``torch.save`` files only: let the pickle build objects outside memtree's
            safe allowlist (tensors, containers, scalars). Only for files you trust.

    Returns:
        A :class:`Checkpoint` (``Mapping[str, torch.Tensor]`` plus ``tensor_spec(key)``).

    Raises:
        LegacyCheckpointError: a pre-zip ``torch.save`` file (the message says how to convert).
        UnsafePickleError: the pickle needs something other than tensors and plain data.
        CheckpointFormatError: an unknown, truncated or damaged file.

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, p)
        >>> ckpt = open_checkpoint(p)
        >>> list(ckpt), ckpt["model.w"].tolist(), ckpt.non_tensors
        (['model.w'], [1.0, 1.0], {'epoch': 3})
    """
    kind = checkpoint_kind(path)
    if kind == "torch":
        return Checkpoint(TorchSaveReader(path, allow_pickle=allow_pickle), kind)
    return Checkpoint(SafetensorsReader(path), kind)
