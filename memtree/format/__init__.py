"""The on-disk format, as pure data and functions (no I/O).

* :mod:`~memtree.format.schema`: ``meta.json`` as ``LevelMeta``, its parser and writer, limits;
* :mod:`~memtree.format.entries`: the classes of a parsed ``meta.json`` (re-exported by ``schema``);
* :mod:`~memtree.format.record`: ``Record``, the base of the immutable dataclasses (cheap to import);
* :mod:`~memtree.format.names`: every name memtree puts on disk, and key <-> file-name escaping;
* :mod:`~memtree.format.dtypes`: the one table of dtype names;
* :mod:`~memtree.format.values`: non-tensor values kept as JSON (:class:`~memtree.NonTensor`);
* :mod:`~memtree.format.level`: ``Level``, the neutral nested structure the store reads and writes.
"""
