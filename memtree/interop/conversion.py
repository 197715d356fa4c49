"""``convert``: stream a checkpoint or tree from one format to another, one tensor at a time.

Sources: a ``torch.save`` file, a ``.safetensors`` file, a Hugging Face shard index or model
directory (through :mod:`memtree.interop.sharded`, which validates the index), a tensordict
``memmap`` directory, or a memtree directory. Destinations (``format=``): a memtree directory,
a ``.safetensors`` file, a Hugging Face model directory (``model.safetensors`` or shards and
their index), or a tensordict directory.

How memory stays bounded by the largest tensor (not the file): the source is opened lazily and
turned into a :class:`~memtree.format.level.Level` whose tensor leaves are
:class:`~memtree.interop.lazy.LazyLeaf` objects. Going to a memtree directory, a contiguous
tensor of a ``torch.save`` file that is not cast is copied from the checkpoint into its leaf
file **file to file** (``copy_file_range``: no byte passes through the process, which holds no
tensor at all; its record's CRC-32 is not checked, as with ``torch.load(mmap=True)``). Every
other leaf reads its bytes with ``pread`` into a new tensor (never through a mapping, whose
pages would stay resident), is cast if asked, and is dropped once its file is written:

* to a memtree directory, the Level goes through :func:`memtree.store.writing.write.write_tree` unchanged:
  the same plan, staging directory and atomic commit as ``TensorTree.memmap`` (no second commit
  protocol); leaves are written one by one in the calling thread;
* to a ``.safetensors`` file, :func:`~memtree.interop.safetensors_file.write_safetensors`
  writes the header from shapes and dtypes, then each tensor at its offset, into a temporary
  file renamed into place at the end;
* to a model directory, :func:`~memtree.interop.sharded.write_model_directory` splits the
  tensors as ``huggingface_hub`` does and writes each file with the same ``write_safetensors``,
  in a staging directory published by the commit of ``write_tree``
  (:func:`~memtree.store.writing.staged.staged_directory`); tied ``torch.save`` tensors (the same view
  of one storage) are written once, under the first name, as ``save_pretrained`` does;
* to a tensordict directory, :func:`~memtree.store.foreign.tensordict_write.write_tensordict_dir`
  writes tensordict's layout, published the same way.

Keys: a checkpoint's dotted keys become nested sub-trees (``"encoder.0.weight"`` ->
``encoder/0/weight``, as ``TensorTree.from_module`` nests them) unless ``flat_keys=True``;
going to safetensors, nested keys are joined with ``.``. ``dtype=`` casts floating-point
tensors only (like ``module.to(dtype)``); integer, bool and complex tensors keep their dtype.
Non-tensor values that format version 2 holds exactly are kept in memtree directories: JSON
values, tuples included (they load as tuples). Others (NaN, bytes, sets, ints beyond 64 bits,
``torch.Size``, ``OrderedDict``, dtypes, devices...; and every non-tensor value, going to
safetensors) are never altered: they are dropped and listed in :attr:`ConvertResult.dropped`.
The containers that became keys are listed in :attr:`ConvertResult.altered` (lists and tuples of
tensors are keyed by index, int dict keys become str). A tensor that memtree cannot read
(sparse, quantized...) is refused, or with ``skip_unsupported=True`` left out and listed in
:attr:`ConvertResult.skipped`; a conjugate or negative view is written with its values, as
``torch.load`` gives them.

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

import functools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from ..format.dtypes import dtype_from_name, itemsize
from ..errors import (
    check_keywords,
    DestinationExistsError,
    DtypeError,
    InvalidArgumentError,
    KeyCollisionError,
    NotAMemtreeError,
)
from ..store.primitives.files import FileRange, open_checked, read_fd
from ..format.names import META_NAME
from ..format.level import Level
from ..format.schema import MAX_META_BYTES
from ..store.reading.mapped import MemoryMappedTensor
from ..format.values import MAX_TUPLE_PATHS, NonTensor, json_problem
from ..store.primitives.progress import Progress
from ..store.reading.read import read_tree
from ..store.reading.options import ReadOptions, WriteOptions
from ..store.reading.storage import local_path
from ..store.writing.write import write_tree
from ..store.foreign.tensordict_write import write_tensordict_dir
from .checkpoint import Checkpoint, checkpoint_kind, open_file
from .lazy import LazyLeaf
from .pickle_guard import PickleLimits
from .safetensors_file import SafetensorsReader, write_safetensors
from .sharded import (
    DIRECTORY_FILES,
    ShardedReader,
    find_checkpoint,
    is_index,
    parse_shard_size,
    write_model_directory,
)
from ..store.foreign.tensordict import is_tensordict_dir, read_tensordict_dir
from .torchao_safetensors import flatten_groups, group_torchao_tensors, is_torchao_metadata
from .torchsave import TorchSaveReader

__all__ = ["ConvertResult", "FORMATS", "convert", "source_kind", "parse_dtype"]

#: Destination formats of :func:`convert`.
FORMATS = ("memtree", "safetensors", "tensordict")


@dataclass
class ConvertResult:
    """What :func:`convert` did."""

    source: str
    """Kind of the source: ``"torch"``, ``"safetensors"`` (a file, or the shards of an index
    or model directory), ``"memtree"`` or ``"tensordict"``."""
    destination: str
    """Kind of the destination: ``"memtree"``, ``"safetensors"`` or ``"tensordict"``."""
    tensors: int = 0
    """Number of tensors written."""
    nbytes: int = 0
    """Bytes of tensor data written."""
    seconds: float = 0.0
    """Wall time of the conversion."""
    files: list[str] = field(default_factory=list)
    """The safetensors files written into a model directory (``model.safetensors``, or the
    shards; the index is ``model.safetensors.index.json``); empty for other destinations."""
    dropped: list[str] = field(default_factory=list)
    """Keys of non-tensor values the destination cannot hold exactly (not written)."""
    altered: dict[str, str] = field(default_factory=dict)
    """Keys of the containers that became keys, with how: ``{"history": "list -> keys by
    index ('0', '1', ...)", "optimizer.state": "int keys -> str keys"}`` (and tied weights left
    out of a safetensors destination, with the key they are tied to)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Keys of the tensors left out with ``skip_unsupported=True``, with what each is
    (``{"emb": "a sparse_coo tensor (sparse)"}``)."""

    def to_dict(self) -> dict[str, Any]:
        """The result as plain JSON data (``memtree convert --json``).

        Example:
            >>> ConvertResult("torch", "memtree", tensors=2, nbytes=16).to_dict()["bytes"]
            16
        """
        return {
            "source": self.source,
            "destination": self.destination,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "files": list(self.files),
            "dropped": list(self.dropped),
            "altered": dict(self.altered),
            "skipped": dict(self.skipped),
        }


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


def _locate(path: str) -> tuple[str, str]:
    """``(kind, path)``: ``"memtree"``, ``"tensordict"`` or ``"checkpoint"``, and what to open
    (for a Hugging Face model directory: its index or weights file).

    Raises:
        NotAMemtreeError: a directory that is none of these.
    """
    if not os.path.isdir(path):
        return "checkpoint", path
    if is_tensordict_dir(path):
        return "tensordict", path
    if os.path.lexists(os.path.join(path, META_NAME)):
        return "memtree", path
    found = find_checkpoint(path)
    if found is None:
        raise NotAMemtreeError(
            f"{path} is a directory without {META_NAME} and without a checkpoint (none of "
            f"{', '.join(DIRECTORY_FILES)}): not a memtree, tensordict or Hugging Face model "
            "directory. Pass the checkpoint file itself (.pt, .bin, .safetensors, or a "
            "*.index.json shard index), or the directory that holds it"
        )
    return "checkpoint", found


def _open_reader(
    path: str, allow_pickle: bool, limits: PickleLimits | None, skip_unsupported: bool = False
) -> TorchSaveReader | SafetensorsReader | ShardedReader:
    """The reader of a checkpoint file or shard index (by content, not by name)."""
    opener = functools.partial(
        open_file, allow_pickle=allow_pickle, limits=limits, skip_unsupported=skip_unsupported
    )
    return ShardedReader(path, opener) if is_index(path) else opener(path)


def _reader_kind(reader: TorchSaveReader | SafetensorsReader | ShardedReader) -> str:
    if isinstance(reader, ShardedReader):
        return reader.format
    return "torch" if isinstance(reader, TorchSaveReader) else "safetensors"


def source_kind(src: str | os.PathLike[str]) -> str:
    """``"memtree"``, ``"tensordict"``, ``"torch"`` or ``"safetensors"`` for a source path.

    A shard index (``*.index.json``) or a Hugging Face model directory is the kind of its
    shards (their headers are read to tell).

    Raises:
        NotAMemtreeError: a directory that is not a memtree, tensordict or model directory.
        CheckpointFormatError: a file that is neither a torch.save zip nor a safetensors file.

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "m.pt")
        >>> torch.save({"w": torch.ones(1)}, p)
        >>> source_kind(p)
        'torch'
    """
    kind, path = _locate(os.fspath(local_path(src, remote="source_kind reads local files")))
    if kind != "checkpoint":
        return kind
    if is_index(path):
        with _open_reader(path, allow_pickle=False, limits=None) as reader:
            return _reader_kind(reader)
    return checkpoint_kind(path)


def _cast_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """What ``dtype=cast`` makes of a tensor of ``dtype``: floating-point ones are cast, except
    packed FP4 (two values a byte: no element-wise cast), which keeps its dtype like ints."""
    return cast if cast is not None and dtype.is_floating_point and dtype is not _PACKED_FP4 else dtype


_PACKED_FP4 = dtype_from_name("float4_e2m1fn_x2")


#: orjson refuses nesting deeper than 254 levels, and a value lies a few levels down in its
#: meta.json: deeper values are dropped.
_MAX_JSON_DEPTH = 200
#: The containers a JSON value may hold (exactly these types: subclasses would come back as
#: these).
_JSON_CONTAINERS = frozenset({list, tuple, dict})


def _json_problem(value: Any) -> str | None:
    """Why ``value`` cannot be written exactly as a JSON entry of format version 2, or ``None``.

    A value is written exactly when it holds only ``None``, ``bool``, ``int`` (64 bits),
    finite ``float``, ``str`` and exact ``list``, ``tuple`` (recorded as such: ``tuples``) and
    ``dict`` with ``str`` keys (:func:`~memtree.format.values.json_problem`), without a cycle,
    nesting at most 200 levels, within the size of a meta.json and at most
    :data:`~memtree.format.values.MAX_TUPLE_PATHS` tuples. Anything else (``torch.Size``, an
    ``OrderedDict``, a set, bytes...) would come back changed. Each distinct container is
    checked once (memoised by identity) and its size remembered, so a part shared by many
    places costs its size once in time while its repetitions still count towards the size of
    the JSON.

    Example:
        >>> _json_problem({"betas": (0.9, 0.99), "n": 3}) is None
        True
        >>> _json_problem({"size": torch.Size([2])})
        "value['size'] is a Size, which JSON would change or cannot hold"
    """
    if type(value) not in _JSON_CONTAINERS:
        return json_problem(value)
    finished: dict[int, tuple[int, int]] = {}  # id -> (JSON values it expands to, tuples in it)
    on_path = {id(value)}
    expanded, tuples = 1, int(type(value) is tuple)

    def items(obj: Any) -> Iterator[tuple[Any, Any]]:
        return iter(obj.items()) if type(obj) is dict else enumerate(obj)

    stack: list[tuple[Any, Iterator[tuple[Any, Any]], str, int, int]] = [(value, items(value), "", 0, 0)]
    while stack:
        obj, children, where, start, tuples_start = stack[-1]
        for key, child in children:
            if type(obj) is dict and type(key) is not str:
                return f"value{where} has a non-str dict key {key!r:.60}"
            if type(obj) is dict and (problem := json_problem(key, f"value{where} key")):
                return problem
            sub = f"{where}[{key!r}]"
            if type(child) not in _JSON_CONTAINERS:
                if problem := json_problem(child, f"value{sub}"):
                    return problem
                size, inner = 1, 0
            elif id(child) in finished:
                size, inner = finished[id(child)]
            elif id(child) in on_path:
                return f"value{sub} contains itself (a cycle)"
            elif len(stack) >= _MAX_JSON_DEPTH:
                return f"value{sub} is nested more than {_MAX_JSON_DEPTH} levels deep"
            else:
                on_path.add(id(child))
                stack.append((child, items(child), sub, expanded, tuples))
                expanded += 1
                tuples += type(child) is tuple
                break
            expanded += size
            tuples += inner
            if expanded > MAX_META_BYTES:  # each JSON value takes a byte at least
                return (
                    f"value expands to more than {MAX_META_BYTES:,} JSON values (a part shared "
                    "by several places is repeated at each), more than a meta.json holds"
                )
            if tuples > MAX_TUPLE_PATHS:
                return f"value holds more than {MAX_TUPLE_PATHS:,} tuples, more than a meta.json records"
        else:
            stack.pop()
            on_path.discard(id(obj))
            finished[id(obj)] = (expanded - start, tuples - tuples_start)
    nbytes = len(orjson.dumps(value))
    if nbytes > MAX_META_BYTES:
        return f"value takes {nbytes:,} bytes of JSON, more than a meta.json holds"
    return None


#: How TorchSaveReader.containers kinds are described in ConvertResult.altered.
_CONTAINER_CHANGES = {
    "list": "list -> keys by index ('0', '1', ...)",
    "tuple": "tuple -> keys by index ('0', '1', ...)",
    "int keys": "int keys -> str keys",
}


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

    def __init__(self, cast: torch.dtype | None, destination: str) -> None:
        self.cast = cast
        self.destination = destination
        self.on_read: Callable[[int], None] = lambda nbytes: None
        self.level = Level((), {})
        self.dropped: list[str] = []
        self.altered: dict[str, str] = {}
        self.metadata: dict[str, str] | None = None
        self.skipped: dict[str, str] = {}
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

    def from_checkpoint(
        self,
        reader: TorchSaveReader | SafetensorsReader | ShardedReader,
        flat_keys: bool,
        to_safetensors: bool,
    ) -> None:
        """Stream a checkpoint's tensors; its non-tensor values as JSON (dropped when going to
        safetensors, which holds none). Going to safetensors, a tensor that is the very same
        view of a storage as an earlier one (a tied weight) is written once, under the first
        name, as Hugging Face saves tied weights."""
        if isinstance(reader, TorchSaveReader):
            self.altered.update(
                (k or "(top level)", _CONTAINER_CHANGES[v]) for k, v in reader.containers.items()
            )
        ckpt = Checkpoint(reader, _reader_kind(reader))
        self.close = ckpt.close
        self.metadata = ckpt.metadata
        self.skipped = dict(ckpt.skipped)
        views: dict[tuple[Any, ...], str] = {}
        for key in ckpt:
            if to_safetensors and isinstance(reader, TorchSaveReader):
                ref = reader.ref(key)  # the same values: the same view, with the same bits
                view = (ref.storage.key, ref.dtype, ref.offset, ref.size, ref.stride, ref.conj, ref.neg)
                if view in views:
                    self.altered[key] = (
                        f"tied to {views[view]}: written once, under that name (as Hugging Face "
                        "saves tied weights)"
                    )
                    continue
                views[view] = key
            shape, dtype = ckpt.tensor_spec(key)
            path = (key,) if flat_keys else _split(ckpt.key_path(key))
            read = (lambda k: lambda: ckpt.read(k, mmap=False))(key)
            file_range = None
            if isinstance(reader, TorchSaveReader):
                file_range = (lambda r, k: lambda: r.file_range(k))(reader, key)
            _insert(self.level, path, self.leaf(shape, dtype, read, file_range), key)
        if is_torchao_metadata(self.metadata):
            self._torchao_groups(ckpt, flat_keys)
        for key, value in ckpt.non_tensors.items():
            if to_safetensors or _json_problem(value) is not None:
                self.dropped.append(key)
                continue
            path = (key,) if flat_keys else _split(ckpt.key_path(key))
            _insert(self.level, path, NonTensor(value), key)

    def _torchao_groups(self, ckpt: Checkpoint, flat_keys: bool) -> None:
        """Gather the inner tensors of each subclass of a file in torchao's safetensors convention
        (:mod:`memtree.interop.torchao_safetensors`) into its group, at the subclass's key."""
        assert self.metadata is not None
        place = (lambda k: (k,)) if flat_keys else (lambda k: _split(ckpt.key_path(k)))
        groups = group_torchao_tensors(self.metadata, lambda k: ckpt.tensor_spec(k) if k in ckpt else None)
        for name, (keys, group) in groups.items():
            for inner, key in keys.items():
                *parents, last = place(key)
                node = self.level
                for part in parents:
                    child = node.entries[part]
                    assert isinstance(child, Level)  # where _insert put the key's leaf
                    node = child
                group.entries[inner] = node.entries.pop(last)
            _insert(self.level, (name,) if flat_keys else _split((name,)), group, name)

    def from_directory(self, src: str, kind: str, allow_pickle: bool) -> None:
        if kind == "tensordict":
            mapped = read_tensordict_dir(src, mode="r")
        else:
            mapped = read_tree(src, ReadOptions(mode="r", allow_pickle=allow_pickle))
        self.level = self._rebuild(mapped)

    def _rebuild(self, level: Level, path: tuple[str, ...] = ()) -> Level:
        out = Level(level.batch_size, {}, level.type, level.foreign_type, subclass=level.subclass)
        if level.foreign_type is not None and self.destination == "memtree":
            self.altered[".".join(path) or "(top level)"] = (
                f"tensordict @tensorclass {level.foreign_type} -> plain tree (load the tensordict "
                "directory with memtree.load_memmap to get a registered memtree @tensorclass)"
            )
        for key, value in level.entries.items():
            if isinstance(value, Level):
                out.entries[key] = self._rebuild(value, path + (key,))
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


