"""``.safetensors`` files: a validating lazy reader and a streaming writer, both bit-exact.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header size
``N``, ``N`` bytes of JSON ``{"<key>": {"dtype": "F32", "shape": [..], "data_offsets": [begin,
end]}, ..., "__metadata__": {str: str}}``, then the data; offsets are relative to the end of
the header, and the data must be covered exactly (no overlap, no hole, nothing past the end).

Why memtree implements this small format itself instead of calling the ``safetensors`` package
(which the tests use as an independent cross-check, and which remains a fine optional tool):

* **streaming export**: ``safetensors.torch.save_file`` takes a dict of tensors that are all in
  memory at once; :func:`write_safetensors` writes the header from shapes and dtypes, then
  produces, casts and writes (``pwrite``) one tensor at a time, so converting a checkpoint holds
  one tensor, not the model. The file appears atomically (temporary file + rename), like every file
  memtree publishes;
* **memtree errors**: a malformed header (overlapping or out-of-range offsets, a size that does
  not match dtype × shape, duplicate keys, an absurd header size) is a
  :class:`~memtree.errors.CheckpointFormatError` naming the key and the offsets, not a
  ``SafetensorError`` the caller has to know about;
* **one dtype table**: names map onto memtree's closed dtype table
  (:mod:`memtree.format.dtypes`), including ``F8_E8M0``, which ``safetensors.torch`` 0.8 writes but
  cannot load;
* **no extra runtime dependency** for reading and writing model files.

Reading is lazy and zero-copy: :meth:`SafetensorsReader.read` returns a slice of one read-only
(copy-on-write) mapping of the file, or, with ``mmap=False``, a new tensor filled with ``pread``.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.interop.safetensors_file import SafetensorsReader, save_safetensors
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> save_safetensors({"w": torch.ones(2, 2, dtype=torch.bfloat16)}, path)
    >>> with SafetensorsReader(path) as r:
    ...     r.spec("w"), r.read("w").sum().item()
    ((torch.Size([2, 2]), torch.bfloat16), 4.0)
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from math import prod
from typing import Any

import orjson
import torch

from ..format.dtypes import dtype_from_name, itemsize
from ..format.schema import MAX_NBYTES, extent_bytes
from ..format.names import TIED_KEY
from ..format.values import NonTensor, json_depth
from ..errors import (
    check_keywords,
    CheckpointFormatError,
    DtypeError,
    KeyCollisionError,
    MemtreeKeyError,
    NonTensorValueError,
)
from ..store.primitives.faults import point
from ..store.primitives.files import FileRange, write_fd
from ..store.reading.mapped import to_storable
from ..store.reading.storage import local_path
from ..store.writing.staged import staged_file
from ..format.level import Level, as_level
from ..format.subclass_registry import is_dtensor, is_plain, to_group
from .checkpoint_file import CheckpointFile, Closing
from .torchao_safetensors import flatten_groups

__all__ = [
    "SAFETENSORS_DTYPES",
    "SafetensorsEntry",
    "SafetensorsReader",
    "parse_header",
    "safetensors_dtype",
    "write_safetensors",
    "save_safetensors",
    "looks_like_safetensors",
]

#: A header larger than this is refused (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000
_MAX_NDIM = 64
#: A header object holds entry objects, which hold the shape list: nothing nests deeper.
_HEADER_DEPTH = 3
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)

_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
#: safetensors dtype name -> torch dtype, for the dtypes both safetensors and this torch have.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    st: dt for st, name in _NAMES.items() if (dt := dtype_from_name(name)) is not None
}
_BY_DTYPE = {dt: st for st, dt in SAFETENSORS_DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype, key: str = "tensor") -> str:
    """The safetensors name of ``dtype``.

    Raises:
        DtypeError: safetensors has no such dtype (``complex32``, ``complex128``).
    """
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise DtypeError(
            f"{key}: safetensors cannot hold {dtype} (it has "
            f"{', '.join(SAFETENSORS_DTYPES)}); cast it "
            "first (e.g. --dtype, or .to(torch.complex64)), or keep a memtree directory"
        ) from None


def looks_like_safetensors(head: bytes) -> bool:
    """True if ``head`` (at least the file's first 9 bytes) starts like a safetensors file."""
    return (
        len(head) >= 9
        and head[8:9] == b"{"
        and 2 <= struct.unpack("<Q", head[:8])[0] <= MAX_HEADER_BYTES
    )


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: dtype, shape and absolute byte range in the file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_duplicates(where: str, what: str = "the header") -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise CheckpointFormatError(f"{where}: {what} repeats the key {key!r:.80}")
            out[key] = value
        return out

    return pairs


def parse_header(
    header: bytes, data_start: int, file_size: int, where: str
) -> tuple[dict[str, SafetensorsEntry], dict[str, str] | None]:
    """Validate a safetensors header (the JSON bytes) against the file's size.

    Args:
        header: the ``N`` header bytes.
        data_start: ``8 + N``, where the data begins.
        file_size: the file's size.
        where: the file's path, for messages.

    Returns:
        The entries in header order, and the ``__metadata__`` map (or ``None``).

    Raises:
        CheckpointFormatError: anything malformed: JSON, fields, dtypes, shapes, sizes,
            overlapping, missing or out-of-range data.
    """
    try:
        depth = json_depth(orjson.loads(header), _HEADER_DEPTH)  # orjson: bounded, no recursion
        if depth > _HEADER_DEPTH:
            raise CheckpointFormatError(
                f"{where}: the header nests JSON more than {_HEADER_DEPTH} levels deep (tensor "
                "entries hold a shape list, nothing deeper); the file is damaged or not safetensors"
            )
        doc = json.loads(header.decode("utf-8"), object_pairs_hook=_no_duplicates(where))
    except (UnicodeDecodeError, ValueError) as err:  # orjson.JSONDecodeError is a ValueError
        if isinstance(err, CheckpointFormatError):
            raise
        raise CheckpointFormatError(
            f"{where}: the header is not valid UTF-8 JSON ({err})"
        ) from None
    if type(doc) is not dict:
        raise CheckpointFormatError(f"{where}: the header must be a JSON object")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and (
        type(metadata) is not dict or not all(type(v) is str for v in metadata.values())
    ):
        raise CheckpointFormatError(f"{where}: __metadata__ must map str to str")
    entries: dict[str, SafetensorsEntry] = {}
    data_size = file_size - data_start
    for key, raw in doc.items():
        what = f"{where}: tensor {key!r:.80}"
        if type(raw) is not dict or set(raw) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointFormatError(f"{what} must have exactly dtype, shape and data_offsets")
        dtype = SAFETENSORS_DTYPES.get(raw["dtype"]) if type(raw["dtype"]) is str else None
        if dtype is None:
            raise CheckpointFormatError(f"{what} has the unknown dtype {raw['dtype']!r:.40}")
        shape, offsets = raw["shape"], raw["data_offsets"]
        if (
            type(shape) is not list
            or len(shape) > _MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)
        ):
            raise CheckpointFormatError(f"{what} has a malformed shape {shape!r:.80}")
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or not all(type(n) is int and n >= 0 for n in offsets)
        ):
            raise CheckpointFormatError(f"{what} has malformed data_offsets {offsets!r:.80}")
        begin, end = offsets
        if extent_bytes(tuple(shape), dtype) > MAX_NBYTES:
            raise CheckpointFormatError(
                f"{what} has the shape {shape}, beyond any tensor torch can make (its non-zero "
                f"dims span {extent_bytes(tuple(shape), dtype)} bytes)"
            )
        nbytes = prod(shape) * itemsize(dtype)
        if end < begin or end - begin != nbytes:
            raise CheckpointFormatError(
                f"{what}: data_offsets [{begin}, {end}] hold {end - begin} bytes but "
                f"{raw['dtype']} × {shape} needs {nbytes}; the header is damaged"
            )
        if end > data_size:
            raise CheckpointFormatError(
                f"{what}: data_offsets [{begin}, {end}] are out of range: the data section has "
                f"{data_size:,} bytes; the file is truncated or the header is damaged"
            )
        entries[key] = SafetensorsEntry(
            key, dtype, tuple(shape), data_start + begin, data_start + end
        )
    covered = data_start
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < covered:
            raise CheckpointFormatError(
                f"{where}: tensor {e.key!r:.80} (data_offsets [{e.begin - data_start}, "
                f"{e.end - data_start}]) overlaps the data of another tensor; the header is damaged"
            )
        if e.begin > covered:
            raise CheckpointFormatError(
                f"{where}: bytes {covered - data_start}..{e.begin - data_start} of the data belong "
                "to no tensor (safetensors forbids holes); the header is damaged"
            )
        covered = e.end
    if covered != file_size:
        raise CheckpointFormatError(
            f"{where}: {file_size - covered:,} bytes after the last tensor belong to no tensor; "
            "the file is damaged"
        )
    return entries, metadata


