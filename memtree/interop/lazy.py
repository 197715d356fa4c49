"""``LazyLeaf``: a tensor that knows its shape and dtype and reads its data only when used.

It is how conversions stream through memtree's ordinary write path: a
:class:`~memtree.format.level.Level` whose leaves are ``LazyLeaf`` objects is written by
:func:`memtree.store.writing.write.write_tree` exactly like any other tree (same plan, same staging directory,
same atomic commit), and each leaf's data is loaded at the moment its file is written and
dropped right after, so the process holds one tensor at a time instead of the whole checkpoint.

A leaf whose bytes lie as they are in a file (a contiguous tensor of a ``torch.save`` checkpoint,
not cast) also knows that place: :meth:`LazyLeaf.file_range` returns it as a
:class:`~memtree.store.primitives.files.FileRange`, and the writer then copies the bytes file to file
(``copy_file_range``) instead of loading them: the process holds none of them.

Shape, dtype, device and layout queries never load anything. Any operation on a ``LazyLeaf``
(``detach``, ``contiguous``, arithmetic...) loads it, runs on the loaded tensor and returns
ordinary tensors; every use loads it again (nothing is cached, which is what bounds memory).

Example:
    >>> import torch
    >>> from memtree.interop.lazy import LazyLeaf
    >>> leaf = LazyLeaf((2,), torch.float32, lambda: torch.ones(2))
    >>> leaf.shape, leaf.dtype
    (torch.Size([2]), torch.float32)
    >>> (leaf + 1).tolist()
    [2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..errors import CheckpointFormatError
from ..store.primitives.files import FileRange

__all__ = ["LazyLeaf"]


class LazyLeaf(torch.Tensor):
    """A CPU tensor of a given shape and dtype whose data comes from ``load()`` on each use.

    Args:
        shape: the tensor's shape.
        dtype: the tensor's dtype.
        load: returns the data (a tensor of exactly this shape and dtype).
        file_range: returns where the data lies as it is in an open file, if it does (else
            ``None``); see :meth:`file_range`.
    """

    _load: Callable[[], torch.Tensor]
    _file_range: Callable[[], FileRange | None] | None
    #: Written as the plain tensor it reads, not as a tensor subclass's group.
    _memtree_plain = True
    # torch's stubs declare this builtin as a plain function, which mypy binds as a method
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype,
        load: Callable[[], torch.Tensor],
        file_range: Callable[[], FileRange | None] | None = None,
    ) -> LazyLeaf:
        out = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=torch.device("cpu"))
        out._load = load
        out._file_range = file_range
        return out

    def file_range(self) -> FileRange | None:
        """Where the data lies byte for byte in an open file (``None``: only ``load`` has it).

        :func:`memtree.store.writing.write.write_tree` asks for it before loading a leaf, and copies the range
        into the leaf file without reading it into memory.
        """
        return None if self._file_range is None else self._file_range()

    def materialize(self) -> torch.Tensor:
        """Load the data now (an ordinary tensor) and check it matches the declared spec."""
        value = self._load()
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise CheckpointFormatError(
                f"a tensor read as {value.dtype}{list(value.shape)} was declared "
                f"{self.dtype}{list(self.shape)}; the source changed while it was being read"
            )
        return value

    # torch declares Tensor.__torch_dispatch__ as a builtin that mypy takes for a plain method
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        def load(x: Any) -> Any:
            return x.materialize() if isinstance(x, LazyLeaf) else x

        return func(*tree_map(load, args), **tree_map(load, kwargs or {}))

    # mypy rejects any annotated override of torch's unannotated Tensor.__repr__
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"LazyLeaf(shape={list(self.shape)}, dtype={self.dtype})"
