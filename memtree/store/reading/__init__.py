"""Reading a tree: the ``Storage`` seam (:mod:`~memtree.store.reading.storage`, a local directory),
the keyword arguments of loads and writes (:mod:`~memtree.store.reading.options`), the level walker
and the tree hash, ``open_tree`` (:mod:`~memtree.store.reading.read`), each leaf's checks
(:mod:`~memtree.store.reading.leaf_reader`) and :class:`~memtree.MemoryMappedTensor`.

Above ``primitives/``; below ``writing/`` (``docs/architecture.md``).
"""
