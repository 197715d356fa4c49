"""The user-facing tree: :class:`~memtree.TensorTree`, typed records, stacking, datasets."""
