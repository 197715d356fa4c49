"""The restricted unpickler of ``torch.save`` pickles: what it may build, and how each is built.

:class:`RestrictedUnpickler` resolves globals from a closed allowlist (:meth:`find_class`); any
other global raises :class:`~memtree.errors.UnsafePickleError` *before* it could be called, so a
hostile ``__reduce__`` runs nothing. Each allowed callable is a
:class:`~memtree.interop.pickle_guard.SafeCall` that checks its arguments and charges what it
builds (:class:`~memtree.interop.pickle_guard.Budget`). Tensors are never built: the rebuild
functions return a :class:`TensorRef` (storage record, dtype, offset, size, stride and the
``conj``/``neg`` bits) that the reader reads on demand, or an :class:`UnreadableTensor` saying
what memtree cannot read.

What torch 2.13's ``torch.load(weights_only=True)`` accepts (``torch/_weights_only_unpickler.py``),
and what memtree does with each:

================================================  ============================================
allowed by ``weights_only=True``                  memtree's reader
================================================  ============================================
``dict``, ``list``, ``tuple``, ``str``, ``int``,  kept exactly
``float``, ``bool``, ``None``
``collections.OrderedDict``, ``Counter``          kept exactly (a dict of the tensors is
                                                  flattened into dotted keys)
``set``, ``complex``, ``bytes``, ``bytearray``    kept exactly (non-tensor values)
``torch.Size``, ``torch.device``, every           kept exactly (non-tensor values)
``torch.dtype``, layouts (``_get_layout``),
quantization schemes
tensors (``_rebuild_tensor``, ``_v2``, ``_v3``),  read lazily, bit for bit; the ``conj`` and
``Parameter`` (``_rebuild_parameter``,            ``neg`` bits of ``metadata`` applied as torch
``_with_state``), ``_rebuild_from_type_v2``       applies them; plain ``torch.Tensor`` results
for ``Tensor``/``Parameter``                      (no ``requires_grad``, Python attributes not
                                                  kept)
a tensor saved through a CPU copy                 read on the CPU (as with ``map_location="cpu"``)
(``_rebuild_device_tensor_from_cpu_tensor``)      when its dtype is the copy's
sparse, quantized, nested, meta tensors, wrapper  :class:`UnreadableTensor`: refused with a
subclasses, tensors from numpy, dtypes memtree    :class:`~memtree.errors.DtypeError` naming the
cannot hold (``bits8``, ``float4_e2m1fn_x2``...)  key, or left out and reported when asked
                                                  (``skip_unsupported=True``)
globals added with                                not honoured: refused (``UnsafePickleError``,
``torch.serialization.add_safe_globals``          naming the global) unless ``allow_pickle=True``
memtree's own ``memtree.routing._routed_storage`` a :class:`RoutedStorage`: the tensor's spec
(a file ``torch.save`` wrote under                 is known, its data is in the tree beside the
``memtree.saving()``)                              file (reading it names the way to load it)
================================================  ============================================

``add_safe_globals`` is process-wide state that any imported library may extend (and its entries'
``__new__``/``__setstate__`` run during the load); memtree's safe reader depends on nothing but
the file, and the caller opts in to more per call, with ``allow_pickle=True`` (trusted files).

Example:
    >>> import io, pickle, torch
    >>> from memtree.interop.unpickler import RestrictedUnpickler
    >>> data = pickle.dumps({"s": {1, 2}, "d": torch.device("cpu")}, protocol=2)
    >>> unpickler = RestrictedUnpickler(io.BytesIO(data), lambda *pid: None, "demo")
    >>> unpickler.load()
    {'s': {1, 2}, 'd': device(type='cpu')}
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass
from math import prod
from typing import Any, Callable

import torch

from ..errors import CheckpointFormatError, UnsafePickleError
from ..format.dtypes import dtype_from_name, itemsize
from ..format.schema import MAX_DIM, MAX_NBYTES, extent_bytes
from .pickle_guard import Budget, SafeCall, current_limits, short

__all__ = ["StorageRef", "RoutedStorage", "TensorRef", "UnreadableTensor", "RestrictedUnpickler"]

_MAX_NDIM = 64
_RECORD_KEY = re.compile(r"[A-Za-z0-9_]{1,64}")

# The storage classes torch.save names in persistent ids, by name (a closed table; never
# ``getattr(torch, name)``). ``UntypedStorage`` holds bytes; its tensors carry their own dtype.
_STORAGE_DTYPE_NAMES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}
#: The storages of quantized tensors: named so that such a tensor is reported, never read.
_QUANTIZED_STORAGES = {
    "QUInt8Storage": "torch.quint8",
    "QInt8Storage": "torch.qint8",
    "QInt32Storage": "torch.qint32",
    "QUInt4x2Storage": "torch.quint4x2",
    "QUInt2x4Storage": "torch.quint2x4",
}


@functools.cache
def _torch_values(kind: type) -> dict[str, Any]:
    """Every value of ``kind`` that the ``torch`` module defines, by its ``str`` (``"torch.uint3"``,
    ``"torch.sparse_coo"``): a closed table, built from torch itself, never from a file's names."""
    return {str(v): v for v in vars(torch).values() if isinstance(v, kind)}


