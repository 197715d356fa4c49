"""memtree inside the training frameworks: Lightning, Hugging Face ``Trainer``, torchrl.

The top layer of the package (``docs/architecture.md``): each module plugs memtree's checkpoint
stack into one framework, imports that framework (an optional extra: ``memtree[lightning]``,
``memtree[transformers]``, ``memtree[torchrl]``), and nothing in memtree imports it.

* :mod:`memtree.integrations.lightning`: ``MemtreeCheckpointIO``, a Lightning ``CheckpointIO``
  plugin (``docs/guide/lightning.md``);
* :mod:`memtree.integrations.transformers`: ``MemtreeTrainer``, ``MemtreeTrainerMixin`` and
  ``MemtreeCallback`` for the ``Trainer`` (``docs/guide/transformers.md``);
* :mod:`memtree.integrations.torchrl`: ``MemtreeStorage`` and ``MemtreeStorageCheckpointer``
  for replay buffers (``docs/guide/torchrl.md``).

What they share: :mod:`memtree.integrations.values` (a framework's checkpoint dict with its
exact Python types) and :mod:`memtree.integrations.trees` (such a dict saved as a memtree tree at
a path the framework chooses, loaded, removed).

Importing this package imports no framework; each module imports its own.
"""
