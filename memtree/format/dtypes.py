"""The one table of dtypes the memtree format can hold.

Names are torch's own (``str(dtype)`` without ``torch.``). The table is closed: a name read from
a file is looked up here and nowhere else (never ``getattr(torch, name)``). Dtypes that this torch
build does not have are left out of the table, so a file naming one is refused clearly.

Example:
    >>> import torch
    >>> from memtree.format.dtypes import dtype_name, dtype_from_name
    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    >>> dtype_from_name("bfloat16") is torch.bfloat16
    True
"""

from __future__ import annotations

import torch

from ..errors import DtypeError

__all__ = ["DTYPE_NAMES", "dtype_name", "dtype_from_name", "itemsize"]

#: Every dtype name of format version 1, in the order documented in docs/format.md.
DTYPE_NAMES: tuple[str, ...] = (
    "bool",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

_BY_NAME: dict[str, torch.dtype] = {}
for _name in DTYPE_NAMES:
    _dt = getattr(torch, _name, None)  # fixed names only, resolved once at import
    if isinstance(_dt, torch.dtype):
        _BY_NAME[_name] = _dt
_BY_DTYPE: dict[torch.dtype, str] = {dt: name for name, dt in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name for ``dtype``.

    Raises:
        DtypeError: the dtype cannot be stored (quantized, sub-byte ``bits``/``int1``… types).
    """
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise DtypeError(
            f"dtype {dtype} cannot be stored by memtree (supported: {', '.join(_BY_NAME)}); "
            "convert the tensor first, e.g. with .to(torch.float32) or .dequantize()"
        ) from None


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype for a format name, or ``None`` if the name is not in the table."""
    return _BY_NAME.get(name)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (looked up, not computed: it runs once per leaf)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype, device="meta").element_size()
    return size


_ITEMSIZE: dict[torch.dtype, int] = {}
