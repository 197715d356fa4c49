"""Bytes in files and in memory, below any tree: safe opens and ``pwrite`` loops
(:mod:`~memtree.store.primitives.files`), a tensor's memory as bytes
(:mod:`~memtree.store.primitives.memory`), checksums, the commit primitives (renames, directory
``fsync``, the writer lock: :mod:`~memtree.store.primitives.commit`), read leases (is any process
writing a file? :mod:`~memtree.store.primitives.lease`), encryption, filling tensors from byte
ranges (:mod:`~memtree.store.primitives.fill`), progress bars and the crash-test hook.

The lowest room of ``store/``: it imports no other room (``docs/architecture.md``).
"""
