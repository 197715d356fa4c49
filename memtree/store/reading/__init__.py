"""Reading a tree: the ``Storage`` seam (:mod:`~memtree.store.reading.storage`, a local directory),
the keyword arguments of loads and writes (:mod:`~memtree.store.reading.options`), the level walker
and the tree hash, ``open_tree`` (:mod:`~memtree.store.reading.read`), each leaf's checks
(:mod:`~memtree.store.reading.leaf_reader`), :class:`~memtree.MemoryMappedTensor`, the copy a
leaf shared by a hard link gets before it is mapped read-write
(:mod:`~memtree.store.reading.unshare`), and what a step of a checkpoint root is
(:mod:`~memtree.store.reading.steps`).

Above ``primitives/``; below ``writing/`` (``docs/architecture.md``).
"""
