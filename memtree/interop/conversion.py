"""``convert``: stream a checkpoint or tree from one format to another, one tensor at a time.

Sources: a ``torch.save`` file, a ``.safetensors`` file, a tensordict ``memmap`` directory, or a
memtree directory. Destinations: a memtree directory, or a ``.safetensors`` file (chosen by the
destination's name).

How memory stays bounded by the largest tensor (not the file): the source is opened lazily and
turned into a :class:`~memtree.format.level.Level` whose tensor leaves are
:class:`~memtree.interop.lazy.LazyLeaf` objects. Going to a memtree directory, a contiguous
tensor of a ``torch.save`` file that is not cast is copied from the checkpoint into its leaf
file **file to file** (``copy_file_range``: no byte passes through the process, which holds no
tensor at all; its record's CRC-32 is not checked, as with ``torch.load(mmap=True)``). Every
other leaf reads its bytes with ``pread`` into a new tensor (never through a mapping, whose
pages would stay resident), is cast if asked, and is dropped once its file is written:

* to a memtree directory, the Level goes through :func:`memtree.store.write.write_tree` unchanged:
  the same plan, staging directory and atomic commit as ``TensorTree.memmap`` (no second commit
  protocol); leaves are written one by one in the calling thread;
* to a ``.safetensors`` file, :func:`~memtree.interop.safetensors_file.write_safetensors`
  writes the header from shapes and dtypes, then each tensor at its offset, into a temporary
  file renamed into place at the end.

Keys: a checkpoint's dotted keys become nested sub-trees (``"encoder.0.weight"`` ->
``encoder/0/weight``, as ``TensorTree.from_module`` nests them) unless ``flat_keys=True``;
going to safetensors, nested keys are joined with ``.``. ``dtype=`` casts floating-point
tensors only (like ``module.to(dtype)``); integer, bool and complex tensors keep their dtype.
Non-tensor values that JSON can hold are kept in memtree directories (tuples become lists);
others (and every non-tensor value, going to safetensors) are dropped and listed in the result.

Example:
    >>> import os, tempfile, torch, memtree
    >>> from memtree.interop import convert
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"enc.w": torch.ones(2, 2), "step": 3}, os.path.join(d, "c.pt"))
    >>> result = convert(os.path.join(d, "c.pt"), os.path.join(d, "tree"), dtype=torch.bfloat16)
    >>> tree = memtree.load_memmap(os.path.join(d, "tree"))
    >>> tree["enc", "w"].dtype, tree["step"], result.tensors
    (torch.bfloat16, 3, 1)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.dtypes import dtype_from_name, itemsize
from ..errors import DestinationExistsError, DtypeError, KeyCollisionError, NotAMemtreeError
from ..store.files import FileRange, open_checked, read_fd
from ..format.names import META_NAME
from ..format.level import Level
from ..store.mapped import MemoryMappedTensor
from ..format.values import NonTensor, json_problem
from ..store.progress import Progress
from ..store.read import read_tree
from ..store.write import write_tree
from .checkpoint import Checkpoint, checkpoint_kind
from .lazy import LazyLeaf
from .safetensors_file import SafetensorsReader, write_safetensors
from ..store.tensordict import is_tensordict_dir, read_tensordict_dir
from .torchsave import TorchSaveReader

__all__ = ["ConvertResult", "convert", "source_kind", "parse_dtype"]


@dataclass
class ConvertResult:
    """What :func:`convert` did."""

    source: str
    """Kind of the source: ``"torch"``, ``"safetensors"``, ``"memtree"`` or ``"tensordict"``."""
    destination: str
    """Kind of the destination: ``"memtree"`` or ``"safetensors"``."""
    tensors: int = 0
    """Number of tensors written."""
    nbytes: int = 0
    """Bytes of tensor data written."""
    dropped: list[str] = field(default_factory=list)
    """Keys of non-tensor values the destination cannot hold (not written)."""


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """A floating-point dtype from a name (``"bfloat16"``, ``"torch.float16"``) or ``None``.

    Raises:
        DtypeError: not a floating-point dtype memtree knows.
    """
    if name is None or isinstance(name, torch.dtype):
        dtype = name
    else:
        dtype = dtype_from_name(name.removeprefix("torch."))
        if dtype is None:
            raise DtypeError(
                f"unknown dtype {name!r}; use a name such as bfloat16, float16, float32"
            )
    if dtype is not None and not dtype.is_floating_point:
        raise DtypeError(
            "the cast dtype must be floating-point (only floating-point tensors are cast), "
            f"got {dtype}"
        )
    return dtype


def source_kind(src: str | os.PathLike[str]) -> str:
    """``"memtree"``, ``"tensordict"``, ``"torch"`` or ``"safetensors"`` for a source path.

    Raises:
        NotAMemtreeError: a directory that is neither a memtree nor a tensordict directory.
        CheckpointFormatError: a file that is neither a torch.save zip nor a safetensors file.
    """
    path = os.fspath(src)
    if os.path.isdir(path):
        if is_tensordict_dir(path):
            return "tensordict"
        if not os.path.isfile(os.path.join(path, META_NAME)):
            raise NotAMemtreeError(
                f"{path} is a directory without {META_NAME}: not a memtree or tensordict directory"
            )
        return "memtree"
    return checkpoint_kind(path)


def _cast_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and dtype.is_floating_point else dtype


def _as_json(value: Any) -> Any:
    """``value`` with tuples turned into lists, at any depth (everything else as it is)."""
    if isinstance(value, (tuple, list)):
        return [_as_json(v) for v in value]
    if type(value) is dict:
        return {k: _as_json(v) for k, v in value.items()}
    return value


def _json_value(value: Any) -> tuple[bool, Any]:
    value = _as_json(value)
    return json_problem(value) is None, value


def _insert(root: Level, path: tuple[str, ...], value: Any, label: str) -> None:
    node = root
    for part in path[:-1]:
        nxt = node.entries.setdefault(part, Level(node.batch_size, {}))
        if not isinstance(nxt, Level):
            raise KeyCollisionError(
                f"key {label!r} needs {part!r} to be a sub-tree, but it is also a value; pass "
                "flat_keys=True (CLI: --flat-keys) to keep the dotted keys as they are"
            )
        node = nxt
    if path[-1] in node.entries:
        raise KeyCollisionError(
            f"key {label!r} collides with another entry at the same place; pass flat_keys=True "
            "(CLI: --flat-keys) to keep the dotted keys as they are"
        )
    node.entries[path[-1]] = value


def _split(path: tuple[str, ...]) -> tuple[str, ...]:
    """Split dotted parts (``"enc.0.w"`` -> ``enc, 0, w``); keep parts with empty pieces whole."""
    out: list[str] = []
    for part in path:
        pieces = part.split(".")
        out.extend(pieces if all(pieces) else [part])
    return tuple(out)


class _Stream:
    """The source as a Level of LazyLeaf objects, with byte counting for the progress bar."""

    def __init__(self, cast: torch.dtype | None) -> None:
        self.cast = cast
        self.on_read: Callable[[int], None] = lambda nbytes: None
        self.level = Level((), {})
        self.dropped: list[str] = []
        self.metadata: dict[str, str] | None = None
        self.tensors = 0
        self.nbytes = 0
        self.close: Callable[[], None] = lambda: None

    def leaf(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        read: Callable[[], torch.Tensor],
        file_range: Callable[[], FileRange | None] | None = None,
    ) -> LazyLeaf:
        """A leaf read by ``read`` (and cast), or copied from ``file_range`` when not cast."""
        out_dtype = _cast_dtype(dtype, self.cast)
        nbytes = shape.numel() * itemsize(out_dtype)
        self.tensors += 1
        self.nbytes += nbytes

        def load() -> torch.Tensor:
            t = read()
            if t.dtype != out_dtype:
                t = t.to(out_dtype)
            self.on_read(nbytes)
            return t

        def copy_from() -> FileRange | None:
            found = file_range() if file_range is not None else None
            if found is not None:
                self.on_read(nbytes)
            return found

        uncast = file_range is not None and out_dtype == dtype
        return LazyLeaf(shape, out_dtype, load, copy_from if uncast else None)

    def from_checkpoint(self, src: str, kind: str, allow_pickle: bool, flat_keys: bool) -> None:
        if kind == "torch":
            reader: TorchSaveReader | SafetensorsReader = TorchSaveReader(
                src, allow_pickle=allow_pickle
            )
        else:
            reader = SafetensorsReader(src)
        ckpt = Checkpoint(reader, kind)
        self.close = ckpt.close
        self.metadata = ckpt.metadata
        for key in ckpt:
            shape, dtype = ckpt.tensor_spec(key)
            path = (key,) if flat_keys else _split(ckpt.key_path(key))
            read = (lambda k: lambda: ckpt.read(k, mmap=False))(key)
            file_range = None
            if isinstance(reader, TorchSaveReader):
                file_range = (lambda r, k: lambda: r.file_range(k))(reader, key)
            _insert(self.level, path, self.leaf(shape, dtype, read, file_range), key)
        for key, value in ckpt.non_tensors.items():
            ok, value = _json_value(value)
            if not ok:
                self.dropped.append(key)
                continue
            path = (key,) if flat_keys else _split(ckpt.key_path(key))
            _insert(self.level, path, NonTensor(value), key)

    def from_directory(self, src: str, kind: str, allow_pickle: bool) -> None:
        if kind == "tensordict":
            mapped = read_tensordict_dir(src, mode="r")
        else:
            mapped = read_tree(src, mode="r", allow_pickle=allow_pickle)
        self.level = self._rebuild(mapped)

    def _rebuild(self, level: Level) -> Level:
        out = Level(level.batch_size, {}, level.type)
        for key, value in level.entries.items():
            if isinstance(value, Level):
                out.entries[key] = self._rebuild(value)
            elif isinstance(value, torch.Tensor):
                out.entries[key] = self.leaf(value.shape, value.dtype, _file_reader(value))
            else:
                out.entries[key] = value
        return out


def _file_reader(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Read a mapped leaf again with ``pread`` (its pages are never touched through the map).

    The loader has already checked the file; it holds the tensor's bytes from offset 0 (a
    tensordict leaf or a growable leaf's file may be longer).
    """
    if not isinstance(tensor, MemoryMappedTensor) or tensor.filename is None:
        return lambda: tensor  # a zero-element leaf without a file
    if tensor.storage_offset() != 0 or not tensor.is_contiguous():
        return lambda: tensor.clone()
    path, shape, dtype = tensor.filename, tuple(tensor.shape), tensor.dtype

    def read() -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        fd = open_checked(path, out.numel() * itemsize(dtype), path, strict_size=False)
        try:
            read_fd(fd, out)
        finally:
            os.close(fd)
        return out

    return read


