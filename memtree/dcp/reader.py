"""Reading a DCP checkpoint written by :class:`memtree.dcp.Writer`: the ``Reader`` (no unpickling).

Example:
    >>> import tempfile, torch
    >>> from memtree.dcp import Reader, save
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> _ = save({"w": torch.ones(2)}, d)
    >>> sorted(Reader(d).read_metadata().state_dict_metadata)
    ['w']
"""

from __future__ import annotations

import os
import stat
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import LimitError, MetaFormatError, NotAMemtreeError, UnsafePathError
from ..format.level import Level
from ..format.values import NonTensor
from ..store.reading.options import ReadOptions
from ..store.reading.read import read_tree
from .planners import deliver_value
from ..format.dcp_json import DCP_NAME, MAX_DCP_BYTES, parse_dcp

__all__ = ["Reader"]


# ---------------------------------------------------------------------------------------------
# the reader


class Reader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`Writer`; it never unpickles.

    It reads only ``dcp.json`` and the memtree (validated by the normal loader, leaves mapped
    read-only); any ``.metadata`` or ``*.distcp`` file in the directory is ignored.

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> from memtree.dcp import LoadPlanner, Writer
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> _ = dcp.save({"w": torch.ones(2)}, storage_writer=Writer(d), no_dist=True)
        >>> target = {"w": torch.zeros(2)}
        >>> dcp.load(target, storage_reader=Reader(d), planner=LoadPlanner(), no_dist=True)
        >>> target["w"].tolist()
        [1.0, 1.0]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = os.path.realpath(os.fspath(path))
        self._paths: dict[str, tuple[str, ...]] = {}
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load (from ``checkpoint_id`` if given)."""
        if checkpoint_id is not None:
            self.path = os.path.realpath(os.fspath(checkpoint_id))
        self._paths, self._metadata = {}, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Parse ``dcp.json`` (size-limited, never pickle) into DCP's ``Metadata``."""
        where = os.path.join(self.path, DCP_NAME)
        try:
            fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise NotAMemtreeError(
                f"{where} is missing: {self.path} is not a distributed checkpoint written by memtree.dcp.Writer"
            ) from None
        except OSError as err:
            raise UnsafePathError(f"cannot open {where} safely: {err}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(f"{where} is not a regular file")
            if st.st_size > MAX_DCP_BYTES:
                raise LimitError(f"{where} has {st.st_size:,} bytes, more than the {MAX_DCP_BYTES:,} allowed")
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(MAX_DCP_BYTES + 1)
        finally:
            os.close(fd)
        self._metadata, self._paths = parse_dcp(data, where)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Keep the metadata (``read_metadata`` may have run on another instance)."""
        if self._metadata is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to add: every rank reads the shared directory."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to add: every rank reads the shared directory."""
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> Future[None]:
        """Copy each requested region out of the mapped leaves; JSON values to the planner."""
        assert self._metadata is not None
        wanted = sorted({self._paths[item.storage_index.fqn] for item in plan.items})
        tree = read_tree(self.path, ReadOptions.of(keys=wanted, mode="r")) if wanted else Level(())
        for item in plan.items:
            fqn = item.storage_index.fqn
            value = _lookup(tree, self._paths[fqn])
            md = self._metadata.state_dict_metadata[fqn]
            if item.type == LoadItemType.BYTE_IO:
                if not isinstance(value, NonTensor):
                    raise MetaFormatError(f"{self.path}: {fqn!r} is a non-tensor value in {DCP_NAME} but not in meta.json")
                deliver_value(planner, item, value.data)
                continue
            if not isinstance(value, torch.Tensor) or not isinstance(md, TensorStorageMetadata) or (
                value.dtype != md.properties.dtype or value.shape != md.size
            ):
                raise MetaFormatError(
                    f"{self.path}: tensor {fqn!r} in meta.json does not match {DCP_NAME} "
                    f"(dtype/shape {getattr(value, 'dtype', None)}/{list(getattr(value, 'shape', []))} vs "
                    f"{getattr(getattr(md, 'properties', None), 'dtype', None)}/{list(getattr(md, 'size', []))})"
                )
            src = value
            chunk = item.storage_index.offset or torch.Size([0] * value.dim())
            for d, (c0, o, n) in enumerate(zip(chunk, item.storage_offsets, item.lengths)):
                src = src.narrow(d, c0 + o, n)
            dest = planner.resolve_tensor(item).detach()
            if dest.shape != src.shape:
                raise MetaFormatError(
                    f"tensor {fqn!r}: the load plan asks for a region of shape {list(src.shape)} "
                    f"into a destination of shape {list(dest.shape)}"
                )
            with torch._C.DisableTorchFunctionSubclass():
                dest.copy_(src.as_subclass(torch.Tensor))
            planner.commit_tensor(item, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a directory holding a memtree ``dcp.json``."""
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), DCP_NAME))


def _lookup(tree: Level, path: tuple[str, ...]) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, Level) or key not in node.entries:
            raise MetaFormatError(f"{DCP_NAME} names the tree path {path!r}, which meta.json does not hold")
        node = node.entries[key]
    return node
