"""Disk-offloaded weights: tensors that stay in their files until an operation needs them.

An :class:`OffloadedTensor` stands for a file-backed leaf (a ``MemoryMappedTensor`` written by
``memmap``). It has the shape, dtype and device of the tensor it stands for, but holds no memory
of its own: each operation that reads it (a matmul, a convolution, ``.sum()``) gets the data
*materialised* on the target device for that operation only, and the copy is released as soon
as the operation returns. :func:`offload` binds a tree's leaves into a module this way, so a
model larger than the device memory (or the RAM) runs layer by layer: at any time only the
weights of the running operation are on the device.

**Design.** ``OffloadedTensor`` is a wrapper tensor subclass (``_make_wrapper_subclass``) with
``__torch_dispatch__``, so it is seen by every aten operation, including those called from C++
(``F.linear`` decomposes into ``t`` + ``addmm``, ``TransformerEncoderLayer`` calls its fused
kernel, autograd's backward formulas): nothing can read it without materialising it.

* *View operations* (slicing, indexing with ints, ``t()``, ``view``, ``transpose``, ``detach``...)
  are applied to the file mapping without reading it and return another ``OffloadedTensor``:
  ``w[:, :16]`` stays on disk, and an operation on it reads only those bytes.
* ``.to(device)``, ``.to(dtype)``, ``.cuda()``, ``.half()`` (hence ``module.to(...)``)
  return an ``OffloadedTensor`` that materialises on the new device, with the new dtype: the data
  stays on disk. :meth:`OffloadedTensor.materialize` returns a real tensor.
* Every other operation materialises its offloaded arguments (the file mapping itself on the
  CPU, a copy on an accelerator), runs, and returns ordinary tensors. Afterwards, the pages of
  the mapping that were read are handed back to the kernel (``madvise(MADV_DONTNEED)``; they are
  clean, file-backed pages), so the resident memory does not grow with the model either.
* Writes (in-place operations, ``copy_`` into it, ``load_state_dict`` into an offloaded module)
  raise :class:`~memtree.ReadOnlyError`: the data is a read-only view of the files.
* ``state_dict()`` returns the ``OffloadedTensor`` objects (nothing is read);
  ``TensorTree.from_module(model).memmap(d)``, ``torch.save`` and ``copy.deepcopy`` work (the
  first two read the data once, the last shares the files).

**Trade-offs** against module hooks (``accelerate``'s ``AlignDevicesHook``, which loads a
sub-module's weights before its ``forward`` and drops them after): hooks move each weight once
per ``forward`` call and keep torch's fast paths, but only cover weights used inside their own
module's ``forward`` (a tied weight used by another module, a weight read in a custom function,
break them). The tensor subclass covers every use without touching the model's code, at the cost
of one materialisation per *operation* (a weight read by two operations is read twice), a
Python call per operation on offloaded tensors, and no ``torch.compile``. Offloaded parameters
are for inference: they have ``requires_grad=False`` (gradients still flow to activations).

Example:
    >>> import tempfile, torch, memtree
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    >>> d = tempfile.mkdtemp() + "/model"
    >>> _ = memtree.TensorTree.from_module(model).memmap(d)
    >>> with memtree.empty_init():
    ...     lazy = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    >>> memtree.offload(lazy, d, device="cpu")
    LoadResult(missing=[], unexpected=[])
    >>> type(lazy[0].weight).__name__, lazy[0].weight.device
    ('OffloadedTensor', device(type='cpu'))
    >>> x = torch.randn(2, 8)
    >>> torch.equal(lazy(x), model(x))
    True
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import LeafSizeError, MemtreeKeyError, ReadOnlyError, SourceError, check_keywords
from ..store.primitives.files import map_fd
from ..format.subclass_registry import inner_tensors, is_plain
from ..store.reading.mapped import MemoryMappedTensor
from ..tree.parts.bind import bind, module_groups, names_list, plan
from .loading import LoadResult, as_source

__all__ = ["OffloadedTensor", "offload", "DISK"]

#: The ``device_map`` value that keeps a sub-module's weights on disk.
DISK = "disk"

_aten = torch.ops.aten
_ALIASES = {_aten.detach.default, _aten.alias.default, _aten.lift_fresh.default}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc_madvise() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - not a POSIX libc
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()
_MADV_DONTNEED = 4


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` of the memory a (strided) tensor view reads."""
    if t.numel() == 0:
        return 0, 0
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + span * t.element_size()


