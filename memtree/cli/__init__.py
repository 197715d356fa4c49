"""The ``memtree`` command line: :func:`main`, and one module per sub-command."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
