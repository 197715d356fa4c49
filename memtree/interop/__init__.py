"""Interoperability: read checkpoints and tensordict directories, write safetensors, convert.

* :func:`open_checkpoint` opens a ``torch.save`` or ``.safetensors`` file lazily and safely, as a
  mapping of dotted keys to tensors (no pickle beyond tensors and plain data is executed, and
  :func:`pickle_limits` bounds how much a pickle may build);
* :func:`save_safetensors` exports a tree to a ``.safetensors`` file, bit-exact;
* tensordict ``memmap`` directories load through :func:`memtree.load_memmap` (see
  :mod:`memtree.store.foreign.tensordict`);
* :func:`save_tensordict` writes a tree as a directory tensordict's ``load_memmap`` reads;
* :func:`convert` (the ``memtree convert`` command) streams any of these (and Hugging Face
  shard indexes and model directories) into a memtree directory, a ``.safetensors`` file, a
  sharded Hugging Face model directory or a tensordict directory, one tensor at a time.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.interop import open_checkpoint, save_safetensors
    >>> p = os.path.join(tempfile.mkdtemp(), "m.safetensors")
    >>> save_safetensors({"w": torch.arange(3)}, p)
    >>> open_checkpoint(p)["w"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

from .checkpoint import Checkpoint, open_checkpoint
from .conversion import ConvertResult, convert
from .pickle_guard import PickleLimits, pickle_limits
from .safetensors_file import SafetensorsReader, save_safetensors
from ..store.foreign.tensordict import read_tensordict_dir
from ..store.foreign.tensordict_write import save_tensordict
from .torchsave import TorchSaveReader

__all__ = [
    "Checkpoint",
    "open_checkpoint",
    "save_safetensors",
    "convert",
    "ConvertResult",
    "SafetensorsReader",
    "TorchSaveReader",
    "PickleLimits",
    "pickle_limits",
    "read_tensordict_dir",
    "save_tensordict",
]
