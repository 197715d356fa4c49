"""Distributed checkpoints: memtree storage for ``torch.distributed.checkpoint`` (DCP), no pickle.

``dcp.save(state, storage_writer=memtree.dcp.Writer(path))`` writes a directory that is a plain
memtree (``memtree.load_memmap(path)`` opens it in any single process: one full ``.memmap`` file
per tensor, non-tensor values inline in ``meta.json``) plus a ``dcp.json`` file holding DCP's
metadata as JSON: global shapes, dtypes and which chunk of each tensor every rank saved.
``dcp.load(state, storage_reader=memtree.dcp.Reader(path))`` loads it back with any number of
ranks and any sharding: DCP's planner reshards (saved by 2 ranks, loaded by 1 or 3).

How a save works (``docs/format.md``, "Distributed checkpoints"):

1. the coordinator (``prepare_global_plan``) takes the destination's writer lock, creates a
   staging directory next to it and, in it, every leaf file at its full size; each rank's plan
   carries the staging path and the file of each of its tensors;
2. every rank (``write_data``) writes its chunks with ``pwrite`` into those shared files, at the
   byte offsets of the chunk inside the full tensor (chunks never overlap: DCP checks it);
3. the coordinator (``finish``), once every rank succeeded, writes each level's ``meta.json``,
   then ``dcp.json``, then the root ``meta.json``, and renames the staging directory onto the
   destination like any memtree write. A save that fails on any rank commits nothing.

Nothing is pickled: DCP's own file storage unpickles ``.metadata`` and ``torch.load``s non-tensor
values with ``weights_only=False`` (torch 2.13). Here metadata is ``dcp.json``, non-tensor values
are JSON (refused if JSON would change them), and :class:`Reader` never opens any other file.
With DCP's default planners the JSON path is used too; :class:`SavePlanner`/:class:`LoadPlanner`
make it explicit. DCP raises ``CheckpointException``, a ``BaseException``; :func:`save` and
:func:`load` turn it into :class:`~memtree.errors.DistributedCheckpointError`.

Example:
    >>> import tempfile, torch, memtree, memtree.dcp
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7}
    >>> _ = memtree.dcp.save(state, d)
    >>> memtree.load_memmap(d)["model", "w"].sum().item(), memtree.load_memmap(d)["step"]
    (15.0, 7)
    >>> target = {"model": {"w": torch.zeros(2, 3)}, "step": 0}
    >>> memtree.dcp.load(target, d)
    >>> target["step"], target["model"]["w"][1].tolist()
    (7, [3.0, 4.0, 5.0])
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import DistributedCheckpointError, check_keywords
from .reader import Reader
from .planners import LoadPlanner, SavePlanner, check_subclasses
from .writer import Writer
from ..format.dcp_json import DCP_NAME

__all__ = ["Writer", "Reader", "SavePlanner", "LoadPlanner", "save", "load", "DCP_NAME"]


# ---------------------------------------------------------------------------------------------
# the API boundary: CheckpointException (a BaseException) -> DistributedCheckpointError


def _convert(err: CheckpointException, what: str) -> DistributedCheckpointError:
    failures = {rank: pair[0] if isinstance(pair, tuple) else pair for rank, pair in err.failures.items()}
    lines = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(failures.items()))
    return DistributedCheckpointError(f"{what} failed on {len(failures)} rank(s): {lines}", failures)


@check_keywords
def save(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None,
         existsok: bool = True, fsync: bool = True, num_threads: int = 0) -> Metadata:
    """``dcp.save`` with memtree's :class:`Writer` and :class:`SavePlanner` (call it on every rank).

    Args:
        state_dict: the state to save (tensors, DTensors, JSON values), as for ``dcp.save``.
        path: the checkpoint directory, on a filesystem every rank shares.
        process_group: the group to save with (default: the default group, or a single process
            when ``torch.distributed`` is not initialised).
        existsok, fsync, num_threads: see :class:`Writer`.

    Returns:
        DCP's ``Metadata`` of the saved checkpoint.

    Raises:
        DistributedCheckpointError: the save failed on some rank (``failures`` maps each rank to
            its exception); nothing was committed.

    Example:
        >>> import tempfile, torch
        >>> _ = save({"w": torch.ones(3)}, tempfile.mkdtemp() + "/ckpt")
    """
    writer = Writer(path, existsok=existsok, fsync=fsync, num_threads=num_threads)
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            metadata: Metadata = dcp.save(state_dict, storage_writer=writer, planner=SavePlanner(),
                                          process_group=process_group, no_dist=no_dist)
            return metadata
    except CheckpointException as err:
        raise _convert(err, f"saving the checkpoint {writer.path}") from None
    except torch.distributed.DistError as err:  # a collective failed (a rank died, a timeout)
        raise DistributedCheckpointError(
            f"saving the checkpoint {writer.path} failed in a collective ({type(err).__name__}: "
            f"{err}); nothing was committed"
        ) from err
    finally:
        writer.abort()


@check_keywords
def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None) -> None:
    """``dcp.load`` with memtree's :class:`Reader` and :class:`LoadPlanner`: fills ``state_dict`` in place.

    The tensors of ``state_dict`` (plain or ``DTensor``, any sharding, any number of ranks) say
    what to load; DCP's planner reshards.

    Raises:
        DistributedCheckpointError: the load failed on some rank.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> _ = save({"w": torch.arange(3.0)}, d)
        >>> target = {"w": torch.zeros(3)}
        >>> load(target, d)
        >>> target["w"].tolist()
        [0.0, 1.0, 2.0]
    """
    reader = Reader(path)
    planner = LoadPlanner()
    no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state_dict, storage_reader=reader, planner=planner,
                     process_group=process_group, no_dist=no_dist)
        check_subclasses(planner.subclass_records, planner.flattened)
    except CheckpointException as err:
        raise _convert(err, f"loading the checkpoint {reader.path}") from None
    except torch.distributed.DistError as err:
        raise DistributedCheckpointError(
            f"loading the checkpoint {reader.path} failed in a collective ({type(err).__name__}: {err})"
        ) from err