def _flatten(
    level: Level, prefix: tuple[str, ...], leaves: dict[str, LazyLeaf], dropped: list[str]
) -> None:
    for key, value in level.entries.items():
        path = prefix + (key,)
        if isinstance(value, Level):
            _flatten(value, path, leaves, dropped)
        elif isinstance(value, LazyLeaf):
            name = ".".join(path)
            if name in leaves:
                raise KeyCollisionError(f"two tensors flatten to the safetensors key {name!r}")
            leaves[name] = value
        else:
            dropped.append(".".join(path))


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    flat_keys: bool = False,
    fsync: bool = False,
    progress: bool | None = None,
) -> ConvertResult:
    """Convert ``src`` into ``dst``, streaming one tensor at a time (see the module docstring).

    Args:
        src: a ``torch.save`` file, a ``.safetensors`` file, a tensordict or a memtree directory.
        dst: a memtree directory, or a file whose name ends in ``.safetensors``.
        dtype: cast floating-point tensors to this dtype while streaming (e.g. ``"bfloat16"``).
        overwrite: replace an existing destination (atomically) instead of refusing.
        allow_pickle: trusted ``torch.save`` files (and pickled memtree leaves) only: allow
            pickled objects beyond tensors and plain data.
        flat_keys: keep a checkpoint's dotted keys flat instead of nesting them.
        fsync: make the destination durable (survives power loss) before it appears.
        progress: a progress bar on standard error: ``None`` on a terminal only, ``True``,
            ``False``.

    Returns:
        A :class:`ConvertResult` (counts and the keys of dropped non-tensor values).

    Raises:
        MemtreeError: an unreadable source, an existing destination without ``overwrite``, a
            dtype the destination cannot hold, ...; a partial destination never appears.

    Example:
        >>> import os, tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> torch.save({"w": torch.zeros(3)}, os.path.join(d, "m.pt"))
        >>> convert(os.path.join(d, "m.pt"), os.path.join(d, "m.safetensors")).destination
        'safetensors'
    """
    cast = parse_dtype(dtype)
    src_path, dst_path = os.fspath(src), os.fspath(dst)
    kind = source_kind(src_path)
    to_safetensors = dst_path.endswith(".safetensors")
    if (
        not overwrite
        and os.path.lexists(dst_path)
        and not (os.path.isdir(dst_path) and not os.listdir(dst_path))
    ):
        raise DestinationExistsError(
            f"{dst_path} already exists; pass overwrite=True (CLI: --overwrite) to replace it"
        )
    result = ConvertResult(kind, "safetensors" if to_safetensors else "memtree")
    stream = _Stream(cast)
    try:
        if kind in ("torch", "safetensors"):
            stream.from_checkpoint(src_path, kind, allow_pickle, flat_keys)
        else:
            stream.from_directory(src_path, kind, allow_pickle)
        result.dropped = list(stream.dropped)
        name = os.path.basename(src_path.rstrip("/"))
        with Progress(
            total=stream.nbytes, desc=f"converting {name}", unit="B", progress=progress
        ) as bar:
            stream.on_read = bar.update
            if to_safetensors:
                leaves: dict[str, LazyLeaf] = {}
                _flatten(stream.level, (), leaves, result.dropped)
                write_safetensors(
                    dst_path,
                    [(k, leaf.shape, leaf.dtype) for k, leaf in leaves.items()],
                    lambda k: leaves[k].materialize(),
                    metadata=stream.metadata,
                    existsok=overwrite,
                    fsync=fsync,
                )
            else:
                write_tree(
                    dst_path,
                    stream.level,
                    existsok=overwrite,
                    fsync=fsync,
                    allow_pickle=allow_pickle,
                )
    finally:
        stream.close()
    result.tensors, result.nbytes = stream.tensors, stream.nbytes
    return result
