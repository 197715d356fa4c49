"""The user-facing tree: :class:`~memtree.TensorTree`, typed records, stacking, datasets.

Importing any part of it registers :class:`~memtree.TensorTree` with DataLoader's default
``collate_fn`` (:mod:`memtree.tree.dataset`), however the tree was reached (``memtree.TensorTree``
loads lazily, ``from memtree.tree.tensortree import TensorTree`` directly).
"""

from . import dataset as _dataset  # noqa: F401  (registers TensorTree with default_collate)
