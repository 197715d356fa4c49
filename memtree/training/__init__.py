"""Training checkpoints: :class:`Checkpointer` (a layer above ``nn/``), and training state as levels.

Example:
    >>> import tempfile, torch
    >>> from memtree.training import Checkpointer
    >>> Checkpointer(tempfile.mkdtemp()).save(0, {"w": torch.ones(1)}).endswith("/0")
    True
"""

from .checkpointer import Checkpointer
from .filling import RestoreReport

__all__ = ["Checkpointer", "RestoreReport"]
