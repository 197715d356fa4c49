"""The snapshot of an async save: every tensor of a state copied into one reused staging buffer.

``Checkpointer.save(..., blocking=False)`` returns once :meth:`StagingBuffer.take` has copied every
tensor leaf of the state's levels into the staging buffer and put each copy in its place; the
writer thread reads the copies after the snapshot's :meth:`Fence.wait`. What holds:

* a copy holds its tensor's values, whatever the layout: conjugate and negative views,
  transposed, strided, expanded (stride 0), zero-element and 0-dim tensors, every dtype of the
  format. A CUDA tensor's conjugate or negative bit is resolved on its device first: for an
  asynchronous device-to-host copy, torch applies the bit to the host destination right after it
  *enqueues* the copy, before the bytes land, and the bytes then overwrite it;
* tensors that read the same memory the same way (tied weights: one storage, offset, shape,
  strides, dtype and conjugate and negative bits; plain tensors and parameters only) are copied
  once; any other two are copied apart, so two views of one storage (overlapping or not, a
  tensor and its conjugate) each keep their values;
* the buffer is host memory, pinned when a CUDA tensor is copied, reused by the next snapshot
  (reallocated when it is too small or more than twice too big). Where pinning fails (a
  locked-memory limit) it is ordinary memory, with a ``RuntimeWarning`` once: the copies are
  then synchronous, the values the same. CUDA tensors are copied with
  ``non_blocking=True`` on their device's current stream; the :class:`Fence` records an event on
  the current stream of *every* device copied from, and is waited by the writer before it reads
  the buffer and by the next snapshot before it reuses (or frees) the buffer;
* every leaf is checked (dtype, layout, device) before anything is copied.

Example:
    >>> import torch
    >>> from memtree.format.level import Level
    >>> z = torch.tensor([1 + 2j])
    >>> level = Level((), {"z": z, "conj": z.conj()})
    >>> StagingBuffer().take(level).wait()
    >>> level.entries["conj"], level.entries["conj"].is_conj()
    (tensor([1.-2.j]), False)
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..errors import DtypeError
from ..format.dtypes import byte_dtype, dtype_name
from ..format.level import Level, fmt_key
from .state import tensor_slots

__all__ = ["StagingBuffer", "Fence"]

#: Bytes between copies in the staging buffer (every dtype's alignment).
ALIGN = 64


class Fence:
    """The copies of one snapshot that may still be in flight: one CUDA event per device copied
    from, recorded on that device's current stream after its last copy.

    Example:
        >>> Fence([]).wait()  # nothing was copied asynchronously
    """

    __slots__ = ("_events",)

    def __init__(self, events: Sequence[Any]) -> None:
        self._events = tuple(events)

    def wait(self) -> None:
        """Return once every copy of the snapshot is in the buffer (at once if none was
        asynchronous); may be called any number of times, from any thread."""
        for event in self._events:
            event.synchronize()


class StagingBuffer:
    """One host buffer that the async saves of a :class:`~memtree.Checkpointer` copy their
    tensors into, reused from one save to the next.

    The caller makes sure the writer of a snapshot is done before it takes the next one (the
    checkpointer waits for the save in flight); :meth:`take` itself waits for the copies of
    the previous snapshot before it writes into the buffer or frees it.

    Example:
        >>> import torch
        >>> from memtree.format.level import Level
        >>> staging, w = StagingBuffer(), torch.ones(3)
        >>> level = Level((), {"w": w})
        >>> staging.take(level).wait(); w.zero_()
        tensor([0., 0., 0.])
        >>> level.entries["w"], staging.buffer.numel()
        (tensor([1., 1., 1.]), 64)
    """

    def __init__(self) -> None:
        #: The buffer (``None`` before the first snapshot): uint8, 64-byte aligned copies.
        self.buffer: torch.Tensor | None = None
        self._fence = Fence(())
        self._unpinned = False  # pinning failed once: later snapshots use ordinary memory too

    def take(self, level: Level) -> Fence:
        """Copy every tensor leaf of ``level`` (and the levels below) into the buffer and put the
        copies in their place; the fence to wait for before the copies are read.

        The training loop waits for this call, so it does the least Python per tensor: one pass
        checks every leaf and places it in the buffer, then the host tensors are copied in one
        ``torch._foreach_copy_`` (the copies back to back, as a loop of ``copy_`` into
        preallocated memory makes them), CUDA tensors one by one on their streams.

        Raises:
            DtypeError: a leaf that cannot be stored (its dtype, a sparse, nested or meta
                tensor), named by its key path; nothing is copied then.
        """
        slots = tensor_slots(level)
        places: dict[Hashable, int] = {}  # each distinct source's offset in the buffer
        idents: list[Hashable] = []
        total = 0
        cuda = False
        for _, path, t in slots:
            _check(t, path)
            ident = _identity(t)
            idents.append(ident)
            if ident not in places:
                places[ident] = total
                total += -(-t.nbytes // ALIGN) * ALIGN
                cuda = cuda or t.is_cuda
        self._fence.wait()  # the previous snapshot's copies have landed: the buffer may change
        buf = self._reserve(total, pinned=cuda)
        typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer seen as each dtype copied
        copies: dict[Hashable, torch.Tensor] = {}
        host_dst: list[torch.Tensor] = []  # plain host tensors: copied together at the end
        host_src: list[torch.Tensor] = []
        devices: dict[torch.device, None] = {}  # the CUDA devices copied from, in order
        try:
            for (lvl, path, t), ident in zip(slots, idents):
                copy = copies.get(ident)
                if copy is None:
                    copy = copies[ident] = _place(buf, typed, places[ident], t)
                    if t.is_cuda:
                        devices[t.device] = None
                        _copy_values(copy, t)
                    elif type(t) in _PLAIN and _has_copy_kernel(t.dtype):
                        host_dst.append(copy)
                        host_src.append(t)
                    else:
                        _copy_values(copy, t)
                lvl.entries[path[-1]] = copy
            if host_dst:
                _copy_all(host_dst, host_src)
        finally:  # the copies issued so far, even when one failed: the next take waits for them
            self._fence = Fence([_record(device) for device in devices])
        return self._fence

    def _reserve(self, nbytes: int, pinned: bool) -> torch.Tensor:
        buf = self.buffer
        if (
            buf is None
            or buf.numel() < nbytes
            or buf.numel() > 2 * nbytes + (1 << 20)
            or (pinned and not self._unpinned and not buf.is_pinned())
        ):
            self.buffer = None  # the old one is freed before the new one is allocated
            buf = self.buffer = _allocate(nbytes, pinned and not self._unpinned)
            self._unpinned = self._unpinned or (pinned and not buf.is_pinned())
        return buf


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory, pinned if asked and the system allows it, else ordinary
    memory with a warning (the copies from CUDA are then synchronous: slower, still exact)."""
    if pinned:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as err:  # cudaHostAlloc refused: the memlock limit, no host memory
            warnings.warn(
                f"memtree: could not pin {nbytes:,} bytes of host memory for async saves ({err}); "
                "using ordinary memory: the snapshot copies from CUDA block until done. Raise the "
                "locked-memory limit (ulimit -l, or the container's memlock) to pin it",
                RuntimeWarning,
                stacklevel=4,
            )
    return torch.empty(nbytes, dtype=torch.uint8)


