"""Distributed checkpoints: memtree storage for ``torch.distributed.checkpoint`` (DCP), no pickle.

See :mod:`memtree.dcp.storage` for how a save and a load work.
"""

from __future__ import annotations

from .storage import DCP_NAME, LoadPlanner, Reader, SavePlanner, Writer, load, save

__all__ = ["Writer", "Reader", "SavePlanner", "LoadPlanner", "save", "load", "DCP_NAME"]
