"""Tensor memory as bytes, without copying: the views that writes and checksums read from.

A leaf's bytes are written (:mod:`memtree.store.primitives.files`) and hashed
(:mod:`memtree.store.primitives.checksums`) straight from a CPU tensor's memory: :func:`byte_view` for any
contiguous CPU tensor, :func:`writable_view` and :data:`view_of_memory` for plain memory
(:func:`is_plain_memory`), where wrapping an address is about five times cheaper.

Example:
    >>> import torch
    >>> bytes(byte_view(torch.arange(2, dtype=torch.int16)))
    b'\\x00\\x00\\x01\\x00'
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the functions that handle tensors (``memtree info`` has no torch)
    import torch

__all__ = [
    "byte_view",
    "writable_view",
    "is_plain_memory",
    "view_of_memory",
    "PYBUF_READ",
    "PYBUF_WRITE",
]

#: Wraps raw memory in a read-only ``memoryview`` without copying (CPython's C API).
view_of_memory = ctypes.pythonapi.PyMemoryView_FromMemory
view_of_memory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
view_of_memory.restype = ctypes.py_object
PYBUF_READ = 0x100
PYBUF_WRITE = 0x200


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte ``memoryview`` of a contiguous CPU tensor, without copying."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
    import torch

    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def writable_view(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte ``memoryview`` of a plain contiguous CPU tensor's memory
    (:func:`is_plain_memory`), without copying: ~1 µs where :func:`byte_view` takes ~5 µs.
    The view does not keep ``tensor`` alive: the caller does, while the view is used.

    Example:
        >>> import torch
        >>> t = torch.zeros(2, dtype=torch.int16)
        >>> writable_view(t)[:2] = b"\\x01\\x00"
        >>> t.tolist()
        [1, 0]
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    view: memoryview = view_of_memory(tensor.data_ptr(), nbytes, PYBUF_WRITE)
    return view


def is_plain_memory(tensor: torch.Tensor) -> bool:
    """True for a plain, contiguous CPU tensor whose memory holds its bytes as they are (no
    subclass, no lazy conjugate or negation bit): it can be written from ``data_ptr()``.

    Example:
        >>> import torch
        >>> is_plain_memory(torch.ones(2, 3)), is_plain_memory(torch.ones(2, 3).t())
        (True, False)
    """
    import torch

    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )
