"""Memory-mapped trees as ``torch.utils.data`` datasets: collation, batch sampling, workers.

A :class:`~memtree.TensorTree` (or a :func:`~memtree.tensorclass`) with a first batch dim is
already a map-style dataset: ``len(tree)`` items, and ``tree[i]`` is one record (a tree of batch
size ``batch_size[1:]`` whose leaves are views of the files: nothing is read until used). Give a
``DataLoader`` two more things:

* nothing for collation: importing memtree registers trees with torch's default collation
  (``default_collate_fn_map``), so the default ``collate_fn`` stacks records into a batch tree,
  also for datasets whose items hold trees among other values (``memtree.collate`` does the
  same and still works as an explicit ``collate_fn``);
* for speed, whole batches: ``sampler=BatchIndexSampler(tree, batch_size)`` with
  ``batch_size=None`` makes the loader fetch each batch as ``tree[idx]``, *one* gather per leaf
  instead of one small read per item and leaf (:func:`batch_loader` sets this up). With
  ``batch_size=k``, the loader uses ``tree.__getitems__``,
  which also reads a batch with one gather per leaf.

With ``num_workers > 0``, the tree travels to each worker (fork or spawn) as references to its
files: each worker maps them again, no data is copied through pickling (see
:mod:`memtree.store.reading.mapped`). Rows written into the files later (a dataset filled by index, a
buffer that grows) are visible to workers started afterwards.

Example:
    >>> import tempfile, torch, memtree
    >>> data = memtree.TensorTree({"x": torch.arange(10.0), "y": torch.arange(10)}, batch_size=[10])
    >>> data = data.memmap(tempfile.mkdtemp() + "/data")
    >>> [b["y"].tolist() for b in batch_loader(data, 4)]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    >>> loader = torch.utils.data.DataLoader(data, batch_size=5)     # the default collate_fn
    >>> batch = next(iter(loader))
    >>> type(batch).__name__, batch["x"].tolist()
    ('TensorTree', [0.0, 1.0, 2.0, 3.0, 4.0])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import InvalidArgumentError, UnknownKeywordError, check_keywords, keyword_names
from .parts.gather import batch_memory
from .ops import stack_into
from .tensortree import TensorTree

__all__ = ["collate", "BatchIndexSampler", "batch_loader"]


def collate(batch: Sequence[TensorTree] | TensorTree) -> TensorTree:
    """Stack records (trees of equal batch size) into one batch tree along a new first dim.

    A batch that is already one tree (from ``tree[idx]`` or ``tree.__getitems__``) is returned
    as it is. Each leaf is stacked with one call into a new tensor; in a DataLoader worker, a
    tensor in shared memory, which goes to the main process without another copy (as
    ``default_collate`` does for tensors). The DataLoader's default ``collate_fn`` calls it for
    trees (registered in ``default_collate_fn_map`` where :class:`~memtree.TensorTree` is
    defined); pass it as ``collate_fn`` to use it explicitly.

    Example:
        >>> rec = TensorTree({"x": torch.zeros(3)})
        >>> collate([rec, rec]).batch_size
        torch.Size([2])
    """
    if isinstance(batch, TensorTree):
        return batch
    return stack_into(batch, batch_memory())


class BatchIndexSampler(Sampler[torch.Tensor]):
    """Yields one ``int64`` index tensor per batch, for ``DataLoader(..., batch_size=None)``.

    Args:
        source: the dataset (its ``len()`` is read at the start of each epoch, so a growing
            buffer is sampled in full) or a number of items.
        batch_size: items per batch.
        shuffle: a new random permutation each epoch (else in order).
        drop_last: drop a last batch smaller than ``batch_size``.
        generator: the ``torch.Generator`` of the permutation.
        sort_indices: sort each shuffled batch, so that its rows are read in file order (the
            batch holds the same items; reads through the mapping become sequential).

    Example:
        >>> [i.tolist() for i in BatchIndexSampler(5, 2)]
        [[0, 1], [2, 3], [4]]
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        sort_indices: bool = True,
    ) -> None:
        if type(batch_size) is not int or batch_size <= 0:
            raise InvalidArgumentError(f"batch_size must be an int > 0, got {batch_size!r}")
        self.source = source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.generator = generator
        self.sort_indices = sort_indices

    def _items(self) -> int:
        return self.source if isinstance(self.source, int) else len(self.source)

    def __iter__(self) -> Iterator[torch.Tensor]:
        n = self._items()
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        for start in range(0, n, self.batch_size):
            idx = order[start : start + self.batch_size]
            if self.drop_last and len(idx) < self.batch_size:
                return
            yield idx.sort().values if self.shuffle and self.sort_indices else idx

    def __len__(self) -> int:
        n = self._items()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


@check_keywords
def batch_loader(
    tree: TensorTree,
    batch_size: int,
    *,
    shuffle: bool = False,
    drop_last: bool = False,
    generator: torch.Generator | None = None,
    sort_indices: bool = True,
    **loader_kwargs: Any,
) -> DataLoader[TensorTree]:
    """A ``DataLoader`` that reads each batch of ``tree`` with one index operation per leaf.

    Args:
        tree: a tree or tensorclass with a first batch dim (memory-mapped, typically).
        batch_size: items per batch.
        shuffle: a new random permutation each epoch (else in order).
        drop_last: drop a last batch smaller than ``batch_size``.
        generator: the ``torch.Generator`` of the permutation.
        sort_indices: sort each shuffled batch (see :class:`BatchIndexSampler`).
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``multiprocessing_context``,
            ``pin_memory``, ``persistent_workers``, ``prefetch_factor``...). With
            ``pin_memory=True`` and no workers, each batch is gathered straight into
            page-locked memory (the loader's own pinning then copies nothing); with workers,
            they gather into shared memory and the loader pins the batches it receives.

    Example:
        >>> t = TensorTree({"x": torch.arange(6)}, batch_size=[6])
        >>> [b["x"].tolist() for b in batch_loader(t, 3)]
        [[0, 1, 2], [3, 4, 5]]
    """
    passed = ("dataset", "sampler", "batch_size", "shuffle", "drop_last", "generator", "batch_sampler")
    loader_names = [n for n in keyword_names(DataLoader.__init__) if n not in passed]
    unknown = [k for k in loader_kwargs if k not in loader_names]
    if unknown:
        raise UnknownKeywordError.of("batch_loader", unknown, keyword_names(batch_loader) + loader_names)
    sampler = BatchIndexSampler(
        tree,
        batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        generator=generator,
        sort_indices=sort_indices,
    )
    dataset: Any = tree
    if loader_kwargs.get("pin_memory") and not loader_kwargs.get("num_workers") and torch.cuda.is_available():
        dataset = _PinnedBatches(tree)
    return DataLoader(dataset, sampler=sampler, batch_size=None, **loader_kwargs)


class _PinnedBatches(Dataset[TensorTree]):
    """``tree``'s batches gathered straight into page-locked memory: what :func:`batch_loader`
    reads with ``pin_memory=True`` in the main process."""

    def __init__(self, tree: TensorTree) -> None:
        self.tree = tree

    def __len__(self) -> int:
        return len(self.tree)

    def __getitem__(self, idx: torch.Tensor) -> TensorTree:
        batch = self.tree._gather(idx, batch_memory(pin_memory=True))
        return self.tree[idx] if batch is None else batch