class SafetensorsReader(Closing):
    """A ``.safetensors`` file, opened lazily: the header is validated, data is read on demand.

    Args:
        path: the file.

    Raises:
        CheckpointFormatError: the file is not a valid safetensors file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = CheckpointFile(path)
        self.path = self._file.path
        try:
            head = self._file.read_bytes(0, 8, "the header size")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointFormatError(
                    f"{self.path}: the header claims {n:,} bytes, more than {MAX_HEADER_BYTES:,}; "
                    "this is not a safetensors file (or it is damaged)"
                )
            header = self._file.read_bytes(8, n, "the header")
            self.entries, self.metadata = parse_header(header, 8 + n, self._file.size, self.path)
        except BaseException:
            self._file.close()
            raise

    def keys(self) -> list[str]:
        """The tensors' keys, in header order."""
        return list(self.entries)

    def path_of(self, key: str) -> tuple[str, ...]:
        """The key as a one-element path (safetensors keys are flat)."""
        return (key,)

    def entry(self, key: str) -> SafetensorsEntry:
        """The header entry of ``key``."""
        try:
            return self.entries[key]
        except KeyError:
            raise MemtreeKeyError(
                f"{key!r} is not a tensor of {self.path} (tensors: {list(self.entries)[:10]})"
            ) from None

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """``(shape, dtype)`` of ``key`` without reading data."""
        e = self.entry(key)
        return torch.Size(e.shape), e.dtype

    def read(self, key: str, *, mmap: bool = True) -> torch.Tensor:
        """Read one tensor: a zero-copy view of the file's mapping, or (``mmap=False``) a copy."""
        e = self.entry(key)
        if mmap and e.begin % itemsize(e.dtype) == 0:
            return self._file.mapped()[e.begin : e.end].view(e.dtype).view(e.shape)
        out = torch.empty(e.shape, dtype=e.dtype)
        self._file.read_into(out, e.begin, f"tensor {key!r}")
        return out

    def fill_range(self, key: str) -> tuple[FileRange, None]:
        """Where ``key``'s bytes lie in the open file, for :func:`memtree.store.primitives.fill.fill`
        (valid while the reader is open; no checksum to check)."""
        e = self.entry(key)
        return FileRange(self._file.fd, e.begin, e.end - e.begin, f"tensor {key!r} of {self.path}"), None

    def close(self) -> None:
        """Close the file (tensors already read or mapped stay valid)."""
        self._file.close()