class OffloadedTensor(torch.Tensor):
    """A read-only tensor whose data stays in a file; each operation materialises it.

    Args:
        source: a file-backed :class:`~memtree.MemoryMappedTensor` (a leaf of a tree written
            by ``memmap`` or loaded by ``load_memmap``), or a view of one.
        device: where operations get the data (default: the CPU).
        dtype: the dtype operations get (a cast on materialisation; default: the source's).

    Example:
        >>> import os, tempfile, torch
        >>> from memtree import MemoryMappedTensor
        >>> path = os.path.join(tempfile.mkdtemp(), "w.memmap")
        >>> mt = MemoryMappedTensor.from_tensor(torch.arange(6.0).reshape(2, 3), filename=path)
        >>> w = OffloadedTensor(mt)
        >>> (w * 2).tolist(), type(w[1]).__name__, w[1].materialize().tolist()
        ([[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]], 'OffloadedTensor', [3.0, 4.0, 5.0])
    """

    _source: torch.Tensor
    #: Written as the plain tensor of its file, not as a tensor subclass's group.
    _memtree_plain = True
    _filename: str

    @staticmethod
    def __new__(
        cls,
        source: torch.Tensor,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        filename: str | None = None,
    ) -> OffloadedTensor:
        if filename is None:
            if not isinstance(source, MemoryMappedTensor) or source.filename is None:
                raise SourceError(
                    f"OffloadedTensor needs a file-backed MemoryMappedTensor, got a "
                    f"{type(source).__name__}; write the tree with memmap(prefix) first and "
                    "offload the loaded leaves"
                )
            filename = source.filename
            source = _private_view(source)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            source.shape,
            strides=source.stride(),
            storage_offset=source.storage_offset(),  # as_strided on it means the same as on the file
            dtype=dtype or source.dtype,
            device=dev,
            requires_grad=False,
        )
        out._source = source
        out._filename = filename
        return out

    def _like(self, source: torch.Tensor, device: torch.device | None = None, dtype: torch.dtype | None = None) -> OffloadedTensor:
        return OffloadedTensor(source, device or self.device, dtype or self.dtype, filename=self._filename)

    @property
    def filename(self) -> str:
        """The file that holds the data."""
        return self._filename

    def materialize(self) -> torch.Tensor:
        """The data as a new ordinary tensor (a copy, safe to modify) on this device and dtype."""
        out = self._data()
        try:
            return out.clone() if out is self._source else out
        finally:
            self.release()

    def _data(self) -> torch.Tensor:
        """The data for one operation: on the CPU without a cast, the file mapping itself.

        The device and dtype are read from the tensor itself, so ``param.data =
        offloaded.to(...)`` (what ``module.to`` does on some torch versions) retargets it too.
        """
        src = self._source
        if self.device.type == "cpu" and self.dtype == src.dtype:
            return src
        return src.to(device=self.device, dtype=self.dtype)

    def release(self) -> None:
        """Hand the mapping's pages that this tensor covers back to the kernel (they stay valid)."""
        if _MADVISE is None:
            return
        start, end = _extent(self._source)
        if end <= start:
            return
        base = start - start % _PAGE
        _MADVISE(base, end - base, _MADV_DONTNEED)

    # -- torch integration -------------------------------------------------------------------
    # torch declares Tensor.__torch_dispatch__ as a builtin that mypy takes for a plain method
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, OffloadedTensor):
            if func in _ALIASES:
                return first._like(first._source)
            if func is _aten._to_copy.default and _only_moves(kwargs):
                dev = kwargs.get("device")
                return first._like(first._source, torch.device(dev) if dev is not None else None, kwargs.get("dtype"))
            if func.is_view and func is not _aten.view.dtype and not _has_offloaded(args[1:], kwargs):
                out = func(first._source, *args[1:], **kwargs)
                return tree_map(lambda o: first._like(o) if isinstance(o, torch.Tensor) else o, out)
        _refuse_writes(func, args, kwargs)
        offloaded: list[OffloadedTensor] = []

        def unwrap(a: Any) -> Any:
            if isinstance(a, OffloadedTensor):
                offloaded.append(a)
                return a._data()
            return a

        try:
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        finally:
            for t in offloaded:
                t.release()

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_source"], (self.device, self.dtype, self._filename)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> OffloadedTensor:
        device, dtype, filename = ctx
        return OffloadedTensor(inner["_source"], device, dtype, filename=filename)

    # mypy rejects any annotated override of torch's unannotated Tensor.__repr__
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        dtype = str(self.dtype).replace("torch.", "")
        return f"OffloadedTensor({dtype}{list(self.shape)}, device={self.device}, file={self._filename!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:  # pickle/torch.save: the data, as an ordinary tensor
        return self.materialize().cpu().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadedTensor:
        out = self._like(self._source)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    def numpy(self, *, force: bool = False) -> Any:
        """The data as a NumPy array (a copy, on the CPU)."""
        return self.materialize().cpu().numpy(force=force)

    def tolist(self) -> Any:
        """The data as nested Python lists."""
        try:
            return self._data().tolist()
        finally:
            self.release()


