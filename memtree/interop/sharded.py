"""Checkpoints in several files, as Hugging Face ships them: a shard index, a model directory.

A large model comes as shards plus an index that says which shard holds each tensor:
``model.safetensors.index.json`` (safetensors shards) or ``pytorch_model.bin.index.json``
(``torch.save`` shards)::

    {"metadata": {"total_size": 1234},
     "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", ...}}

:class:`ShardedReader` reads such an index and presents all its shards as one checkpoint (the
reader interface of :class:`~memtree.interop.Checkpoint`: keys, specs, lazy reads).
:func:`find_checkpoint` picks the checkpoint of a model directory, in Hugging Face's order of
preference: ``model.safetensors.index.json``, ``model.safetensors``,
``pytorch_model.bin.index.json``, ``pytorch_model.bin``.

The index is not trusted. It is refused (``CheckpointFormatError``, or ``UnsafePathError`` for
a path) when it is larger than :data:`MAX_INDEX_BYTES`, not UTF-8 JSON, repeats a key, lacks a
``weight_map`` of names to shard files, names a shard by anything but a relative path of plain
names inside the index's directory (no ``..``, no absolute path, no backslash), names a shard
that resolves (through symbolic links) outside that directory, mixes safetensors and
``torch.save`` shards, or lists a tensor that its shard does not hold. One exception to the
directory rule keeps Hugging Face's cache usable: in a cache snapshot
(``models--org--name/snapshots/<revision>/``) the files are links into the repository's
``blobs/`` directory, which is allowed too. Every shard is opened (its header read, no tensor
data) when the index is opened. Tensors that a shard holds but the index does not list are
ignored: the index is the table of contents.

Writing: :func:`write_model_directory` writes tensors as Hugging Face's ``save_pretrained``
does: ``model.safetensors`` when everything fits in ``max_shard_size``, else shards
``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` (``metadata.total_size``
and ``weight_map``, sorted, indented by 2), split by :func:`plan_shards` with the rule of
``huggingface_hub.split_state_dict_into_shards_factory`` (tensors in order; a new shard when the
next tensor would overflow; a tensor larger than the limit alone in its own shard). The directory
is published atomically (:func:`~memtree.store.writing.staged.staged_directory`).

Example:
    >>> import json, os, tempfile, torch
    >>> from memtree.interop import open_checkpoint, save_safetensors
    >>> d = tempfile.mkdtemp()
    >>> save_safetensors({"a": torch.zeros(2)}, os.path.join(d, "part-1.safetensors"))
    >>> save_safetensors({"b": torch.ones(3)}, os.path.join(d, "part-2.safetensors"))
    >>> index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    >>> with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
    ...     json.dump(index, f)
    >>> ckpt = open_checkpoint(d)          # the directory: its index is found
    >>> sorted(ckpt), ckpt["b"].tolist(), len(ckpt.files)
    (['a', 'b'], [1.0, 1.0, 1.0], 2)
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from math import prod
from typing import Any, Union

import orjson
import torch

from ..errors import (
    CheckpointFormatError,
    InvalidArgumentError,
    MemtreeKeyError,
    StorageError,
    UnsafePathError,
)
from ..format.dtypes import itemsize
from ..format.values import json_depth
from ..store.primitives.commit import write_small_file
from ..store.writing.staged import staged_directory
from .checkpoint_file import CheckpointFile, Closing
from .safetensors_file import SafetensorsReader, _no_duplicates, write_safetensors
from .torchsave import TorchSaveReader, skipped_error

__all__ = [
    "DIRECTORY_FILES",
    "MAX_INDEX_BYTES",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "ShardedReader",
    "find_checkpoint",
    "is_index",
    "parse_shard_size",
    "plan_shards",
    "write_model_directory",
]

FileReader = Union[TorchSaveReader, SafetensorsReader]

#: What :func:`find_checkpoint` looks for in a model directory, first found wins.
DIRECTORY_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)

#: An index larger than this is refused before it is read (real ones are well under 10 MB).
MAX_INDEX_BYTES = 64 * 2**20
#: Nesting a shard index may have (Hugging Face's: 2, a metadata map and the weight map).
_INDEX_DEPTH = 16

_LIST_MAX = 10


def is_index(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a shard index (``*.index.json``)."""
    return os.fspath(path).endswith(".index.json")


