"""memtree: nested tensor trees on disk, one raw memory-mapped file per leaf, no pickle.

Example:
    >>> import tempfile, torch, memtree
    >>> tree = memtree.TensorTree({"w": torch.randn(4, 3), "meta": {"step": torch.tensor(7)}})
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> _ = tree.memmap(d, num_threads=2)
    >>> loaded = memtree.load_memmap(d)
    >>> bool((loaded == tree).all()), loaded.is_memmap()
    (True, True)
"""

from __future__ import annotations

from .tree.dataset import BatchIndexSampler, batch_loader, collate
from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .interop import convert, open_checkpoint, save_safetensors
from .store.mapped import MemoryMappedTensor
from .nn.empty_init import empty_init, init_missing
from .nn.loading import LoadResult, load_into_module
from .format.values import NonTensor
from .nn.offloading import OffloadedTensor, offload
from .tree.ops import cat, stack
from .store.recovery import recover
from .tree.records import tensorclass
from .tree.tensortree import TensorTree, load_memmap
from .store.verify import Problem, VerifyReport, verify_tree
from .training import Checkpointer

__version__ = "0.1.0"

__all__ = [
    "TensorTree",
    "MemoryMappedTensor",
    "NonTensor",
    "stack",
    "cat",
    "load_memmap",
    "tensorclass",
    "collate",
    "BatchIndexSampler",
    "batch_loader",
    "open_checkpoint",
    "save_safetensors",
    "convert",
    "recover",
    "verify_tree",
    "VerifyReport",
    "Problem",
    "load_into_module",
    "LoadResult",
    "empty_init",
    "init_missing",
    "offload",
    "OffloadedTensor",
    "Checkpointer",
    *_errors_all,
]


def __getattr__(name: str) -> object:
    """``memtree.remote`` (fsspec) and ``memtree.dcp`` (torch.distributed) load on first use."""
    if name in ("remote", "dcp"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'memtree' has no attribute {name!r}")