def _private_view(source: MemoryMappedTensor) -> torch.Tensor:
    """The same view as ``source``, over a new read-only private mapping of its file.

    :meth:`OffloadedTensor.release` drops pages of the mapping; owning the mapping makes that
    safe even if the caller writes through other (copy-on-write) views of the same file.
    """
    plain = source.as_subclass(torch.Tensor)
    nbytes = plain.untyped_storage().nbytes()
    path = source.filename
    assert path is not None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:  # never map past the end of a file (SIGBUS); map_fd never extends it
            raise LeafSizeError(f"{path} has {size:,} bytes, fewer than the {nbytes:,} mapped; the file changed")
        whole = map_fd(fd, path, nbytes, writable=False)
    finally:
        os.close(fd)
    return whole.view(plain.dtype).as_strided(plain.shape, plain.stride(), plain.storage_offset())


def _only_moves(kwargs: dict[str, Any]) -> bool:
    """True if a ``_to_copy`` changes nothing but the device and/or dtype (``.to``, ``.cpu()``...)."""
    return (
        set(kwargs) <= {"dtype", "device", "non_blocking", "layout", "pin_memory", "memory_format"}
        and kwargs.get("layout") in (None, torch.strided)
        and not kwargs.get("pin_memory")
        and kwargs.get("memory_format") in (None, torch.preserve_format)
    )


def _has_offloaded(args: Any, kwargs: dict[str, Any]) -> bool:
    found = False

    def visit(a: Any) -> Any:
        nonlocal found
        found = found or isinstance(a, OffloadedTensor)
        return a

    tree_map(visit, (args, kwargs))
    return found


def _refuse_writes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if not func._schema.is_mutable:
        return
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        if isinstance(value, OffloadedTensor):
            raise ReadOnlyError(
                f"{func.__name__} would write to an offloaded tensor (data in {value.filename}); "
                "offloaded tensors are read-only. Load the weights with load_into_module (or "
                "materialize() a copy) to modify them"
            )


def _device_for(name: str, device_map: Mapping[str, Any] | None, default: torch.device) -> torch.device | None:
    """``None`` for "keep on disk", else the device to load the tensor onto (resident)."""
    if device_map is None:
        return None
    best, where = -1, DISK
    for prefix, dev in device_map.items():
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if len(prefix) > best:
                best, where = len(prefix), dev
    if isinstance(where, str) and where == DISK:
        return None
    return torch.device(where) if where is not None else default


