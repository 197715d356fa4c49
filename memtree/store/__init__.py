"""All I/O, on :class:`~memtree.format.level.Level` values: never imports the tree layer.

In rooms, lowest first (each imports only from itself and the rooms below; ``docs/architecture.md``):

* :mod:`~memtree.store.primitives`: bytes in files and in memory (files, checksums, the commit
  primitives, encryption, fills);
* :mod:`~memtree.store.reading`: reading a tree (the ``Storage`` seam, options,
  :mod:`~memtree.store.reading.read`, memory-mapped tensors);
* :mod:`~memtree.store.writing`: writing one (:mod:`~memtree.store.writing.write`, the staged
  commit, recovery, growth, links, the download cache);
* :mod:`~memtree.store.urls` (trees at fsspec URLs) and :mod:`~memtree.store.foreign`
  (tensordict's layout);
* this package's own modules, the front doors: :mod:`~memtree.store.open` (which reader opens a
  prefix) and :mod:`~memtree.store.verify`.

Importing this package or a room loads none of their modules.
"""