@functools.cache
def _negatable(dtype: torch.dtype) -> bool:
    """Whether torch can compute the values of a negative view (``neg`` bit) of ``dtype``
    (not for ``bool``, ``uint16``-``uint64`` or the float8 types)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32's "experimental" warning
        try:
            torch._neg_view(torch.zeros(1, dtype=dtype)).resolve_neg()
        except (RuntimeError, TypeError):
            return False
    return True


# -- what the unpickler builds instead of tensors ------------------------------------------------
@dataclass(frozen=True, slots=True)
class _StorageType:
    """Stands in for a ``torch.*Storage`` class named in a pickle (never the class itself)."""

    name: str
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class _TensorType:
    """Stands in for ``torch.Tensor`` / ``torch.nn.Parameter`` named in a pickle."""

    name: str


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage record of the zip: ``<archive>/data/<key>``, ``numel`` items of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int
    data_offset: int
    crc: int

    @property
    def nbytes(self) -> int:
        """Size of the record in bytes."""
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class RoutedStorage:
    """A storage of a file that ``torch.save`` wrote under ``memtree.saving()``: the pickle names
    ``memtree.routing._routed_storage(entry, key, dtype, location)`` and the data is leaf ``key``
    of the tree ``<file>.memtree/<entry>/`` (:mod:`memtree.routing`). Only described here: the
    tensors of such a file are read by ``torch.load`` inside ``memtree.loading()``."""

    entry: str
    key: str
    dtype: torch.dtype


_ROUTED_ENTRY = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _routed_storage(entry: Any, key: Any, dtype: Any, location: Any) -> RoutedStorage:
    """What ``memtree.routing._routed_storage`` builds in memtree's safe reader: a description."""
    known = dtype_from_name(dtype) if type(dtype) is str else None
    if not (type(entry) is str and _ROUTED_ENTRY.fullmatch(entry) and type(key) is str
            and _RECORD_KEY.fullmatch(key) and known is not None and type(location) is str):
        raise CheckpointFormatError(
            f"a storage routed by memtree.saving() is described by {short((entry, key, dtype, location))}"
        )
    return RoutedStorage(entry, key, known)


