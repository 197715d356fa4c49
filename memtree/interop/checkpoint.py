"""``open_checkpoint``: one lazy, read-only mapping interface over checkpoint files.

``open_checkpoint(path)`` recognises the file by its first bytes (not its name):

* a zip archive: a ``torch.save`` checkpoint (``.pt``, ``.pth``, ``.bin``, ``.ckpt``), read by
  :class:`~memtree.interop.torchsave.TorchSaveReader` (safe unpickling, lazy tensors);
* an 8-byte header size followed by ``{``, or a ``.safetensors`` name: a safetensors file, read
  by :class:`~memtree.interop.safetensors_file.SafetensorsReader`;
* a raw pickle or a tar archive: a legacy ``torch.save`` file, refused with a message saying how
  to convert it;
* a shard index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) or a
  Hugging Face model directory: all the shards as one checkpoint, read by
  :class:`~memtree.interop.sharded.ShardedReader` (the index is validated: see
  :mod:`memtree.interop.sharded`).

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

import functools
import os
from collections.abc import Iterator, Mapping
from typing import Any, Union

import torch

from ..errors import CheckpointFormatError, LegacyCheckpointError, check_keywords
from ..store.reading.storage import local_path
from .checkpoint_file import CheckpointFile, Closing
from .safetensors_file import SafetensorsReader, looks_like_safetensors
from .sharded import DIRECTORY_FILES, ShardedReader, find_checkpoint, is_index
from .pickle_guard import PickleLimits
from .torchsave import TorchSaveReader, is_torch_zip, legacy_message

__all__ = ["Checkpoint", "open_checkpoint", "open_file", "checkpoint_kind"]

Reader = Union[TorchSaveReader, SafetensorsReader, ShardedReader]


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
        path: the file (for a sharded checkpoint: its index).
        format: ``"torch"`` or ``"safetensors"``.
        files: the files that hold the tensors: ``[path]``, or every shard.
        non_tensors: non-tensor values by dotted key (``torch.save`` files: ``{"epoch": 3}``),
            exactly as ``torch.load(weights_only=True)`` gives them (sets, ``torch.device``...).
        skipped: the tensors left out with ``skip_unsupported=True``, by dotted key, with what
            each is (``{"emb": "a sparse_coo tensor (sparse)"}``).
        metadata: a safetensors file's ``__metadata__`` (``None`` otherwise, and for shards).
    """

    def __init__(self, reader: Reader, format: str) -> None:
        self._reader = reader
        self.path = reader.path
        self.format = format
        self.files: list[str] = reader.files if isinstance(reader, ShardedReader) else [reader.path]
        self.non_tensors: dict[str, Any] = (
            reader.non_tensors if isinstance(reader, (TorchSaveReader, ShardedReader)) else {}
        )
        self.skipped: dict[str, str] = (
            reader.skipped if isinstance(reader, (TorchSaveReader, ShardedReader)) else {}
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

    def fill_range(self, key: str) -> Any:
        """Where ``key``'s bytes lie in the open file and the check to run on them, for the
        in-place loader (:func:`memtree.store.primitives.fill.fill`); ``None`` when they do not lie as
        they are (a strided view): then :meth:`read` it."""
        return self._reader.fill_range(key)

    def key_path(self, key: str) -> tuple[str, ...]:
        """How ``key`` was nested in the file (``("model", "encoder.weight")``)."""
        return self._reader.path_of(key)

    def close(self) -> None:
        """Release the file."""
        self._reader.close()


    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, format={self.format!r}, tensors={len(self)})"


def open_file(
    path: str, *, allow_pickle: bool, limits: PickleLimits | None = None, skip_unsupported: bool = False
) -> TorchSaveReader | SafetensorsReader:
    """The reader of one checkpoint file, by its content (see :func:`checkpoint_kind`)."""
    if checkpoint_kind(path) == "torch":
        return TorchSaveReader(
            path, allow_pickle=allow_pickle, limits=limits, skip_unsupported=skip_unsupported
        )
    return SafetensorsReader(path)


@check_keywords
def open_checkpoint(
    path: str | os.PathLike[str], *, allow_pickle: bool = False, skip_unsupported: bool = False
) -> Checkpoint:
    """Open a checkpoint lazily: a mapping of dotted keys to tensors.

    Args:
        path: a ``torch.save`` or ``.safetensors`` file; a shard index
            (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``: every shard,
            as one mapping); or a Hugging Face model directory, where the first of
            ``model.safetensors.index.json``, ``model.safetensors``,
            ``pytorch_model.bin.index.json``, ``pytorch_model.bin`` is opened.
        allow_pickle: ``torch.save`` files only: let the pickle build objects outside memtree's
            safe allowlist (tensors and the values ``torch.load(weights_only=True)`` accepts by
            default). Only for files you trust.
        skip_unsupported: ``torch.save`` files only: leave out the tensors memtree cannot read
            (sparse, quantized, nested, meta, dtypes it cannot hold, tensors inside a set or
            under dict keys other than ``str`` and ``int``), listed in
            :attr:`Checkpoint.skipped`, instead of refusing the file.

    Returns:
        A :class:`Checkpoint` (``Mapping[str, torch.Tensor]`` plus ``tensor_spec(key)``).

    Raises:
        LegacyCheckpointError: a pre-zip ``torch.save`` file (the message says how to convert).
        UnsafePickleError: the pickle needs something other than tensors and the values
            ``torch.load(weights_only=True)`` accepts by default.
        DtypeError: a tensor memtree cannot read (see ``skip_unsupported``), named by its key.
        CheckpointFormatError: an unknown, truncated or damaged file; a directory without a
            checkpoint; a damaged shard index.
        UnsafePathError: a shard index names a file outside its directory.

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, p)
        >>> ckpt = open_checkpoint(p)
        >>> list(ckpt), ckpt["model.w"].tolist(), ckpt.non_tensors
        (['model.w'], [1.0, 1.0], {'epoch': 3})
    """
    local = "checkpoint files are read locally; download it first (memtree.load_memmap reads memtree URLs)"
    name = os.fspath(local_path(path, remote=local))
    if os.path.isdir(name):
        found = find_checkpoint(name)
        if found is None:
            raise CheckpointFormatError(
                f"{name} is a directory without a checkpoint: it holds none of "
                f"{', '.join(DIRECTORY_FILES)}. Pass the checkpoint file itself, or load a memtree "
                "or tensordict directory with memtree.load_memmap"
            )
        name = found
    opener = functools.partial(open_file, allow_pickle=allow_pickle, skip_unsupported=skip_unsupported)
    if is_index(name):
        reader = ShardedReader(name, opener)
        return Checkpoint(reader, reader.format)
    file_reader = opener(name)
    return Checkpoint(file_reader, "torch" if isinstance(file_reader, TorchSaveReader) else "safetensors")