#: Tensors whose memory holds their values (not a subclass): their copies go in one call.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _check(t: torch.Tensor, path: tuple[str, ...]) -> None:
    try:
        dtype_name(t.dtype)
    except DtypeError as err:
        raise DtypeError(f"leaf {fmt_key(path)}: {err}") from None
    if t.layout is not torch.strided or t.is_nested:
        raise DtypeError(f"leaf {fmt_key(path)}: {t.layout} tensors cannot be stored; use .to_dense()")
    if t.is_meta:
        raise DtypeError(f"leaf {fmt_key(path)} is on the meta device and has no data to save; load real weights first")


def _identity(t: torch.Tensor) -> Hashable:
    """What makes two tensors read the same values: equal for tied weights, different for a
    tensor and its conjugate or negative view, or two views of one storage."""
    if type(t) not in _PLAIN:
        return id(t)  # a subclass's storage need not hold its values: copied on its own
    storage = t.untyped_storage().data_ptr()
    return (t.device, storage, t.storage_offset(), t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


def _place(buf: torch.Tensor, typed: dict[torch.dtype, torch.Tensor], start: int, t: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor of ``t``'s dtype and shape at byte ``start`` of ``buf``."""
    dtype = t.dtype
    whole = typed.get(dtype)
    if whole is None:  # every start is a multiple of ALIGN, so of every item size
        whole = typed[dtype] = buf[: buf.numel() // ALIGN * ALIGN].view(dtype)
    first = start // t.element_size()
    if t.is_contiguous():  # its strides lay the elements out densely, in order
        return whole.as_strided(t.shape, t.stride(), first)
    return whole[first : first + t.numel()].view(t.shape)


def _copy_values(dest: torch.Tensor, t: torch.Tensor) -> None:
    """Copy ``t``'s values into ``dest`` (plain host memory of its dtype and shape)."""
    src = t.detach().resolve_conj().resolve_neg()  # on t's device, in its stream's order
    copyable = byte_dtype(src.dtype)  # int4, bits8...: torch copies them only as bytes
    if copyable != src.dtype:
        dest, src = dest.view(copyable), src.view(copyable)
    dest.copy_(src, non_blocking=src.is_cuda)


def _has_copy_kernel(dtype: torch.dtype) -> bool:
    """Whether torch copies tensors of ``dtype`` element by element (not int4, bits8...:
    :func:`~memtree.format.dtypes.byte_dtype`), remembered per dtype."""
    known = _COPY_KERNEL.get(dtype)
    if known is None:
        known = _COPY_KERNEL[dtype] = byte_dtype(dtype) == dtype
    return known


_COPY_KERNEL: dict[torch.dtype, bool] = {}


def _copy_all(dests: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy plain host tensors into their ``dests`` in one call (``copy_`` applies a conjugate
    or negative bit of a host source to the values it writes); where that call cannot copy one
    of them (a dtype without a copy kernel), one by one as :func:`_copy_values` copies."""
    try:
        with torch.no_grad():  # a source that requires grad: the copy is not part of any graph
            torch._foreach_copy_(dests, sources)
    except RuntimeError:  # NotImplementedError too: copied again, each its own way
        for dest, t in zip(dests, sources):
            _copy_values(dest, t)


def _record(device: torch.device) -> Any:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