@dataclass(frozen=True, slots=True)
class _UnreadableStorage:
    """A storage of a dtype memtree does not read (a quantized one): its record is never read."""

    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor of the checkpoint: a strided view of one storage, not read yet.

    ``conj`` and ``neg`` are the bits ``torch.save`` records in a tensor's ``metadata``: the
    values are the conjugate (the negation) of the stored ones, as for ``z.conj()`` and
    ``torch._neg_view(x)``; the reader applies them as ``torch.load`` does.
    """

    storage: StorageRef | RoutedStorage
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    conj: bool = False
    neg: bool = False

    @property
    def shape(self) -> torch.Size:
        """The tensor's shape."""
        return torch.Size(self.size)

    def span(self) -> tuple[int, int]:
        """``(first element, element count)`` of the storage that the tensor touches (``(0,
        0)`` for a tensor without elements, whatever its offset: it touches none)."""
        if 0 in self.size:
            return 0, 0
        count = 1
        for n, s in zip(self.size, self.stride):  # same length: checked when it was built
            count += (n - 1) * s
        return self.offset, count

    def is_contiguous(self) -> bool:
        """True if the tensor's elements lie in order, one after another (as ``torch``'s)."""
        if prod(self.size) == 0:
            return True
        expected = 1
        for n, s in zip(reversed(self.size), reversed(self.stride), strict=True):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    def stored_as_is(self) -> bool:
        """True if the tensor's values are the bytes it spans, in order: contiguous, and
        neither conjugated nor negated."""
        return self.is_contiguous() and not (self.conj or self.neg)

    def apply_bits(self, data: torch.Tensor) -> torch.Tensor:
        """``data`` (the stored values) with the ``conj``/``neg`` bits set, as ``torch.load``
        returns it: a lazy view, whose values are the conjugate/negation of ``data``'s."""
        if self.neg:
            data = torch._neg_view(data)
        if self.conj:
            data = data.conj()
        return data


@dataclass(frozen=True, slots=True)
class UnreadableTensor:
    """A tensor of the checkpoint that memtree does not read: ``what`` it is (``"a sparse_coo
    tensor"``); ``damaged``: no ``torch.load`` can read it either."""

    what: str
    damaged: bool = False


def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def _bits(metadata: Any, dtype: torch.dtype) -> tuple[bool, bool] | UnreadableTensor:
    """``(conj, neg)`` from a tensor's ``metadata`` (what ``torch._utils.get_tensor_metadata``
    wrote), or what is wrong with it."""
    if metadata is None or (type(metadata) is dict and not metadata):
        return False, False
    # torch.save writes only the bits that are set, as True; torch.load sets a bit whatever
    # its value: a False (or anything else) is malformed
    if type(metadata) is not dict or not all(v is True for v in metadata.values()):
        return UnreadableTensor(f"a tensor with malformed metadata {short(metadata)}", True)
    unknown = [k for k in metadata if k not in ("conj", "neg")]
    if unknown:
        return UnreadableTensor(
            f"a tensor with the metadata {short(unknown[0])}, which memtree does not know (torch "
            f"{torch.__version__} writes only 'conj' and 'neg')"
        )
    conj, neg = "conj" in metadata, "neg" in metadata
    if conj and not dtype.is_complex:
        return UnreadableTensor(f"a {dtype} tensor with the conjugate bit (only complex ones have it)", True)
    if neg and not _negatable(dtype):
        return UnreadableTensor(f"a negative view of a {dtype} tensor (torch cannot compute its values)")
    return conj, neg


