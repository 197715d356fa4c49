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

__all__ = ["DTYPE_NAMES", "DTYPE_ITEMSIZES", "dtype_name", "dtype_from_name", "itemsize"]

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
}
#: Every dtype name of the format, in the order documented in docs/format.md.
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_ITEMSIZES)

_BY_NAME: dict[str, torch.dtype] = {}  # filled on first use (torch is imported then)
_BY_DTYPE: dict[torch.dtype, str] = {}


def _torch_tables() -> None:
    import torch

    by_name = {}
    for name in DTYPE_NAMES:
        dt = getattr(torch, name, None)  # fixed names only, resolved once
        if isinstance(dt, torch.dtype):
            by_name[name] = dt
    _BY_DTYPE.update({dt: name for name, dt in by_name.items()})
    _BY_NAME.update(by_name)  # last: a thread that sees it filled sees _BY_DTYPE filled too


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
            f"dtype {dtype} cannot be stored by memtree (supported: {', '.join(_BY_NAME)}); "
            "convert the tensor first, e.g. with .to(torch.float32) or .dequantize()"
        ) from None


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
