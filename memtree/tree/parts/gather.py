"""Batch gathers: the rows of every leaf copied with one call per leaf into a new output.

``tree[idx]`` with an index tensor, a list or an array of rows (and ``tree.__getitems__``, the
DataLoader's path) reads a batch this way:

1. the index is normalised once for the whole tree (:func:`~memtree.tree.parts.args.batch_rows`:
   any integer dtype, lists, numpy arrays, a 1-D mask);
2. each leaf's output is allocated at its final size in the memory the batch is for
   (:func:`batch_memory`, :func:`output_tensors`): ordinary memory; page-locked memory when
   asked for (for copies to a GPU); inside a DataLoader worker, shared memory, so that sending
   the batch to the main process copies nothing more (what ``default_collate`` does with the
   tensors it stacks in a worker);
3. each leaf is gathered with one ``torch.index_select(leaf, 0, rows, out=output)``: on a
   memory-mapped leaf, a copy of whole rows from the page cache, in C, with no Python per row.
   torch's own threads copy the rows of a large batch in parallel (``torch.set_num_threads``),
   which also overlaps the page faults of a cold read.

Rows out of range are found by the first ``index_select`` (it checks every row), and only then
checked again to raise :class:`~memtree.errors.InvalidIndexError` naming the row, the bound and
the leaves, or to wrap negative rows: a batch of valid rows pays for no separate check.

Each leaf gets its own output (not one buffer for the whole batch), so a leaf kept from a batch
(``labels.append(batch["label"])``) keeps only its own memory alive.

Leaves this path does not take keep torch's own indexing, with the same rows: leaves on another
device (``index_select`` there), tensor subclasses, tensors that require grad, and non-strided or
lazily conjugated tensors.

Example:
    >>> import torch, memtree
    >>> tree = memtree.TensorTree({"x": torch.arange(10.0), "y": {"z": torch.arange(20).view(10, 2)}},
    ...                           batch_size=[10])
    >>> batch = tree[[7, -1, 2]]
    >>> batch["x"].tolist(), batch["y", "z"][:, 0].tolist()
    ([7.0, 9.0, 2.0], [14, 18, 4])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import get_worker_info

from ...errors import InvalidArgumentError
from ...format.dtypes import DTYPE_NAMES, dtype_from_name
from ...format.values import NonTensor
from ...store.reading.mapped import MemoryMappedTensor
from .args import check_rows

__all__ = ["MEMORY", "PLAIN", "Rows", "batch_memory", "output_tensors", "gather"]

#: The memories a batch is gathered into (see :func:`output_tensors`).
MEMORY = ("plain", "pinned", "shared")
#: Leaf classes whose rows are copied into new outputs here (a subclass of either indexes itself).
PLAIN = (torch.Tensor, MemoryMappedTensor)
_Job = tuple[dict[str, Any], str, torch.Tensor]


class Rows(Protocol):
    """What :func:`gather` reads of a tree (:class:`~memtree.tree.parts.core.TreeCore`, which
    this module cannot import: the core imports it)."""

    _batch_size: torch.Size

    @property
    def _data(self) -> dict[str, Any]: ...

    def _new_like(self, batch_size: torch.Size | None = None) -> Any: ...

#: Dtypes whose CPU ``index_select`` kernel works for every shape.
_KERNEL = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})
#: Every other dtype a leaf may hold is gathered as integers of its size, the same bits (torch's
#: CPU ``index_select`` lacks some of them: 1-D unsigned ones, float8, float4, bits, sub-byte ints).
_BITS = {
    dtype: {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    for dtype in map(dtype_from_name, DTYPE_NAMES)
    if dtype is not None and dtype not in _KERNEL
}


def batch_memory(pin_memory: bool = False) -> str:
    """The memory a batch is gathered into here: ``"shared"`` in a DataLoader worker (the batch
    goes to the main process), ``"pinned"`` when asked for and CUDA is available, else ``"plain"``.

    Example:
        >>> batch_memory()
        'plain'
    """
    if get_worker_info() is not None:
        return "shared"
    if pin_memory and torch.cuda.is_available():
        return "pinned"
    return "plain"


def output_tensors(specs: Sequence[tuple[Sequence[int], torch.dtype]], memory: str = "plain") -> list[torch.Tensor]:
    """New contiguous CPU tensors of the given shapes and dtypes, in ``memory``.

    Args:
        specs: ``(shape, dtype)`` of each tensor.
        memory: ``"plain"``, ``"pinned"`` (page-locked: needs CUDA) or ``"shared"`` (shared
            memory: sent to another process without a copy).

    Example:
        >>> [t.is_shared() for t in output_tensors([((2, 3), torch.float32), ((0,), torch.int64)], "shared")]
        [True, False]
    """
    if memory not in MEMORY:
        raise InvalidArgumentError(f"memory must be one of {MEMORY}, got {memory!r}")
    out = []
    for shape, dtype in specs:
        size = torch.Size(shape)
        nbytes = size.numel() * dtype.itemsize
        if memory == "shared" and nbytes:  # an empty storage cannot be shared (nor needs to be)
            out.append(torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes)).view(size))
        else:
            out.append(torch.empty(size, dtype=dtype, pin_memory=memory == "pinned" and nbytes > 0))
    return out


def gather(tree: Rows, rows: torch.Tensor, memory: str, where: Callable[[], str]) -> Any:
    """``tree[rows]`` for an int64 or int32 CPU tensor of rows of dim 0 (of any shape).

    Args:
        tree: the tree (its first batch dim is indexed).
        rows: the rows; negative ones count from the end. Several dims become the batch's
            leading dims (as in torch).
        memory: where the gathered leaves go (see :func:`output_tensors`).
        where: what is indexed, for the message of an out-of-range row.

    Raises:
        InvalidIndexError: a row out of range (nothing is returned).

    Example:
        >>> import memtree
        >>> t = memtree.TensorTree({"a": torch.arange(6).view(3, 2)}, batch_size=[3])
        >>> gather(t, torch.tensor([[2, -3]]), "plain", lambda: "t")["a"].tolist()
        [[[4, 5], [0, 1]]]
    """
    fast: list[_Job] = []
    slow: list[_Job] = []
    with torch._C.DisableTorchFunctionSubclass():  # MemoryMappedTensor's hook: not needed to read rows
        out = _skeleton(tree, rows.shape, fast, slow)
    if slow or not fast:  # torch indexes these leaves: every row checked (and wrapped) first
        rows = check_rows(rows, tree._batch_size[0], where)
    try:
        _gather_fast(fast, rows, memory)
    except (IndexError, RuntimeError):  # a row out of range (or negative): check them all, then retry
        rows = check_rows(rows, tree._batch_size[0], where)
        _gather_fast(fast, rows, memory)
    flat = rows.reshape(-1)
    for entries, key, leaf in slow:
        got = leaf[flat] if leaf.is_cpu else torch.index_select(leaf, 0, flat.to(leaf.device))
        entries[key] = got if rows.ndim == 1 else got.view(rows.shape + leaf.shape[1:])
    return out


def _gather_fast(jobs: list[_Job], rows: torch.Tensor, memory: str) -> None:
    """One ``index_select`` per leaf, each into a new output of ``memory`` (rows of a dtype torch
    has no ``index_select`` kernel for are copied as integers of the same size: the same bits)."""
    flat = rows.reshape(-1)
    with torch._C.DisableTorchFunctionSubclass():
        outs = output_tensors([((len(flat),) + leaf.shape[1:], leaf.dtype) for _, _, leaf in jobs], memory)
        for (_, _, leaf), dst in zip(jobs, outs):
            bits = _BITS.get(leaf.dtype)
            if bits is None:
                torch.index_select(leaf, 0, flat, out=dst)
            else:
                torch.index_select(leaf.view(bits), 0, flat, out=dst.view(bits))
        for (entries, key, leaf), dst in zip(jobs, outs):
            entries[key] = dst if rows.ndim == 1 else dst.view(rows.shape + leaf.shape[1:])


def _skeleton(tree: Rows, lead: torch.Size, fast: list[_Job], slow: list[_Job]) -> Any:
    """A tree of ``tree``'s classes and keys with batch size ``lead + batch_size[1:]``, holding
    its non-tensor values and (until they are replaced) its tensors, each listed in ``fast``
    (gathered here) or ``slow`` (indexed by torch). Call without torch-function subclasses."""
    out = tree._new_like(lead + tree._batch_size[1:])
    entries = out._data
    for key, value in tree._data.items():
        if isinstance(value, torch.Tensor):
            entries[key] = value
            plain = (
                type(value) in PLAIN
                and value.is_cpu
                and value.layout == torch.strided
                and not value.requires_grad
                and not value.is_conj()
                and not value.is_neg()
            )
            (fast if plain else slow).append((entries, key, value))
        elif isinstance(value, NonTensor):
            entries[key] = value
        else:  # a sub-tree
            entries[key] = _skeleton(value, lead, fast, slow)
    return out
