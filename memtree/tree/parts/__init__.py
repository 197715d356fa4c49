"""The parts :class:`~memtree.TensorTree` is assembled from (``tree/tensortree.py``): the core
(:mod:`~memtree.tree.parts.core`: entries, keys, batch indexing), shape operations, persistence
(writing, loading, growth, module binding) and ``repr``; and what they use: argument checks, the
binding of tensors into ``nn.Module`` slots (:mod:`~memtree.tree.parts.bind`), the registry of
``@tensorclass`` names, numpy views.

Below ``tree/``'s own modules, which import it (``docs/architecture.md``); it imports none of them.
"""
