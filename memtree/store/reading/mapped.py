"""``MemoryMappedTensor``: a ``torch.Tensor`` whose storage is a file mapped into memory.

* Views (indexing, slicing, ``view``, ``reshape`` without copy...) stay ``MemoryMappedTensor``
  and write through to the file; results of computations are ordinary tensors.
* Read-only tensors (``mode="r"``) are mapped copy-on-write, so the file can never change
  through them; in-place operations on them raise :class:`~memtree.errors.ReadOnlyError`, and
  ``.numpy()`` (or ``numpy.asarray``) gives a read-only array. A plain ``torch.Tensor`` alias
  (``as_subclass(torch.Tensor)``, ``torch.Tensor(t)``) has no read-only flag in torch: writes
  through it change this process's private copy of the pages, never the file.
* Sent to another process (DataLoader workers, ``torch.multiprocessing`` queues, spawn or
  fork), a file-backed tensor travels as *(file, dtype, layout)* and the receiver maps the file
  again: no data is copied, and torch 2.13's failing fd-passing path is never used.
* Row assignment (``t[i] = row``, ``t[rows] = values``) into a file-backed tensor is written
  with ``pwrite`` into the mapped file (identified by device and inode, so a tree re-saved at
  the same path since is never written by mistake): no page fault per page of a sparse file,
  and a full disk raises ``StorageError`` instead of killing the process with SIGBUS.
* Pickled with ``pickle``/``torch.save``, it is saved as an ordinary tensor (its data).
* A file with another hard link (a leaf that an incremental save shares between two trees) is
  never mapped read-write: writes would change every tree that shares it. Such a mapping is
  refused with ``UnsafePathError``; ``load_memmap`` gives the leaf its own copy first
  (:mod:`memtree.store.reading.unshare`).

Example:
    >>> import os, tempfile, torch
    >>> from memtree import MemoryMappedTensor
    >>> path = os.path.join(tempfile.mkdtemp(), "x.memmap")
    >>> mt = MemoryMappedTensor.from_tensor(torch.arange(6.0).reshape(2, 3), filename=path)
    >>> mt[1] = 0.0                      # writes through to the file
    >>> MemoryMappedTensor.from_filename(path, torch.float32, (2, 3), mode="r").sum().item()
    3.0
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from math import prod
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, cast

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ...format.dtypes import byte_dtype, dtype_name, itemsize
from ...errors import DtypeError, MissingLeafError, ReadOnlyError
from ..primitives.files import map_fd, open_checked, pwrite_from, shared_file_error, storage_error, write_file_replace
from .options import check_mode
from .mapped_files import WRITERS, FileId, MappedFile

__all__ = ["MemoryMappedTensor", "map_leaf", "map_view", "check_sole", "to_storable"]

_INPLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in (
        "add sub mul matmul truediv floordiv mod pow lshift rshift and or xor".split()
    )
) | {"__setitem__"}
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream"})
_NEVER_WRAP = frozenset({"as_subclass", "__reduce_ex__", "__deepcopy__"})
#: Methods that return a numpy array sharing the tensor's memory (read-only for ``mode="r"``).
_TO_NUMPY = frozenset({"numpy", "__array__"})
#: The row writer's descriptor: never through a link (a path that became one is stale).
_GETITEM = torch.Tensor.__getitem__
_SETITEM = torch.Tensor.__setitem__

ShapeArg = Any
#: Bytes of copies of one row written per ``pwrite`` when a value broadcasts over many rows.
_BROADCAST_BYTES = 1 << 20
_UNKNOWN: Any = object()  # a row layout not computed yet
#: Index tensor dtypes that ``index_select`` takes.
_GATHER_DTYPES = (torch.int64, torch.int32)
#: Integer dtypes of row-index tensors (uint8 index tensors are masks to torch).
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)
#: A file's identity: ``(st_dev, st_ino)``.


def _parse_shape(shape: tuple[Any, ...]) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (Sequence, torch.Size)):
        shape = tuple(shape[0])
    return tuple(int(s) for s in shape)


def to_storable(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """A contiguous CPU tensor holding ``tensor``'s values, copying only when needed.

    Raises:
        DtypeError: sparse, nested or quantized tensors, meta tensors, unsupported dtypes.
    """
    dtype_name(tensor.dtype)  # raises DtypeError for unsupported dtypes
    if tensor.layout != torch.strided or tensor.is_nested:
        raise DtypeError(
            f"{where}: {tensor.layout} tensors cannot be stored; convert with .to_dense() first"
        )
    if tensor.device.type == "meta":
        raise DtypeError(
            f"{where} is on the meta device and has no data; use memmap_like() to allocate "
            "files for it, or materialise it first"
        )
    with torch._C.DisableTorchFunctionSubclass():
        t = tensor.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        copyable = byte_dtype(t.dtype)  # int4, bits8...: torch copies them only as bytes
        if copyable != t.dtype:
            return t.view(copyable).to("cpu").contiguous().view(t.dtype)
        return t.to("cpu").contiguous()


class MemoryMappedTensor(torch.Tensor):
    """A tensor stored in a file (or in anonymous shared memory), mapped into memory.

    Create one with :meth:`from_tensor`, :meth:`empty`, :meth:`zeros`, :meth:`ones`,
    :meth:`full` or :meth:`from_filename`; trees create them with ``memmap``/``load_memmap``.
    """

    #: A plain tensor's data to a writer, not a tensor subclass to store as a group
    #: (:func:`memtree.format.subclass_registry.is_plain`).
    _memtree_plain = True

    _file: MappedFile | None  # None: anonymous shared memory
    _readonly: bool
    _rows: _Rows | None  # cached by _row_layout (absent until the first row write)

    @staticmethod
    def _wrap(tensor: torch.Tensor, file: MappedFile | None, readonly: bool) -> MemoryMappedTensor:
        out = torch.Tensor._make_subclass(MemoryMappedTensor, tensor)
        out._file = file
        out._readonly = readonly
        return out

    # -- properties ---------------------------------------------------------------------------
    @property
    def filename(self) -> str | None:
        """Path of the backing file, or ``None`` for anonymous shared memory."""
        file = getattr(self, "_file", None)
        return None if file is None else file.path

    @property
    def readonly(self) -> bool:
        """True when mapped with ``mode="r"``: in-place writes raise."""
        return getattr(self, "_readonly", False)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_tensor(
        cls,
        tensor: torch.Tensor,
        *,
        filename: str | os.PathLike[str] | None = None,
        existsok: bool = False,
        copy_data: bool = True,
    ) -> MemoryMappedTensor:
        """Copy ``tensor`` into a new file (or shared memory when ``filename`` is None).

        Args:
            tensor: any strided tensor of a storable dtype, on any device.
            filename: the file to create; ``None`` for anonymous shared memory.
            existsok: replace an existing file (by a new inode) instead of raising.
            copy_data: False creates zeros of the same shape and dtype (a sparse file).

        Example:
            >>> MemoryMappedTensor.from_tensor(torch.ones(3)).filename is None
            True
        """
        if filename is None:
            dtype_name(tensor.dtype)
            shared = torch.zeros(tensor.shape, dtype=tensor.dtype).share_memory_()
            if copy_data:
                shared.copy_(to_storable(tensor, "tensor"))
            return cls._wrap(shared, None, False)
        path = os.fspath(filename)
        if isinstance(tensor, MemoryMappedTensor) and tensor.filename == os.path.abspath(path):
            return tensor
        nbytes = tensor.numel() * itemsize(tensor.dtype)
        data = to_storable(tensor, path) if copy_data else None
        dtype_name(tensor.dtype)
        write_file_replace(path, data, nbytes, existsok=existsok)
        return cls.from_filename(path, tensor.dtype, tensor.shape)

    @classmethod
    def empty(
        cls,
        *shape: ShapeArg,
        dtype: torch.dtype | None = None,
        filename: str | os.PathLike[str] | None = None,
        existsok: bool = False,
    ) -> MemoryMappedTensor:
        """A new tensor of the given shape; its content is zeros (a sparse file).

        Example:
            >>> MemoryMappedTensor.empty(2, 3, dtype=torch.int64).shape
            torch.Size([2, 3])
        """
        return cls._new(_parse_shape(shape), dtype, filename, existsok, None)

    @classmethod
    def zeros(
        cls,
        *shape: ShapeArg,
        dtype: torch.dtype | None = None,
        filename: str | os.PathLike[str] | None = None,
        existsok: bool = False,
    ) -> MemoryMappedTensor:
        """A new tensor of zeros (a sparse file: no data is written).

        Example:
            >>> MemoryMappedTensor.zeros((2,)).tolist()
            [0.0, 0.0]
        """
        return cls._new(_parse_shape(shape), dtype, filename, existsok, None)

    @classmethod
    def ones(
        cls,
        *shape: ShapeArg,
        dtype: torch.dtype | None = None,
        filename: str | os.PathLike[str] | None = None,
        existsok: bool = False,
    ) -> MemoryMappedTensor:
        """A new tensor of ones.

        Example:
            >>> MemoryMappedTensor.ones(2, dtype=torch.int32).tolist()
            [1, 1]
        """
        return cls._new(_parse_shape(shape), dtype, filename, existsok, 1)

    @classmethod
    def full(
        cls,
        shape: ShapeArg,
        fill_value: Any,
        *,
        dtype: torch.dtype | None = None,
        filename: str | os.PathLike[str] | None = None,
        existsok: bool = False,
    ) -> MemoryMappedTensor:
        """A new tensor filled with ``fill_value``.

        Example:
            >>> MemoryMappedTensor.full((2,), 7, dtype=torch.int16).tolist()
            [7, 7]
        """
        return cls._new(_parse_shape((shape,)), dtype, filename, existsok, fill_value)

    @classmethod
    def _new(
        cls,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
        filename: str | os.PathLike[str] | None,
        existsok: bool,
        fill: Any,
    ) -> MemoryMappedTensor:
        dtype = dtype or torch.get_default_dtype()
        dtype_name(dtype)
        if filename is None:
            t = torch.zeros(shape, dtype=dtype).share_memory_()
            if fill is not None:
                t.fill_(fill)
            return cls._wrap(t, None, False)
        path = os.fspath(filename)
        nbytes = prod(shape) * itemsize(dtype)
        data = None if fill is None else torch.full(shape, fill, dtype=dtype)
        write_file_replace(path, data, nbytes, existsok=existsok)
        return cls.from_filename(path, dtype, shape)

    @classmethod
    def from_filename(
        cls,
        filename: str | os.PathLike[str],
        dtype: torch.dtype,
        shape: ShapeArg,
        *,
        mode: str = "r+",
    ) -> MemoryMappedTensor:
        """Map an existing raw file as a tensor of ``dtype`` and ``shape``.

        The file must hold exactly ``numel × itemsize`` bytes; anything else is refused before
        mapping (the file is never created, extended or truncated).

        Args:
            mode: ``"r+"`` maps read-write (writes reach the file); ``"r"`` read-only.

        Raises:
            MissingLeafError, LeafSizeError, UnsafePathError: the file is absent, of the wrong
                size, or not a regular file; or, with ``mode="r+"``, it has another hard link
                (another tree shares its bytes: map it with ``mode="r"``, or load its tree with
                ``load_memmap``, which gives the leaf its own copy first).
        """
        check_mode(mode)
        path = os.path.abspath(os.fspath(filename))
        size = _parse_shape((shape,))
        nbytes = prod(size) * itemsize(dtype)
        fd = open_checked(path, nbytes, path)
        try:
            return map_leaf(fd, path, dtype, size, readonly=mode == "r")
        finally:
            os.close(fd)

    # -- torch integration --------------------------------------------------------------------
    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is _SETITEM and len(args) == 3:  # torch.Tensor.__setitem__(t, idx, value)
            _check_writable(args[0])
            with torch._C.DisableTorchFunctionSubclass():
                if not _pwrite_setitem(*args):
                    func(*args)
            return None
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = kwargs.get("out")
        if target is None and args and (
            name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
        ) and name not in _NOT_WRITES:
            target = args[0]
        _check_writable(target)
        if args and isinstance(args[0], MemoryMappedTensor) and (
            name == "__set__" or (name.endswith("_") and not name.endswith("__"))
        ):
            args[0].__dict__.pop("_rows", None)  # set_, resize_, .data = ...: new row layout
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if name in _NEVER_WRAP or not args or not isinstance(args[0], MemoryMappedTensor):
                return out
            if name in _TO_NUMPY and args[0].readonly and hasattr(out, "setflags"):
                out.setflags(write=False)  # numpy refuses writes into a read-only tensor's memory
            return _wrap_views(out, args[0])

    def __setitem__(self, idx: Any, value: Any) -> None:
        """``t[idx] = value``; rows of a file-backed tensor are written with ``pwrite``.

        Defined here (not only in ``__torch_function__``) because filling a dataset row by row
        is a hot loop, and torch's dispatch to ``__torch_function__`` costs as much as the
        ``pwrite`` itself; under an active ``TorchFunctionMode`` it dispatches as usual.
        """
        if torch._C._is_torch_function_mode_enabled():
            return super().__setitem__(idx, value)  # through __torch_function__: the mode sees it
        if getattr(self, "_readonly", False):
            _check_writable(self)
        if type(idx) is int and _pwrite_row(self, idx, value):
            return
        with torch._C.DisableTorchFunctionSubclass():
            if not _pwrite_setitem(self, idx, value):
                _SETITEM(self, idx, value)

    def __getitem__(self, idx: Any) -> Any:
        """``t[idx]``: views stay ``MemoryMappedTensor``; gathers are ordinary tensors.

        Defined here for the same reason as ``__setitem__``: random batch reads are a hot loop.
        """
        if torch._C._is_torch_function_mode_enabled():
            return super().__getitem__(idx)  # through __torch_function__: the mode sees it
        with torch._C.DisableTorchFunctionSubclass():
            rows = _gather_rows(self, idx)
            if rows is not None:
                return rows
            return _wrap_views(_GETITEM(self, idx), self)

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickle/torch.save: an ordinary tensor
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).clone()


def _check_writable(target: Any) -> None:
    targets = target if isinstance(target, (tuple, list)) else (target,)
    for t in targets:
        if isinstance(t, MemoryMappedTensor) and t.readonly:
            raise ReadOnlyError(
                f"tensor mapped read-only from {t.filename} cannot be modified; load the tree "
                "with mode='r+' to write to it, or .clone() it to get a writable copy"
            )


# -- row assignment with pwrite ----------------------------------------------------------------
class _Rows:
    """Where the rows (dim 0) of a file-backed tensor lie in its file (a plain class: a
    ``NamedTuple`` compiles its constructor when the module is imported)."""

    __slots__ = ("nrows", "nbytes", "step", "base", "shape", "dtype", "storage", "storage_end", "buffer")

    def __init__(
        self,
        nrows: int,
        nbytes: int,  # bytes per row
        step: int,  # bytes from one row to the next
        base: int,  # file offset of row 0
        shape: torch.Size,  # of one row
        dtype: torch.dtype,
        storage: int,  # address range of the mapping (to spot values read from it)
        storage_end: int,
        buffer: type[ctypes.Array[ctypes.c_char]],  # one row of memory, for pwrite
    ) -> None:
        self.nrows = nrows
        self.nbytes = nbytes
        self.step = step
        self.base = base
        self.shape = shape
        self.dtype = dtype
        self.storage = storage
        self.storage_end = storage_end
        self.buffer = buffer


def _row_layout(dst: MemoryMappedTensor) -> _Rows | None:
    """``dst``'s rows when they are contiguous, non-overlapping, non-empty byte ranges of a file
    it maps read-write (``t``, ``t[a:b]``, ``t[::2]``...), else None; cached on ``dst``.

    In-place operations that may change the layout (``set_``, ``resize_``, ``.data = ``...)
    drop the cache (``__torch_function__``).
    """
    cached = dst.__dict__.get("_rows", _UNKNOWN)
    if cached is not _UNKNOWN:
        return cast("_Rows | None", cached)
    with torch._C.DisableTorchFunctionSubclass():
        rows: _Rows | None = None
        shape = dst.shape
        if shape and getattr(dst, "_file", None) is not None and not dst.readonly:
            strides = dst.stride()
            row_numel = 1
            for size, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
                if size != 1 and stride != row_numel:
                    row_numel = 0  # a row is not one contiguous range
                    break
                row_numel *= size
            step = strides[0] if shape[0] > 1 else row_numel
            if row_numel and step >= row_numel:
                item = dst.element_size()
                storage = dst.untyped_storage()
                rows = _Rows(
                    shape[0],
                    row_numel * item,
                    step * item,
                    # torch types storage_offset() as int | SymInt; a real tensor's is an int
                    dst.storage_offset() * item,  # type: ignore[arg-type]
                    shape[1:],
                    dst.dtype,
                    storage.data_ptr(),
                    storage.data_ptr() + storage.nbytes(),
                    ctypes.c_char * (row_numel * item),
                )
    dst._rows = rows
    return rows


def _row_indices(idx: Any, n: int) -> int | slice | torch.Tensor | None:
    """Rows of dim 0 selected by ``idx`` when it is a plain row selection, else None.

    An int gives one row (its result drops dim 0); a slice of step 1 a run of rows; anything
    else an int64 tensor of rows in ``[0, n)``.
    """
    if isinstance(idx, tuple) and len(idx) == 1:
        idx = idx[0]
    if isinstance(idx, torch.Tensor) and idx.ndim == 0:
        if idx.dtype not in _INDEX_DTYPES:
            return None
        idx = int(idx)
    if isinstance(idx, bool):
        return None
    if isinstance(idx, int):
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of bounds for dimension 0 with size {n}")
        return idx + n if idx < 0 else idx
    if isinstance(idx, slice):
        start, stop, step = idx.indices(n)
        stop = max(stop, start)
        return slice(start, stop) if step == 1 else torch.arange(start, stop, step)
    if isinstance(idx, list) and idx and all(type(i) is int for i in idx):
        idx = torch.tensor(idx)
    if isinstance(idx, torch.Tensor) and idx.ndim == 1 and idx.device.type == "cpu":
        if idx.dtype == torch.bool:
            return idx.nonzero().flatten() if idx.numel() == n else None
        if idx.dtype in _INDEX_DTYPES:
            rows = idx.to(torch.int64)
            if rows.numel() and (rows.min() < -n or rows.max() >= n):
                raise IndexError(f"index out of bounds for dimension 0 with size {n}")
            return rows % n if n else rows
    return None


def _source(
    value: Any, dst: MemoryMappedTensor, rows: _Rows, count: int | None
) -> tuple[torch.Tensor, bool] | None:
    """``value`` as a contiguous CPU tensor of ``dst``'s dtype, converted as ``copy_`` does.

    Returns ``(block, False)`` holding ``count`` rows, or ``(row, True)`` with one row that goes
    to every row (``count`` None: a single row); None leaves the assignment to torch (a value
    this path does not take, one read from the file being written, or one torch rejects with
    its own error).
    """
    row_shape = rows.shape
    try:
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                return None
            src = value.detach() if value.requires_grad else value
            if src.dtype != rows.dtype or not src.is_cpu:
                src = src.to(device="cpu", dtype=rows.dtype)
            elif _aliases(src, dst, rows):
                return None  # read from the file being written: torch handles (or refuses) overlap
            if src.is_conj():
                src = src.resolve_conj()
            if src.is_neg():
                src = src.resolve_neg()
        elif isinstance(value, (bool, int, float, complex)):
            src = torch.scalar_tensor(value, dtype=rows.dtype)  # overflow raises as in torch
        else:
            return None
        shape = src.shape
        lead = 0
        while lead < len(shape) and shape[lead] == 1:  # torch drops the value's leading 1-dims
            lead += 1
        if lead:
            src = src.reshape(shape[lead:])
        if count is None or src.ndim <= len(row_shape):
            return src.expand(row_shape).contiguous(), True
        return src.expand(count, *row_shape).contiguous(), False
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


def _aliases(src: torch.Tensor, dst: MemoryMappedTensor, rows: _Rows) -> bool:
    """Whether ``src`` may read bytes of the file ``dst`` maps (this or another mapping)."""
    other = getattr(src, "_file", None)
    if other is not None and other.file_id == dst._file.file_id:  # type: ignore[union-attr]
        return True
    return src.untyped_storage().data_ptr() == rows.storage


def _runs(rows: slice | torch.Tensor, contiguous: bool) -> list[tuple[int, int, int]]:
    """``(first file row, first source row, rows)`` for each run of consecutive rows."""
    if isinstance(rows, slice):
        if contiguous:
            return [(rows.start, 0, rows.stop - rows.start)]
        return [(r, k, 1) for k, r in enumerate(range(rows.start, rows.stop))]
    listed = rows.tolist()
    if not contiguous:
        return [(r, k, 1) for k, r in enumerate(listed)]
    runs: list[tuple[int, int, int]] = []
    k = 0
    while k < len(listed):
        j = k + 1
        while j < len(listed) and listed[j] == listed[j - 1] + 1:
            j += 1
        runs.append((listed[k], k, j - k))
        k = j
    return runs


def _pwrite_row(dst: MemoryMappedTensor, i: int, value: Any) -> bool:
    """``dst[i] = value`` for a value that needs no conversion: one ``pwrite``, no tensor made.

    The hot loop of filling a dataset item by item (so the cached lookups are inlined here).
    False: take :func:`_pwrite_setitem`.
    """
    rows = dst.__dict__.get("_rows", _UNKNOWN)
    if rows is _UNKNOWN:
        rows = _row_layout(dst)
    if rows is None:
        return False
    n = rows.nrows
    if not -n <= i < n:
        raise IndexError(f"index {i} is out of bounds for dimension 0 with size {n}")
    if not (  # the value's data is written as is (autograd aside, as on the general path)
        type(value) is torch.Tensor
        and value.dtype is rows.dtype
        and value.is_cpu
        and value.shape == rows.shape
        and value.is_contiguous()
        and not value.is_conj()
        and not value.is_neg()
    ):
        return False
    address = value.data_ptr()
    if rows.storage <= address < rows.storage_end:  # read from the mapping written
        return False
    file = dst._file
    writer = file.writer if file is not None else None
    if writer is None:
        writer = WRITERS.get(file)  # type: ignore[arg-type]
        if writer is None:
            return False
    else:
        WRITERS.touch(file)  # type: ignore[arg-type]
    nbytes, offset = rows.nbytes, rows.base + (i % n) * rows.step
    try:
        # one pwrite from the value's memory (what fileio.pwrite_from does, minus its setup)
        done = os.pwrite(writer.fd, rows.buffer.from_address(address), offset)
        if done < nbytes:  # a short write: the rest by the general helper
            pwrite_from(writer.fd, address + done, nbytes - done, offset + done)
    except OSError as err:
        raise storage_error(err, f"writing a row of {dst.filename}") from err
    return True


def _pwrite_setitem(dst: torch.Tensor, idx: Any, value: Any) -> bool:
    """``dst[idx] = value`` with ``pwrite`` for row selections of a file-backed tensor.

    Writing through a sparse shared mapping costs a page fault and a block allocation per page
    (hundreds of times slower than ``pwrite`` on some filesystems) and dies with SIGBUS when
    the disk is full. ``pwrite`` goes through the same page cache, so the mapping sees the data
    at once, and a full disk raises ``StorageError``. Only the very file that ``dst`` maps is
    written (same device and inode). Returns False when the fast path does not apply; the
    caller then assigns through the mapping. Call under ``DisableTorchFunctionSubclass``.
    """
    if not isinstance(dst, MemoryMappedTensor):
        return False
    rows = _row_layout(dst)
    if rows is None:
        return False
    selected = _row_indices(idx, rows.nrows)
    if selected is None:
        return False
    if isinstance(value, torch.Tensor) and value.dtype != rows.dtype:
        index = idx[0] if isinstance(idx, tuple) else idx
        if isinstance(index, list) or (isinstance(index, torch.Tensor) and index.ndim):
            return False  # index_put_: torch refuses another dtype (masked_fill_ casts a scalar)
    if isinstance(selected, int):
        count = None
    else:
        count = selected.stop - selected.start if isinstance(selected, slice) else selected.numel()
        if count == 0:
            return False
    converted = _source(value, dst, rows, count)
    if converted is None:
        return False
    writer = WRITERS.get(dst._file)  # type: ignore[arg-type]
    if writer is None:
        return False
    src, one_row = converted
    row_bytes, step, base = rows.nbytes, rows.step, rows.base
    if isinstance(selected, int):
        runs = [(selected, 0, 1)]
    else:
        runs = _runs(selected, step == row_bytes)
    if one_row:  # the same row everywhere: write a block of copies of it repeatedly
        per_block = min(max(m for _, _, m in runs), max(1, _BROADCAST_BYTES // row_bytes))
        src = src.expand(per_block, *src.shape).contiguous()
    address = src.data_ptr()
    try:
        for first, k, m in runs:
            offset = base + first * step
            if not one_row:
                pwrite_from(writer.fd, address + k * row_bytes, m * row_bytes, offset)
                continue
            while m:
                part = min(m, per_block)
                pwrite_from(writer.fd, address, part * row_bytes, offset)
                offset += part * row_bytes
                m -= part
    except OSError as err:
        raise storage_error(err, f"writing rows of {dst.filename}") from err
    return True


def _gather_rows(src: torch.Tensor, idx: Any) -> torch.Tensor | None:
    """``src[idx]`` for a 1-D int64/int32 index tensor (a random batch), else None.

    ``index_select`` copies whole rows; torch's advanced indexing copies element by element,
    several times slower on rows of kilobytes (W3: 256 images of 12 KiB). Same values, shape
    and dtype. Negative or out-of-range rows, which ``index_select`` refuses (with an
    ``IndexError``, or a ``RuntimeError`` for rows of no elements), and dtypes it has no kernel
    for are left to torch's indexing (it wraps the negative rows and raises its own
    ``IndexError``); no bounds are computed beforehand, as small temporaries between the large
    batches fragment the heap.
    """
    if isinstance(idx, tuple) and len(idx) == 1:
        idx = idx[0]
    if not (
        isinstance(idx, torch.Tensor)
        and idx.ndim == 1
        and idx.dtype in _GATHER_DTYPES
        and idx.is_cpu
        and src.ndim
    ):
        return None
    try:
        return torch.index_select(src, 0, idx)
    except (IndexError, RuntimeError):  # NotImplementedError (a dtype) is a RuntimeError
        return None


def _wrap_views(out: Any, src: MemoryMappedTensor) -> Any:
    if isinstance(out, torch.Tensor):
        if type(out) is torch.Tensor and out.is_cpu and (
            out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
        ):
            return MemoryMappedTensor._wrap(out, getattr(src, "_file", None), src.readonly)
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return type(out)(_wrap_views(o, src) for o in out)
    return out


def map_leaf(
    fd: int,
    path: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    *,
    readonly: bool,
    st: os.stat_result | None = None,
) -> MemoryMappedTensor:
    """Map an open, already size-checked leaf file as a ``MemoryMappedTensor``.

    ``st`` is the descriptor's ``fstat`` when the caller has it (the file's identity); for a
    read-write mapping, taken after ``fd`` was opened read-write. A read-write mapping of a file
    with another hard link is refused (see the module docstring).

    Raises:
        UnsafePathError: ``readonly=False`` and the file has another hard link.
    """
    nbytes = prod(shape) * itemsize(dtype)
    flat = map_fd(fd, path, nbytes, writable=not readonly, dtype=dtype)
    if st is None:
        st = os.fstat(fd)  # after mapping: a read-write mapping is a writer the linker respects
    check_sole(path, st, readonly, nbytes)
    if len(shape) != 1:  # a 1-d leaf is the flat mapping itself
        flat = flat.view(shape)
    return MemoryMappedTensor._wrap(flat, MappedFile(path, (st.st_dev, st.st_ino)), readonly)


def map_view(view: torch.Tensor, file: MappedFile, readonly: bool) -> MemoryMappedTensor:
    """A view of a mapping of ``file`` (a packed leaf: part of its pack's one mapping) as a
    ``MemoryMappedTensor``: its row writes go to its bytes of that file."""
    return MemoryMappedTensor._wrap(view, file, readonly)


def check_sole(path: str, st: os.stat_result, readonly: bool, nbytes: int) -> None:
    """Refuse a read-write mapping of bytes another hard link shares."""
    if not readonly and nbytes and st.st_nlink > 1:
        raise shared_file_error(path, st.st_nlink)


# -- sending to other processes ---------------------------------------------------------------
def _rebuild_from_file(
    path: str,
    dtype: torch.dtype,
    nbytes: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    readonly: bool,
    file_id: FileId | None = None,
) -> MemoryMappedTensor:
    fd = open_checked(path, nbytes, path, strict_size=False)  # a growable leaf's file may be longer
    try:
        flat = map_fd(fd, path, nbytes, writable=not readonly)
        st = os.fstat(fd)  # after mapping (see map_leaf)
        file = MappedFile(path, (st.st_dev, st.st_ino))
        if file_id is not None and file.file_id != file_id:
            raise MissingLeafError(
                f"{path} is no longer the file this tensor was mapped from (the tree was re-saved, "
                "or the file replaced, after the sending process mapped it), so the receiving "
                "process cannot map the same data; load the tree again before sending it"
            )
        check_sole(path, st, readonly, nbytes)
    finally:
        os.close(fd)
    base = flat.view(dtype)
    return MemoryMappedTensor._wrap(base.as_strided(size, stride, offset), file, readonly)


def _rebuild_anonymous(rebuild: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> MemoryMappedTensor:
    return MemoryMappedTensor._wrap(rebuild(*args), None, False)


def _reduce_mmt(t: MemoryMappedTensor) -> tuple[Any, ...]:
    with torch._C.DisableTorchFunctionSubclass():
        plain = t.as_subclass(torch.Tensor)
        file = getattr(t, "_file", None)  # as t.filename does
        if file is None:
            return (_rebuild_anonymous, reduce_tensor(plain))
        nbytes = plain.untyped_storage().nbytes()
        return (
            _rebuild_from_file,
            (
                t.filename,
                plain.dtype,
                nbytes,
                tuple(plain.shape),
                plain.stride(),
                plain.storage_offset(),
                t.readonly,
                file.file_id,
            ),
        )


ForkingPickler.register(MemoryMappedTensor, _reduce_mmt)

