"""The one table of dtypes the memtree format can hold.

Names are torch's own (``str(dtype)`` without ``torch.``). The table is closed: a name read from
a file is looked up here and nowhere else (never ``getattr(torch, name)``). The names and their
item sizes need no torch (``memtree info`` reads a tree's metadata without importing it); the
torch dtypes are looked up on first use. Dtypes that this torch build does not have are left out
of that lookup, so a tree naming one is refused clearly when it is loaded.

Example:
    >>> import torch
    >>> from memtree.format.dtypes import dtype_name, dtype_from_name
    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    >>> dtype_from_name("bfloat16") is torch.bfloat16
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import DtypeError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_NAMES",
    "DTYPE_ITEMSIZES",
    "V3_DTYPE_NAMES",
    "NO_COPY_KERNEL",
    "QUANTIZED_DTYPE_NAMES",
    "dtype_name",
    "any_dtype_name",
    "any_dtype_from_name",
    "dtype_from_name",
    "itemsize",
    "byte_dtype",
]

#: Every dtype name of the format with its bytes per element, in the order documented in
#: docs/format.md (a test checks each size against torch's ``element_size``).
DTYPE_ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    # version 3: packed FP4 (two values a byte, NVFP4/MXFP4 weights), torch's bit containers
    # and its shell dtypes of 1 to 7 bits (one element a byte in torch's memory)
    "float4_e2m1fn_x2": 1,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    "bits8": 1,
    "bits16": 2,
    **{f"{sign}int{bits}": 1 for sign in ("u", "") for bits in range(1, 8)},
}
#: Every dtype name of the format, in the order documented in docs/format.md.
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_ITEMSIZES)
#: The names a leaf may hold only in a level of format version 3 or later (a reader of version 2
#: does not know them): from ``float4_e2m1fn_x2`` on.
V3_DTYPE_NAMES: frozenset[str] = frozenset(DTYPE_NAMES[DTYPE_NAMES.index("float4_e2m1fn_x2"):])
#: torch's quantized dtypes: never a leaf's dtype (a quantized tensor needs its scales and zero
#: points), but the outer dtype of a subclass group that stores one (``torch.quantized``).
QUANTIZED_DTYPE_NAMES: tuple[str, ...] = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
#: Names whose tensors torch cannot copy element by element (its copy kernels lack them): their
#: bytes are copied through a view of the same item size (:func:`byte_dtype`).
NO_COPY_KERNEL: frozenset[str] = frozenset(n for n in V3_DTYPE_NAMES if n != "float4_e2m1fn_x2")

_BY_NAME: dict[str, torch.dtype] = {}  # filled on first use (torch is imported then)
_BY_DTYPE: dict[torch.dtype, str] = {}
_QUANTIZED: dict[str, torch.dtype] = {}  # the quantized dtypes this torch has, by name
_QUANTIZED_NAMES: dict[torch.dtype, str] = {}


def _torch_tables() -> None:
    import torch

    by_name = {}
    for name in (*DTYPE_NAMES, *QUANTIZED_DTYPE_NAMES):
        dt = getattr(torch, name, None)  # fixed names only, resolved once
        if isinstance(dt, torch.dtype):
            by_name[name] = dt
    quantized = {name: by_name.pop(name) for name in QUANTIZED_DTYPE_NAMES if name in by_name}
    _QUANTIZED_NAMES.update({dt: name for name, dt in quantized.items()})
    _QUANTIZED.update(quantized)
    _BY_DTYPE.update({dt: name for name, dt in by_name.items()})
    _BY_NAME.update(by_name)  # last: a thread that sees it filled sees the others filled too


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name for ``dtype``.

    Raises:
        DtypeError: the dtype cannot be stored (quantized, sub-byte ``bits``/``int1``… types).
    """
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        if not _BY_NAME:
            _torch_tables()
            return dtype_name(dtype)
        raise DtypeError(
            f"dtype {dtype} cannot be stored as a tensor leaf (supported: {', '.join(_BY_NAME)}); "
            "a quantized tensor is stored as a tensor subclass (a TensorTree leaf), or convert "
            "it first, e.g. with .to(torch.float32) or .dequantize()"
        ) from None


def any_dtype_name(dtype: torch.dtype) -> str:
    """The format's name for ``dtype``, a leaf dtype or a quantized one (a subclass group's
    outer dtype).

    Raises:
        DtypeError: neither.

    Example:
        >>> import torch
        >>> any_dtype_name(torch.qint8), any_dtype_name(torch.float32)
        ('qint8', 'float32')
    """
    if not _BY_NAME:
        _torch_tables()
    found = _QUANTIZED_NAMES.get(dtype)
    return found if found is not None else dtype_name(dtype)


def any_dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype for a leaf or quantized dtype name; ``None`` if there is none."""
    if not _BY_NAME:
        _torch_tables()
    return _BY_NAME.get(name) or _QUANTIZED.get(name)


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype for a format name, or ``None`` if the name is not in the table (or this
    torch build lacks it). Imports torch on first use."""
    if not _BY_NAME:
        _torch_tables()
    return _BY_NAME.get(name)


def itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of ``dtype``, a torch dtype or a format name (looked up, not computed:
    it runs once per leaf; a name needs no torch).

    Example:
        >>> itemsize("bfloat16"), itemsize("complex128")
        (2, 16)
    """
    if isinstance(dtype, str):
        return DTYPE_ITEMSIZES[dtype]
    size = _ITEMSIZE.get(dtype)
    if size is None:
        import torch

        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype, device="meta").element_size()
    return size


_ITEMSIZE: dict[torch.dtype, int] = {}


def byte_dtype(dtype: torch.dtype) -> torch.dtype:
    """A dtype of the same item size whose tensors torch copies: ``dtype`` itself, or for the
    dtypes torch has no copy kernel for (:data:`NO_COPY_KERNEL`: ``int4``, ``bits8``...)
    ``uint8`` (``int16`` for ``bits16``). ``t.view(byte_dtype(t.dtype))`` shares ``t``'s memory.

    Example:
        >>> import torch
        >>> byte_dtype(torch.int4), byte_dtype(torch.bits16), byte_dtype(torch.float32)
        (torch.uint8, torch.int16, torch.float32)
    """
    import torch

    if dtype_name(dtype) not in NO_COPY_KERNEL:
        return dtype
    return torch.int16 if itemsize(dtype) == 2 else torch.uint8
