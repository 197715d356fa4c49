"""Trees at fsspec URLs: the ``Storage`` over fsspec (:mod:`~memtree.store.urls.fsspec_storage`)
and its HTTP transport, downloads into the cache and uploads (:mod:`~memtree.store.urls.remote`,
``memtree.remote``).

Above ``writing/`` (an upload plans its files as a write does) (``docs/architecture.md``).
"""