# -- writing -------------------------------------------------------------------------------------
def write_safetensors(
    path: str | os.PathLike[str],
    specs: Sequence[tuple[str, torch.Size | tuple[int, ...], torch.dtype]],
    produce: Callable[[str], torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    existsok: bool = False,
    fsync: bool = False,
    commit: bool = True,
) -> None:
    """Write a safetensors file tensor by tensor (only one tensor is in memory at a time).

    The header is computed from ``specs``; then ``produce(key)`` is called once per key and its
    tensor written at its offset. Data is ordered by decreasing item size, so every tensor is
    aligned for zero-copy reads. The file is written under a temporary name in the same
    directory and renamed into place when complete: ``path`` never holds a partial file. The
    write holds ``path``'s writer lock, whose journal names the temporary file, so a writer
    killed meanwhile leaves a file that the next write of ``path`` and :func:`memtree.recover`
    remove (:func:`~memtree.store.writing.staged.staged_file`).

    Args:
        path: the file to create.
        specs: ``(key, shape, dtype)`` of every tensor, in header order.
        produce: returns the tensor of a key (any device or layout; it must match its spec).
        metadata: the ``__metadata__`` map (str to str).
        existsok: replace an existing file (else :class:`DestinationExistsError`).
        fsync: make the file durable before it is renamed into place.
        commit: False writes ``path`` itself, a new file, with no temporary name or lock: for a
            file inside a staging directory that the caller publishes (a model directory's shards).

    Raises:
        DtypeError: a dtype safetensors cannot hold.
        CheckpointFormatError: ``produce`` returned a tensor that does not match its spec.
        DestinationExistsError: ``path`` exists and ``existsok`` is False.
        LockError: another memtree writer is writing ``path`` (for more than
            :data:`~memtree.store.primitives.commit.LOCK_TIMEOUT` seconds).
    """
    path = os.fspath(local_path(path, remote="this writes a local file; write it locally, then copy it"))
    header: dict[str, Any] = {}
    if metadata:
        if not all(type(k) is str and type(v) is str for k, v in metadata.items()):
            raise CheckpointFormatError(f"{path}: safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    names = [
        (key, tuple(shape), dtype, safetensors_dtype(dtype, repr(key)))
        for key, shape, dtype in specs
    ]
    if len({k for k, *_ in names}) != len(names) or "__metadata__" in {k for k, *_ in names}:
        raise CheckpointFormatError(f"{path}: tensor keys must be unique and not '__metadata__'")
    offset = 0
    layout: dict[str, int] = {}
    for key, shape, dtype, _ in sorted(names, key=lambda n: -itemsize(n[2])):
        nbytes = prod(shape) * itemsize(dtype)
        layout[key] = offset
        offset += nbytes
    for key, shape, dtype, st in names:
        begin = layout[key]
        header[key] = {
            "dtype": st,
            "shape": list(shape),
            "data_offsets": [begin, begin + prod(shape) * itemsize(dtype)],
        }
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    data_start = 8 + len(blob)
    header_bytes = struct.pack("<Q", len(blob)) + blob

    hint = "pass existsok=True (CLI: --overwrite) to replace it"
    if not commit:
        _write_file(path, path, header_bytes, names, layout, data_start + offset, produce, fsync)
        return
    with staged_file(path, existsok=existsok, hint=hint) as tmp:
        _write_file(tmp, path, header_bytes, names, layout, data_start + offset, produce, fsync)


def _write_file(
    where: str,
    path: str,
    header: bytes,
    names: list[tuple[str, tuple[int, ...], torch.dtype, str]],
    layout: dict[str, int],
    size: int,
    produce: Callable[[str], torch.Tensor],
    fsync: bool,
) -> None:
    """Create ``where`` (a new file of ``size`` bytes) and write the header, then each tensor
    at its offset (``path``: the destination, for messages)."""
    fd = os.open(where, _NEW_FILE, 0o644)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, header, 0)
        point("staging_created")
        for key, shape, dtype, _ in sorted(names, key=lambda n: layout[n[0]]):
            tensor = to_storable(produce(key), repr(key))
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise CheckpointFormatError(
                    f"{path}: tensor {key!r} is {tensor.dtype}{list(tensor.shape)}, its header "
                    f"says {dtype}{list(shape)}"
                )
            write_fd(fd, tensor, len(header) + layout[key])
            del tensor
            point("after_leaf")
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


