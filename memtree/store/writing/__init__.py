"""Writing a tree: ``write_tree`` (:mod:`~memtree.store.writing.write`), the staged commit under the
writer lock (:mod:`~memtree.store.writing.staged`), crash recovery, growth (``append_``...),
hard links of incremental saves, and the download cache (committed the same way).

Above ``reading/`` (a write opens the tree it wrote); below ``urls/`` and ``foreign/``
(``docs/architecture.md``).
"""