def find_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The checkpoint file of a Hugging Face model directory (see :data:`DIRECTORY_FILES`).

    Returns ``None`` when the directory holds none of them. A name that exists but is broken
    (a dangling link) is still returned, so that opening it reports the problem.

    Example:
        >>> import tempfile
        >>> find_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    for name in DIRECTORY_FILES:
        path = os.path.join(os.fspath(directory), name)
        if os.path.lexists(path):
            return path
    return None


def _allowed_roots(directory: str) -> list[str]:
    """Where a shard may resolve to: the directory, and in a Hugging Face cache snapshot the
    repository's ``blobs/``."""
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _parse_index(path: str) -> dict[str, str]:
    """The ``weight_map`` of the index at ``path``, checked (see the module's docstring)."""
    with CheckpointFile(path) as f:
        if f.size > MAX_INDEX_BYTES:
            raise CheckpointFormatError(
                f"{path}: the shard index has {f.size:,} bytes, more than {MAX_INDEX_BYTES:,}; "
                "it is not a checkpoint index (or it is damaged)"
            )
        data = f.read_bytes(0, f.size, "the index")
    try:
        # nesting measured on orjson's parse (bounded, no recursion) before json.loads recurses:
        # never a RecursionError, whatever sys.getrecursionlimit() a test or a library set
        if json_depth(orjson.loads(data), _INDEX_DEPTH) > _INDEX_DEPTH:
            raise CheckpointFormatError(
                f"{path}: the shard index nests JSON more than {_INDEX_DEPTH} levels deep (it holds "
                "a map of tensor names and a metadata map); it is damaged or not a shard index"
            )
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates(path, "the index"))
    except (UnicodeDecodeError, ValueError) as err:
        if isinstance(err, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{path}: the shard index is not valid UTF-8 JSON ({err})") from None
    weight_map = doc.get("weight_map") if type(doc) is dict else None
    if type(weight_map) is not dict or not weight_map:
        raise CheckpointFormatError(
            f"{path}: a shard index is a JSON object whose \"weight_map\" maps tensor names to "
            "shard files, and this one has none; the file is damaged or not an index"
        )
    bad = [k for k, v in weight_map.items() if type(v) is not str or not k]
    if bad:
        raise CheckpointFormatError(
            f"{path}: weight_map entries must map a tensor name to a shard file name; "
            f"{bad[0]!r:.80} maps to {weight_map[bad[0]]!r:.80}"
        )
    if "metadata" in doc and type(doc["metadata"]) is not dict:
        raise CheckpointFormatError(f"{path}: the index's \"metadata\" must be a JSON object")
    return weight_map


def _shard_path(name: str, directory: str, roots: list[str], index: str) -> str:
    """The real path of shard ``name``, refused if it could leave ``directory``."""
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(
            f"{index}: the shard name {name!r:.120} is not a relative path of plain names inside "
            f"{directory}; the index is damaged or hostile, refusing to read it"
        )
    try:
        real = os.path.realpath(os.path.join(directory, *parts))
    except (OSError, ValueError) as err:  # a name the filesystem cannot encode, a link loop...
        raise UnsafePathError(f"{index}: the shard name {name!r:.120} cannot be resolved ({err})") from None
    if not any(_inside(real, root) for root in roots):
        raise UnsafePathError(
            f"{index}: the shard {name!r:.120} resolves to {real}, outside {directory} (a symbolic "
            "link out of the model directory); refusing to read it. Copy the file into the "
            "directory if you trust it"
        )
    return real


class ShardedReader(Closing):
    """A shard index and its shards, read as one checkpoint; open it with :func:`open_checkpoint`.

    Args:
        path: the index (``*.index.json``). Shards are looked up in its directory as named
            (the index itself may be a link, as in Hugging Face's cache).
        open_file: opens one shard file (a safetensors or ``torch.save`` reader).

    Attributes:
        path: the index.
        format: ``"safetensors"`` or ``"torch"``, the shards' format.
        files: the shards' paths, in the order the index first names them.
        non_tensors: the ``torch.save`` shards' non-tensor values, merged.
        skipped: the tensors the ``torch.save`` shards left out (``skip_unsupported=True``),
            merged.

    Raises:
        CheckpointFormatError, UnsafePathError: the index or a shard is refused (see the
            module's docstring); nothing stays open.
    """

    def __init__(self, path: str | os.PathLike[str], open_file: Callable[[str], FileReader]) -> None:
        self.path = os.fspath(path)
        weight_map = _parse_index(self.path)
        directory = os.path.dirname(os.path.abspath(self.path))
        roots = _allowed_roots(directory)
        by_shard: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            by_shard.setdefault(name, []).append(key)
        paths = {name: _shard_path(name, directory, roots, self.path) for name in by_shard}
        self._readers: dict[str, FileReader] = {}
        try:
            for name, keys in by_shard.items():
                if not os.path.lexists(paths[name]):
                    raise StorageError(
                        errno.ENOENT,
                        f"{self.path}: the shard {name:.120} does not exist in {directory} (the "
                        f"index lists {len(keys)} tensors in it); the download is incomplete (fetch "
                        "the missing shard) or the index does not belong to this directory",
                    )
                reader = self._readers[name] = open_file(paths[name])
                held = set(reader.keys()) | set(getattr(reader, "skipped", ()))
                lacking = [k for k in keys if k not in held]
                if lacking:
                    raise CheckpointFormatError(
                        f"{self.path}: the index lists {len(lacking)} tensors in {name!r} that the "
                        f"shard does not hold: {', '.join(repr(k) for k in lacking[:_LIST_MAX])}; the "
                        "index and its shards do not belong together (download them again)"
                    )
            kinds = {type(r) for r in self._readers.values()}
            if len(kinds) > 1:
                raise CheckpointFormatError(
                    f"{self.path}: the index mixes safetensors and torch.save shards; a checkpoint's "
                    "shards are all of one format"
                )
        except BaseException:
            self.close()
            raise
        self.format = "torch" if kinds == {TorchSaveReader} else "safetensors"
        self.files = [paths[name] for name in by_shard]
        self.non_tensors: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}
        for reader in self._readers.values():
            if isinstance(reader, TorchSaveReader):
                self.non_tensors.update(reader.non_tensors)
                self.skipped.update(reader.skipped)
        self._shard_of = {
            key: self._readers[name] for key, name in weight_map.items() if key not in self.skipped
        }

    def _reader(self, key: str) -> FileReader:
        try:
            return self._shard_of[key]
        except KeyError:
            if key in self.skipped:
                raise skipped_error(self.path, key, self.skipped[key]) from None
            raise MemtreeKeyError(
                f"{key!r} is not a tensor of {self.path} (tensors: {list(self._shard_of)[:_LIST_MAX]})"
            ) from None

    def keys(self) -> list[str]:
        """The tensors' keys, in the index's order."""
        return list(self._shard_of)

    def path_of(self, key: str) -> tuple[str, ...]:
        """How ``key`` is nested in its shard."""
        return self._reader(key).path_of(key)

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """``(shape, dtype)`` of ``key`` without reading data."""
        return self._reader(key).spec(key)

    def read(self, key: str, *, mmap: bool = True) -> torch.Tensor:
        """Read one tensor from its shard (see the shard readers' ``read``)."""
        return self._reader(key).read(key, mmap=mmap)

    def fill_range(self, key: str) -> Any:
        """Where ``key``'s bytes lie in its shard (see the shard readers' ``fill_range``)."""
        return self._reader(key).fill_range(key)

    def close(self) -> None:
        """Close every shard (tensors already read stay valid)."""
        for reader in getattr(self, "_readers", {}).values():
            reader.close()


