"""All I/O, on :class:`~memtree.format.level.Level` values: never imports the tree layer.

Writing (:mod:`~memtree.store.writing.write`), reading (:mod:`~memtree.store.reading.read`), growth, crash
recovery, verification, memory-mapped tensors, other layouts (tensordict) and remote stores.
"""