@check_keywords
def offload(
    module: nn.Module,
    source: Any,
    *,
    device: torch.device | str = "cpu",
    device_map: Mapping[str, Any] | None = None,
    strict: bool = True,
) -> LoadResult:
    """Bind a tree's leaves into ``module`` as :class:`OffloadedTensor` (weights stay on disk).

    Each parameter and persistent buffer found in ``source`` is replaced by an
    ``OffloadedTensor`` over its file, which materialises on ``device`` for each operation that
    reads it. Works on modules built under :func:`~memtree.empty_init`, so a model bigger than
    the device memory (or the RAM) is built and run without ever holding all its weights.
    Tied tensors stay tied; everything is checked before anything changes. A tensor subclass (a
    quantized weight) is bound as it was loaded, its inner tensors the mapped files (their pages
    read when used, and evictable), on the CPU; for another ``device`` it is copied there.

    Args:
        module: the module to offload into.
        source: a memtree directory (mapped read-only) or a :class:`~memtree.TensorTree` whose
            leaves are file-backed (``load_memmap``/``memmap`` output).
        device: the compute device: where offloaded weights are materialised.
        device_map: optional ``{module path prefix: "disk" | device}``; the longest matching
            prefix wins, ``""`` matches everything, unlisted names are ``"disk"``. A device value
            loads those weights *resident* on that device (a copy; on the CPU, the mapping
            itself) instead of offloading them, e.g. ``{"": "disk", "embed": "cuda"}``. Inputs
            and activations are not moved between devices: resident devices should match
            ``device``.
        strict: raise if the module and the source do not cover each other (as in
            :func:`~memtree.load_into_module`).

    Returns:
        :class:`~memtree.LoadResult` ``(missing, unexpected)``.

    Raises:
        SourceError: a leaf to offload is not file-backed.
        ShapeMismatchError, MemtreeKeyError: as :func:`~memtree.load_into_module`.

    Example:
        >>> import tempfile
        >>> from memtree import TensorTree
        >>> d = tempfile.mkdtemp() + "/m"
        >>> _ = TensorTree.from_module(nn.Linear(4, 4)).memmap(d)
        >>> m = nn.Linear(4, 4)
        >>> offload(m, d, device_map={"bias": "cpu"})
        LoadResult(missing=[], unexpected=[])
        >>> type(m.weight).__name__, type(m.bias).__name__
        ('OffloadedTensor', 'Parameter')
    """
    dev = torch.device(device)
    src = as_source(source, mode="r")
    found = plan(module_groups(module), src, None)
    if strict and (found.missing_names or found.unexpected):
        raise MemtreeKeyError(
            f"offload(strict=True) into {type(module).__name__}: missing from the source: "
            f"{names_list(found.missing_names) or 'none'}; unexpected in the source: "
            f"{names_list(found.unexpected) or 'none'}. Nothing was changed: pass strict=False to "
            "offload what matches"
        )
    wanted = {name: _device_for(group.names[0], device_map, dev) for group, name in found.pairs}
    for name, target in wanted.items():
        value = src.get(name)
        if target is None and not all(
            isinstance(t, MemoryMappedTensor) and t.filename is not None for _, t in inner_tensors(value)
        ):
            raise SourceError(
                f"cannot offload {name!r}: it is a {type(value).__name__} in memory, not a "
                "file-backed leaf. Write the tree with memmap(prefix) and offload the directory"
            )

    def convert(kind: str, name: str, value: Any) -> Any:
        target = wanted[name]
        if target is None and not is_plain(value):  # a tensor subclass: its inner tensors are the
            return value if value.device == dev else value.to(dev)  # files (pages read on use)
        if target is None:
            off = OffloadedTensor(value, dev)
            return nn.Parameter(off, requires_grad=False) if kind == "param" else off
        return value if value.device == target else value.to(target)

    bind(found, src, convert)
    return LoadResult(found.missing_names, found.unexpected)
