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

from typing import TYPE_CHECKING

from .errors import *  # noqa: F401,F403
from .errors import RetentionWarning  # a warning: not in errors.__all__ (its errors)
from .errors import __all__ as _errors_all

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name loads on first use
    from .tree.dataset import BatchIndexSampler, batch_loader, collate
    from .interop import convert, open_checkpoint, save_safetensors, save_tensordict
    from .store.primitives.crypto import EncryptionKey
    from .routing import loading, saving
    from .store.reading.mapped import MemoryMappedTensor
    from .nn.empty_init import empty_init, init_missing
    from .nn.loading import LoadResult, load_into_module
    from .format.values import NonTensor
    from .nn.offloading import OffloadedTensor, offload
    from .tree.ops import cat, stack
    from .store.writing.recovery import recover
    from .tree.records import tensorclass
    from .format.subclass_registry import register_subclass
    from .tree.tensortree import TensorTree, load_memmap
    from .store.verify import Problem, VerifyReport, verify_tree
    from .training import Checkpointer
    from . import dcp, remote

#: Public name -> the module (under memtree) that defines it. ``import memtree`` imports no
#: torch; the first use of a name imports its module (PEP 562), so ``memtree info`` starts fast.
_LAZY: dict[str, str] = {
    "BatchIndexSampler": "tree.dataset",
    "batch_loader": "tree.dataset",
    "collate": "tree.dataset",
    "convert": "interop",
    "open_checkpoint": "interop",
    "save_safetensors": "interop",
    "save_tensordict": "interop",
    "EncryptionKey": "store.primitives.crypto",
    "saving": "routing",
    "loading": "routing",
    "MemoryMappedTensor": "store.reading.mapped",
    "empty_init": "nn.empty_init",
    "init_missing": "nn.empty_init",
    "LoadResult": "nn.loading",
    "load_into_module": "nn.loading",
    "NonTensor": "format.values",
    "OffloadedTensor": "nn.offloading",
    "offload": "nn.offloading",
    "cat": "tree.ops",
    "stack": "tree.ops",
    "recover": "store.writing.recovery",
    "tensorclass": "tree.records",
    "register_subclass": "format.subclass_registry",
    "TensorTree": "tree.tensortree",
    "load_memmap": "tree.tensortree",
    "Problem": "store.verify",
    "VerifyReport": "store.verify",
    "verify_tree": "store.verify",
    "Checkpointer": "training",
}

__version__ = "0.1.0"

__all__ = [
    "TensorTree",
    "MemoryMappedTensor",
    "NonTensor",
    "stack",
    "cat",
    "load_memmap",
    "tensorclass",
    "register_subclass",
    "collate",
    "BatchIndexSampler",
    "batch_loader",
    "open_checkpoint",
    "save_safetensors",
    "save_tensordict",
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
    "saving",
    "loading",
    "EncryptionKey",
    "Checkpointer",
    "RetentionWarning",
    *_errors_all,
]


def __getattr__(name: str) -> object:
    """Load a public name's module on first use (PEP 562); ``memtree.remote`` (fsspec) and
    ``memtree.dcp`` (torch.distributed) are sub-modules loaded the same way."""
    import importlib

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if name in ("remote", "dcp"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'memtree' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names, the lazily loaded ones included (for ``dir()`` and completion)."""
    return sorted(set(globals()) | set(_LAZY) | {"remote", "dcp"})