# -- writing -------------------------------------------------------------------------------------
#: The single file of a model directory that fits in one shard (Hugging Face's name).
SAFE_WEIGHTS_NAME = "model.safetensors"
#: The index of a sharded model directory (Hugging Face's name).
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_SIZE = re.compile(r"(-?(?:\d+(?:\.\d*)?|\.\d+))\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1}
_UNITS.update({f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGT")})
_UNITS.update({f"{p}IB": 1024 ** (i + 1) for i, p in enumerate("KMGT")})


def parse_shard_size(size: int | str) -> int:
    """Bytes from a shard size as Hugging Face's ``max_shard_size`` takes it.

    ``"5GB"`` is 5 * 10**9 bytes (decimal units KB, MB, GB, TB, as ``huggingface_hub``), ``"4GiB"``
    4 * 2**30 (binary units KiB..TiB), ``"1.5GB"`` 1.5 * 10**9, and an int (or a string of
    digits) is bytes. Units are case-insensitive.

    Raises:
        InvalidArgumentError: not a size, or not a positive one.

    Example:
        >>> parse_shard_size("5GB"), parse_shard_size("500MB"), parse_shard_size("4GiB"), parse_shard_size(10)
        (5000000000, 500000000, 4294967296, 10)
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InvalidArgumentError(f"max_shard_size must be an int or a str such as '5GB', got {size!r:.40}")
    if isinstance(size, str):
        match = _SIZE.fullmatch(size.strip())
        if match is None:
            raise InvalidArgumentError(
                f"max_shard_size {size!r:.40} is not a size: use bytes or a number with a unit "
                "(KB, MB, GB, TB = powers of 1000, as Hugging Face; KiB, MiB, GiB, TiB = powers of 1024)"
            )
        number, unit = match.groups()
        size = int(float(number) * _UNITS[(unit or "").upper()])
    if size <= 0:
        raise InvalidArgumentError(f"max_shard_size must be positive, got {size} bytes")
    return size


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split ``(key, nbytes)`` pairs into shards, as ``huggingface_hub`` splits a state dict.

    Keys stay in order; a shard is closed when the next tensor would take it past
    ``max_shard_size``; a tensor larger than the limit gets a shard of its own, placed where it
    comes (the shard being filled stays open after it).

    Example:
        >>> plan_shards([("a", 6), ("b", 6), ("c", 2), ("d", 6), ("e", 2), ("f", 2)], 10)
        [['a'], ['b', 'c'], ['d', 'e', 'f']]
    """
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for key, nbytes in sizes:
        if nbytes > max_shard_size:
            shards.append([key])
            continue
        if current_size + nbytes > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(key)
        current_size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def is_model_directory_output(path: str) -> bool:
    """Whether a directory holds only what :func:`write_model_directory` writes (it may replace it)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(
        name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or _SHARD_NAME.fullmatch(name)
        for name in names
    )


def write_model_directory(
    directory: str | os.PathLike[str],
    specs: Sequence[tuple[str, torch.Size | tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    existsok: bool = False,
    fsync: bool = False,
) -> dict[str, list[str]]:
    """Write tensors as a Hugging Face model directory, one tensor in memory at a time.

    Args:
        directory: the directory to create (published atomically: complete, or not at all).
        specs: ``(key, shape, dtype)`` of every tensor, in order.
        produce: returns the tensor of a key (called once per key).
        max_shard_size: the shard size limit (see :func:`parse_shard_size`).
        metadata: each file's ``__metadata__``; ``"format": "pt"`` is added as Hugging Face does.
        existsok: replace an existing destination that holds only a model's weights (other
            directories are never replaced).
        fsync: make every file and the directory durable before it appears.

    Returns:
        ``{file name: keys}``, in the order the files were written.

    Raises:
        InvalidArgumentError: a bad ``max_shard_size``.
        DestinationExistsError: ``directory`` exists and may not be replaced.
        DtypeError: a dtype safetensors cannot hold.

    Example:
        >>> import os, tempfile, torch
        >>> d = os.path.join(tempfile.mkdtemp(), "model")
        >>> t = {"a": torch.zeros(4), "b": torch.ones(4)}
        >>> write_model_directory(d, [(k, v.shape, v.dtype) for k, v in t.items()], t.__getitem__,
        ...                       max_shard_size=20)
        {'model-00001-of-00002.safetensors': ['a'], 'model-00002-of-00002.safetensors': ['b']}
    """
    limit = parse_shard_size(max_shard_size)
    by_key = {key: (tuple(shape), dtype) for key, shape, dtype in specs}
    if len(by_key) != len(specs):
        raise CheckpointFormatError(f"{os.fspath(directory)}: tensor keys must be unique")
    sizes = [(key, prod(shape) * itemsize(dtype)) for key, (shape, dtype) in by_key.items()]
    shards = plan_shards(sizes, limit)
    if len(shards) == 1:
        files = {SAFE_WEIGHTS_NAME: shards[0]}
    else:
        n = len(shards)
        files = {f"model-{i + 1:05d}-of-{n:05d}.safetensors": keys for i, keys in enumerate(shards)}
    file_metadata = {"format": "pt", **(metadata or {})}
    total = sum(nbytes for _, nbytes in sizes)
    with staged_directory(
        directory, existsok=existsok, fsync=fsync, nbytes=total, replaceable=is_model_directory_output
    ) as staging:
        for name, keys in files.items():
            write_safetensors(
                os.path.join(staging, name),
                [(key, *by_key[key]) for key in keys],
                produce,
                metadata=file_metadata,
                fsync=fsync,
                commit=False,  # the staging directory is the commit
            )
        if len(files) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {key: name for name, keys in files.items() for key in keys},
            }
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            write_small_file(os.path.join(staging, SAFE_WEIGHTS_INDEX_NAME), text.encode(), fsync=fsync)
    return files
