"""``MemoryMappedTensor``: a ``torch.Tensor`` whose storage is a file mapped into memory.

* Views (indexing, slicing, ``view``, ``reshape`` without copy...) stay ``MemoryMappedTensor``
  and write through to the file; results of computations are ordinary tensors.
* Read-only tensors (``mode="r"``) are mapped copy-on-write, so the file can never change
  through them, and in-place operations on them raise :class:`~memtree.errors.ReadOnlyError`.
* Sent to another process (DataLoader workers, ``torch.multiprocessing`` queues, spawn or
  fork), a file-backed tensor travels as *(file, dtype, layout)* and the receiver maps the file
  again: no data is copied, and torch 2.13's failing fd-passing path is never used.
* Pickled with ``pickle``/``torch.save``, it is saved as an ordinary tensor (its data).

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

import os
from collections.abc import Sequence
from math import prod
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import reduce_tensor

from .dtypes import dtype_name, itemsize
from .errors import DtypeError, ReadOnlyError
from .fileio import map_fd, open_checked, write_fd, write_file_replace

__all__ = ["MemoryMappedTensor", "map_leaf", "to_storable"]

_INPLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in (
        "add sub mul matmul truediv floordiv mod pow lshift rshift and or xor".split()
    )
) | {"__setitem__"}
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream"})
_NEVER_WRAP = frozenset({"as_subclass", "__reduce_ex__", "__deepcopy__"})

ShapeArg = Any


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
        return t.to("cpu").contiguous()


class MemoryMappedTensor(torch.Tensor):
    """A tensor stored in a file (or in anonymous shared memory), mapped into memory.

    Create one with :meth:`from_tensor`, :meth:`empty`, :meth:`zeros`, :meth:`ones`,
    :meth:`full` or :meth:`from_filename`; trees create them with ``memmap``/``load_memmap``.
    """

    _filename: str | None
    _readonly: bool

    @staticmethod
    def _wrap(tensor: torch.Tensor, filename: str | None, readonly: bool) -> MemoryMappedTensor:
        out = torch.Tensor._make_subclass(MemoryMappedTensor, tensor)
        out._filename = filename
        out._readonly = readonly
        return out

    # -- properties ---------------------------------------------------------------------------
    @property
    def filename(self) -> str | None:
        """Path of the backing file, or ``None`` for anonymous shared memory."""
        return getattr(self, "_filename", None)

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
                size, or not a regular file.
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
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
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = kwargs.get("out")
        if target is None and args and (
            name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))
        ) and name not in _NOT_WRITES:
            target = args[0]
        _check_writable(target)
        with torch._C.DisableTorchFunctionSubclass():
            if name == "__setitem__" and len(args) == 3 and _pwrite_setitem(*args):
                return None
            out = func(*args, **kwargs)
            if name in _NEVER_WRAP or not args or not isinstance(args[0], MemoryMappedTensor):
                return out
            return _wrap_views(out, args[0])

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


def _row_indices(idx: Any, n: int) -> torch.Tensor | slice | None:
    """Rows of dim 0 selected by ``idx`` when it is a plain row selection, else None."""
    if isinstance(idx, tuple) and len(idx) == 1:
        idx = idx[0]
    if isinstance(idx, bool):
        return None
    if isinstance(idx, int):
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of bounds for dimension 0 with size {n}")
        return torch.tensor([idx % n])
    if isinstance(idx, slice):
        start, stop, step = idx.indices(n)
        return slice(start, max(stop, start)) if step == 1 else torch.arange(start, stop, step)
    if isinstance(idx, list) and idx and all(type(i) is int for i in idx):
        idx = torch.tensor(idx)
    if isinstance(idx, torch.Tensor) and idx.ndim == 1 and idx.device.type == "cpu":
        if idx.dtype == torch.bool:
            return idx.nonzero().flatten() if idx.numel() == n else None
        if idx.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            rows = idx.to(torch.int64)
            if rows.numel() and (rows.min() < -n or rows.max() >= n):
                raise IndexError(f"index out of bounds for dimension 0 with size {n}")
            return rows % n if n else rows
    return None


def _pwrite_setitem(dst: torch.Tensor, idx: Any, value: Any) -> bool:
    """``dst[idx] = value`` with ``pwrite`` for row selections of a file-backed tensor.

    Writing through a sparse shared mapping costs a page fault and a block allocation per page
    (hundreds of times slower than ``pwrite`` on some filesystems) and dies with SIGBUS when
    the disk is full. ``pwrite`` goes through the same page cache, so the mapping sees the data
    at once, and a full disk raises ``ENOSPC``. Returns False when the fast path does not apply.
    """
    if not isinstance(dst, MemoryMappedTensor) or dst.filename is None or dst.readonly:
        return False
    if dst.ndim == 0 or not dst.is_contiguous() or dst.device.type != "cpu":
        return False
    rows = _row_indices(idx, dst.shape[0])
    if rows is None:
        return False
    row_shape = dst.shape[1:]
    if isinstance(rows, slice):
        count = rows.stop - rows.start
    else:
        count = rows.numel()
    src = torch.as_tensor(value).to(device="cpu", dtype=dst.dtype)
    while src.ndim > len(row_shape) + 1 and src.shape[0] == 1:  # torch drops leading 1-dims
        src = src[0]
    src = src.expand(count, *row_shape).contiguous()
    itemsize = dst.element_size()
    row_bytes = prod(row_shape) * itemsize
    base = dst.storage_offset() * itemsize
    fd = os.open(dst.filename, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if isinstance(rows, slice):
            write_fd(fd, src, base + rows.start * row_bytes)
        else:
            for i, r in enumerate(rows.tolist()):
                write_fd(fd, src[i], base + r * row_bytes)
    finally:
        os.close(fd)
    return True


def _wrap_views(out: Any, src: MemoryMappedTensor) -> Any:
    if isinstance(out, torch.Tensor):
        if type(out) is torch.Tensor and out.device == src.device and (
            out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
        ):
            return MemoryMappedTensor._wrap(out, src.filename, src.readonly)
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return type(out)(_wrap_views(o, src) for o in out)
    return out


def map_leaf(
    fd: int, path: str, dtype: torch.dtype, shape: tuple[int, ...], *, readonly: bool
) -> MemoryMappedTensor:
    """Map an open, already size-checked leaf file as a ``MemoryMappedTensor``."""
    nbytes = prod(shape) * itemsize(dtype)
    flat = map_fd(fd, path, nbytes, writable=not readonly)
    return MemoryMappedTensor._wrap(flat.view(dtype).view(shape), path, readonly)


# -- sending to other processes ---------------------------------------------------------------
def _rebuild_from_file(
    path: str,
    dtype: torch.dtype,
    nbytes: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    readonly: bool,
) -> MemoryMappedTensor:
    fd = open_checked(path, nbytes, path, strict_size=False)  # a growable leaf's file may be longer
    try:
        flat = map_fd(fd, path, nbytes, writable=not readonly)
    finally:
        os.close(fd)
    base = flat.view(dtype)
    return MemoryMappedTensor._wrap(base.as_strided(size, stride, offset), path, readonly)


def _rebuild_anonymous(rebuild: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> MemoryMappedTensor:
    return MemoryMappedTensor._wrap(rebuild(*args), None, False)


def _reduce_mmt(t: MemoryMappedTensor) -> tuple[Any, ...]:
    with torch._C.DisableTorchFunctionSubclass():
        plain = t.as_subclass(torch.Tensor)
        if t.filename is None:
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
            ),
        )


ForkingPickler.register(MemoryMappedTensor, _reduce_mmt)