def _tensor_ref(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: Any = None, metadata: Any = None
) -> TensorRef | UnreadableTensor:
    if isinstance(storage, _UnreadableStorage):
        return UnreadableTensor(f"a tensor of dtype {storage.dtype} (quantized)")
    if not isinstance(storage, (StorageRef, RoutedStorage)):
        raise CheckpointFormatError(
            f"a tensor's storage is a {type(storage).__name__}, not a storage"
        )
    if dtype is None:
        dtype = storage.dtype
    elif not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"a tensor names the dtype {short(dtype)}")
    elif dtype_from_name(str(dtype)[6:]) is not dtype:
        return UnreadableTensor(f"a tensor of dtype {dtype}")
    if not (
        _int(offset)
        and isinstance(size, (tuple, list))
        and isinstance(stride, (tuple, list))
        and len(size) == len(stride) <= _MAX_NDIM
    ):
        raise CheckpointFormatError(
            f"a tensor has a malformed layout: offset {short(offset)}, size {short(size)}"
        )
    size, stride = tuple(size), tuple(stride)
    if not all(_int(n) and n <= MAX_DIM for n in size + stride):  # torch's are int64
        raise CheckpointFormatError(
            f"a tensor has a malformed size {short(size)} or stride {short(stride)}"
        )
    if extent_bytes(size, dtype) > MAX_NBYTES:  # as the format bounds every leaf
        return UnreadableTensor(f"a tensor of shape {short(list(size))}, beyond 2**62 bytes")
    bits = _bits(metadata, dtype)
    if isinstance(bits, UnreadableTensor):
        return bits
    ref = TensorRef(storage, dtype, offset, size, stride, *bits)
    first, count = ref.span()
    if isinstance(storage, RoutedStorage):  # its data is not in this file: nothing to bound here
        return ref
    if count and (first + count) * itemsize(dtype) > storage.nbytes:  # (no element: no byte read)
        raise CheckpointFormatError(
            f"a tensor of shape {list(size)} at offset {offset} reaches past the end of storage "
            f"{storage.key!r} ({storage.nbytes:,} bytes); the checkpoint is damaged"
        )
    return ref


def _rebuild_v1(storage: Any, offset: Any, size: Any, stride: Any) -> TensorRef | UnreadableTensor:
    return _tensor_ref(storage, offset, size, stride)


def _rebuild_v2(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    metadata: Any = None,
) -> TensorRef | UnreadableTensor:
    return _tensor_ref(storage, offset, size, stride, metadata=metadata)


def _rebuild_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> TensorRef | UnreadableTensor:
    return _tensor_ref(storage, offset, size, stride, dtype, metadata)


def _tensor_arg(data: Any, what: str) -> TensorRef | UnreadableTensor:
    if not isinstance(data, (TensorRef, UnreadableTensor)):
        raise CheckpointFormatError(f"{what} wraps a {type(data).__name__}, not a tensor")
    return data


def _rebuild_parameter(
    data: Any, requires_grad: Any, hooks: Any, state: Any = None
) -> TensorRef | UnreadableTensor:
    return _tensor_arg(data, "a parameter")


def _rebuild_from_cpu(data: Any, dtype: Any, device: Any, requires_grad: Any) -> TensorRef | UnreadableTensor:
    """A tensor of another device (XLA, MTIA, ...) saved through a CPU copy: that copy, read on
    the CPU like every tensor, when it has the tensor's dtype."""
    data = _tensor_arg(data, "a device tensor")
    if isinstance(data, TensorRef) and dtype is data.dtype:
        return data
    return UnreadableTensor(f"a {short(device)} tensor saved as a CPU tensor of another dtype")


def _unreadable(what: str) -> Callable[..., UnreadableTensor]:
    def rebuild(*args: Any) -> UnreadableTensor:
        return UnreadableTensor(what)

    return rebuild


def _rebuild_sparse(layout: Any, data: Any) -> UnreadableTensor:
    name = str(layout)[6:] if isinstance(layout, torch.layout) else "sparse"
    return UnreadableTensor(f"a {name} tensor (sparse)")


#: The tensor rebuild functions ``torch.save`` names, and what each builds here.
_TENSOR_REBUILDS: dict[str, Callable[..., TensorRef | UnreadableTensor]] = {
    "_rebuild_tensor": _rebuild_v1,
    "_rebuild_tensor_v2": _rebuild_v2,
    "_rebuild_tensor_v3": _rebuild_v3,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter,
    "_rebuild_device_tensor_from_cpu_tensor": _rebuild_from_cpu,
    "_rebuild_sparse_tensor": _rebuild_sparse,
    "_rebuild_qtensor": _unreadable("a quantized tensor"),
    "_rebuild_nested_tensor": _unreadable("a nested tensor"),
    "_rebuild_meta_tensor_no_storage": _unreadable("a tensor on the meta device (it has no data)"),
    "_rebuild_wrapper_subclass": _unreadable("a tensor subclass without data of its own"),
    "_rebuild_device_tensor_from_numpy": _unreadable("a tensor saved as a numpy array"),
}
_REBUILD_FUNCTIONS = frozenset(_TENSOR_REBUILDS.values())