def _flatten(level: Level, leaves: dict[str, LazyLeaf], dropped: list[str]) -> dict[str, str] | None:
    """The leaves under their safetensors names (a subclass's inner tensors under torchao's
    names) and torchao's metadata when there is a subclass (else ``None``)."""
    skipped: list[tuple[str, ...]] = []
    tensors, metadata = flatten_groups(level, ".".join, skipped)
    dropped.extend(".".join(p) for p in skipped)
    for name, value in tensors:
        if name in leaves:
            raise KeyCollisionError(f"two tensors flatten to the safetensors key {name!r}")
        leaves[name] = value
    return metadata


@check_keywords
def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    max_shard_size: int | str | None = None,
    dtype: str | torch.dtype | None = None,
    existsok: bool = False,
    allow_pickle: bool = False,
    flat_keys: bool = False,
    fsync: bool = False,
    progress: bool | None = None,
    limits: PickleLimits | None = None,
    skip_unsupported: bool = False,
) -> ConvertResult:
    """Convert ``src`` into ``dst``, streaming one tensor at a time (see the module docstring).

    Args:
        src: a ``torch.save`` or ``.safetensors`` file; a shard index
            (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``); a Hugging Face
            model directory (its index or weights file is found as ``open_checkpoint`` finds
            it); a tensordict or a memtree directory.
        dst: the destination (a directory or a file, by ``format``).
        format: ``"memtree"`` (a directory), ``"safetensors"`` or ``"tensordict"`` (a directory
            that ``tensordict.TensorDict.load_memmap`` reads). Default: ``"safetensors"`` when
            ``dst`` ends in ``.safetensors`` (one file), else ``"memtree"``. ``"safetensors"``
            with a ``dst`` that does not end in ``.safetensors`` writes a Hugging Face model
            directory: ``model.safetensors``, or shards and ``model.safetensors.index.json``.
        max_shard_size: the shard size limit of a model directory (Hugging Face's semantics:
            ``"5GB"`` = 5 * 10**9 bytes, ``"500MB"``, ``"4GiB"``, or bytes; a tensor larger than
            the limit gets a shard of its own). Default ``"5GB"``.
        dtype: cast floating-point tensors to this dtype while streaming (e.g. ``"bfloat16"``).
        existsok: replace an existing destination (atomically) instead of refusing. A
            directory is replaced only if it holds what this format writes (a memtree or
            tensordict directory, a model directory of weights only).
        allow_pickle: trusted ``torch.save`` files (and pickled memtree leaves) only: allow
            pickled objects beyond tensors and plain data.
        flat_keys: keep a checkpoint's dotted keys flat instead of nesting them.
        fsync: make the destination durable (survives power loss) before it appears.
        progress: a progress bar on standard error: ``None`` on a terminal only, ``True``,
            ``False``.
        limits: bounds on a ``torch.save`` file's pickle (default: those of
            :func:`~memtree.interop.pickle_limits` in force).
        skip_unsupported: leave out the tensors of a ``torch.save`` file that memtree cannot
            read (sparse, quantized, nested, meta...: see
            :func:`~memtree.interop.open_checkpoint`), listed in
            :attr:`ConvertResult.skipped`, instead of refusing the file.

    Returns:
        A :class:`ConvertResult`: counts, time, the files of a model directory, the keys of
        dropped non-tensor values, of containers that became keys
        (:attr:`ConvertResult.altered`) and of skipped tensors.

    Raises:
        MemtreeError: an unreadable source, an existing destination without ``existsok``, a
            dtype the destination cannot hold, a bad ``format`` or ``max_shard_size``, ...; a
            partial destination never appears.

    Example:
        >>> import os, tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> torch.save({"w": torch.zeros(3)}, os.path.join(d, "m.pt"))
        >>> convert(os.path.join(d, "m.pt"), os.path.join(d, "m.safetensors")).destination
        'safetensors'
        >>> convert(os.path.join(d, "m.pt"), os.path.join(d, "hf"), format="safetensors").files
        ['model.safetensors']
    """
    started = time.perf_counter()
    cast = parse_dtype(dtype)
    local = "convert reads and writes local files; download the source or upload the result with memtree.remote"
    src_path, dst_path = os.fspath(local_path(src, remote=local)), os.fspath(local_path(dst, remote=local))
    single_file = dst_path.endswith(".safetensors")
    fmt = format if format is not None else ("safetensors" if single_file else "memtree")
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r:.40}")
    model_dir = fmt == "safetensors" and not single_file
    if max_shard_size is not None and not model_dir:
        raise InvalidArgumentError(
            "max_shard_size splits a Hugging Face model directory into shards: use "
            "format='safetensors' (CLI: --format safetensors) with a destination directory "
            f"(not a name ending in .safetensors), got format={fmt!r} and {dst_path!r}"
        )
    if max_shard_size is not None:
        parse_shard_size(max_shard_size)  # refuse a bad size before reading anything
    kind, located = _locate(src_path)
    if (
        not existsok
        and os.path.lexists(dst_path)
        and not (os.path.isdir(dst_path) and not os.listdir(dst_path))
    ):
        raise DestinationExistsError(
            f"{dst_path} already exists; pass existsok=True (CLI: --existsok) to replace it"
        )
    result = ConvertResult(kind, fmt)
    stream = _Stream(cast, fmt)
    try:
        if kind == "checkpoint":
            reader = _open_reader(located, allow_pickle, limits, skip_unsupported)
            result.source = _reader_kind(reader)
            stream.close = reader.close
            stream.from_checkpoint(reader, flat_keys, to_safetensors=fmt == "safetensors")
        else:
            stream.from_directory(located, kind, allow_pickle)
        name = os.path.basename(src_path.rstrip("/"))
        with Progress(
            total=stream.nbytes, desc=f"converting {name}", unit="B", progress=progress
        ) as bar:
            stream.on_read = bar.update
            if fmt == "safetensors":
                leaves: dict[str, LazyLeaf] = {}
                groups = _flatten(stream.level, leaves, stream.dropped)
                if groups is not None:  # subclasses: torchao's convention, which torchao loads
                    stream.metadata = {**(stream.metadata or {}), **groups}
                specs = [(k, leaf.shape, leaf.dtype) for k, leaf in leaves.items()]
                produce = lambda k: leaves[k].materialize()  # noqa: E731
                if model_dir:
                    files = write_model_directory(
                        dst_path, specs, produce, max_shard_size=max_shard_size or "5GB",
                        metadata=stream.metadata, existsok=existsok, fsync=fsync,
                    )
                    result.files = list(files)
                else:
                    write_safetensors(
                        dst_path, specs, produce, metadata=stream.metadata,
                        existsok=existsok, fsync=fsync,
                    )
            elif fmt == "tensordict":
                written = write_tensordict_dir(dst_path, stream.level, existsok=existsok, fsync=fsync)
                stream.dropped.extend(written.dropped)
                stream.altered.update(written.altered)
            else:
                write_tree(
                    dst_path, stream.level,
                    WriteOptions.of(existsok=existsok, fsync=fsync, allow_pickle=allow_pickle),
                )
    finally:
        stream.close()
    result.dropped = list(stream.dropped)
    result.altered = dict(stream.altered)
    result.skipped = dict(stream.skipped)
    result.tensors, result.nbytes = stream.tensors, stream.nbytes
    result.seconds = time.perf_counter() - started
    return result
