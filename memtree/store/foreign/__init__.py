"""Another library's directory layout: tensordict's ``memmap`` directories read into a ``Level``
(:mod:`~memtree.store.foreign.tensordict`) and a ``Level`` written in that layout
(:mod:`~memtree.store.foreign.tensordict_write`).

Above ``writing/`` (``docs/architecture.md``).
"""