@check_keywords
def save_safetensors(
    tensors: Mapping[str, Any] | Any,
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    existsok: bool = False,
    sep: str = ".",
) -> None:
    """Export a :class:`~memtree.TensorTree` (or a mapping of tensors) to a ``.safetensors`` file.

    Nested keys are flattened with ``sep`` (``("encoder", "w")`` -> ``"encoder.w"``), as in a
    ``state_dict``. Bytes are written as they are: the file is bit-exact for every dtype
    safetensors supports.

    **Tied tensors.** A tree made by :meth:`~memtree.TensorTree.from_module` holds a tied tensor
    (a language model's input embedding and output projection) once, under its first name, and
    records the other names in its root ``"__tied__"`` leaf. That record is not written: the file
    holds each shared tensor once, under the name Hugging Face keeps (``transformer.wte.weight``,
    not ``lm_head.weight``: the names in a model's ``_tied_weights_keys`` come later), as
    ``save_pretrained`` writes it and ``from_pretrained`` expects it. A model
    that ties the names itself (every ``transformers`` model with tied embeddings) is tied again
    when the file is loaded into it with :func:`~memtree.load_into_module`. Pass
    ``metadata={"format": "pt"}`` for readers that ask for it (older ``transformers``).

    Args:
        tensors: a TensorTree or a (nested) mapping of str to tensors.
        path: the file to create.
        metadata: the ``__metadata__`` map (str to str).
        existsok: replace an existing file.
        sep: separator of flattened keys.

    Raises:
        NonTensorValueError: the tree has non-tensor leaves (safetensors holds tensors only).
        DtypeError: a dtype safetensors cannot hold.

    Example:
        >>> import os, tempfile, torch, memtree
        >>> tree = memtree.TensorTree({"enc": {"w": torch.zeros(2)}})
        >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
        >>> save_safetensors(tree, p)
        >>> SafetensorsReader(p).keys()
        ['enc.w']
    """
    level = _as_level(tensors, ())
    if TIED_KEY in level.entries and _is_tie_record(level.entries[TIED_KEY]):
        # the aliases of tensors written under their first name
        level = replace(level, entries={k: v for k, v in level.entries.items() if k != TIED_KEY})
    dropped: list[tuple[str, ...]] = []
    items, groups = flatten_groups(level, sep.join, dropped)
    if dropped:
        raise NonTensorValueError(
            f"{sep.join(dropped[0])!r} is a non-tensor value; safetensors holds tensors only: "
            "exclude it (tree.exclude(key)) or keep a memtree directory"
        )
    flat: dict[str, torch.Tensor] = {}
    for key, tensor in items:
        if key in flat:
            raise KeyCollisionError(
                f"two tensors flatten to the key {key!r}; rename one or change sep"
            )
        flat[key] = tensor
    write_safetensors(
        path,
        [(k, tuple(t.shape), t.dtype) for k, t in flat.items()],
        flat.__getitem__,
        metadata={**(metadata or {}), **groups} if groups is not None else metadata,
        existsok=existsok,
    )


def _as_level(obj: Any, path: tuple[str, ...]) -> Level:
    """A tree (its own levels) or a nested mapping as a Level: a tensor subclass as its group
    (:mod:`memtree.format.subclass_registry`), a DTensor as its full tensor."""
    level = as_level(obj)
    if level is not None:
        return level
    out = Level(())
    for key, value in obj.items():
        if isinstance(value, Mapping) or as_level(value) is not None:
            value = _as_level(value, path + (key,))
        elif isinstance(value, torch.Tensor) and is_dtensor(value):
            value = value.full_tensor()  # type: ignore[attr-defined]
        if isinstance(value, torch.Tensor) and not is_plain(value):
            value = to_group(value, path + (key,))
        out.entries[key] = value
    return out


def _is_tie_record(value: Any) -> bool:
    """A tie record (alias -> first name, all str), held as a value or, from a mapping, a level."""
    data = value.data if isinstance(value, NonTensor) else value
    if isinstance(data, Level):
        data = {k: v.data if isinstance(v, NonTensor) else v for k, v in data.entries.items()}
    return isinstance(data, Mapping) and all(type(k) is str and type(v) is str for k, v in data.items())
