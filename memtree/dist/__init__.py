"""Many ranks, one tree: collective writes of ``DTensor`` trees and rank-aware reads.

A tree holding ``torch.distributed.tensor.DTensor`` leaves (an FSDP2 or tensor-parallel model,
its optimizer state) is written by every rank of the default process group at once into one
ordinary memtree directory (:mod:`memtree.dist.write`), and read back by any number of ranks,
each reading only the bytes of its own shards (:mod:`memtree.dist.read`); the ranks agree on each
step over JSON exchanges (:mod:`memtree.dist.comm`). The plan (which indices and bytes of a leaf
a rank holds) is pure, in :mod:`memtree.dist.placement`. ``docs/guide/distributed.md`` is the
guide; ``docs/format.md`` ("Version 3") the format.

This package imports nothing: :mod:`memtree.dist.dtensor` (imported by the tree layer to tell a
tree of ``DTensor`` s) never imports ``torch.distributed`` before a ``DTensor`` exists.
"""