# -- plain values ---------------------------------------------------------------------------------
def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if type(real) not in (int, float) or type(imag) not in (int, float):
        raise CheckpointFormatError("complex() called with non-numbers")
    return complex(real, imag)


def _device(kind: Any, index: Any = None) -> torch.device:
    """``torch.device("cuda", 1)`` as pickles call it: a short type name and an index."""
    if type(kind) is not str or len(kind) > 64 or not (index is None or (_int(index) and index < 2**31)):
        raise CheckpointFormatError(f"torch.device() called with {short(kind)}, {short(index)}")
    try:
        return torch.device(kind) if index is None else torch.device(kind, index)
    except RuntimeError:
        raise CheckpointFormatError(f"torch.device() called with an unknown device {short(kind)}") from None


def _layout(name: Any) -> torch.layout:
    """``torch.serialization._get_layout(name)``: a layout (``torch.strided``...) by its name."""
    layout: torch.layout | None = _torch_values(torch.layout).get(name) if type(name) is str else None
    if layout is None:
        raise CheckpointFormatError(f"a pickle names the unknown layout {short(name)}")
    return layout


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only plain data and lazy tensor references, within limits.

    What it may build is an allowlist (:meth:`find_class`; the module docstring has the table);
    each global it hands out is a :class:`~memtree.interop.pickle_guard.SafeCall` that charges
    what it builds to ``budget``. The caller scans the pickle first
    (:class:`~memtree.interop.pickle_guard.PickleScanner`) and calls :meth:`release` after
    :meth:`load`.

    Args:
        file: the pickle stream.
        storages: persistent-id resolver: ``(key, dtype, numel) -> StorageRef``.
        where: the pickle's name, for messages.
        allow_pickle: let globals outside the allowlist through (trusted files only).
        budget: what the calls may still build (default: the limits in force, nothing used).
    """

    def __init__(
        self,
        file: io.IOBase,
        storages: Callable[[str, torch.dtype, int], StorageRef],
        where: str,
        *,
        allow_pickle: bool = False,
        budget: Budget | None = None,
    ) -> None:
        super().__init__(file)
        self._storages = storages
        self._where = where
        self._allow_pickle = allow_pickle
        self._budget = budget if budget is not None else Budget(current_limits(), where)
        self._parameter = _TensorType("torch.nn.parameter.Parameter")
        self._tensor = _TensorType("torch.Tensor")
        calls: dict[str, Callable[..., Any]] = {
            f"torch._utils.{name}": fn for name, fn in _TENSOR_REBUILDS.items()
        }
        calls.update({
            "collections.OrderedDict": functools.partial(self._budget.mapping, OrderedDict),
            "collections.Counter": functools.partial(self._budget.mapping, Counter),
            "builtins.set": self._budget.set_of,
            "builtins.bytearray": self._bytearray,
            "builtins.complex": _complex,
            "_codecs.encode": self._codecs_encode,
            "torch._tensor._rebuild_from_type_v2": self._rebuild_from_type_v2,
            "torch.Size": self._size,
            "torch.device": _device,
            "torch.serialization._get_layout": _layout,
            "memtree.routing._routed_storage": _routed_storage,
        })  # fmt: skip
        self._safe: dict[str, Any] = {name: SafeCall(fn, name) for name, fn in calls.items()}
        self._safe["torch.Tensor"] = self._tensor
        self._safe["torch.nn.parameter.Parameter"] = self._parameter

    def find_class(self, module: str, name: str) -> Any:
        # protocol-2 pickles name builtins by their Python 2 module
        full = f"{'builtins' if module == '__builtin__' else module}.{name}"
        if full in self._safe:
            return self._safe[full]
        if module == "torch":
            if name in _STORAGE_DTYPE_NAMES:
                dtype = dtype_from_name(_STORAGE_DTYPE_NAMES[name])
                assert dtype is not None
                return _StorageType(name, dtype)
            if name in _QUANTIZED_STORAGES:
                return _StorageType(name, _torch_values(torch.dtype)[_QUANTIZED_STORAGES[name]])
            constant = _torch_values(torch.dtype).get(full, _torch_values(torch.qscheme).get(full))
            if constant is not None:  # a dtype or a quantization scheme, as a value
                return constant
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(name, torch.uint8)
        if self._allow_pickle:  # pickle's own lookup, Python 2 names (xrange...) included
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"{self._where} refers to {full!r:.120}, which is not a tensor, storage, container or "
            "value that torch.load(weights_only=True) accepts by default; memtree's safe loader "
            "refuses it (nothing was executed; globals added with "
            "torch.serialization.add_safe_globals are not honoured). If you trust this file, pass "
            "allow_pickle=True (the CLI: --allow-pickle), or load it with torch.load in a trusted "
            "environment and re-save only its state_dict"
        )

    def release(self) -> None:
        """Undo what the load set up on the objects it built (call it after :meth:`load`)."""
        self._budget.release()

    def _size(self, dims: Any = ()) -> torch.Size:
        self._budget.sized(dims, "torch.Size()")
        return torch.Size(dims)

    def _codecs_encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        """``_codecs.encode`` as protocol-2 pickles use it for ``bytes`` (and nothing else)."""
        if type(text) is not str or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
            raise CheckpointFormatError(
                f"{self._where}: _codecs.encode called with {type(text).__name__}, "
                f"{short(encoding)}"
            )
        self._budget.charge(1, len(text) * (1 if encoding.startswith("latin") else 4))
        return text.encode(encoding)

    def _bytearray(self, data: Any = b"") -> bytearray:
        """``bytearray(bytes)`` as pickles call it (the bytes from ``_codecs.encode``); never
        ``bytearray(n)``, which would allocate ``n`` bytes."""
        if type(data) is not bytes:
            raise CheckpointFormatError(f"{self._where}: bytearray() called with {short(data)}")
        self._budget.charge(1, len(data))
        return bytearray(data)

    def _rebuild_from_type_v2(
        self, func: Any, new_type: Any, args: Any, state: Any
    ) -> TensorRef | UnreadableTensor:
        if not (isinstance(func, SafeCall) and func.fn in _REBUILD_FUNCTIONS) or type(args) is not tuple:
            raise CheckpointFormatError(
                f"{self._where}: a tensor subclass is rebuilt with {short(func)}"
            )
        if new_type not in (self._tensor, self._parameter) and not self._allow_pickle:
            raise UnsafePickleError(
                f"{self._where} holds a tensor of subclass {short(new_type)}; pass "
                "allow_pickle=True "
                "to read it as a plain tensor"
            )
        ref: TensorRef | UnreadableTensor = func(*args)
        return ref

    def persistent_load(self, pid: Any) -> StorageRef | _UnreadableStorage:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointFormatError(f"{self._where}: unknown persistent id {short(pid)}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointFormatError(
                f"{self._where}: storage type {short(storage_type)} is not supported"
            )
        if type(key) is not str or not _RECORD_KEY.fullmatch(key) or not _int(numel):
            raise CheckpointFormatError(f"{self._where}: malformed storage id {short(pid)}")
        if storage_type.name in _QUANTIZED_STORAGES:
            return _UnreadableStorage(storage_type.dtype)
        return self._storages(key, storage_type.dtype, numel)
